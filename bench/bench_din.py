"""Benchmark: DIN tower forward+backward, jagged vs tzrec's padded, in one run; and DenseArch.

    python -m bench.bench_din --out results/bench_din_cpu.json [--device cuda] [--batch 8192]

Sequence lengths follow the Taobao click-history shape: mean ~3.8, many empty rows, a long tail
up to 100 (a geometric body mixed with a log-uniform tail, see :func:`sample_lengths`). The padded
DIN pads to ``--max-len`` (100: tzrec pads to the configured sequence length). Times are the
median of ``--repeats`` timed runs after ``--warmup`` runs; on CUDA every run is bracketed by
``torch.cuda.synchronize``. Weights are shared between the two DINs, and the JSON records their
max output difference as a sanity check.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from train.model.dense_arch import DenseArch
from train.model.din import JaggedDIN, PaddedDIN

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


def time_runs(
    step: Callable[[], None], repeats: int, warmup: int, device: torch.device
) -> list[float]:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def summary(times: list[float]) -> dict[str, object]:
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),  # the least disturbed run, for a busy shared machine
        "times_ms": [round(t, 3) for t in times],
    }


def bench_din(
    lengths: torch.Tensor, device: torch.device, max_len: int, repeats: int, warmup: int
) -> dict[str, object]:
    gen = torch.Generator().manual_seed(1)
    b, t = lengths.numel(), int(lengths.sum())
    jagged = JaggedDIN(DIM, ATTN_UNITS).to(device)
    padded = PaddedDIN(DIM, ATTN_UNITS, max_length=max_len).to(device)
    padded.load_state_dict(jagged.state_dict())
    q = torch.randn(b, DIM, generator=gen).to(device).requires_grad_()
    s = torch.randn(t, DIM, generator=gen).to(device).requires_grad_()
    lens, ui = lengths.to(device), torch.arange(b, device=device)
    outputs: dict[str, torch.Tensor] = {}

    def step_of(name: str, module: torch.nn.Module) -> Callable[[], None]:
        def step() -> None:
            module.zero_grad(set_to_none=True)
            q.grad, s.grad = None, None
            out = module(q, s, lens, ui)  # [B, D]
            out.square().sum().backward()
            outputs[name] = out.detach()

        return step

    result: dict[str, object] = {}
    for name, module in (("jagged", jagged), ("padded", padded)):
        result[name] = summary(time_runs(step_of(name, module), repeats, warmup, device))
    jag_ms = result["jagged"]["median_ms"]  # type: ignore[index]
    pad_ms = result["padded"]["median_ms"]  # type: ignore[index]
    result["padded_over_jagged"] = pad_ms / jag_ms  # ratio of medians
    result["padded_over_jagged_min"] = (
        result["padded"]["min_ms"] / result["jagged"]["min_ms"]  # type: ignore[index]
    )
    result["max_abs_diff"] = float((outputs["jagged"] - outputs["padded"]).abs().max())
    return result


def bench_dense_arch(
    lengths: torch.Tensor, device: torch.device, repeats: int, warmup: int
) -> dict[str, object]:
    """The seed config's dense part, training layout (U == B, user_index = arange)."""
    gen = torch.Generator().manual_seed(2)
    b, t = lengths.numel(), int(lengths.sum())
    arch = DenseArch(144, 112, DIM, [512, 256, 128], ATTN_UNITS, [64]).to(device)
    inputs = {
        "user_deep": torch.randn(b, 144, generator=gen),
        "item_deep": torch.randn(b, 112, generator=gen),
        "query": torch.randn(b, DIM, generator=gen),
        "seq_values": torch.randn(t, DIM, generator=gen),
    }
    x = {k: v.to(device).requires_grad_() for k, v in inputs.items()}
    x["seq_lengths"], x["user_index"] = lengths.to(device), torch.arange(b, device=device)
    labels = (torch.rand(b, generator=gen) < 0.05).float().to(device)

    def step() -> None:
        arch.zero_grad(set_to_none=True)
        logits = arch(**x)  # [B]
        torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()

    return summary(time_runs(step, repeats, warmup, device))


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results JSON path")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--mean-len", type=float, default=3.8)
    parser.add_argument("--max-len", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=None, help="default: 20 on cuda, 5 on cpu")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    repeats = args.repeats or (20 if device.type == "cuda" else 5)
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
        "din_forward_backward": bench_din(lengths, device, args.max_len, repeats, args.warmup),
        "dense_arch_forward_backward": bench_dense_arch(lengths, device, repeats, args.warmup),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
