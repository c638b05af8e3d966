"""Storage tiers at scale (issue #52, "Done when" part 3): one table of ``--scale-keys`` keys
(default 500M), dim 16, exact Adagrad, CACHING with its hash index's row arrays in host memory,
trained on a Zipf stream with the tables inside ``--hbm-budget-gib`` (default 16) of HBM.

    python -m bench.bench_tiers_scale --scale-keys 200000 --hbm-budget-gib 0.006 \\
        --lookups 20000 --out bench/results/bench_tiers_scale_cpu.json       # CPU, small
    python -m bench.bench_tiers_scale --device cuda --out out/bench_tiers_scale_gpu.json

The table: ``max_capacity = keys / 0.8`` slots (a load of 0.8, as :mod:`bench.bench_tiers`),
STEP scores, no admission. Its placement is the planner's
(:func:`~shared.hashtable.placement.plan_placement` with the budget): the cache factor, and the
row arrays (key, table id, score) on the host, which the planner chooses when a 1 % cache does
not fit beside them; a budget that keeps them on the device is refused here (this bench measures
them on the host: lower ``--hbm-budget-gib``). The storage is pre-sized (init = max capacity:
no growth) and populated by inserts of ``--chunk`` keys (zero rows, score 0), keys ``0 ..
keys - 1`` (key = Zipf rank: the index hashes keys, so hot keys spread over buckets anyway). A
full bucket evicts at a load of 0.8, so the keys stored can be a few fewer than inserted: both
are reported, with the populate time.

Then ``--warmup`` + ``--steps`` embedding steps (:func:`bench.bench_tiers.time_steps`: a
training lookup and the backward of a fixed gradient, sparse Adagrad on the rows), batches of
``--lookups`` keys drawn Zipf(``--alpha``, 1.05) over the keys before the table is built (the
Zipf CDF over 500M ranks takes 4 GB of device memory for a moment).

The JSON: the plan's line and bytes, in all and by part (``device_parts``: index, row arrays,
cache, counters, the CUDA insert kernels' scratch; ``host_parts``: rows, row arrays, the insert
kernels' stage), keys inserted and stored, allocation and populate seconds, the median step (ms,
steps/s, lookups/s), the cache's hit rate and per-step counters over the timed steps, the bytes
measured per tier (device: slot arrays, line map, lines, the insert kernels' scratch (their
``scratch_bytes``: the plan's ``insert_scratch`` and ``rep_of``, 4 B a key of a populate chunk),
and on CUDA what torch's allocator held after the populate and at its peak during the steps;
host: the rows' payload, the row arrays and the insert kernels' stage; on the CPU every tier is
the same memory, the split is where a CUDA run puts them, and the torch backend has no insert
scratch: 0 where the plan counts it) and the process's peak resident memory. Written after the
populate and again at the end, so a run cut short keeps the first part.
"""

from __future__ import annotations

import math
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.bench_tiers import LOAD, TABLE, _sync, spec, time_steps, zipf_ranks
from shared.cli import Parser, check_device, plain, run_cli, write_result
from shared.cli import exit_code as _exit_code
from shared.hashtable import host_memory
from shared.hashtable.cuda import insert
from shared.hashtable.embedding import DynamicEmbeddingCollection
from shared.hashtable.layout import RowArrays
from shared.hashtable.placement import GIB, StorageMode, TablePlacement, plan_placement
from shared.hashtable.row_cache import RowCache
from shared.hashtable.storage import FusedStorage

EXAMPLE = """examples:
  python -m bench.bench_tiers_scale --scale-keys 200000 --hbm-budget-gib 0.006 --lookups 20000 --out bench/results/bench_tiers_scale_cpu.json
  python -m bench.bench_tiers_scale --device cuda --out out/bench_tiers_scale_gpu.json"""


def plan(keys: int, dim: int, budget_gib: float) -> TablePlacement:
    """The planner's placement of the table; ValueError unless CACHING with host row arrays."""
    slots = math.ceil(keys / LOAD)
    (placed,) = plan_placement([spec(dim, slots, None)], hbm_budget=int(budget_gib * GIB))
    if placed.mode is not StorageMode.CACHING or placed.row_arrays is not RowArrays.HOST:
        raise ValueError(
            f"--hbm-budget-gib {budget_gib} plans {placed.line()}: the row arrays stay on the "
            "device, which this bench does not measure; lower --hbm-budget-gib (or raise "
            "--scale-keys) until the planner moves them to the host"
        )
    return placed


def populate(storage: FusedStorage, keys: int, chunk: int) -> dict[str, Any]:
    """Insert keys ``0 .. keys - 1`` (zero rows, score 0) in chunks; what the table then holds."""
    device, dim = storage.device, storage.dim
    t0 = time.perf_counter()
    for a in range(0, keys, chunk):
        k = torch.arange(a, min(a + chunk, keys), device=device)  # [chunk]
        zeros = torch.zeros(k.numel(), dim, device=device)  # [chunk, dim]
        storage.payload.insert_or_assign(k, zeros, torch.zeros_like(k), table_ids=None)
        if (a // chunk) % 16 == 15:  # progress in the log (a run cut short says how far)
            took = time.perf_counter() - t0
            print(f"populate: {a + k.numel():,} keys, {took:.1f} s", file=sys.stderr, flush=True)
    storage.mutations += 1
    _sync(device)
    t = storage.table
    return {
        "populate_s": round(time.perf_counter() - t0, 2),
        "keys_inserted": keys,
        "keys_stored": t.size,
        "evictions": t.evictions,
        "refusals": t.refusals,
    }


def tier_bytes(storage: FusedStorage, cache: RowCache) -> dict[str, dict[str, int]]:
    """The bytes of each array of the storage (its payload ``cache``), by the tier it is in."""
    t = storage.table
    slots = t._slot_fp, t._slot_row, t._sentinel, t._bucket_count
    lines = cache._values, cache._accum, cache._row_of_line, cache._stamps, cache._dirty
    row_arrays = sum(a.nbytes for a in (t._row_key, t._row_tid, t._row_score))
    hosted = t.row_arrays is RowArrays.HOST
    device = {
        "slot_arrays": sum(a.nbytes for a in slots),
        "line_map": cache._line_map.nbytes,
        "lines": sum(a.nbytes for a in lines),
        "row_arrays": 0 if hosted else row_arrays,
        # kept with the table by the CUDA insert kernels (the CPU's torch backend has none)
        "insert_scratch": insert.scratch_bytes(t),
    }
    host = {
        "rows": cache.store.capacity * 2 * storage.dim * 4,
        "row_arrays": row_arrays if hosted else 0,
        "insert_stage": insert.stage_host_bytes(t),
    }
    return {"device": device, "host": host}


def run(args: Any) -> dict[str, Any]:
    check_device(args.device)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(args.seed)
    placed = plan(args.scale_keys, args.dim, args.hbm_budget_gib)
    result: dict[str, Any] = {
        "what": "issue #52 scale: one CACHING table, row arrays on the host, Zipf embedding steps",
        "command": args.command,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "threads": torch.get_num_threads(),
        "keys": args.scale_keys,
        "dim": args.dim,
        "alpha": args.alpha,
        "lookups": args.lookups,
        "steps": args.steps,
        "warmup": args.warmup,
        "host_memory": args.host_memory,
        "hbm_budget_gib": args.hbm_budget_gib,
        "plan": {
            "line": placed.line(),
            "cache_load_factor": placed.cache_load_factor,
            "row_arrays": placed.row_arrays.value,
            "hbm_bytes": placed.hbm_bytes,
            "host_bytes": placed.host_bytes,
            "device_parts": placed.device_parts(),
            "host_parts": placed.host_parts(),
        },
    }
    gen = torch.Generator(device=device).manual_seed(args.seed)
    n = args.warmup + args.steps
    # [n * lookups] ranks = keys, drawn before the table exists (the CDF is 8 B a key)
    batches = list(
        zipf_ranks(args.scale_keys, args.alpha, n * args.lookups, gen).split(args.lookups)
    )
    result["distinct_keys_a_step"] = statistics.median(
        int(torch.unique(b).numel()) for b in batches
    )
    grad = torch.randn(args.lookups, args.dim, device=device, generator=gen) * 1e-3
    if cuda:
        torch.cuda.empty_cache()

    t0 = time.perf_counter()
    dec = DynamicEmbeddingCollection(
        [spec(args.dim, placed.slots, None)], {}, lr=0.01, device=device, max_load_factor=1.0,
        cache_load_factors={TABLE: placed.cache_load_factor},
        row_arrays={TABLE: placed.row_arrays},
    )  # fmt: skip
    storage = dec._storages[0]
    cache = storage.payload
    assert isinstance(cache, RowCache)
    _sync(device)
    result["allocate_s"] = round(time.perf_counter() - t0, 2)
    print(f"allocated in {result['allocate_s']} s: {placed.line()}", file=sys.stderr, flush=True)
    result["populate"] = populate(storage, args.scale_keys, args.chunk)
    result["bytes"] = tier_bytes(storage, cache)
    if cuda:
        result["bytes"]["device"]["allocated_after_populate"] = torch.cuda.memory_allocated(device)
    print(f"populated: {result['populate']}", file=sys.stderr, flush=True)
    write_result(args.out, result)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    steps = time_steps(dec, batches, grad, args.warmup)
    median = statistics.median(steps.seconds)
    result.update(
        step_ms_median=round(median * 1e3, 3),
        step_ms=[round(x * 1e3, 3) for x in steps.seconds],
        steps_per_s=round(1 / median, 2),
        lookups_per_s=round(args.lookups / median),
        hit_rate=steps.hit_rate,
        per_step=steps.per_step,
        cache_lines=cache.lines,
        keys_stored_after_steps=storage.table.size,
    )
    if cuda:
        result["bytes"]["device"]["max_allocated_during_steps"] = torch.cuda.max_memory_allocated(
            device
        )
    result["host_max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"steps: {result['step_ms_median']} ms, hit rate {steps.hit_rate:.3f}", file=sys.stderr)
    write_result(args.out, result)
    return result


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_tiers_scale", description=plain(__doc__), epilog=EXAMPLE)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--scale-keys", type=int, default=500_000_000, help="keys in the table")
    p.add_argument("--dim", type=int, default=16, help="embedding dim")
    p.add_argument("--hbm-budget-gib", type=float, default=16.0, help="device budget of the tables")
    p.add_argument("--lookups", type=int, default=1_000_000, help="keys a step looks up")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the keys")
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first (warm the cache)")
    p.add_argument(
        "--chunk", type=int, default=1 << 22, help="keys an insert of the populate takes"
    )
    p.add_argument("--seed", type=int, default=0, help="batches and gradient")
    p.add_argument(
        "--host-memory", choices=host_memory.KINDS, default="register",
        help="how the host tier and the index's host row arrays are made on CUDA "
        "(shared.hashtable.host_memory): registered in place, or the CUDA driver's memory",
    )  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    args.command = " ".join(["python -m bench.bench_tiers_scale", *given])
    host_memory.refuse_off_cuda(args.host_memory, args.device, "bench_tiers_scale")
    with host_memory.using(args.host_memory):
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
