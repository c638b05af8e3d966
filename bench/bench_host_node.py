"""The host's cores in a CUDA graph: n random rows of the host tier to the device (and back)
through a host node, against the device's own reads, in one run (issue #52's fill at scale).

    python -m bench.bench_host_node --out out/bench_host_node_cpu.json          # CPU: the move
    python -m bench.bench_host_node --device cuda --rows 100000000 --dims 16 \\
        --ns 107000 262144 --out out/bench_host_node_gpu.json                  # the device

Why: at item 1's 100M rows the static cache's fill reads 107K random rows a step at about 35M
rows/s (a cost per row, most likely its address translation), while the host's cores gather 200-400M
rows/s of the same tier. A graph cannot call Python, but it can run a host function: here
:func:`shared.hashtable.host_move.launch_on_stream` queues the native mover between two
kernels. The tier is ``bench_host_rows``' (:class:`~shared.hashtable.host_store.TensorHostStore`,
rows holding a pattern of their id). For each n (distinct random rows), in one graph each:

- ``uva_gather``: :func:`~shared.hashtable.cuda.host_rows.gather` of the rows, random order
  (today's fill reads this way, in row order since 2026-12-07: ``uva_gather_sorted``);
- ``host_node``: a host node gathers the rows into pinned staging rows (the native mover, all
  cores), then a kernel reads the staging rows, which lie one after another, through UVA;
- ``host_node_writeback``: also n other rows' payload written back first: a kernel writes it to
  pinned staging rows, the host node scatters it into the tier, then gathers, then the read;
- on CPU (and beside them on CUDA), ``host_move``: the mover alone, called from Python.

Device methods are graphs replayed (timed with CUDA events, medians of ``--repeats``); every
method's rows are checked against the pattern, and the written-back rows in the tier after.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.bench_host_rows import bits, figures, matrix, pattern
from shared.cli import Parser, check_device, plain, run_cli, write_result
from shared.cli import exit_code as _exit_code
from shared.hashtable import host_move

DEVICE_METHODS = ("uva_gather", "uva_gather_sorted", "host_node", "host_node_writeback")


def graph_ms(fn: Callable[[], None], repeats: int) -> list[float]:
    """``fn`` captured in a CUDA graph (after one eager run), then replayed ``repeats`` times:
    every replay's ms."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)))
    return times


def measure(m: Any, n: int, cuda: bool, threads: int, repeats: int) -> dict[str, Any]:
    width = 2 * m.dim
    ids = m.perm[:n].contiguous()  # [n] random rows read
    backs = m.perm[n : 2 * n].contiguous()  # [n] other rows written back
    want = pattern(ids, width)
    read_ids = ids.clone().pin_memory() if cuda else ids.clone()
    back_ids = backs.clone().pin_memory() if cuda else backs.clone()
    staging_in = torch.empty(n, width, pin_memory=cuda)  # [n, 2 * dim]
    staging_out = torch.empty(n, width, pin_memory=cuda)
    staging_out.view(torch.int32).copy_(pattern(backs, width))  # written back unchanged
    counts = torch.tensor([0, n], dtype=torch.int64)
    counts_wb = torch.tensor([n, n], dtype=torch.int64)
    if cuda:
        counts, counts_wb = counts.pin_memory(), counts_wb.pin_memory()
    gather_only = host_move.HostMove(m.host, back_ids, staging_out, read_ids, staging_in, counts,
                                     threads=threads)  # fmt: skip
    with_backs = host_move.HostMove(m.host, back_ids, staging_out, read_ids, staging_in,
                                    counts_wb, threads=threads)  # fmt: skip
    out: dict[str, Any] = {}

    def record(name: str, times: list[float], ok: bool, moved: int) -> None:
        out[name] = {"run": True, **figures(times, n, moved * width * 4), "rows_equal": ok}

    times = []
    for _ in range(repeats):
        staging_in.zero_()
        t = time.perf_counter()
        gather_only.run()
        times.append((time.perf_counter() - t) * 1e3)
    record("host_move", times, torch.equal(bits(staging_in), want), n)
    if not cuda:
        why = "needs a CUDA device (run with --device cuda)"
        out.update({name: {"run": False, "reason": why} for name in DEVICE_METHODS})
        return out
    from shared.hashtable.cuda import host_rows

    dev = torch.device("cuda")
    rows_dev, sorted_dev = ids.to(dev), ids.sort().values.to(dev)
    seq = torch.arange(n, device=dev)
    got = torch.empty(n, width, device=dev)
    payload = pattern(backs, width).view(torch.float32).to(dev)  # the rows' own: unchanged
    ptr, stage_in, stage_out = (
        m.store.device_pointer(),
        staging_in.data_ptr(),
        staging_out.data_ptr(),
    )
    stream = torch.cuda.current_stream  # the capture's stream inside the graph

    def uva(rows: torch.Tensor) -> Callable[[], None]:
        return lambda: host_rows.gather(ptr, rows, got)

    def node(move: host_move.HostMove, writeback: bool) -> Callable[[], None]:
        def run() -> None:
            if writeback:  # the victims' payload to pinned staging rows, one after another
                host_rows.scatter(stage_out, seq, payload)
            host_move.launch_on_stream(move, stream())
            host_rows.gather(stage_in, seq, got)  # the staged rows, in order, through UVA

        return run

    checks = {
        "uva_gather": (uva(rows_dev), want, n),
        "uva_gather_sorted": (uva(sorted_dev), pattern(ids.sort().values, width), n),
        "host_node": (node(gather_only, False), want, n),
        "host_node_writeback": (node(with_backs, True), want, 2 * n),
    }
    for name, (fn, expect, moved) in checks.items():
        got.zero_()
        times = graph_ms(fn, repeats)
        ok = torch.equal(bits(got), expect)
        if name == "host_node_writeback":  # the rows written back hold their own pattern
            ok = ok and torch.equal(bits(m.host[backs]), pattern(backs, width))
        record(name, times, ok, moved)
    return out


def run(args: Any) -> dict[str, Any]:
    check_device(args.device)
    cuda = args.device.startswith("cuda")
    why = host_move.unavailable_reason()
    if why is not None:
        raise RuntimeError(f"bench_host_node: {why}")
    threads = args.threads or len(os.sched_getaffinity(0))
    result: dict[str, Any] = {
        "what": "n random host-tier rows to the device: a host node's gather against UVA reads",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "threads": threads,
        "repeats": args.repeats,
        "dims": {},
    }
    for dim in args.dims:
        m = matrix(dim, args.rows, torch.device(args.device), args.seed)
        entry: dict[str, Any] = {"rows": args.rows, "row_bytes": 8 * dim, "n": {}}
        result["dims"][str(dim)] = entry
        for n in args.ns:
            entry["n"][str(n)] = got = measure(m, n, cuda, threads, args.repeats)
            line = ", ".join(f"{k} {v['ms']:.3f} ms {v['rows_per_s'] / 1e6:.1f}M rows/s"
                             for k, v in got.items() if v["run"])  # fmt: skip
            print(f"dim {dim} n {n}: {line}", file=sys.stderr, flush=True)
            write_result(args.out, result)
        del m
    return result


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_host_node", description=plain(__doc__))
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--rows", type=int, default=200_000, help="rows of the host tier")
    p.add_argument("--dims", type=int, nargs="+", default=[16], help="embedding dims")
    p.add_argument("--ns", type=int, nargs="+", default=[4096], help="rows moved a call")
    p.add_argument("--threads", type=int, default=0, help="the mover's threads (0: the cores)")
    p.add_argument("--repeats", type=int, default=9, help="timed calls of each method")
    p.add_argument("--seed", type=int, default=0, help="the row ids' permutation")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if min(args.ns) < 1 or 2 * max(args.ns) > args.rows or args.repeats < 1:
        raise ValueError(
            f"bench_host_node: --ns must be >= 1 and at most half of --rows ({args.rows}: the "
            f"rows written back are others), --repeats >= 1"
        )
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
