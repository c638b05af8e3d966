"""Benchmark: DIN tower forward+backward, jagged vs tzrec's padded, in one run; and DenseArch.

    python -m bench.bench_din --out results/bench_din_cpu.json [--device cuda] [--batch 8192]

Sequence lengths follow the Taobao click-history shape: mean ~3.8, many empty rows, a long tail
up to 100 (a geometric body mixed with a log-uniform tail, see :func:`sample_lengths`). The padded
DIN pads to ``--max-len`` (100: tzrec pads to the configured sequence length).

DIN variants, all on the training layout (U == B, one user row per sample) with the same weights:

- ``padded``: tzrec's padded DIN (the baseline);
- ``jagged``: :class:`JaggedDIN`'s general path, given ``user_index = arange(B)`` (what serving
  exports: pair expansion, one host sync for the pair count);
- ``jagged_fast``: the training fast path, ``user_index=None`` (no sync, no expansion, custom
  autograd nodes for the pair features and the segment softmax pooling);
- ``jagged_compiled``: the fast path under ``torch.compile`` (dynamic shapes, no CUDA graphs);
  on by default on CUDA only (``--compile``);
- ``jagged_graphed``: the fast path's forward and backward captured as CUDA graphs and replayed
  (:class:`train.model.graphed.DINGraphs`: T padded to its bucket, one dummy row); CUDA only
  (``--graphs``). The capture happens in the warmup runs; ``graphs`` records the bucket and the
  replay/capture counts.

Times are the median of ``--repeats`` timed runs after ``--warmup`` runs (the first compiled run
compiles); on CUDA every run is bracketed by ``torch.cuda.synchronize`` (latency of one step).
``steady_ms`` is the mean of ``--repeats`` back-to-back steps with one synchronize at the end
(throughput, host and device overlapping as in training). ``agreement`` holds each jagged
variant's max abs difference to the general path in output and gradients (query, sequence and
every parameter), and the padded one's output difference. ``profile`` counts, for one step of
each variant, the operator calls issued from Python/autograd, the autograd nodes run and (CUDA)
the device kernels launched.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from shared.cli import Parser, check_device, plain, run_cli
from shared.cli import exit_code as _exit_code
from train.model.dense_arch import DenseArch
from train.model.din import JaggedDIN, PaddedDIN
from train.model.graphed import DenseArchGraphs, DINGraphs, bucket_rows

DIM = 48  # query / sequence width: adgroup_id, cate_id, brand embeddings of 16
ATTN_UNITS = [256, 64]
TAIL_SHARE = 0.04  # share of rows drawn from the log-uniform tail


def sample_lengths(n: int, mean: float, max_len: int, gen: torch.Generator) -> torch.Tensor:
    """[n] int64 lengths: geometric body (from 0) mixed with a log-uniform tail on [1, max_len].

    The body's mean is solved so that the mixture's mean is ``mean`` (before clamping at
    ``max_len``, which the geometric body practically never reaches).
    """
    tail_mean = (max_len + 1 - 1) / math.log(max_len + 1) - 0.5  # E[floor(exp(U ln(max_len+1)))]
    body_mean = max((mean - TAIL_SHARE * tail_mean) / (1 - TAIL_SHARE), 0.1)
    p = 1.0 / (1.0 + body_mean)  # geometric on {0, 1, ...} with mean body_mean
    u = torch.rand(n, generator=gen, dtype=torch.float64).clamp_min(1e-12)
    body = torch.floor(torch.log(u) / math.log(1.0 - p))
    tail = torch.floor(
        torch.exp(torch.rand(n, generator=gen, dtype=torch.float64) * math.log(max_len + 1))
    )
    pick_tail = torch.rand(n, generator=gen) < TAIL_SHARE
    return torch.where(pick_tail, tail, body).clamp(0, max_len).to(torch.int64)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_runs(
    step: Callable[[], None], repeats: int, warmup: int, device: torch.device
) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def steady_ms(step: Callable[[], None], repeats: int, device: torch.device) -> float:
    """Mean time of ``repeats`` back-to-back steps, one synchronize at the end."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    _sync(device)
    return (time.perf_counter() - start) * 1e3 / repeats


def summary(times: list[float]) -> dict[str, object]:
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),  # the least disturbed run, for a busy shared machine
        "times_ms": [round(t, 3) for t in times],
    }


VIEW_OPS = {
    "aten::alias",
    "aten::as_strided",
    "aten::detach",
    "aten::expand",
    "aten::expand_as",
    "aten::narrow",
    "aten::permute",
    "aten::select",
    "aten::slice",
    "aten::split",
    "aten::squeeze",
    "aten::t",
    "aten::transpose",
    "aten::unsqueeze",
    "aten::view",
    "aten::_reshape_alias",
    "aten::reshape",
    "aten::promote_types",
    "aten::result_type",
    "aten::to",
}


def profile_step(step: Callable[[], None], device: torch.device) -> dict[str, object]:
    """Operator calls, autograd nodes and device kernels of one step (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    try:
        _sync(device)
        with profile(activities=activities) as prof:
            step()
            _sync(device)
    except Exception as err:  # noqa: BLE001 - profiling is diagnostics only
        return {"error": repr(err)}

    def outermost_aten(event: object) -> bool:
        parent = getattr(event, "cpu_parent", None)
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    events = list(prof.events())
    calls = [e.name for e in events if e.name.startswith("aten::") and outermost_aten(e)]
    out: dict[str, object] = {
        "aten_calls": len(calls),  # outermost aten ops: one dispatch each from Python/autograd
        "aten_calls_no_views": sum(1 for n in calls if n not in VIEW_OPS),
        "autograd_nodes": sum(1 for e in events if e.name.startswith("autograd::engine::")),
        "host_syncs": sum(1 for n in calls if n in ("aten::item", "aten::_local_scalar_dense")),
    }
    if device.type == "cuda":  # kernels, memcpys and memsets on the device
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        out["cuda_kernels"] = len(kernels)
        out["cuda_kernel_ms"] = sum(getattr(e, "device_time", 0.0) for e in kernels) / 1e3
    return out


def _max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """max |a - b|; inf when only one is None."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _clone(a: torch.Tensor | None) -> torch.Tensor | None:
    return None if a is None else a.detach().clone()


def _max_abs(a: torch.Tensor | None) -> float:
    return float(a.abs().max()) if a is not None and a.numel() else 0.0


def bench_din(
    lengths: torch.Tensor,
    device: torch.device,
    max_len: int,
    repeats: int,
    warmup: int,
    compile_fast_path: bool = False,
    graphs: bool = False,
) -> dict[str, object]:
    gen = torch.Generator().manual_seed(1)
    b, t = lengths.numel(), int(lengths.sum())
    jagged = JaggedDIN(DIM, ATTN_UNITS).to(device)
    padded = PaddedDIN(DIM, ATTN_UNITS, max_length=max_len).to(device)
    padded.load_state_dict(jagged.state_dict())
    compiled = JaggedDIN(DIM, ATTN_UNITS).to(device)
    compiled.load_state_dict(jagged.state_dict())
    compiled.compile_fast_path = True
    q = torch.randn(b, DIM, generator=gen).to(device).requires_grad_()
    s = torch.randn(t, DIM, generator=gen).to(device).requires_grad_()
    lens, ui = lengths.to(device), torch.arange(b, device=device)
    # name -> (callable, module with the parameters, user_index): None is the training fast path
    variants: dict[str, tuple[Callable[..., torch.Tensor], torch.nn.Module, torch.Tensor | None]]
    variants = {
        "jagged": (jagged, jagged, ui),
        "padded": (padded, padded, ui),
        "jagged_fast": (jagged, jagged, None),
    }
    if compile_fast_path:
        variants["jagged_compiled"] = (compiled, compiled, None)
    din_graphs = None
    if graphs:  # the fast path through CUDA graphs, on the same module and inputs
        din_graphs = DINGraphs(jagged)
        variants["jagged_graphed"] = (din_graphs, jagged, None)
    outputs: dict[str, dict[str, torch.Tensor | None]] = {}

    def step_of(name: str, keep: bool = False) -> Callable[[], None]:
        fn, module, user_index = variants[name]

        def step() -> None:
            module.zero_grad(set_to_none=True)
            q.grad, s.grad = None, None
            out = fn(q, s, lens, user_index)  # [B, D]
            out.square().sum().backward()
            if keep:  # outside the timed runs: output and gradients for the agreement check
                # clones: a graph's output and gradients live in its buffers
                grads: dict[str, torch.Tensor | None] = {"out": out.detach().clone()}
                grads.update({"query": _clone(q.grad), "seq_values": _clone(s.grad)})
                grads.update({n: _clone(p.grad) for n, p in module.named_parameters()})
                outputs[name] = grads

        return step

    result: dict[str, object] = {}
    profiles: dict[str, object] = {}
    for name in variants:
        step = step_of(name)
        timed = summary(time_runs(step, repeats, warmup, device))
        timed["steady_ms"] = steady_ms(step, repeats, device)
        result[name] = timed
        profiles[name] = profile_step(step, device)
        step_of(name, keep=True)()

    def ms(name: str, key: str) -> float:
        return result[name][key]  # type: ignore[index]

    for name in variants:
        if name.startswith("jagged"):
            suffix = name[len("jagged") :]
            result[f"padded_over_jagged{suffix}"] = ms("padded", "median_ms") / ms(
                name, "median_ms"
            )
            result[f"padded_over_jagged{suffix}_min"] = ms("padded", "min_ms") / ms(name, "min_ms")
            result[f"padded_over_jagged{suffix}_steady"] = ms("padded", "steady_ms") / ms(
                name, "steady_ms"
            )
    result["max_abs_diff"] = _max_diff(outputs["jagged"]["out"], outputs["padded"]["out"])
    ref = outputs["jagged"]
    params = [k for k in ref if k not in ("out", "query", "seq_values")]
    agreement: dict[str, object] = {"padded_out": result["max_abs_diff"]}
    for name in variants:
        if name.startswith("jagged_"):
            got = outputs[name]
            agreement[name] = {
                "out": _max_diff(ref["out"], got["out"]),
                "grad_query": _max_diff(ref["query"], got["query"]),
                "grad_seq_values": _max_diff(ref["seq_values"], got["seq_values"]),
                "grad_params": max(_max_diff(ref[k], got[k]) for k in params),
                # over the largest parameter gradient entry (per tensor would divide by ~0:
                # the softmax makes attn_out.bias's true gradient exactly zero)
                "grad_params_relative": max(_max_diff(ref[k], got[k]) for k in params)
                / max(max(_max_abs(ref[k]) for k in params), 1e-30),
            }

    # fp32 with sums in another order: outputs to 1e-4, gradients to 1e-3 of their scale
    def agrees(a: dict[str, float]) -> bool:
        return (
            a["out"] < 1e-4
            and a["grad_params_relative"] < 1e-3
            and a["grad_query"] < 1e-3 * max(_max_abs(ref["query"]), 1.0)
            and a["grad_seq_values"] < 1e-3 * max(_max_abs(ref["seq_values"]), 1.0)
        )

    result["agree"] = result["max_abs_diff"] < 1e-4 and all(  # type: ignore[operator]
        agrees(a)  # type: ignore[arg-type]
        for n, a in agreement.items()
        if n != "padded_out"
    )
    result["agreement"] = agreement
    result["profile"] = profiles
    if din_graphs is not None:
        result["graphs"] = {"t_pad": bucket_rows(t), "t": t, **din_graphs.stats}
    return result


def bench_dense_arch(
    lengths: torch.Tensor,
    device: torch.device,
    repeats: int,
    warmup: int,
    compile_fast_path: bool = False,
    graphs: bool = False,
) -> dict[str, dict[str, object]]:
    """The seed config's dense part, training layout (U == B, user_index = arange).

    ``general``: user_index given (as exported); ``fast``: ``user_index=None``;
    ``compiled``: ``fast`` with the DIN's ``compile_fast_path`` (only when asked for);
    ``graphed``: ``fast`` through :class:`DenseArchGraphs` (CUDA graphs, only when asked for),
    with ``agreement``: max abs difference to ``fast`` in logits and in every gradient.
    """
    gen = torch.Generator().manual_seed(2)
    b, t = lengths.numel(), int(lengths.sum())
    arch = DenseArch(144, 112, DIM, [512, 256, 128], ATTN_UNITS, [64]).to(device)
    inputs = {
        "user_deep": torch.randn(b, 144, generator=gen),
        "item_deep": torch.randn(b, 112, generator=gen),
        "query": torch.randn(b, DIM, generator=gen),
        "seq_values": torch.randn(t, DIM, generator=gen),
    }
    x: dict[str, torch.Tensor | None] = {
        k: v.to(device).requires_grad_() for k, v in inputs.items()
    }
    x["seq_lengths"], x["user_index"] = lengths.to(device), torch.arange(b, device=device)
    labels = (torch.rand(b, generator=gen) < 0.05).float().to(device)

    kept: dict[str, list[torch.Tensor | None]] = {}

    def step_of(
        user_index: torch.Tensor | None,
        fn: Callable[..., torch.Tensor] = arch,
        keep: str | None = None,
    ) -> Callable[[], None]:
        def step() -> None:
            arch.zero_grad(set_to_none=True)
            for k in ("user_deep", "item_deep", "query", "seq_values"):
                x[k].grad = None  # type: ignore[union-attr]
            logits = fn(**{**x, "user_index": user_index})  # [B]
            torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
            if keep is not None:
                kept[keep] = [logits.detach().clone()]
                kept[keep] += [
                    _clone(v.grad) for k, v in x.items() if v is not None and v.is_floating_point()
                ]
                kept[keep] += [_clone(p.grad) for p in arch.parameters()]

        return step

    out = {
        "general": summary(time_runs(step_of(x["user_index"]), repeats, warmup, device)),
        "fast": summary(time_runs(step_of(None), repeats, warmup, device)),
    }
    if compile_fast_path:
        arch.din.compile_fast_path = True
        out["compiled"] = summary(time_runs(step_of(None), repeats, warmup, device))
        arch.din.compile_fast_path = False
    if graphs:
        dense_graphs = DenseArchGraphs(arch)
        graphed = step_of(None, dense_graphs)
        out["fast"]["steady_ms"] = steady_ms(step_of(None), repeats, device)
        out["graphed"] = summary(time_runs(graphed, repeats, warmup, device))
        out["graphed"]["steady_ms"] = steady_ms(graphed, repeats, device)
        step_of(None, keep="fast")()
        step_of(None, dense_graphs, keep="graphed")()
        diffs = [_max_diff(a, b) for a, b in zip(kept["fast"], kept["graphed"], strict=True)]
        out["graphed"]["agreement"] = {"logits": diffs[0], "grads": max(diffs[1:])}
        out["graphed"]["graphs"] = dict(dense_graphs.stats)
    return out


EXAMPLE = """examples:
  python -m bench.bench_din --out results/bench_din_cpu.json --batch 2048
  python -m bench.bench_din --out results/bench_din_gpu.json --device cuda --graphs on"""


def _parser() -> Parser:
    parser = Parser(
        prog="python -m bench.bench_din",
        description=plain(__doc__.split("\n")[0]),
        epilog=EXAMPLE,
    )
    parser.add_argument("--out", type=Path, required=True, help="results JSON path")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--batch", type=int, default=8192, help="samples (user rows) per step")
    parser.add_argument(
        "--mean-len", type=float, default=3.8, help="mean click-sequence length of the samples"
    )
    parser.add_argument(
        "--max-len", type=int, default=100, help="longest sequence; the padded DIN pads to it"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed runs (default: 30 on cuda, 5 on cpu)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before the timed ones")
    parser.add_argument("--seed", type=int, default=0, help="seed of the lengths and weights")
    parser.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="time the torch.compile'd fast path too (auto: on CUDA only)",
    )
    parser.add_argument(
        "--graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="time the fast path through CUDA graphs too (auto: on CUDA only; elsewhere the "
        "wrapper runs eagerly)",
    )
    return parser


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = _parser().parse_args(argv)
    check_device(args.device)
    device = torch.device(args.device)
    repeats = args.repeats or (30 if device.type == "cuda" else 5)
    compile_din = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    graphs = args.graphs == "on" or (args.graphs == "auto" and device.type == "cuda")
    torch.manual_seed(args.seed)

    lengths = sample_lengths(
        args.batch, args.mean_len, args.max_len, torch.Generator().manual_seed(args.seed)
    )
    lf = lengths.double()
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "max_len": args.max_len,
        "attn_units": ATTN_UNITS,
        "repeats": repeats,
        "warmup": args.warmup,
        "lengths": {
            "mean": lf.mean().item(),
            "p50": lf.quantile(0.5).item(),
            "p90": lf.quantile(0.9).item(),
            "p99": lf.quantile(0.99).item(),
            "max": int(lengths.max()),
            "empty_share": (lengths == 0).double().mean().item(),
            "total_elements": int(lengths.sum()),
            "padded_elements": args.batch * args.max_len,
        },
        "din_forward_backward": bench_din(
            lengths, device, args.max_len, repeats, args.warmup, compile_din, graphs
        ),
    }
    dense = bench_dense_arch(lengths, device, repeats, args.warmup, compile_din, graphs)
    result["dense_arch_forward_backward"] = dense["general"]  # user_index given, as exported
    result["dense_arch_forward_backward_fast"] = dense["fast"]  # user_index=None (training)
    if "compiled" in dense:
        result["dense_arch_forward_backward_compiled"] = dense["compiled"]
    if "graphed" in dense:
        result["dense_arch_forward_backward_graphed"] = dense["graphed"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
