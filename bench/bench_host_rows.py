"""The host tier's row path: how fast n random rows of a page-locked, device-mapped host matrix
reach the device (and go back), by each way there is, in the same run (issue #52's fill design).

    python -m bench.bench_host_rows --out bench/results/bench_host_rows_cpu.json    # CPU, small
    python -m bench.bench_host_rows --device cuda --rows 30000000 --rows-128 10000000 \\
        --ns 65536 262144 1048576 --out out/bench_host_rows_gpu.json            # the device

The matrix is the host tier's (:class:`~shared.hashtable.host_store.TensorHostStore`, mapped on
CUDA): ``--rows`` rows (``--rows-128`` for dims above 64) of ``2 * dim`` float32 (values, then
Adagrad accumulators). Each row holds a pattern of its row id (finite float32 bits), so every
method's rows are checked against the pattern, not against another gather (``rows_equal``).
For each n of ``--ns``, n distinct random row ids (a prefix of one permutation), methods:

- ``a_uva_gather``: :func:`~shared.hashtable.cuda.host_rows.gather`, ids on the device;
- ``b_uva_fill_slots``: the same read as the static cache's line fill does it
  (:func:`~shared.hashtable.cuda.host_rows.fill_slots`): ``--positions`` P positions of which
  n (random ones) have a slot, the rest idle; ``b_uva_fill_slots_writeback`` also writes each
  slot's old payload back to another row first (the 10 % cache's case; its GB/s counts both
  ways, its rows/s the rows read); ``b_uva_fill_paired*`` the same as the static cache runs
  it (``row_cache_static._pair_in_row_order``): the k-th slot reads the k-th smallest row and
  writes back to the k-th smallest, the threads walk the positions in that order, so both
  directions go in address order in one launch (the order's sort timed too);
- ``c_*``: through the CPU, ids on the host: ``torch.index_select`` into a pinned staging
  buffer (``c_cpu_gather`` with torch threads = the cores, ``c_cpu_gather_1t`` with one), one
  bulk ``non_blocking`` copy to the device (``c_h2d_copy``), and both (``c_gather_copy``,
  ``c_gather_copy_1t``: host wall time to the copy's end); ``c_gather_copy_chunked`` gathers
  in 4 chunks, each chunk's copy overlapping the next chunk's gather;
- ``d_uva_scatter``: :func:`~shared.hashtable.cuda.host_rows.scatter` of n rows (a write-back);
- ``e_bulk_h2d``: one contiguous copy of n rows' bytes from the pinned matrix (the ceiling);
  ``e_bulk_d2h`` the same the other way.

Every repeat runs every method once, in turn (drift hits them alike), after one untimed call of
each (kernel compilation, first touch); the figures are the medians over ``--repeats``. Device
work is timed with CUDA events around it; the CPU gathers and the ``c_gather_copy*`` totals
with the host clock (up to a device sync). Per method: ms, rows/s, GB/s and
``x_bulk_h2d`` (its ms over ``e_bulk_h2d``'s at the same n: how far from the ceiling). On CPU
(``--device cpu``) only the CPU gathers run; the others say why not (``run: false``).
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.cli import Parser, check_device, plain, run_cli, write_result
from shared.cli import exit_code as _exit_code
from shared.hashtable.host_store import TensorHostStore

CHUNKS = 4  # c_gather_copy_chunked's pieces
MIX = 2654435761  # a row id's pattern: (row * MIX + column * 97) & MASK, as float32 bits
MASK = 0x3FFFFFFF  # sign and top exponent bit clear: finite floats, never NaN or inf
FILL_ROWS = 1 << 18  # rows of the pattern written at a time
EXAMPLE = """examples:
  python -m bench.bench_host_rows --out bench/results/bench_host_rows_cpu.json
  python -m bench.bench_host_rows --device cuda --rows 30000000 --rows-128 10000000 --ns 65536 262144 1048576 --out out/bench_host_rows_gpu.json"""


def pattern(ids: torch.Tensor, width: int) -> torch.Tensor:
    """[n, width] int32: the bits every row ``ids[i]`` (int64 on the CPU) holds."""
    cols = torch.arange(width, dtype=torch.int64) * 97  # [width]
    return ((ids.unsqueeze(1) * MIX + cols) & MASK).to(torch.int32)  # [n, width]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The float32 rows ``t`` as int32 bits on the CPU (compared bit for bit)."""
    return t.detach().cpu().view(torch.int32)


@dataclass
class Matrix:
    """One dim's host tier: the store, its rows [rows, 2 * dim] and a permutation of row ids."""

    dim: int
    store: TensorHostStore
    host: torch.Tensor  # [rows, 2 * dim] float32 (pinned and mapped on CUDA)
    perm: torch.Tensor  # [rows] int64: ids[:n] are n distinct random rows

    @property
    def row_bytes(self) -> int:
        return 2 * self.dim * 4


def matrix(dim: int, rows: int, device: torch.device, seed: int) -> Matrix:
    """The host tier of ``rows`` rows, each holding its :func:`pattern`."""
    cuda = device.type == "cuda"
    store = TensorHostStore(dim, capacity=rows, pin=cuda, mapped=cuda)
    host = store.rows  # [rows, 2 * dim]
    as_int = host.view(torch.int32)
    for a in range(0, rows, FILL_ROWS):
        b = min(rows, a + FILL_ROWS)
        as_int[a:b] = pattern(torch.arange(a, b), 2 * dim)
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    return Matrix(dim, store, host, perm)


class Clock:
    """Milliseconds of one call: device work by CUDA events around it, host work by the host
    clock up to a device sync."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def device_ms(self, fn: Callable[[], object]) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        self.sync()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    def host_ms(self, fn: Callable[[], object]) -> float:
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        return (time.perf_counter() - t) * 1e3


@dataclass
class Method:
    """A timed call and what it moves: ``rows`` rows read (or written), ``moved`` rows' bytes
    over the bus (both ways), ``check`` whether its result holds the expected rows."""

    run: Callable[[], float]  # one timed call: ms
    rows: int
    moved: int
    check: Callable[[], bool]  # after the untimed first call
    after: Callable[[], None] | None = None  # untimed, after every call (undo a write)


def figures(times: list[float], rows: int, nbytes: int) -> dict[str, Any]:
    """A method's figures from its calls' ``times`` (ms): the median ms, every call's, and rows
    and GB a second at the median for ``rows`` rows and ``nbytes`` bytes moved a call (this
    bench's and ``bench_host_pages``' and ``bench_host_node``'s)."""
    ms = statistics.median(times)
    return {
        "ms": round(ms, 6),
        "ms_all": [round(x, 4) for x in times],
        "rows_per_s": round(rows / ms * 1e3) if ms > 0 else None,
        "gb_per_s": round(nbytes / ms / 1e6, 3) if ms > 0 else None,
    }


def at_threads(n: int, timed: Callable[[], float]) -> float:
    """``timed()`` with ``n`` torch threads (set outside its timed region; restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return timed()
    finally:
        torch.set_num_threads(before)


def cpu_methods(
    m: Matrix, ids: torch.Tensor, clock: Clock, cores: int
) -> tuple[dict[str, Method], torch.Tensor]:
    """The CPU gathers of ``ids`` (and the staging buffer they fill: pinned on CUDA)."""
    n, width = ids.numel(), 2 * m.dim
    staging = torch.empty(n, width, dtype=torch.float32, pin_memory=clock.cuda)  # [n, 2 * dim]
    want = pattern(ids, width)  # [n, 2 * dim]

    def gather() -> None:
        torch.index_select(m.host, 0, ids, out=staging)

    def check() -> bool:
        return torch.equal(bits(staging), want)

    methods = {
        "c_cpu_gather": Method(lambda: at_threads(cores, lambda: clock.host_ms(gather)), n, n, check),
        "c_cpu_gather_1t": Method(lambda: at_threads(1, lambda: clock.host_ms(gather)), n, n, check),
    }  # fmt: skip
    return methods, staging


def cuda_methods(
    m: Matrix, ids: torch.Tensor, staging: torch.Tensor, clock: Clock, positions: int, cores: int
) -> dict[str, Method]:
    """The device's ways to the rows of ``ids`` (and back), beside the CPU's gathers."""
    from shared.hashtable.cuda import host_rows

    dev, n, width, dim = clock.device, ids.numel(), 2 * m.dim, m.dim
    ptr = m.store.device_pointer()
    want = pattern(ids, width)  # [n, 2 * dim]
    rows_dev = ids.to(dev)  # [n]
    out = torch.empty(n, width, device=dev)  # [n, 2 * dim]

    # the fill: P positions, n of them (random) with slots 0..n-1 reading rows_dev; "paired":
    # the static cache's pairing (row_cache_static._pair_in_row_order), the k-th slot reading
    # the k-th smallest row and writing back to the k-th smallest, the threads walking the
    # positions in that order (its sort timed too: the step sorts as well)
    p = max(positions, n)
    at = torch.randperm(p, generator=torch.Generator().manual_seed(n))[:n].to(dev)  # [n]
    slots = torch.full((p,), -1, dtype=torch.int64, device=dev)
    slots[at] = torch.arange(n, device=dev)
    back_ids = m.perm[n : 2 * n]  # [n] rows written back: none of them read

    def layout(ids_: torch.Tensor, backs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(read [P], back [P], no_back [P], the slots' old payload [n, 2 * dim])."""
        read = torch.full((p,), -1, dtype=torch.int64, device=dev)
        read[at] = ids_.to(dev)
        back = torch.full((p,), -1, dtype=torch.int64, device=dev)
        back[at] = backs.to(dev)
        old = pattern(backs, width).view(torch.float32).to(dev)  # written back unchanged
        return read, back, torch.full_like(back, -1), old

    plain = layout(ids, back_ids)
    paired = layout(ids.sort().values, back_ids.sort().values)
    want_paired = pattern(ids.sort().values, width)
    values = torch.empty(n, dim, device=dev)  # [n, dim]
    accum = torch.empty(n, dim, device=dev)  # [n, dim]

    def fill(writeback: bool, pair: bool = False) -> Callable[[], float]:
        read, back, no_back, old = paired if pair else plain
        b = back if writeback else no_back

        def once() -> None:
            order = None
            if pair:  # above every row (the host's rows): the positions without a slot last
                order = torch.argsort(torch.where(slots >= 0, read, m.host.shape[0]).int())
            host_rows.fill_slots(ptr, b, read, slots, None, None, 0.0, values, accum, order=order)

        def run() -> float:
            values.copy_(old[:, :dim])  # the slots' old payload: written back unchanged
            accum.copy_(old[:, dim:])
            return clock.device_ms(once)

        return run

    def filled() -> bool:
        return torch.equal(bits(torch.cat([values, accum], 1)), want)

    def filled_paired() -> bool:
        return torch.equal(bits(torch.cat([values, accum], 1)), want_paired)

    # the CPU gather, then one bulk copy of the staged rows
    staged = torch.empty(n, width, device=dev)  # [n, 2 * dim]

    def copy() -> None:
        staged.copy_(staging, non_blocking=True)

    def gather_copy() -> None:
        torch.index_select(m.host, 0, ids, out=staging)
        copy()

    def chunked() -> None:
        step = -(-n // CHUNKS)
        for a in range(0, n, step):  # chunk k's copy runs while chunk k + 1 is gathered
            part = staging[a : a + step]
            torch.index_select(m.host, 0, ids[a : a + step], out=part)
            staged[a : a + step].copy_(part, non_blocking=True)

    # the write-back: n rows with their bits flipped, restored after each call (untimed)
    flipped = (want ^ 1).view(torch.float32).to(dev)  # [n, 2 * dim]
    original = want.view(torch.float32).to(dev)  # [n, 2 * dim]

    def scattered() -> bool:
        clock.sync()
        return torch.equal(bits(m.host[ids]), want ^ 1)

    def restore() -> None:
        host_rows.scatter(ptr, rows_dev, original)
        clock.sync()

    bulk = torch.empty(n, width, device=dev)  # [n, 2 * dim]
    src = m.host[:n]  # contiguous, pinned: one DMA
    bulk_want = pattern(torch.arange(n), width)

    def is_staged() -> bool:
        return torch.equal(bits(staged), want)

    return {
        "a_uva_gather": Method(
            lambda: clock.device_ms(lambda: host_rows.gather(ptr, rows_dev, out)),
            n, n, lambda: torch.equal(bits(out), want),
        ),
        "b_uva_fill_slots": Method(fill(False), n, n, filled),
        "b_uva_fill_slots_writeback": Method(fill(True), n, 2 * n, filled),
        "b_uva_fill_paired": Method(fill(False, True), n, n, filled_paired),
        "b_uva_fill_paired_writeback": Method(fill(True, True), n, 2 * n, filled_paired),
        "c_h2d_copy": Method(lambda: clock.device_ms(copy), n, n, is_staged),
        "c_gather_copy": Method(
            lambda: at_threads(cores, lambda: clock.host_ms(gather_copy)), n, n, is_staged
        ),
        "c_gather_copy_1t": Method(
            lambda: at_threads(1, lambda: clock.host_ms(gather_copy)), n, n, is_staged
        ),
        "c_gather_copy_chunked": Method(
            lambda: at_threads(cores, lambda: clock.host_ms(chunked)), n, n, is_staged
        ),
        "d_uva_scatter": Method(
            lambda: clock.device_ms(lambda: host_rows.scatter(ptr, rows_dev, flipped)),
            n, n, scattered, restore,
        ),
        "e_bulk_h2d": Method(
            lambda: clock.device_ms(lambda: bulk.copy_(src, non_blocking=True)),
            n, n, lambda: torch.equal(bits(bulk), bulk_want),
        ),
        "e_bulk_d2h": Method(
            lambda: clock.device_ms(lambda: staging.copy_(bulk, non_blocking=True)),
            n, n, lambda: torch.equal(bits(staging), bulk_want),
        ),
    }  # fmt: skip


CUDA_METHODS = (
    "a_uva_gather", "b_uva_fill_slots", "b_uva_fill_slots_writeback", "b_uva_fill_paired",
    "b_uva_fill_paired_writeback", "c_h2d_copy",
    "c_gather_copy", "c_gather_copy_1t", "c_gather_copy_chunked", "d_uva_scatter",
    "e_bulk_h2d", "e_bulk_d2h",
)  # fmt: skip


def measure(
    m: Matrix, n: int, clock: Clock, repeats: int, positions: int, cores: int
) -> dict[str, Any]:
    """Every method at ``n`` rows: one untimed call and its check each, then ``repeats``
    rounds of every method in turn; medians."""
    ids = m.perm[:n].contiguous()  # [n] distinct random rows
    methods, staging = cpu_methods(m, ids, clock, cores)
    if clock.cuda:
        methods.update(cuda_methods(m, ids, staging, clock, positions, cores))
        assert set(CUDA_METHODS) <= set(methods), "CUDA_METHODS names every CUDA method"
    equal: dict[str, bool] = {}
    for name, meth in methods.items():  # untimed: compilation, first touch; then its check
        meth.run()
        clock.sync()
        equal[name] = meth.check()
        if meth.after is not None:
            meth.after()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, meth in methods.items():
            times[name].append(meth.run())
            if meth.after is not None:
                meth.after()
    out: dict[str, Any] = {
        name: {"run": True, **figures(times[name], meth.rows, meth.moved * m.row_bytes),
               "rows_equal": equal[name]}
        for name, meth in methods.items()
    }  # fmt: skip
    if clock.cuda:
        ceiling = out["e_bulk_h2d"]["ms"]
        for v in out.values():
            v["x_bulk_h2d"] = round(v["ms"] / ceiling, 3) if ceiling > 0 else None
    else:
        reason = "needs a CUDA device with the CUDA kernels' runtime (run with --device cuda)"
        out.update({name: {"run": False, "reason": reason} for name in CUDA_METHODS})
    return out


def rows_of(args: Any, dim: int) -> int:
    """The host matrix's rows at ``dim``."""
    return int(args.rows_128 if dim > 64 and args.rows_128 else args.rows)


def check_sizes(args: Any) -> None:
    """Refuse sizes the run would fail on only after building a matrix (minutes at scale)."""
    if args.repeats < 1 or min(args.ns) < 1:
        raise ValueError(
            f"bench_host_rows: --repeats and --ns must be >= 1, got {args.repeats}, {args.ns}"
        )
    # on CUDA the fill's write-back takes n rows other than the n read: 2n rows
    need = max(args.ns) * (2 if args.device.startswith("cuda") else 1)
    for dim in args.dims:
        if rows_of(args, dim) < need:
            raise ValueError(
                f"bench_host_rows: --ns {max(args.ns)} needs {need} rows at dim {dim}, the matrix "
                f"has {rows_of(args, dim)}: pass larger --rows / --rows-128 or smaller --ns"
            )


def run(args: Any) -> dict[str, Any]:
    check_device(args.device)
    device = torch.device(args.device)
    if device.type == "cuda":
        from shared.hashtable.cuda import runtime

        reason = runtime.unavailable_reason()
        if reason is not None:
            raise RuntimeError(
                f"bench_host_rows: the host tier cannot be mapped into {device}: {reason}"
            )
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    clock = Clock(device)
    result: dict[str, Any] = {
        "what": "n random rows of the host tier (pinned, mapped) to the device and back, by method",
        "device": torch.cuda.get_device_name(device) if clock.cuda else "cpu",
        "cores": cores,  # torch's threads but in the *_1t methods
        "repeats": args.repeats,
        "positions": args.positions,
        "staging": "pinned" if clock.cuda else "pageable (no CUDA: nothing to pin for)",
        "dims": {},
    }
    for dim in args.dims:
        rows = rows_of(args, dim)
        t = time.perf_counter()
        m = matrix(dim, rows, device, args.seed)
        entry: dict[str, Any] = {
            "rows": rows,
            "row_bytes": m.row_bytes,
            "host_bytes": m.store.nbytes,
            # registered memory torch's copies see as pinned (else e_bulk_h2d is no ceiling)
            "host_pinned": bool(m.host.is_pinned()) if clock.cuda else False,
            "setup_s": round(time.perf_counter() - t, 2),
            "n": {},
        }
        result["dims"][str(dim)] = entry
        for n in args.ns:
            entry["n"][str(n)] = got = measure(m, n, clock, args.repeats, args.positions, cores)
            line = ", ".join(
                f"{k} {v['ms']:.3f} ms {v['rows_per_s'] / 1e6:.1f}M rows/s {v['gb_per_s']:.2f} GB/s"
                for k, v in got.items()
                if v["run"]
            )
            print(f"dim {dim} n {n}: {line}", file=sys.stderr, flush=True)
            write_result(args.out, result)  # each n as it ends: a run cut short keeps the rest
        del m
        gc.collect()  # the store's pages unlocked and freed before the next dim's
    return result


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_host_rows", description=plain(__doc__), epilog=EXAMPLE)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--rows", type=int, default=200_000, help="rows of the host matrix")
    p.add_argument("--rows-128", type=int, default=0, help="rows for dims > 64 (0: --rows)")
    p.add_argument("--dims", type=int, nargs="+", default=[16, 128], help="embedding dims")
    p.add_argument(
        "--ns", type=int, nargs="+", default=[4096, 16384], help="rows moved a call (distinct)"
    )
    p.add_argument("--positions", type=int, default=1 << 20, help="fill_slots' positions (P >= n)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls of each method")
    p.add_argument("--seed", type=int, default=0, help="the row ids' permutation")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    check_sizes(args)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
