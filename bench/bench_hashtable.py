"""Throughput of the hash-table core beside a dense ``index_select`` of the same rows.

    python -m bench.bench_hashtable --out out/bench_hashtable.json [--device cuda]

For each load factor (0.5, 0.9) a HashTable sized ``keys / load_factor`` (dim 16, 128 slots per
bucket, no growth) is filled with ``--keys`` random int64 keys in batches of ``--batch``; then:

- ``insert``: inserting all keys into an empty table (keys/s; at 0.9 some buckets overflow and
  evict: the JSON reports the resulting size),
- ``assign``: insert_or_assign of a batch of existing keys (update path),
- ``find``: one batch find of every key (and of one training-size batch),
- ``find_gather``: find plus the gather of the rows, the work a lookup does,
- ``dense_index_select``: ``index_select`` on a dense [keys, dim] matrix with the same number of
  random row ids, in the same run: the floor a hash lookup is compared against.

Also the startup build of ``--build-keys`` keys (``StaticLookupTable.from_keys_values``, what
serving does, and ``HashTable.from_keys_values``), the static lookup, and one training step of
DynamicEmbeddingCollection. Every number is the median of ``--repeats`` runs; the JSON records
the device, torch version and CPU thread count beside them.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shared.cli import Parser, check_device, plain, run_cli
from shared.cli import exit_code as _exit_code
from shared.features import (
    CONSTANT_ZERO,
    DynamicTableSpec,
    InitializerSpec,
    InitMode,
    ScoreStrategy,
    TableSpec,
)
from shared.hashtable.embedding import DynamicEmbeddingCollection
from shared.hashtable.lookup import StaticLookupTable
from shared.hashtable.table import HashTable


def _timed(
    fn: Callable[[], Any],
    device: torch.device,
    repeats: int,
    setup: Callable[[], Any] | None = None,
) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs (``setup`` runs untimed before each)."""
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _random_keys(n: int, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    keys = torch.unique(torch.randint(0, 1 << 62, (n + n // 100,), generator=g))
    return keys[torch.randperm(keys.numel(), generator=g)[:n]].to(device)


def bench_load_factor(
    keys: torch.Tensor, lf: float, dim: int, batch: int, repeats: int
) -> dict[str, Any]:
    device = keys.device
    n = keys.numel()
    cap = math.ceil(n / lf)
    values = torch.randn(n, dim, device=device)
    scores = torch.arange(n, device=device)
    state: dict[str, HashTable] = {}

    def fresh() -> None:
        state["t"] = HashTable(
            dim, init_capacity=cap, max_capacity=cap, bucket_capacity=128, device=device
        )

    def fill() -> None:
        t = state["t"]
        for s in range(0, n, batch):
            t.insert_or_assign(keys[s : s + batch], values[s : s + batch], scores[s : s + batch])

    insert_s = _timed(fill, device, repeats, setup=fresh)
    table = state["t"]
    _, found = table.find(keys)
    filled = {  # before the assign runs below re-insert keys that were evicted
        "capacity": table.capacity,
        "size_after_insert": table.size,
        "load_factor": table.load_factor,
        "evictions": table.evictions,
        "found_fraction": float(found.float().mean()),
    }
    q = keys[torch.randperm(n, device=device)]
    qb = q[:batch]
    find_s = _timed(lambda: table.find(q), device, repeats)
    find_batch_s = _timed(lambda: table.find(qb), device, repeats)
    gather_s = _timed(lambda: table.values[table.find(q)[0].clamp(min=0)], device, repeats)
    assign_s = _timed(
        lambda: table.insert_or_assign(qb, values[:batch], scores[:batch]), device, repeats
    )
    dense = torch.randn(n, dim, device=device)
    rows = torch.randint(0, n, (n,), device=device)
    dense_s = _timed(lambda: dense.index_select(0, rows), device, repeats)
    dense_batch_s = _timed(lambda: dense.index_select(0, rows[:batch]), device, repeats)
    return {
        "load_factor_target": lf,
        **filled,
        "insert_keys_per_s": n / insert_s,
        "assign_keys_per_s": batch / assign_s,
        "find_keys_per_s": n / find_s,
        "find_batch_keys_per_s": batch / find_batch_s,
        "find_gather_keys_per_s": n / gather_s,
        "dense_index_select_keys_per_s": n / dense_s,
        "dense_index_select_batch_keys_per_s": batch / dense_batch_s,
        "find_vs_index_select_slowdown": find_s / dense_s,
        "find_gather_vs_index_select_slowdown": gather_s / dense_s,
    }


def bench_build(n: int, dim: int, repeats: int, device: torch.device) -> dict[str, Any]:
    keys = _random_keys(n, device, seed=2)
    values = torch.randn(n, dim, device=device)
    static_s = _timed(
        lambda: StaticLookupTable.from_keys_values(keys, values, device=device), device, repeats
    )
    hash_s = _timed(
        lambda: HashTable.from_keys_values(keys, values, device=device), device, repeats
    )
    static = StaticLookupTable.from_keys_values(keys, values, device=device)
    q = keys[torch.randint(0, n, (1_000_000,), device=device)]
    lookup_s = _timed(lambda: static.lookup(q), device, repeats)
    return {
        "keys": n,
        "static_build_s": static_s,
        "hashtable_build_s": hash_s,
        "static_lookup_keys_per_s": q.numel() / lookup_s,
    }


def bench_train_step(device: torch.device, repeats: int) -> dict[str, Any]:
    """One forward+backward of 2 fused tables with 100k lookups each into ~200k-key tables."""
    init = InitializerSpec(InitMode.NORMAL, std_dev=0.05)
    dyn = DynamicTableSpec(500_000, 1024, 128, ScoreStrategy.LFU, init, CONSTANT_ZERO, None, None)
    tables = [TableSpec(n, 16, None, dyn, "sum") for n in ("a_emb", "b_emb")]
    dec = DynamicEmbeddingCollection(tables, {"g": ["a_emb", "b_emb"]}, lr=0.01, device=device)
    g = torch.Generator().manual_seed(3)

    def batch() -> dict[str, torch.Tensor]:  # skewed: many repeats of popular keys
        return {
            t: (200_000 * torch.rand(100_000, generator=g) ** 3).long().to(device)
            for t in ("a_emb", "b_emb")
        }

    for _ in range(3):  # warm up: fill the tables
        sum(v.sum() for v in dec(batch()).values()).backward()
    step_s = _timed(lambda: sum(v.sum() for v in dec(batch()).values()).backward(), device, repeats)
    return {
        "lookups_per_step": 200_000,
        "step_s": step_s,
        "lookups_per_s": 200_000 / step_s,
        "table_sizes": {t: s["size"] for t, s in dec.stats().items()},
    }


EXAMPLE = """examples:
  python -m bench.bench_hashtable --out out/bench_hashtable.json --threads 1
  python -m bench.bench_hashtable --out out/bench_hashtable_gpu.json --device cuda"""


def _parser() -> Parser:
    p = Parser(
        prog="python -m bench.bench_hashtable",
        description=plain(__doc__.split("\n\n")[0]),
        epilog=EXAMPLE,
    )
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--keys", type=int, default=1_000_000, help="random keys in each table")
    p.add_argument("--dim", type=int, default=16, help="embedding dim of the tables")
    p.add_argument("--batch", type=int, default=65_536, help="keys per insert/assign call")
    p.add_argument(
        "--build-keys", type=int, default=1_500_000, help="keys of the startup build (serving)"
    )
    p.add_argument("--repeats", type=int, default=5, help="runs per figure (the median is kept)")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (0, the default: torch's default). On a busy machine 1 is "
        "steadier: with 2 threads, waits at each op's thread barrier dominate small ops",
    )
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    check_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    keys = _random_keys(args.keys, device, seed=1)
    result: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "keys": args.keys,
        "dim": args.dim,
        "batch": args.batch,
        "repeats": args.repeats,
        "statistic": "median",
        "load_factors": [
            bench_load_factor(keys, lf, args.dim, args.batch, args.repeats) for lf in (0.5, 0.9)
        ],
        "build": bench_build(args.build_keys, args.dim, args.repeats, device),
        "train_step": bench_train_step(device, args.repeats),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
