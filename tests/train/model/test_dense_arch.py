"""DenseArch: layout from the seed config, construction, user tiling, and the exported program
(export → save → load gives eager's logits for many shapes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.export import ExportedProgram

from protos import pipeline_pb2
from shared.config import ConfigError, parse_config
from shared.dense_inputs import INPUT_NAMES, dense_layout
from shared.features import FeatureSet, feature_set_from_text
from train.model.dense_arch import (
    DENSE_PROGRAM_FILE,
    DenseArch,
    DenseArchConfig,
    example_inputs,
    export_dense_arch,
    load_dense_program,
    save_dense_program,
)
from train.model.mlp import MLP, MLPConfig

CONFIG = Path(__file__).parents[3] / "configs" / "multi_tower_din_taobao_dynamicemb.config"


@pytest.fixture(scope="module")
def seed_config() -> tuple[FeatureSet, pipeline_pb2.EasyRecConfig]:
    text = CONFIG.read_text()
    return feature_set_from_text(text, str(CONFIG)), parse_config(text, str(CONFIG))


@pytest.fixture(scope="module")
def small_arch() -> DenseArch:
    torch.manual_seed(0)
    return DenseArch(24, 20, 12, [32, 16], [16, 8], [8]).eval()


@pytest.fixture(scope="module")
def loaded(small_arch: DenseArch, tmp_path_factory: pytest.TempPathFactory) -> ExportedProgram:
    program = export_dense_arch(small_arch, example_inputs(small_arch))
    directory = tmp_path_factory.mktemp("bundle")
    path = save_dense_program(program, directory)
    assert path == directory / DENSE_PROGRAM_FILE
    assert [p.name for p in directory.iterdir()] == [DENSE_PROGRAM_FILE]  # no temp file left
    return load_dense_program(directory)


def inputs(
    arch: DenseArch, gen: torch.Generator, lengths: list[int], user_index: list[int]
) -> dict[str, torch.Tensor]:
    c = arch.config
    lens = torch.tensor(lengths, dtype=torch.int64)
    u, b, t = len(lengths), len(user_index), int(lens.sum())
    return {
        "user_deep": torch.randn(u, c.user_deep_dim, generator=gen),
        "item_deep": torch.randn(b, c.item_deep_dim, generator=gen),
        "query": torch.randn(b, c.seq_dim, generator=gen),
        "seq_values": torch.randn(t, c.seq_dim, generator=gen),
        "seq_lengths": lens,
        "user_index": torch.tensor(user_index, dtype=torch.int64),
    }


def test_layout_of_seed_config(seed_config: tuple[FeatureSet, pipeline_pb2.EasyRecConfig]) -> None:
    layout = dense_layout(seed_config[0])
    assert layout.user_deep[:2] == ("user_id", "cms_segid") and len(layout.user_deep) == 9
    assert set(layout.item_deep) == {
        "adgroup_id", "cate_id", "campaign_id", "customer", "brand", "price", "pid"
    }  # fmt: skip
    assert layout.query == ("adgroup_id", "cate_id", "brand")
    assert layout.sequence == tuple(f"click_50_seq__{n}" for n in layout.query)
    assert (layout.user_deep_dim, layout.item_deep_dim, layout.seq_dim) == (144, 112, 48)


def test_from_config_matches_seed_config(
    seed_config: tuple[FeatureSet, pipeline_pb2.EasyRecConfig],
) -> None:
    fs, config = seed_config
    arch = DenseArch.from_config(fs, config.model_config)
    c = arch.config
    assert (c.tower.hidden_units, c.attn.hidden_units) == ((512, 256, 128), (256, 64))
    assert c.final is not None and c.final.hidden_units == (64,)
    assert arch.tower.in_features == 256 and arch.final.in_features == 128 + 48  # type: ignore[union-attr]
    assert DenseArchConfig.from_dict(c.to_dict()) == c
    rebuilt = DenseArch.from_arch_config(c)
    rebuilt.load_state_dict(arch.state_dict())
    gen = torch.Generator().manual_seed(0)
    x = inputs(arch, gen, [3, 0], [0, 1, 1])
    assert arch(**x).shape == (3,)
    torch.testing.assert_close(rebuilt(**x), arch(**x))


def _model_config(
    seed_config: tuple[FeatureSet, pipeline_pb2.EasyRecConfig],
) -> pipeline_pb2.ModelConfig:
    config = pipeline_pb2.ModelConfig()
    config.CopyFrom(seed_config[1].model_config)
    return config


def test_from_config_errors(seed_config: tuple[FeatureSet, pipeline_pb2.EasyRecConfig]) -> None:
    fs = seed_config[0]
    config = _model_config(seed_config)
    config.multi_tower_din.towers[0].input = "seq"
    with pytest.raises(ConfigError, match=r"towers: need exactly one tower with input 'deep'"):
        DenseArch.from_config(fs, config)

    config = _model_config(seed_config)
    config.multi_tower_din.din_towers[0].attn_mlp.activation = "nn.PReLU"
    with pytest.raises(ConfigError, match=r"attn_mlp.activation: 'nn.PReLU' is not supported"):
        DenseArch.from_config(fs, config)

    config = _model_config(seed_config)
    config.multi_tower_din.towers[0].mlp.dropout_ratio.extend([0.1, 0.2])
    with pytest.raises(ConfigError, match=r"towers\[0\].mlp: dropout_ratio has 2 entries"):
        DenseArch.from_config(fs, config)


def test_mlp_honours_dropout_and_batch_norm() -> None:
    mlp = MLP(10, MLPConfig((8, 4), dropout_ratio=(0.5,), use_bn=True))
    kinds = [type(m).__name__ for m in mlp.layers]
    assert kinds == ["Linear", "_BatchNormLastDim", "ReLU", "Dropout"] * 2
    assert mlp(torch.randn(3, 5, 10)).shape == (3, 5, 4)  # any leading dims
    plain = MLP(10, [8, 4])
    assert [type(m).__name__ for m in plain.layers] == ["Linear", "ReLU"] * 2


def test_user_tiling_equals_repeated_user_rows(small_arch: DenseArch) -> None:
    gen = torch.Generator().manual_seed(1)
    n = 50
    tiled = inputs(small_arch, gen, [6], [0] * n)
    untiled = dict(tiled)
    untiled["user_deep"] = tiled["user_deep"].repeat(n, 1)
    untiled["seq_values"] = tiled["seq_values"].repeat(n, 1)
    untiled["seq_lengths"] = tiled["seq_lengths"].repeat(n)
    untiled["user_index"] = torch.arange(n)
    torch.testing.assert_close(small_arch(**tiled), small_arch(**untiled))


@pytest.mark.parametrize(
    ("lengths", "user_index"),
    [
        pytest.param([5], [0] * 100, id="U=1,B=100"),
        pytest.param([0], [0] * 100, id="U=1,B=100,empty"),
        pytest.param([0, 0, 0], [0, 1, 2], id="T=0"),
        pytest.param([4, 0, 100, 1, 2], [0, 1, 2, 3, 4], id="training,U=B"),
        pytest.param([2, 0, 7], [2, 2, 0, 1, 0, 2, 1], id="tiled,empty-rows"),
        pytest.param([1], [0], id="U=B=T=1"),
        pytest.param([3, 1], [], id="B=0"),
    ],
)
def test_exported_program_matches_eager(
    small_arch: DenseArch, loaded: ExportedProgram, lengths: list[int], user_index: list[int]
) -> None:
    gen = torch.Generator().manual_seed(len(lengths) * 1000 + len(user_index))
    x = inputs(small_arch, gen, lengths, user_index)
    got = loaded.module()(**x)
    assert got.shape == (len(user_index),)
    torch.testing.assert_close(got, small_arch(**x), rtol=1e-6, atol=1e-6)


def test_exported_program_takes_keywords_in_any_order(
    small_arch: DenseArch, loaded: ExportedProgram
) -> None:
    gen = torch.Generator().manual_seed(9)
    x = inputs(small_arch, gen, [2, 3], [1, 0, 1])
    shuffled = dict(reversed(list(x.items())))
    torch.testing.assert_close(loaded.module()(**shuffled), small_arch(**x))


def test_exported_program_is_pure_aten(loaded: ExportedProgram) -> None:
    targets = {str(n.target) for n in loaded.graph.nodes if n.op == "call_function"}
    assert not [t for t in targets if "fbgemm" in t]
    names = [s.arg.name for s in loaded.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    assert names == list(INPUT_NAMES)


def test_load_moves_to_device(tmp_path: Path, loaded: ExportedProgram) -> None:
    save_dense_program(loaded, tmp_path)
    moved = load_dense_program(tmp_path / DENSE_PROGRAM_FILE, device="meta")
    assert all(p.device.type == "meta" for p in moved.state_dict.values())
    devices = {str(n.kwargs["device"]) for n in moved.graph.nodes if "device" in n.kwargs}
    assert devices == {"meta"}


def test_export_rejects_bad_examples(small_arch: DenseArch) -> None:
    with pytest.raises(ValueError, match=r"\{'U': 1\} are < 2"):
        export_dense_arch(small_arch, example_inputs(small_arch, lengths=[3], user_index=[0, 0]))
    bad = example_inputs(small_arch)
    bad["user_index"] = bad["user_index"].int()
    with pytest.raises(ValueError, match="user_index.*must be int64"):
        export_dense_arch(small_arch, bad)
    with pytest.raises(FileNotFoundError, match=DENSE_PROGRAM_FILE):
        load_dense_program(Path("/nonexistent"))


def test_program_loads_and_runs_without_fbgemm_or_torchrec(
    small_arch: DenseArch, loaded: ExportedProgram, tmp_path: Path
) -> None:
    """A fresh interpreter that imports only torch can load and run dense.pt2."""
    save_dense_program(loaded, tmp_path)
    x = inputs(small_arch, torch.Generator().manual_seed(11), [4, 0], [0, 1, 0])
    torch.save(x, tmp_path / "inputs.pt")
    script = (
        "import sys, torch\n"
        f"d = {str(tmp_path)!r}\n"
        "x = torch.load(d + '/inputs.pt')\n"
        "out = torch.export.load(d + '/dense.pt2').module()(**x)\n"
        "torch.save(out, d + '/out.pt')\n"
        "bad = [m for m in sys.modules if m.startswith(('fbgemm', 'torchrec', 'train', 'shared'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, timeout=120)
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), small_arch(**x))


@pytest.mark.parametrize("lengths", [[4, 0, 100, 1, 2, 0, 9], [0, 0, 0], [3]])
def test_training_fast_path_equals_general_path(lengths: list[int]) -> None:
    """user_index=None (training: one user per row) gives the logits and gradients of
    user_index=arange(B), in train mode, and leaves the exported program's inputs alone."""
    torch.manual_seed(3)
    arch = DenseArch(24, 20, 12, [32, 16], [16, 8], [8]).double().train()
    gen = torch.Generator().manual_seed(4)
    x = inputs(arch, gen, lengths, list(range(len(lengths))))
    results = []
    for user_index in (x["user_index"], None):
        leaves = {k: v.double().requires_grad_() for k, v in x.items() if v.is_floating_point()}
        arch.zero_grad()
        logits = arch(**leaves, seq_lengths=x["seq_lengths"], user_index=user_index)
        (logits * torch.linspace(-1, 1, len(lengths), dtype=torch.float64)).sum().backward()
        named = {k: v.grad for k, v in leaves.items()}
        named.update({n: p.grad for n, p in arch.named_parameters()})
        results.append((logits.detach(), named))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-9, atol=1e-12, msg=name)
    with pytest.raises(ValueError, match="one user per candidate row"):
        arch(**{**x, "user_deep": x["user_deep"].repeat(2, 1), "user_index": None})


def test_item_tower_starts_at_zero_and_adds_a_term_of_the_item_side_alone() -> None:
    """item_tower: the other layers keep their seeded weights (the tower draws last) and its
    output layer starts at zero, so the switch off is the model as it was; trained, it adds a
    term that depends on item_deep alone (the same whatever the user), in eager and in the
    exported program; the arch config carries it (old configs: off)."""
    torch.manual_seed(0)
    off = DenseArch(24, 20, 12, [32, 16], [16, 8], [8]).eval()
    torch.manual_seed(0)
    on = DenseArch(24, 20, 12, [32, 16], [16, 8], [8], item_tower_units=[6]).eval()
    a, b = off.state_dict(), on.state_dict()
    assert {k for k in b if k not in a} == {
        "item_tower.mlp.layers.0.weight",
        "item_tower.mlp.layers.0.bias",
        "item_tower.output.weight",
        "item_tower.output.bias",
    }
    assert all(torch.equal(a[k], b[k]) for k in a)
    x = inputs(on, torch.Generator().manual_seed(5), [3, 0, 2], [0, 1, 2, 2, 0])
    with torch.no_grad():
        torch.testing.assert_close(on(**x), off(**x), rtol=0, atol=0)
        assert on.item_tower is not None
        on.item_tower.output.weight.normal_()
        on.item_tower.output.bias.fill_(0.25)
        hidden = torch.relu(
            x["item_deep"] @ b["item_tower.mlp.layers.0.weight"].T
            + b["item_tower.mlp.layers.0.bias"]
        )
        term = hidden @ on.item_tower.output.weight[0] + 0.25
        torch.testing.assert_close(on(**x) - off(**x), term, rtol=1e-5, atol=1e-5)
        other_users = {**x, "user_deep": torch.randn_like(x["user_deep"])}
        torch.testing.assert_close(
            on(**other_users) - off(**other_users), term, rtol=1e-5, atol=1e-5
        )
    for pairs in (False, True):
        example = example_inputs(on, pairs=pairs)
        program = export_dense_arch(on, example).module()
        torch.testing.assert_close(program(**example), on(**example), rtol=1e-6, atol=1e-6)
    assert on.config.item_tower == MLPConfig((6,))
    assert DenseArchConfig.from_dict(on.config.to_dict()) == on.config
    old = {k: v for k, v in on.config.to_dict().items() if k != "item_tower"}
    assert DenseArchConfig.from_dict(old).item_tower is None


def test_item_tower_comes_from_the_config(
    seed_config: tuple[FeatureSet, pipeline_pb2.EasyRecConfig],
) -> None:
    fs, config = seed_config
    assert DenseArch.from_config(fs, config.model_config).item_tower is None
    with_tower = pipeline_pb2.ModelConfig()
    with_tower.CopyFrom(config.model_config)
    with_tower.multi_tower_din.item_tower.hidden_units.extend([64])
    arch = DenseArch.from_config(fs, with_tower)
    assert arch.item_tower is not None and arch.config.item_tower == MLPConfig((64,))
    assert arch.item_tower.mlp.in_features == arch.config.item_deep_dim
    with_tower.multi_tower_din.item_tower.activation = "nn.Tanh"
    with pytest.raises(ConfigError, match=r"multi_tower_din\.item_tower\.activation"):
        DenseArch.from_config(fs, with_tower)
