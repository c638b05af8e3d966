"""The DIN and the dense program with the (candidate, element) pairs as inputs (bundle format 3):
the same function as today's, with no host sync and no data-dependent shape in the export."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.export import ExportedProgram

from shared.dense_inputs import INPUT_NAMES, PAIR_INPUT_NAMES, pair_index
from train.model.dense_arch import DenseArch, example_inputs, export_dense_arch
from train.model.din import JaggedDIN

CASES = [
    pytest.param([5], [0] * 40, id="U=1,B=40"),
    pytest.param([0], [0] * 6, id="U=1,empty"),
    pytest.param([0, 0, 0], [0, 1, 2], id="T=0"),
    pytest.param([4, 0, 9, 1, 2], [0, 1, 2, 3, 4], id="U=B"),
    pytest.param([2, 0, 7], [2, 2, 0, 1, 0, 2, 1], id="tiled,empty-rows"),
    pytest.param([3, 0, 4], [2], id="B=1"),
    pytest.param([1], [0], id="U=B=T=1"),
    pytest.param([3, 1], [], id="B=0"),
]


def _pairs(lengths: list[int], user_index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    seg, elem = pair_index(np.array(lengths, np.int64), np.array(user_index, np.int64))
    return torch.from_numpy(seg), torch.from_numpy(elem)


@pytest.fixture(scope="module")
def arch() -> DenseArch:
    torch.manual_seed(0)
    return DenseArch(24, 20, 12, [32, 16], [16, 8], [8]).eval()


@pytest.fixture(scope="module")
def pair_program(arch: DenseArch) -> ExportedProgram:
    return export_dense_arch(arch, example_inputs(arch, pairs=True))


@pytest.fixture(scope="module")
def legacy_program(arch: DenseArch) -> ExportedProgram:
    return export_dense_arch(arch, example_inputs(arch))


def _inputs(
    arch: DenseArch, seed: int, lengths: list[int], user_index: list[int]
) -> dict[str, torch.Tensor]:
    """Random inputs with the pairs (drop them for today's signature)."""
    gen = torch.Generator().manual_seed(seed)
    c = arch.config
    u, b, t = len(lengths), len(user_index), sum(lengths)
    seg, elem = _pairs(lengths, user_index)
    return {
        "user_deep": torch.randn(u, c.user_deep_dim, generator=gen),
        "item_deep": torch.randn(b, c.item_deep_dim, generator=gen),
        "query": torch.randn(b, c.seq_dim, generator=gen),
        "seq_values": torch.randn(t, c.seq_dim, generator=gen),
        "seq_lengths": torch.tensor(lengths, dtype=torch.int64),
        "user_index": torch.tensor(user_index, dtype=torch.int64),
        "pair_segment": seg,
        "pair_element": elem,
    }


def _six(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: x[n] for n in INPUT_NAMES}


@pytest.mark.parametrize(("lengths", "user_index"), CASES)
def test_din_with_pairs_equals_din_without(lengths: list[int], user_index: list[int]) -> None:
    torch.manual_seed(1)
    din = JaggedDIN(8, [16, 4]).eval()
    b, t = len(user_index), sum(lengths)
    q, s = torch.randn(b, 8), torch.randn(t, 8)
    lens = torch.tensor(lengths, dtype=torch.int64)
    users = torch.tensor(user_index, dtype=torch.int64)
    with torch.no_grad():
        want = din(q, s, lens, users)
        got = din(q, s, lens, users, pairs=_pairs(lengths, user_index))
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same ops on the same pairs
    empty = torch.tensor([lengths[u] == 0 for u in user_index], dtype=torch.bool)
    assert bool((got[empty] == 0).all())


def test_din_pairs_gradients_equal() -> None:
    torch.manual_seed(2)
    din = JaggedDIN(8, [16, 4])
    lengths, user_index = [3, 0, 5], [2, 2, 0, 1, 2]
    q = torch.randn(5, 8, requires_grad=True)
    s = torch.randn(8, 8, requires_grad=True)
    lens, users = torch.tensor(lengths), torch.tensor(user_index)
    g1 = torch.autograd.grad(din(q, s, lens, users).sum(), (q, s))
    g2 = torch.autograd.grad(
        din(q, s, lens, users, pairs=_pairs(lengths, user_index)).sum(), (q, s)
    )
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)


def test_din_refuses_pairs_on_the_training_fast_path() -> None:
    din = JaggedDIN(8, [16, 4])
    lens = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="pass pairs=None"):
        din(torch.randn(2, 8), torch.randn(3, 8), lens, None, pairs=_pairs([1, 2], [0, 1]))


@pytest.mark.parametrize(("lengths", "user_index"), CASES)
def test_arch_with_pairs_equals_arch_without(
    arch: DenseArch, lengths: list[int], user_index: list[int]
) -> None:
    x = _inputs(arch, len(lengths) * 100 + len(user_index), lengths, user_index)
    with torch.no_grad():
        torch.testing.assert_close(arch(**x), arch(**_six(x)), rtol=0, atol=0)


def test_arch_wants_both_pair_inputs_or_neither(arch: DenseArch) -> None:
    x = _inputs(arch, 0, [2, 1], [0, 1])
    with pytest.raises(ValueError, match="both pair_segment and pair_element"):
        arch(**_six(x), pair_segment=x["pair_segment"])


@pytest.mark.parametrize(("lengths", "user_index"), CASES)
def test_exported_pair_program_equals_eager_and_todays_program(
    arch: DenseArch,
    pair_program: ExportedProgram,
    legacy_program: ExportedProgram,
    lengths: list[int],
    user_index: list[int],
) -> None:
    x = _inputs(arch, len(lengths) * 10 + len(user_index), lengths, user_index)
    got = pair_program.module()(**x)
    assert got.shape == (len(user_index),)
    with torch.no_grad():
        torch.testing.assert_close(got, arch(**x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, legacy_program.module()(**_six(x)), rtol=1e-6, atol=1e-6)


def test_pair_program_has_no_host_sync_or_data_dependent_shape(
    pair_program: ExportedProgram, legacy_program: ExportedProgram
) -> None:
    def targets(p: ExportedProgram) -> set[str]:
        return {str(n.target) for n in p.graph.nodes if n.op == "call_function"}

    syncs = {"aten._local_scalar_dense.default", "aten.item.default"}
    assert not targets(pair_program) & syncs
    assert targets(legacy_program) & syncs  # today's program reads the pair count back
    assert not [t for t in targets(pair_program) if "fbgemm" in t]
    unbacked = [s for s in pair_program.range_constraints if str(s).startswith("u")]
    assert not unbacked, f"data-dependent sizes {unbacked}"
    names = [
        s.arg.name for s in pair_program.graph_signature.input_specs if s.kind.name == "USER_INPUT"
    ]
    assert names == list(PAIR_INPUT_NAMES)


def test_pair_example_checks() -> None:
    arch = DenseArch(4, 4, 4, [8], [8], None)
    x = example_inputs(arch, pairs=True)
    assert tuple(x) == PAIR_INPUT_NAMES
    del x["pair_element"]
    with pytest.raises(ValueError, match="expected exactly"):
        export_dense_arch(arch, x)
    small = example_inputs(arch, (1, 3), (0, 1), pairs=True)  # N = 4: cut to 1
    small["pair_segment"] = small["pair_segment"][:1]
    small["pair_element"] = small["pair_element"][:1]
    with pytest.raises(ValueError, match="'N': 1"):
        export_dense_arch(arch, small)
