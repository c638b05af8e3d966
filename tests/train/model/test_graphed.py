"""CUDA graphs for the dense training step (train.model.graphed).

CPU: the padding to a T bucket (one dummy row owning the padding elements) gives the unpadded
outputs and gradients; the wrapper's buffer and gradient plumbing, run with ``emulate=True``
(same code, no capture), equals eager over several optimizer steps, buckets, LRU eviction, the
eager fallbacks and gradient accumulation. GPU (``pytest -m gpu``): real capture and replay
against eager on CUDA, fp32 and BF16 autocast, the DIN alone and a whole ``train_step``.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from train.model.dense_arch import DenseArch
from train.model.din import JaggedDIN
from train.model.graphed import (
    DenseArchGraphs,
    DINGraphs,
    JaggedGraphs,
    bucket_rows,
    pad_to_bucket,
)

DU, DI, DQ = 8, 6, 12
# host reads of a device value: each one a sync on CUDA
HOST_READS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero"}
FLOATS = ("user_deep", "item_deep", "query", "seq_values")


def make_arch(dtype: torch.dtype = torch.float64) -> DenseArch:
    torch.manual_seed(0)
    return DenseArch(DU, DI, DQ, [16, 8], [8, 4], [8]).to(dtype)


def make_inputs(
    gen: torch.Generator, lengths: list[int], dtype: torch.dtype = torch.float64, device="cpu"
) -> dict[str, torch.Tensor | None]:
    b, t = len(lengths), sum(lengths)
    x = {
        "user_deep": torch.randn(b, DU, generator=gen, dtype=dtype),
        "item_deep": torch.randn(b, DI, generator=gen, dtype=dtype),
        "query": torch.randn(b, DQ, generator=gen, dtype=dtype),
        "seq_values": torch.randn(t, DQ, generator=gen, dtype=dtype),
    }
    out: dict[str, torch.Tensor | None] = {k: v.to(device) for k, v in x.items()}
    out["seq_lengths"] = torch.tensor(lengths, dtype=torch.int64, device=device)
    out["user_index"] = None
    return out


def random_lengths(gen: torch.Generator, n: int, max_len: int = 9) -> list[int]:
    lens = torch.randint(0, max_len + 1, (n,), generator=gen)
    lens[torch.rand(n, generator=gen) < 0.3] = 0
    return lens.tolist()


def fwd_bwd(fn, module: torch.nn.Module, x: dict, zero: bool = True):
    """Output and gradients (inputs and every parameter), all cloned; a loss weighting every
    output differently."""
    if zero:
        module.zero_grad(set_to_none=True)
    leaves = {k: (v.detach().clone().requires_grad_() if k in FLOATS else v) for k, v in x.items()}
    out = fn(**leaves)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device)
    (out * weights.reshape(out.shape)).sum().backward()
    grads = {k: leaves[k].grad.clone() for k in FLOATS if k in leaves}
    grads |= {n: p.grad.clone() for n, p in module.named_parameters()}
    return out.detach().clone(), grads


def assert_same(got, want, rtol: float = 1e-10, atol: float = 1e-12) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=atol)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=rtol, atol=atol, msg=name)


# --------------------------------------------------------------------------- buckets, padding


def test_bucket_rows() -> None:
    assert bucket_rows(0) == bucket_rows(1) == bucket_rows(1024) == 1024
    assert bucket_rows(31_000) == 32_768 and bucket_rows(30_000) == 30_720
    assert bucket_rows(32_769) == 36_864
    assert bucket_rows(5, min_rows=16) == 16 and bucket_rows(17, min_rows=16) == 18
    sizes = set()
    for t in range(1, 70_000, 7):
        p = bucket_rows(t)
        assert p >= t and bucket_rows(p) == p
        if t > 1024:
            assert (p - t) / t < 0.125
        if 16_384 < t <= 32_768:
            sizes.add(p)
    assert len(sizes) == 8  # 8 buckets per octave


@pytest.mark.parametrize(
    "lengths", [[3, 0, 5, 1, 0, 2], [0, 0, 0], [4], [7, 9, 0, 1], [1, 1, 1, 1, 1, 1, 1, 1]]
)
@pytest.mark.parametrize("extra", [0, 5])
def test_padded_bucket_equals_unpadded(lengths: list[int], extra: int) -> None:
    """The graphs' computation, run eagerly: B + 1 rows, T + extra elements of which the extra
    hold garbage (NaN and huge values, masked in pad_to_bucket), against the plain DenseArch:
    same outputs, same gradients of every parameter and every input (real rows)."""
    gen = torch.Generator().manual_seed(sum(lengths) + extra)
    arch = make_arch()
    x = make_inputs(gen, lengths)
    want = fwd_bwd(arch, arch, x)

    def padded(user_deep, item_deep, query, seq_values, seq_lengths, user_index):
        t = seq_values.shape[0]
        garbage = torch.full((extra, DQ), 1e30, dtype=seq_values.dtype)
        garbage[::2] = float("nan")
        seq = torch.cat([seq_values, garbage])  # [T_pad, D]
        rows, seq, lens, _ = pad_to_bucket([user_deep, item_deep, query], seq, seq_lengths)
        assert lens.tolist() == [*lengths, extra] and seq.shape[0] == t + extra
        out = arch(*rows, seq, lens, None)  # [B + 1]
        return out[: len(lengths)]

    assert_same(fwd_bwd(padded, arch, x), want)


def eager_din(din: JaggedDIN):
    def eager(query, seq_values, seq_lengths):
        return din(query, seq_values, seq_lengths, None)  # the training fast path

    return eager


def test_padded_bucket_equals_unpadded_din_alone() -> None:
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    din = JaggedDIN(DQ, [8, 4]).double()
    x = make_inputs(gen, [2, 0, 6, 1])
    x = {"query": x["query"], "seq_values": x["seq_values"], "seq_lengths": x["seq_lengths"]}

    def padded(query, seq_values, seq_lengths):
        seq = torch.cat([seq_values, torch.full((7, DQ), float("nan"), dtype=torch.float64)])
        rows, seq, lens, _ = pad_to_bucket([query], seq, seq_lengths)
        return din(rows[0], seq, lens, None)[:4]

    assert_same(fwd_bwd(padded, din, x), fwd_bwd(eager_din(din), din, x))


# --------------------------------------------------------------------------- emulated wrapper


def run_steps(
    lengths_per_step: list[list[int]],
    device: str = "cpu",
    dtype: torch.dtype = torch.float64,
    amp: torch.dtype | None = None,
    rtol: float = 1e-10,
    atol: float = 1e-12,
    **kw: object,
) -> JaggedGraphs:
    """Two copies of one model, eager and graphed, each with its own Adam: per step compare
    outputs and gradients, then step both optimizers (replays must see the updated weights)."""
    eager = make_arch(dtype).to(device)
    graphed = copy.deepcopy(eager)
    graphs = DenseArchGraphs(graphed, **kw)  # type: ignore[arg-type]
    # SGD: linear in the gradients (Adam would blow up the rounding noise of attn_out.bias,
    # whose true gradient is exactly zero, into full-size steps of either sign)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (eager, graphed)]
    gen = torch.Generator().manual_seed(0)
    for lengths in lengths_per_step:
        x = make_inputs(gen, lengths, dtype, device)
        with torch.autocast(device, dtype=amp or torch.bfloat16, enabled=amp is not None):
            want = fwd_bwd(eager, eager, x)
            got = fwd_bwd(graphs, graphed, x)
        assert_same(got, want, rtol=rtol, atol=atol)
        for opt in opts:
            opt.step()
    for (name, a), b in zip(eager.named_parameters(), graphed.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=max(rtol, 1e-6), atol=max(atol, 1e-6), msg=name)
    return graphs


STEPS = [[3, 0, 5, 1], [2, 2, 2, 2], [9, 9, 9, 0], [0, 0, 0, 0], [1, 0, 1, 0], [9, 8, 9, 9], [4, 1]]


def test_emulated_graphs_equal_eager_over_steps() -> None:
    """Buckets 16 (T <= 16) and 28/36 (new buckets), an all-empty batch and a smaller last
    batch: every step equal to eager; one capture per (B, T_pad), replays otherwise."""
    graphs = run_steps(STEPS, emulate=True, min_bucket=16)
    keys = {(len(s), bucket_rows(sum(s), 16)) for s in STEPS}
    assert graphs.stats["captures"] == graphs.num_graphs == len(keys) == 4
    assert graphs.stats["replays"] == len(STEPS) and graphs.stats["eager"] == 0


def test_emulated_capture_after_runs_a_shape_eagerly_until_its_nth_call() -> None:
    """capture_after=2: each shape's first call is eager, its second captures; the same
    results either way (a shape seen once, as STEPS' last, is never captured)."""
    steps = [*STEPS, [3, 0, 5, 1], [9, 8, 9, 9]]  # two shapes again
    graphs = run_steps(steps, emulate=True, min_bucket=16, capture_after=2)
    keys = [(len(s), bucket_rows(sum(s), 16)) for s in steps]
    again = {k for k in keys if keys.count(k) > 1}
    assert graphs.stats["captures"] == graphs.num_graphs == len(again)
    assert graphs.stats["eager:shape not seen often enough yet"] == len(set(keys))
    assert graphs.stats["replays"] == len(steps) - len(set(keys))
    with pytest.raises(ValueError, match="capture_after"):
        DenseArchGraphs(make_arch(torch.float64), capture_after=0)


def test_emulated_lru_eviction_and_capture_budget() -> None:
    graphs = run_steps(STEPS, emulate=True, min_bucket=16, max_graphs=2)
    assert graphs.num_graphs == 2 and graphs.stats["evictions"] == graphs.stats["captures"] - 2
    graphs = run_steps(STEPS, emulate=True, min_bucket=16, max_graphs=1, max_captures=2)
    assert graphs.stats["captures"] == 2 and graphs.stats["eager:capture budget spent"] > 0


def test_emulated_bf16_autocast() -> None:
    """Captured under the caller's autocast state (part of the key); same result as eager
    under the same autocast."""
    graphs = run_steps(
        STEPS[:3], dtype=torch.float32, amp=torch.bfloat16, rtol=1e-5, atol=1e-6,
        emulate=True, min_bucket=16,
    )  # fmt: skip
    assert graphs.stats["replays"] == 3


def test_cpu_without_emulation_is_eager() -> None:
    arch = make_arch()
    graphs = DenseArchGraphs(arch)
    x = make_inputs(torch.Generator().manual_seed(1), [3, 0, 2])
    assert_same(fwd_bwd(graphs, arch, x), fwd_bwd(arch, arch, x), rtol=0, atol=0)
    assert graphs.num_graphs == 0 and graphs.stats["eager:not on CUDA"] == 1


def test_fallbacks_are_eager() -> None:
    gen = torch.Generator().manual_seed(2)
    arch = make_arch()
    graphs = DenseArchGraphs(arch, emulate=True, min_bucket=16)
    x = make_inputs(gen, [3, 0, 2])
    # user_index given: the general path, eagerly
    y = {**x, "user_index": torch.arange(3)}
    assert_same(fwd_bwd(graphs, arch, y), fwd_bwd(arch, arch, y), rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(graphs(**x), arch(**x), rtol=0, atol=0)
    arch.eval()
    torch.testing.assert_close(graphs(**x), arch(**x), rtol=0, atol=0)
    arch.train()
    assert graphs.num_graphs == 0
    assert {k for k in graphs.stats if k.startswith("eager:")} == {
        "eager:user_index given",
        "eager:grad mode off",
        "eager:eval mode",
    }
    bn = DenseArch(DU, DI, DQ, [16], [8], None).double()
    bn.tower = torch.nn.Sequential(torch.nn.Linear(DU + DI, 16), torch.nn.BatchNorm1d(16)).double()
    bn_graphs = DenseArchGraphs(bn, emulate=True, min_bucket=16)
    assert_same(fwd_bwd(bn_graphs, bn, x), fwd_bwd(bn, bn, x), rtol=0, atol=0)
    assert bn_graphs.num_graphs == 0 and bn_graphs.stats["eager"] == 1


def test_two_forwards_before_one_backward() -> None:
    """A forward while a replay awaits its backward runs eagerly (it would overwrite the
    graph's activations); one backward through both gives the eager gradients."""
    gen = torch.Generator().manual_seed(4)
    arch = make_arch()
    graphs = DenseArchGraphs(arch, emulate=True, min_bucket=16)
    x1, x2 = make_inputs(gen, [3, 0, 2]), make_inputs(gen, [1, 4, 2])

    def both(fn):
        arch.zero_grad(set_to_none=True)
        (fn(**x1).sum() + 2 * fn(**x2).sum()).backward()
        return [p.grad.clone() for p in arch.parameters()]

    want = both(arch)
    got = both(graphs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert (
        graphs.stats["replays"] == 1 and graphs.stats["eager:a replay's backward is pending"] == 1
    )
    # the pending replay was consumed: the next call replays again
    fwd_bwd(graphs, arch, x1)
    assert graphs.stats["replays"] == 2


def test_dropped_output_without_backward_releases_the_graph() -> None:
    gen = torch.Generator().manual_seed(5)
    arch = make_arch()
    graphs = DenseArchGraphs(arch, emulate=True, min_bucket=16)
    x = make_inputs(gen, [3, 0, 2])
    out = graphs(**{k: (v.clone().requires_grad_() if k in FLOATS else v) for k, v in x.items()})
    del out  # no backward: its autograd node dies, nothing is pending any more
    assert_same(fwd_bwd(graphs, arch, x), fwd_bwd(arch, arch, x))
    assert graphs.stats["replays"] == 2 and graphs.stats["eager"] == 0


def test_second_backward_after_newer_forward_raises() -> None:
    gen = torch.Generator().manual_seed(6)
    arch = make_arch()
    graphs = DenseArchGraphs(arch, emulate=True, min_bucket=16)
    x = make_inputs(gen, [3, 0, 2])
    out = graphs(**x)
    out.sum().backward(retain_graph=True)
    first = [p.grad.clone() for p in arch.parameters()]
    arch.zero_grad(set_to_none=True)
    out.sum().backward(retain_graph=True)  # no replay in between: same gradients again
    for g, w in zip(arch.parameters(), first, strict=True):
        torch.testing.assert_close(g.grad, w, rtol=0, atol=0)
    graphs(**x).sum().backward()  # a newer replay
    with pytest.raises(RuntimeError, match="replayed again"):
        out.sum().backward()


def test_gradient_accumulation_without_zeroing() -> None:
    """``.grad`` holding a graph buffer (stolen by autograd) is copied out before the next
    backward overwrites it: accumulating over steps (set_to_none=False) equals eager."""
    gen = torch.Generator().manual_seed(7)
    eager = make_arch()
    graphed = copy.deepcopy(eager)
    graphs = DenseArchGraphs(graphed, emulate=True, min_bucket=16)
    q = torch.randn(3, DQ, dtype=torch.float64, generator=gen).requires_grad_()
    q2 = q.detach().clone().requires_grad_()
    batches = [make_inputs(gen, [3, 0, 2]) for _ in range(3)]
    for i, x in enumerate(batches):  # same key each time: the same buffers
        if i == 1:
            for m in (eager, graphed):
                m.zero_grad(set_to_none=False)  # zeroes the aliased buffer in place
        (eager(**{**x, "query": q}) * (i + 1)).sum().backward()
        (graphs(**{**x, "query": q2}) * (i + 1)).sum().backward()
    for (name, a), b in zip(eager.named_parameters(), graphed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(q2.grad, q.grad, rtol=1e-10, atol=1e-12)
    assert graphs.stats["replays"] == 3


def test_parameter_gradients_reach_grad_without_a_node_each() -> None:
    """The replay's backward writes the parameters' gradients into ``.grad`` itself: outside
    the replay's node, the backward runs one AccumulateGrad a leaf input and one for the
    graphs' anchor, none a parameter, and every parameter and input gradient equals eager."""
    gen = torch.Generator().manual_seed(11)
    arch = make_arch()
    graphs = DenseArchGraphs(arch, emulate=True, min_bucket=16)
    x = make_inputs(gen, [3, 0, 2])
    fwd_bwd(graphs, arch, x)  # the capture
    arch.zero_grad(set_to_none=True)
    leaves = {k: (v.detach().clone().requires_grad_() if k in FLOATS else v) for k, v in x.items()}
    out = graphs(**leaves)
    with torch.profiler.profile() as prof:
        out.sum().backward()
    nodes = [e for e in prof.events() if e.name.startswith("autograd::engine::evaluate_function")]
    top = [e for e in nodes if not _inside(e, "_ReplayBackward")]
    accumulate = [e for e in top if e.name.endswith("AccumulateGrad")]
    assert len(accumulate) == len(FLOATS) + 1 < len(list(arch.parameters()))
    got = {n: p.grad.clone() for n, p in arch.named_parameters()}
    got |= {k: leaves[k].grad.clone() for k in FLOATS}
    arch.zero_grad(set_to_none=True)
    eager = {k: (v.detach().clone().requires_grad_() if k in FLOATS else v) for k, v in x.items()}
    arch(**eager).sum().backward()
    want = {n: p.grad for n, p in arch.named_parameters()} | {k: eager[k].grad for k in FLOATS}
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-10, atol=1e-12, msg=name)
    assert graphs.stats["replays"] == 2


def _inside(event, name: str) -> bool:
    """Whether a profiler event runs inside an event called ``name`` (its parents')."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name or parent.name.endswith(": " + name):
            return True
        parent = parent.cpu_parent
    return False


def test_partial_requires_grad_and_frozen_parameters() -> None:
    gen = torch.Generator().manual_seed(8)
    arch = make_arch()
    graphs = DenseArchGraphs(arch, emulate=True, min_bucket=16)
    arch.output.weight.requires_grad_(False)  # changes the parameter signature: recapture
    x = make_inputs(gen, [3, 0, 2])
    for frozen in ("seq_values", "query"):

        def run(fn, frozen: str = frozen):
            arch.zero_grad(set_to_none=True)
            leaves = {k: (v.clone().requires_grad_(k != frozen) if k in FLOATS else v)
                      for k, v in x.items()}  # fmt: skip
            fn(**leaves).square().sum().backward()
            return [leaves[k].grad for k in FLOATS] + [p.grad for p in arch.parameters()]

        got, want = run(graphs), run(arch)
        for g, w in zip(got, want, strict=True):
            assert (g is None) == (w is None)
            if w is not None:
                torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert graphs.stats["captures"] == 2 and arch.output.weight.grad is None


def test_wrapper_leaves_the_module_alone() -> None:
    arch = make_arch()
    keys = list(arch.state_dict())
    modules = [n for n, _ in arch.named_modules()]
    graphs = DenseArchGraphs(arch, emulate=True, min_bucket=16)
    fwd_bwd(graphs, arch, make_inputs(torch.Generator().manual_seed(9), [3, 0, 2]))
    assert list(arch.state_dict()) == keys and [n for n, _ in arch.named_modules()] == modules
    assert not isinstance(graphs, torch.nn.Module)


def test_din_graphs_emulated() -> None:
    gen = torch.Generator().manual_seed(10)
    torch.manual_seed(0)
    din = JaggedDIN(DQ, [8, 4]).double()
    graphs = DINGraphs(din, emulate=True, min_bucket=16)
    for lengths in ([2, 0, 6, 1], [9, 9, 0, 3], [0, 0, 0, 0]):
        x = make_inputs(gen, lengths)
        x = {"query": x["query"], "seq_values": x["seq_values"], "seq_lengths": x["seq_lengths"]}
        assert_same(fwd_bwd(graphs, din, x), fwd_bwd(eager_din(din), din, x))
    assert graphs.stats["replays"] == 3 and graphs.stats["captures"] == 2


# --------------------------------------------------------------------------- train_step


# the dense part's options a whole training step is checked with: none, the cold-id backoff,
# the feature crosses (every user x item pair)
DENSE_OPTIONS = {"plain": "", "backoff": "cold_backoff {}", "crosses": "crosses {}"}


# the seed config's dynamic tables small and at their max capacity from the start, admitting
# at 2: the static sparse step (shared.hashtable.static_step) takes every step, with evictions
FULL_TABLES = {
    **{f"max_capacity: {n}": "max_capacity: 64" for n in (300000, 250000, 150000, 100000, 5000)},
    "init_capacity_per_rank: 1024": "init_capacity_per_rank: 64",
    "threshold: 3": "threshold: 2",
}


def _tiny_model(
    tiny: Path, tmp: Path, device: str, *, option: str = "", replace: dict[str, str] | None = None
):
    from tests.conftest import SEED_CONFIG, write_config
    from tests.train.test_trainer import _options
    from train.trainer import Trainer

    config = SEED_CONFIG
    if option or replace:
        tmp.mkdir(parents=True, exist_ok=True)
        on = dict(replace or {})
        if option:
            on["final { hidden_units: [64] }"] = f"final {{ hidden_units: [64] }}\n{option}"
        config = write_config(
            SEED_CONFIG, tmp / "cold.config", train=tiny / "train", eval_=tiny / "eval", replace=on
        )
    options = _options(tiny, tmp, config, max_steps=1, device=device, cuda_graphs=False)
    return Trainer(options)


@pytest.mark.parametrize("option", DENSE_OPTIONS.values(), ids=DENSE_OPTIONS.keys())
def test_train_step_with_emulated_graphs_equals_eager(
    tiny_samples: Path, tmp_path: Path, option: str
) -> None:
    """Whole training steps (lookups, dynamic-table updates in the backward, Adam) with the
    dense part through the emulated graphs: the same losses and weights as eager, with a
    cold-id backoff (run eagerly before the graph) or the feature crosses (inside it) too."""
    from train.trainer import train_step

    runs = []
    for graphed in (False, True):
        trainer = _tiny_model(tiny_samples, tmp_path / f"m{graphed}", "cpu", option=option)
        assert trainer.graphs is None  # CPU: the trainer never builds them
        model, opts = trainer.model, trainer.optimizers
        graphs = DenseArchGraphs(model.dense, emulate=True, min_bucket=64) if graphed else None
        batches = list(trainer.loader.epoch(0))[:4]
        losses = [
            float(train_step(model, opts, b, i, graphs=graphs)) for i, b in enumerate(batches)
        ]
        runs.append((losses, [p.detach().clone() for p in model.dense.parameters()], graphs))
    (want, want_p, _), (got, got_p, graphs) = runs
    assert graphs is not None and graphs.stats["replays"] == 4
    for a, b in zip(got, want, strict=True):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)
    for a, b in zip(got_p, want_p, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_trainer_option_and_cli_flag(
    tiny_samples: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU never builds graphs, whatever the option; ``--cuda-graphs`` / ``--no-cuda-graphs``
    reach TrainOptions (absent: None, the default)."""
    import train.trainer
    from tests.conftest import SEED_CONFIG
    from tests.train.test_trainer import _options
    from train.__main__ import main

    for flag in (None, True):
        trainer = train.trainer.Trainer(_options(tiny_samples, tmp_path / "a", cuda_graphs=flag))
        assert trainer.graphs is None

    seen: list[bool | None] = []

    class Stop(Exception):
        pass

    class FakeTrainer:
        def __init__(self, options: train.trainer.TrainOptions) -> None:
            seen.append(options.cuda_graphs)

        def fit(self) -> None:
            raise Stop

    monkeypatch.setattr(train.trainer, "Trainer", FakeTrainer)
    # a real config: the command parses it before it builds the trainer
    base = ["train", "--config", str(SEED_CONFIG), "--device", "cpu"]
    for extra in ([], ["--cuda-graphs"], ["--no-cuda-graphs"]):
        with pytest.raises(Stop):
            main([*base, *extra])
    assert seen == [None, True, False]


# --------------------------------------------------------------------------- GPU

# fp32 on the GPU: the weight-gradient GEMMs over B + 1 rows may pick another cuBLAS kernel
# (another summation order) than over B rows; everything else is per row / per segment.
GPU_RTOL, GPU_ATOL = 1e-4, 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: captures CUDA graphs")
@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_cuda_graphs_equal_eager_over_steps(amp: torch.dtype | None) -> None:
    """Real capture and replay: three batches in one bucket (replays after optimizer steps),
    a new larger bucket, back to the first, a smaller last batch; each equal to eager."""
    gen = torch.Generator().manual_seed(11)
    totals = [1000, 970, 1024, 5000, 990, 700]  # buckets (min 256): 1024 x3, 5120, 1024, 704
    steps = [lengths_with_total(gen, 64, t) for t in totals]
    steps.append(lengths_with_total(gen, 17, 300))  # a smaller last batch: its own graph
    tol = (GPU_RTOL, GPU_ATOL) if amp is None else (2e-2, 2e-3)
    graphs = run_steps(
        steps, device="cuda", dtype=torch.float32, amp=amp, rtol=tol[0], atol=tol[1],
        min_bucket=256,
    )  # fmt: skip
    assert graphs.stats["capture_failures"] == 0 and graphs.stats["eager"] == 0
    assert graphs.stats["replays"] == len(steps)
    assert graphs.stats["captures"] == len({(len(s), bucket_rows(sum(s), 256)) for s in steps}) == 4


def lengths_with_total(gen: torch.Generator, n: int, total: int) -> list[int]:
    """n random lengths summing to ``total``, about a third of them empty."""
    owners = torch.nonzero(torch.rand(n, generator=gen) > 0.33).flatten()
    pick = owners[torch.randint(0, len(owners), (total,), generator=gen)]
    return torch.bincount(pick, minlength=n).tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: captures CUDA graphs")
def test_cuda_din_graphs_equal_eager() -> None:
    gen = torch.Generator().manual_seed(12)
    torch.manual_seed(0)
    din = JaggedDIN(48, [256, 64]).cuda()
    graphs = DINGraphs(din, min_bucket=256)
    for n, total in ((512, 9000), (512, 8800), (300, 2000)):  # buckets 9216, 9216, 2048
        lengths = lengths_with_total(gen, n, total)
        x = {
            "query": torch.randn(n, 48, generator=gen).cuda(),
            "seq_values": torch.randn(total, 48, generator=gen).cuda(),
            "seq_lengths": torch.tensor(lengths, device="cuda"),
        }
        want = fwd_bwd(eager_din(din), din, x)
        assert_same(fwd_bwd(graphs, din, x), want, rtol=GPU_RTOL, atol=GPU_ATOL)
    assert graphs.stats["replays"] == 3 and graphs.stats["captures"] == 2
    assert graphs.stats["capture_failures"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: captures CUDA graphs")
@pytest.mark.parametrize("option", DENSE_OPTIONS.values(), ids=DENSE_OPTIONS.keys())
def test_cuda_train_step_with_graphs_matches_eager(
    tiny_samples: Path, tmp_path: Path, option: str
) -> None:
    from train.trainer import train_step

    runs = []
    for graphed in (False, True):
        trainer = _tiny_model(tiny_samples, tmp_path / f"m{graphed}", "cuda", option=option)
        model, opts = trainer.model, trainer.optimizers
        graphs = DenseArchGraphs(model.dense, min_bucket=256) if graphed else None
        batches = [b.to("cuda") for b in list(trainer.loader.epoch(0))[:6]]
        losses = [
            float(train_step(model, opts, b, i, graphs=graphs)) for i, b in enumerate(batches)
        ]
        runs.append((losses, graphs))
    (want, _), (got, graphs) = runs
    assert graphs is not None and graphs.stats["replays"] == 6, graphs.stats
    for a, b in zip(got, want, strict=True):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5), (got, want)


def _table_states(model) -> list[torch.Tensor]:
    dec = model.sparse.dynamic
    out = []
    for name in dec.tables:
        st = dec.table_state(name)
        out += [st.keys.cpu(), st.values.cpu(), st.scores.cpu(), st.accumulators.cpu()]
        if st.counter_keys is not None:
            out += [st.counter_keys.cpu(), st.counter_counts.cpu()]
    return out


# cate_id's table at its own sparse rate: a storage of its own beside the fused groups
TABLE_RATE = {
    "constant_learning_rate {}\n}\ndense_optimizer": "constant_learning_rate {}\n"
    'table_learning_rates { feature_name: "cate_id" lr_scale: 4 }\n}\ndense_optimizer'
}


def _static_runs(tiny: Path, tmp: Path, device: str, steps: int, replace: dict[str, str]):
    """(losses, table states, model) of ``steps`` training steps with full tables, eager and
    with the static sparse step (and, on CUDA, the dense graphs: cuda_graphs_for)."""
    from train.trainer import cuda_graphs_for, train_step

    runs = []
    for static in (False, True):
        trainer = _tiny_model(tiny, tmp / f"s{static}", device, replace=replace)
        model, opts = trainer.model, trainer.optimizers
        graphs = None
        if static and device == "cuda":
            graphs = cuda_graphs_for(model)
        elif static:
            model.sparse.dynamic.use_static_step(capture=False)
        batches = [b.to(device) for b in list(trainer.loader.epoch(0))[:steps]]
        losses = [
            float(train_step(model, opts, b, i, graphs=graphs)) for i, b in enumerate(batches)
        ]
        runs.append((losses, _table_states(model), model))
    return runs


STATIC_CASES = {"seed": FULL_TABLES, "table_rate": {**FULL_TABLES, **TABLE_RATE}}


@pytest.mark.parametrize("replace", STATIC_CASES.values(), ids=STATIC_CASES.keys())
def test_train_steps_with_the_static_sparse_step_equal_eager(
    tiny_samples: Path, tmp_path: Path, replace: dict[str, str]
) -> None:
    """Whole training steps of the seed model with full tables (evictions, admission) through
    the static sparse step on CPU: the same losses and tables as the eager lookup, bit for bit;
    also with a table at its own sparse rate (one more storage)."""
    (want, want_t, _), (got, got_t, model) = _static_runs(tiny_samples, tmp_path, "cpu", 4, replace)
    if replace is not FULL_TABLES:
        assert "cate_id_emb" in model.sparse.dynamic.storages
    assert got == want
    for a, b in zip(got_t, want_t, strict=True):
        assert torch.equal(a, b)
    assert model.sparse.dynamic.static_stats()["deep"]["eager"] == 4
    stats = model.sparse.dynamic.stats()
    assert sum(s["evictions"] + s["refusals"] for s in stats.values()) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: captures CUDA graphs")
@pytest.mark.parametrize("replace", STATIC_CASES.values(), ids=STATIC_CASES.keys())
def test_cuda_train_steps_with_the_captured_sparse_step_match_eager(
    tiny_samples: Path, tmp_path: Path, replace: dict[str, str]
) -> None:
    """The same on CUDA, the sparse step and the dense part replayed from CUDA graphs against
    eager CUDA: losses to the dense graphs' rounding, the tables' keys exactly."""
    (want, want_t, _), (got, got_t, model) = _static_runs(
        tiny_samples, tmp_path, "cuda", 6, replace
    )
    for a, b in zip(got, want, strict=True):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5), (got, want)
    for a, b in zip(got_t, want_t, strict=True):
        if a.dtype == torch.int64:
            assert a.shape == b.shape
        else:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    for ran in model.sparse.dynamic.static_stats().values():  # a table at its own rate too
        assert ran["replays"] == 6 and ran["captures"] >= 1 and ran["eager"] == 0, ran


# --------------------------------------------------------------------------- the cold-ids config


def _cold_ids_runs(tiny: Path, tmp: Path, device: str, steps: int, after=None):
    """Per run (eager; graphed): losses, dense parameters, dense EMA averages, the dense graphs,
    where the backoff ran (True: inside a graph body) and the model, of ``steps`` steps of the
    cold-ids config (backoff, crosses, item tower, dense EMA) with small full tables, the EMA
    updated after each step as the trainer does. Graphed: the static sparse step (captured on
    CUDA) and the dense graphs (emulated on CPU); ``after(step)`` is then called with a
    function that runs one more of its steps, on the last batch again (its shapes captured:
    a replay, no capture)."""
    import inspect

    from tests.conftest import ROOT, write_config
    from tests.train.test_trainer import _options
    from train.trainer import Trainer, train_step

    base = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb_cold_ids.config"
    runs = []
    for graphed in (False, True):
        tmp_run = tmp / f"cold{graphed}"
        tmp_run.mkdir(parents=True, exist_ok=True)
        config = write_config(
            base, tmp_run / "cold.config", train=tiny / "train", eval_=tiny / "eval",
            replace=FULL_TABLES,
        )  # fmt: skip
        trainer = Trainer(_options(tiny, tmp_run, config, device=device, cuda_graphs=False))
        model, opts, ema = trainer.model, trainer.optimizers, trainer.dense_ema
        assert ema is not None and model.dense.takes_cold
        assert model.dense.crosses is not None and model.dense.item_tower is not None
        where: list[bool] = []

        def in_graph_body(*_: object, where: list[bool] = where) -> None:
            frames = inspect.stack()
            where.append(any(f.function == "_run" and f.filename.endswith("graphed.py")
                             for f in frames))  # fmt: skip

        model.dense.backoff.register_forward_hook(in_graph_body)
        graphs = None
        if graphed:
            model.sparse.dynamic.use_static_step(capture=device == "cuda")
            model.sparse.dynamic.reserve_max_capacity()
            graphs = DenseArchGraphs(model.dense, emulate=device == "cpu", min_bucket=256)
        batches = [b.to(device) for b in list(trainer.loader.epoch(0))[:steps]]
        losses = []
        for i, b in enumerate(batches):
            losses.append(float(train_step(model, opts, b, i, graphs=graphs, ema=ema)))
        params = [p.detach().clone() for p in model.dense.parameters()]
        averages = [a.clone() for a in ema.averaged().values()]
        if graphed and after is not None:  # after the figures the runs are compared by
            last = (model, opts, batches[-1], steps)
            after(
                lambda last=last, graphs=graphs, ema=ema: train_step(*last, graphs=graphs, ema=ema)
            )
        runs.append((losses, params, averages, graphs, where, model))
    return runs


def test_cold_ids_steps_with_emulated_graphs_equal_eager(
    tiny_samples: Path, tmp_path: Path
) -> None:
    """The cold-ids config's whole step on CPU (lookups with hit masks, the static sparse
    step, the backoff, crosses and item tower, Adam, the dense EMA) with the dense part
    through the emulated graphs: the backoff runs inside the graph body, and the losses,
    weights and averages are eager's."""
    eager, graphed = _cold_ids_runs(tiny_samples, tmp_path, "cpu", 4)
    graphs = graphed[3]
    assert graphs is not None and graphs.stats["replays"] == 4 and graphs.stats["eager"] == 0
    assert eager[4] and not any(eager[4])  # eager: the module's own forward
    assert len(graphed[4]) >= 4 and all(graphed[4]), graphed[4]  # graphed: in the graph body
    for a, b in zip(graphed[0], eager[0], strict=True):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), (graphed[0], eager[0])
    for got, want in ((graphed[1], eager[1]), (graphed[2], eager[2])):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert graphed[5].sparse.dynamic.static_stats()["deep"]["eager"] == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: captures CUDA graphs")
def test_cuda_cold_ids_steps_with_graphs_match_eager(tiny_samples: Path, tmp_path: Path) -> None:
    """The same on CUDA, the sparse step and the dense part (backoff, crosses, item tower)
    replayed from CUDA graphs, the EMA fused: every step replayed, the losses, weights and
    averages eager's to the dense graphs' rounding, and no host sync in a replayed step."""
    import warnings

    syncs: list[str] = []

    def without_syncs(step) -> None:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        syncs.extend(str(w.message) for w in seen if "called a synchronizing" in str(w.message))

    eager, graphed = _cold_ids_runs(tiny_samples, tmp_path, "cuda", 6, after=without_syncs)
    assert not syncs, syncs
    graphs, model = graphed[3], graphed[5]
    assert graphs is not None and graphs.stats["replays"] == 7, graphs.stats
    assert graphs.stats["eager"] == 0 and graphs.stats["capture_failures"] == 0
    ran = model.sparse.dynamic.static_stats()["deep"]
    assert ran["replays"] == 7 and ran["captures"] >= 1, ran
    assert graphed[4] and all(graphed[4])  # the warm-ups and captures: in the graph body
    for a, b in zip(graphed[0], eager[0], strict=True):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5), (graphed[0], eager[0])
    for got, want in ((graphed[1], eager[1]), (graphed[2], eager[2])):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_a_table_at_its_own_rate_costs_no_host_read_with_static_steps(
    tiny_samples: Path, tmp_path: Path
) -> None:
    """A table at its own sparse rate has a storage of its own; with every storage on its
    static step, the collection reads nothing from the device in a training lookup of both
    (its sign check across storages, a host sync, is left to the static steps, which refuse a
    negative key themselves), and both storages take the static path. (The CPU code's own
    reads stay: the torch backend's probe walk and the num_buckets tables' id check, which
    CUDA does without a read.)"""
    trainer = _tiny_model(tiny_samples, tmp_path, "cpu", replace={**FULL_TABLES, **TABLE_RATE})
    model = trainer.model
    dynamic = model.sparse.dynamic
    dynamic.use_static_step(capture=False)
    dynamic.reserve_max_capacity()
    assert set(dynamic.storages) == {"deep", "cate_id_emb"}
    batch = next(iter(trainer.loader.epoch(0)))
    model.train()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True
    ) as prof:
        model.sparse(batch, cold=True)
    callers = []  # the Python function around each host read
    for e in prof.events():
        if e.name in HOST_READS:
            up = e.cpu_parent
            while up is not None and ".py(" not in up.name:
                up = up.cpu_parent
            callers.append(up.name if up is not None else "?")
    assert callers and not [c for c in callers if "hashtable/embedding.py" in c], callers
    assert all(ran["eager"] == 1 for ran in dynamic.static_stats().values())
