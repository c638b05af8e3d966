"""Does the host tier's page size limit the device's random row reads? (issue #52's fill)

    python -m bench.bench_host_pages --out out/bench_host_pages_cpu.json      # CPU: CPU gathers only
    python -m bench.bench_host_pages --device cuda --rows 30000000 --rows-128 10000000 \\
        --out out/bench_host_pages_gpu.json                                    # the device

``bench.bench_host_rows`` measured the UVA gather on the H100 at 47M rows/s for 128-B rows
(6 GB/s) and 29M rows/s for 1-KB rows (30 GB/s), while a bulk copy runs at 54 GB/s and 16 cores'
``index_select`` at 200-275M rows/s. The row rate, nearly flat across row sizes, points at
per-row costs: the device's address translation of host pages (4 KiB each: a 3.8 GB tier is a
million pages) as much as PCIe latency. This bench measures the same gather over the same rows
with the tier's memory made in several ways, in one run:

- ``register_4k``: ``torch.zeros`` then ``cudaHostRegister`` (today's
  :class:`~shared.hashtable.host_store.TensorHostStore`);
- ``register_thp``: an anonymous ``mmap`` aligned to 2 MiB with ``MADV_HUGEPAGE`` (transparent
  huge pages), touched, then ``cudaHostRegister``; the JSON gives the kernel's THP setting and
  ``AnonHugePages`` before and after, so a run where THP did not take says so;
- ``host_alloc``: torch's pinned allocator (``cudaHostAlloc``);
- ``vmm_host`` (CUDA only): the driver's virtual memory API, ``cuMemCreate`` with a HOST location
  at its recommended granularity (:mod:`shared.hashtable.host_memory`), which the device may map
  in large pages.

For each, n random distinct rows (the same ids for every allocation), gathered by
:func:`~shared.hashtable.cuda.host_rows.gather` in random order and in sorted order (``_sorted``:
neighbouring threads on neighbouring pages), and by the CPU's ``index_select`` (all cores) into
a pinned buffer. Every gather is checked: each row's first column holds its row id's bits. Medians of
``--repeats`` rounds, every method once a round in turn.
"""

from __future__ import annotations

import gc
import mmap
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.bench_host_rows import Clock, figures
from shared.cli import Parser, check_device, plain, run_cli, write_result
from shared.cli import exit_code as _exit_code
from shared.hashtable.host_store import _register

HUGE = 2 << 20  # a transparent huge page
ALLOCATIONS = ("register_4k", "register_thp", "host_alloc")
CUDA_ALLOCATIONS = ("vmm_host",)  # made by the CUDA driver: no CPU form
PINNED_WHEN_MADE = ("host_alloc", "vmm_host")  # the others are page-locked after (registered)


def meminfo_kib(key: str) -> int:
    """A ``/proc/meminfo`` line's KiB (-1 where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def thp_setting() -> dict[str, str]:
    """The kernel's transparent huge page settings (the bracketed choice of each)."""
    out = {}
    for name in ("enabled", "defrag"):
        try:
            out[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
        except OSError as e:
            out[name] = f"unreadable: {e}"
    return out


def allocate(how: str, rows: int, width: int, cuda: bool) -> tuple[torch.Tensor, Any]:
    """[rows, width] float32 made ``how``, touched, row i's first column = i; and what keeps
    its memory alive (the mmap for ``register_thp``)."""
    nbytes = rows * width * 4
    keep: Any = None
    if how == "register_thp":
        keep = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = torch.frombuffer(keep, dtype=torch.uint8)  # the whole mapping, to find its address
        skip = (-base.data_ptr()) % HUGE  # to the first 2 MiB boundary
        keep.madvise(mmap.MADV_HUGEPAGE, skip, nbytes)
        t = base[skip : skip + nbytes].view(torch.float32).view(rows, width)
    elif how == "host_alloc":
        t = torch.empty(rows, width, dtype=torch.float32, pin_memory=cuda)
    elif how == "vmm_host":
        from shared.hashtable.host_memory import VmmHost

        keep = VmmHost(nbytes)
        t = keep.as_tensor()[:nbytes].view(torch.float32).view(rows, width)
    else:
        t = torch.empty(rows, width, dtype=torch.float32)
    t.zero_()  # first touch: the pages (huge ones where THP takes) are allocated here
    t.view(torch.int32)[:, 0] = torch.arange(rows, dtype=torch.int32)  # the row id's bits
    if cuda and how not in PINNED_WHEN_MADE:  # as TensorHostStore does: unlocked when t is freed
        _register(t, mapped=True, drain=True)
    return t, keep


def measure(host: torch.Tensor, ids: torch.Tensor, cuda: bool, repeats: int) -> dict[str, Any]:
    """The gathers of ``ids`` from ``host``: ms, rows/s, GB/s and the check of each."""
    from shared.hashtable.cuda import host_rows

    n, width = ids.numel(), host.shape[1]
    staging = torch.empty(n, width, dtype=torch.float32, pin_memory=cuda)
    want = ids.to(torch.int32)

    def first(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int32)[:, 0].cpu()

    clock = Clock(torch.device("cuda" if cuda else "cpu"))

    def cpu() -> float:
        return clock.host_ms(lambda: torch.index_select(host, 0, ids, out=staging))

    methods: dict[str, tuple[Callable[[], float], Callable[[], bool]]] = {
        "cpu_gather": (cpu, lambda: torch.equal(first(staging), want)),
    }
    if cuda:
        ptr = host.data_ptr()  # UVA: registered and pinned host memory at its host address
        out = torch.empty(n, width, device="cuda")
        shuffled = ids.cuda()
        ordered = ids.sort().values
        in_order = ordered.cuda()

        def uva(rows: torch.Tensor) -> Callable[[], float]:
            return lambda: clock.device_ms(lambda: host_rows.gather(ptr, rows, out))

        methods["uva_gather"] = (uva(shuffled), lambda: torch.equal(first(out), want))
        methods["uva_gather_sorted"] = (
            uva(in_order),
            lambda: torch.equal(first(out), ordered.to(torch.int32)),
        )
    got: dict[str, Any] = {}
    for name, (fn, check) in methods.items():
        fn()
        if cuda:
            torch.cuda.synchronize()
        got[name] = {"rows_equal": check()}
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, (fn, _check) in methods.items():
            times[name].append(fn())
    for name, ts in times.items():
        got[name].update(figures(ts, n, n * width * 4))
    return got


def run(args: Any) -> dict[str, Any]:
    check_device(args.device)
    cuda = args.device.startswith("cuda")
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    result: dict[str, Any] = {
        "what": "random host rows to the device by UVA, by how the host memory was made",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "thp": thp_setting(),
        "repeats": args.repeats,
        "dims": {},
    }
    for dim in args.dims:
        rows = args.rows_128 if dim > 64 and args.rows_128 else args.rows
        width = 2 * dim
        perm = torch.randperm(rows, generator=torch.Generator().manual_seed(args.seed))
        entry: dict[str, Any] = {"rows": rows, "row_bytes": width * 4, "allocations": {}}
        result["dims"][str(dim)] = entry
        for how in args.allocations:
            huge_before = meminfo_kib("AnonHugePages")
            t0 = time.perf_counter()
            try:
                host, keep = allocate(how, rows, width, cuda)
            except RuntimeError as e:  # the driver's memory may not be made here: say why, go on
                if how not in CUDA_ALLOCATIONS:
                    raise
                entry["allocations"][how] = {"error": str(e)}
                print(f"dim {dim} {how}: {e}", file=sys.stderr, flush=True)
                write_result(args.out, result)
                continue
            a: dict[str, Any] = {
                "setup_s": round(time.perf_counter() - t0, 2),
                "anon_huge_pages_kib_added": meminfo_kib("AnonHugePages") - huge_before,
                **(
                    {"vmm": {"location": keep.location, "granularity": keep.granularity}}
                    if how == "vmm_host"
                    else {}
                ),  # fmt: skip
                "n": {},
            }
            entry["allocations"][how] = a
            for n in args.ns:
                a["n"][str(n)] = got = measure(host, perm[:n].contiguous(), cuda, args.repeats)
                line = ", ".join(f"{k} {v['ms']:.3f} ms {v['rows_per_s'] / 1e6:.1f}M rows/s"
                                 for k, v in got.items())  # fmt: skip
                print(f"dim {dim} {how} n {n}: {line}", file=sys.stderr, flush=True)
                write_result(args.out, result)
            del host, keep  # host first: its pages are unlocked before the mapping goes
            gc.collect()
    return result


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_host_pages", description=plain(__doc__))
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the host matrix")
    p.add_argument("--rows-128", type=int, default=0, help="rows for dims > 64 (0: --rows)")
    p.add_argument("--dims", type=int, nargs="+", default=[16, 128], help="embedding dims")
    p.add_argument("--ns", type=int, nargs="+", default=[262144], help="rows gathered a call")
    p.add_argument("--repeats", type=int, default=9, help="timed calls of each method")
    p.add_argument("--seed", type=int, default=0, help="the row ids' permutation")
    p.add_argument("--allocations", nargs="+", choices=ALLOCATIONS + CUDA_ALLOCATIONS,
                   help="how the host memory is made (default: every way the device has)")  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cuda = args.device.startswith("cuda")
    if args.allocations is None:
        args.allocations = list(ALLOCATIONS + (CUDA_ALLOCATIONS if cuda else ()))
    elif not cuda and set(args.allocations) & set(CUDA_ALLOCATIONS):
        raise ValueError(f"bench_host_pages: --allocations {' '.join(CUDA_ALLOCATIONS)} needs "
                         "--device cuda (the CUDA driver makes that memory)")  # fmt: skip
    if (
        min(args.ns) < 1
        or args.repeats < 1
        or max(args.ns) > min(args.rows, args.rows_128 or args.rows)
    ):
        raise ValueError(
            "bench_host_pages: --ns and --repeats must be >= 1 and --ns at most the rows"
        )
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
