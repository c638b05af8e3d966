"""The CUDA hash-table backend (CuPy kernels) beside the torch backend and a dense
``index_select``, on one GPU.

    python -m bench.bench_gpu_hashtable --out bench/results/bench_gpu_hashtable.json

For each load factor (0.5, 0.9): ``--keys`` random keys (dim ``--dim``, 128 slots per bucket,
capacity ``keys / load_factor``, no growth) and, in the same run:

- ``find``: one call of every key (shuffled), kernels (each probe window; 0 = binary search)
  and the torch backend (``TorchBackend``, the reference, on the same GPU); also a batch of
  absent keys and a training-size batch; ``dense_index_select``: ``index_select`` of as many
  random rows of a dense [keys, dim] matrix, the floor a hash lookup is compared with;
  ``find_gather``: find plus ``index_select`` of the found rows;
- ``insert``: all keys into an empty table in one call and in ``--batch``-key calls, and an
  assign of every (stored) key: the torch backend and the CUDA backend, with a check that the
  kernels give the torch backend's table; ``erase_all``: an erase of every key, both backends;
  ``counter``: the admission counter's table (dim 0, 1024 slots a bucket, LFU) taking
  ``--counter-keys`` new keys and erasing them, both backends.

Then the bulk build of ``--build-keys`` keys (serving startup): ``HashTable.from_keys_values``
with each backend, and ``StaticLookupTable.from_keys_values``.

Times are medians of ``--repeats`` runs between CUDA events (``per_call``: synchronised before
each call, host work included; ``pipelined``: ``--pipeline`` calls back to back, so host work
overlaps the GPU's; ``kernel_only``: the find kernel relaunched on fixed arguments, without
the Python work of a call). Every launch goes through the driver (``runtime.Launcher``).
Builds and inserts synchronise inside, so they are timed per call. Results measured before the
launch and insert paths were reduced to one each (CuPy's launch, the first insert kernels) are
in ``bench/results/`` and git history. ``--profile`` adds torch.profiler tables of one find,
insert and build. ``--sections`` and ``--load-factors`` select parts of the run.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shared.cli import Parser, plain, run_cli
from shared.cli import exit_code as _exit_code
from shared.features import ScoreStrategy
from shared.hashtable import cuda
from shared.hashtable.backend import Backend
from shared.hashtable.cuda.backend import CudaBackend
from shared.hashtable.cuda.find import find as kernel_find
from shared.hashtable.cuda.find import prepared_find
from shared.hashtable.cuda.runtime import FIND_WINDOWS
from shared.hashtable.lookup import StaticLookupTable
from shared.hashtable.table import HashTable
from shared.hashtable.torch_backend import TorchBackend

TORCH = TorchBackend()

STATE = ("_slot_fp", "_slot_row", "_row_key", "_row_tid", "_row_score", "_values")


def _time(
    fn: Callable[[], Any], repeats: int, *, calls: int = 1, setup: Callable[[], Any] | None = None
) -> float:
    """Median seconds per call of ``fn`` (``calls`` back to back per measurement)."""
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000 / calls)
    return statistics.median(times)


def _rate(n: int, fn: Callable[[], Any], repeats: int, pipeline: int) -> dict[str, float]:
    for _ in range(2):  # warm up (compilation, caches)
        fn()
    per_call = _time(fn, repeats)
    piped = _time(fn, repeats, calls=pipeline)
    return {
        "per_call_s": per_call,
        "per_call_keys_per_s": n / per_call,
        "pipelined_s": piped,
        "pipelined_keys_per_s": n / piped,
    }


def _random_keys(n: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    keys = torch.unique(torch.randint(0, 1 << 62, (n + n // 50,), generator=g))
    return keys[torch.randperm(keys.numel(), generator=g)[:n]].to(device)


def _same_table(a: HashTable, b: HashTable) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in STATE) and a.size == b.size


def _fresh(n: int, lf: float, dim: int, device: torch.device, backend: Backend) -> HashTable:
    cap = math.ceil(n / lf)
    return HashTable(
        dim,
        init_capacity=cap,
        max_capacity=cap,
        bucket_capacity=128,
        device=device,
        backend=backend,
    )


def bench_insert(
    keys: torch.Tensor, lf: float, dim: int, batch: int, repeats: int, kernels: CudaBackend
) -> dict[str, Any]:
    """Inserts of every key into an empty table (one call, ``batch``-key calls) and an assign of
    every stored key: the torch backend (``core``) once, then the CUDA backend, checked against
    the torch backend's table."""
    dev, n = keys.device, keys.numel()
    values = torch.randn(n, dim, device=dev)
    scores = torch.arange(n, device=dev)
    state: dict[str, HashTable] = {}

    def fresh(backend: Backend) -> Callable[[], None]:
        def make() -> None:
            state["t"] = _fresh(n, lf, dim, dev, backend)

        return make

    def insert_all() -> None:
        state["t"].insert_or_assign(keys, values, scores)

    def insert_batches() -> None:
        for s in range(0, n, batch):
            sl = slice(s, s + batch)
            state["t"].insert_or_assign(keys[sl], values[sl], scores[sl])

    calls = (("one_call", insert_all), ("batched", insert_batches))
    perm = torch.randperm(n, device=dev)
    q, qv, qs = keys[perm], values[perm], scores[perm]
    out: dict[str, Any] = {"batch": batch, "core": {}}
    core_fresh, kernel_fresh = fresh(TORCH), fresh(kernels)
    for name, fn in calls:
        core_fresh()
        fn()
        out["core"][name] = _time(fn, max(1, repeats // 2), setup=core_fresh)
    core_fresh()
    insert_all()
    core_table = state["t"]
    core_assign = _time(lambda: core_table.insert_or_assign(q, qv, qs), 3)
    before = kernels.paths.copy()
    for name, fn in calls:
        kernel_fresh()
        fn()  # warm up
        k, c = _time(fn, repeats, setup=kernel_fresh), out["core"][name]
        out[name] = {
            "kernel_s": k,
            "kernel_keys_per_s": n / k,
            "core_s": c,
            "core_keys_per_s": n / c,
            "speedup": c / k,
        }
    kernel_fresh()
    insert_all()
    table = state["t"]
    out["kernel_table_equals_core_table"] = _same_table(table, core_table)
    out["size"], out["evictions"] = table.size, table.evictions
    k = _time(lambda t=table: t.insert_or_assign(q, qv, qs), repeats)  # type: ignore[misc]
    out["assign_all"] = {"kernel_keys_per_s": n / k, "core_keys_per_s": n / core_assign}
    out["kernel_paths"] = dict(kernels.paths - before)  # what the CUDA backend's calls did
    out["erase_all"] = _bench_erase(state, fresh, insert_all, q, repeats, kernels)
    return out


def _kernels_vs_core(
    state: dict[str, HashTable],
    setup: Callable[[Backend], None],
    op: Callable[[], None],
    n: int,
    repeats: int,
    kernels: CudaBackend,
) -> dict[str, Any]:
    """``op`` on a table ``setup(backend)`` makes (``state["t"]``), timed with the CUDA backend
    and with the torch backend, and whether both left the same table."""

    def kernel_setup() -> None:
        setup(kernels)

    def core_setup() -> None:
        setup(TORCH)

    kernel_setup()
    op()  # warm up
    k = _time(op, repeats, setup=kernel_setup)
    kernel_setup()
    op()
    kernel_table = state["t"]
    core_setup()
    op()
    c = _time(op, max(1, repeats // 2), setup=core_setup)
    core_setup()
    op()
    return {
        "kernel_s": k,
        "kernel_keys_per_s": n / k,
        "core_s": c,
        "core_keys_per_s": n / c,
        "speedup": c / k,
        "kernel_table_equals_core_table": _same_table(kernel_table, state["t"]),
    }


def _bench_erase(
    state: dict[str, HashTable],
    fresh: Callable[[Backend], Callable[[], None]],
    fill: Callable[[], None],
    q: torch.Tensor,
    repeats: int,
    kernels: CudaBackend,
) -> dict[str, Any]:
    """Erase of every stored key (``q``, shuffled) from a full table: both backends."""
    n = q.numel()

    def setup(backend: Backend) -> None:
        fresh(backend)()
        fill()

    def erase() -> None:
        state["t"].erase(q)

    return _kernels_vs_core(state, setup, erase, n, repeats, kernels)


def _counter(capacity: int, dev: torch.device, backend: Backend) -> HashTable:
    """The admission counter's table (admission.FrequencyCounter): dim 0, LFU, no growth."""
    return HashTable(
        0,
        init_capacity=capacity,
        max_capacity=capacity,
        bucket_capacity=1024,
        score_strategy=ScoreStrategy.LFU,
        device=dev,
        backend=backend,
    )


def bench_counter(keys: torch.Tensor, repeats: int, kernels: CudaBackend) -> dict[str, Any]:
    """Insert of every key (new, dim 0) into an empty counter table of twice the keys, and the
    erase of every key: both backends (the kernels' place opts in to 61 KB of shared memory a
    warp)."""
    dev, n = keys.device, keys.numel()
    counts = torch.randint(1, 5, (n,), device=dev)
    state: dict[str, HashTable] = {}

    def fresh(backend: Backend) -> Callable[[], None]:
        def make() -> None:
            state["t"] = _counter(2 * n, dev, backend)

        return make

    def fill() -> None:
        state["t"].insert_or_assign(keys, torch.zeros(n, 0, device=dev), counts)

    def setup(backend: Backend) -> None:
        fresh(backend)()

    out: dict[str, Any] = {"keys": n, "bucket_capacity": 1024}
    before = kernels.paths.copy()
    setup(kernels)
    fill()
    out["insert_paths"] = dict(kernels.paths - before)  # the path the kernels took
    out["insert"] = _kernels_vs_core(state, setup, fill, n, repeats, kernels)
    out["erase"] = _bench_erase(state, fresh, fill, keys.flip(0), repeats, kernels)
    return out


def bench_find(
    keys: torch.Tensor,
    lf: float,
    dim: int,
    batch: int,
    repeats: int,
    pipeline: int,
    kernels: CudaBackend,
) -> dict[str, Any]:
    dev, n = keys.device, keys.numel()
    core = _fresh(n, lf, dim, dev, TORCH)
    # filled by the torch backend: the find part does not depend on the insert
    core.insert_or_assign(keys, torch.randn(n, dim, device=dev), torch.arange(n, device=dev))
    table = core.to(dev, backend=kernels)
    q = keys[torch.randperm(n, device=dev)]
    find: dict[str, Any] = {"keys": n, "size": table.size, "load_factor": table.load_factor}
    for w in FIND_WINDOWS:
        find[f"kernel_window_{w}"] = _rate(
            n,
            lambda w=w: kernel_find(table, q, None, probe_window=w),  # type: ignore[misc]
            repeats,
            pipeline,
        )
        run, _, _ = prepared_find(table, q, probe_window=w)
        find[f"kernel_only_window_{w}"] = _rate(n, run, repeats, pipeline)
    find["kernel_api"] = _rate(n, lambda: table.find(q, validate=False), repeats, pipeline)
    find["core"] = _rate(n, lambda: core.find(q, validate=False), repeats, pipeline)
    want = core.find(q, validate=False)
    got = table.find(q, validate=False)
    find["kernel_rows_equal_core_rows"] = bool(
        torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    )
    find["found_fraction"] = float(got[1].float().mean())
    absent = _random_keys(n, seed=7, device=dev) | (1 << 62)
    find["kernel_absent_keys"] = _rate(
        n, lambda: table.find(absent, validate=False), repeats, pipeline
    )
    qb = q[:batch]
    find["kernel_batch"] = _rate(batch, lambda: table.find(qb, validate=False), repeats, pipeline)
    find["core_batch"] = _rate(batch, lambda: core.find(qb, validate=False), repeats, pipeline)

    def find_gather() -> torch.Tensor:
        rows, _ = table.find(q, validate=False)
        return table.values.index_select(0, rows.clamp(min=0))

    find["kernel_find_gather"] = _rate(n, find_gather, repeats, pipeline)
    dense = torch.randn(n, dim, device=dev)
    rows = torch.randint(0, n, (n,), device=dev)
    find["dense_index_select"] = _rate(n, lambda: dense.index_select(0, rows), repeats, pipeline)
    rates = {w: find[f"kernel_only_window_{w}"]["pipelined_keys_per_s"] for w in FIND_WINDOWS}
    find["best_window"] = max(rates, key=rates.__getitem__)
    piped = {
        k: find[k]["pipelined_keys_per_s"] for k in ("kernel_api", "core", "dense_index_select")
    }
    find["kernel_vs_core"] = piped["kernel_api"] / piped["core"]
    find["kernel_vs_dense_index_select"] = piped["kernel_api"] / piped["dense_index_select"]
    return find


def bench_build(
    n: int, dim: int, repeats: int, device: torch.device, kernels: CudaBackend
) -> dict[str, Any]:
    keys = _random_keys(n, seed=2, device=device)
    values = torch.randn(n, dim, device=device)

    def kernel() -> HashTable:
        return HashTable.from_keys_values(keys, values, device=device, backend=kernels)

    def core() -> HashTable:
        return HashTable.from_keys_values(keys, values, device=device, backend=TORCH)

    for _ in range(2):
        kernel(), core()
    k, c = _time(kernel, repeats), _time(core, repeats)
    s = _time(lambda: StaticLookupTable.from_keys_values(keys, values, device=device), repeats)
    return {
        "keys": n,
        "dim": dim,
        "kernel_build_s": k,
        "core_build_s": c,
        "static_lookup_build_s": s,
        "speedup": c / k,
        "kernel_table_equals_core_table": _same_table(kernel(), core()),
    }


def _profiled(
    path: Path, keys: torch.Tensor, dim: int, build_keys: int, kernels: CudaBackend
) -> dict[str, Any]:
    """:func:`profile` as a section of the run (it records nothing in the JSON)."""
    profile(path, keys, dim, build_keys, kernels)
    return {}


def profile(
    path: Path, keys: torch.Tensor, dim: int, build_keys: int, kernels: CudaBackend
) -> None:
    """torch.profiler tables (GPU and host time per op and kernel) of a find and an insert of
    every key at load factor 0.5, and of the bulk build: where the time of each call goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    dev, n = keys.device, keys.numel()
    values = torch.randn(n, dim, device=dev)
    scores = torch.arange(n, device=dev)
    bkeys = _random_keys(build_keys, seed=2, device=dev)
    bvalues = torch.randn(build_keys, dim, device=dev)
    full = _fresh(n, 0.5, dim, dev, kernels)
    full.insert_or_assign(keys, values, scores)
    empty: dict[str, HashTable] = {}

    def new_table() -> None:
        empty["t"] = _fresh(n, 0.5, dim, dev, kernels)

    def full_table() -> None:
        new_table()
        empty["t"].insert_or_assign(keys, values, scores)

    def new_counter() -> None:
        empty["t"] = _counter(2 * n, dev, kernels)

    calls: dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]] = {
        "find (1 call, all keys)": (lambda: full.find(keys, validate=False), None),
        "insert_or_assign (1 call, all keys, empty table made before)": (
            lambda: empty["t"].insert_or_assign(keys, values, scores),
            new_table,
        ),
        "erase (1 call, all keys, full table made before)": (
            lambda: empty["t"].erase(keys),
            full_table,
        ),
        "counter insert (dim 0, bucket 1024, 1 call, all keys, empty table made before)": (
            lambda: empty["t"].insert_or_assign(keys, torch.zeros(n, 0, device=dev), scores),
            new_counter,
        ),
        "from_keys_values": (
            lambda: HashTable.from_keys_values(bkeys, bvalues, device=dev, backend=kernels),
            None,
        ),
    }
    text = []
    for name, (fn, setup) in calls.items():
        for _ in range(2):  # warm up
            if setup is not None:
                setup()
            fn()
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        try:
            table = prof.key_averages().table(sort_by="device_time_total", row_limit=20)
        except Exception:  # older torch names the column cuda_time_total
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
        text.append(f"== {name}\n{table}\n")
    path.write_text("\n".join(text))


EXAMPLE = """examples:
  python -m bench.bench_gpu_hashtable --out bench/results/bench_gpu_hashtable.json
  python -m bench.bench_gpu_hashtable --out /tmp/find.json --sections find --load-factors 0.9"""


def _parser() -> Parser:
    p = Parser(
        prog="python -m bench.bench_gpu_hashtable",
        description=plain(__doc__.split("\n\n")[0]),
        epilog=EXAMPLE,
    )
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--keys", type=int, default=1_000_000, help="random keys in each table")
    p.add_argument("--dim", type=int, default=16, help="embedding dim of the tables")
    p.add_argument("--batch", type=int, default=65_536, help="keys per call of batched runs")
    p.add_argument(
        "--build-keys", type=int, default=1_500_000, help="keys of the bulk build (serving startup)"
    )
    p.add_argument(
        "--counter-keys", type=int, default=200_000, help="keys of the counter part of insert"
    )
    p.add_argument("--repeats", type=int, default=11, help="runs per figure (the median is kept)")
    p.add_argument("--pipeline", type=int, default=20, help="calls back to back per timing")
    p.add_argument("--profile", type=Path, help="also write torch.profiler tables to this file")
    p.add_argument(
        "--load-factors", default="0.5,0.9", help="comma-separated load factors (find, insert)"
    )
    p.add_argument(
        "--sections", default="find,insert,build", help="comma-separated: find, insert, build"
    )
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    sections = set(args.sections.split(","))
    if cuda.unavailable_reason() is not None:
        raise ValueError(
            f"bench_gpu_hashtable needs the CUDA backend: {cuda.unavailable_reason()}; run it "
            "on a machine with a CUDA GPU and CuPy, or run bench.bench_hashtable on the CPU"
        )
    import cupy

    kernels = CudaBackend()
    dev = torch.device("cuda")
    keys = _random_keys(args.keys, seed=1, device=dev)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "cupy": cupy.__version__,
        "python": platform.python_version(),
        "keys": args.keys,
        "dim": args.dim,
        "repeats": args.repeats,
        "pipeline": args.pipeline,
        "load_factors": {},
        "backends": {"kernel": kernels.name, "core": TORCH.name},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def section(name: str, fn: Callable[[], dict[str, Any]], into: dict[str, Any]) -> None:
        """Run one part; a failure is recorded and the others still run. Saves as it goes."""
        try:
            into[name] = fn()
        except Exception as e:  # a bench run on the device is one shot: keep the rest
            into[name] = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps({name: into[name]}, indent=1), flush=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    for lf in (float(x) for x in args.load_factors.split(",")):
        into = result["load_factors"].setdefault(str(lf), {"load_factor_target": lf})
        if "find" in sections:
            section(
                "find",
                lambda lf=lf: bench_find(  # type: ignore[misc]
                    keys, lf, args.dim, args.batch, args.repeats, args.pipeline, kernels
                ),
                into,
            )
        if "insert" in sections:
            section(
                "insert",
                lambda lf=lf: bench_insert(  # type: ignore[misc]
                    keys, lf, args.dim, args.batch, args.repeats, kernels
                ),
                into,
            )
    if "insert" in sections:
        section(
            "counter",
            lambda: bench_counter(keys[: args.counter_keys], args.repeats, kernels),
            result,
        )
    if "build" in sections:
        section(
            "build",
            lambda: bench_build(args.build_keys, args.dim, args.repeats, dev, kernels),
            result,
        )
    if args.profile is not None:
        section(
            "profile",
            lambda: _profiled(args.profile, keys, args.dim, args.build_keys, kernels),
            {},
        )
    return result


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
