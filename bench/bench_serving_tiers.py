"""A server's dynamic tables in host memory with an HBM cache of hot rows (``serve.tiers``)
against all of them in HBM: candidates/s and p99 of batches on the same bundle, in one run.

    python -m bench.bench_serving_tiers --out bench/results/bench_serving_tiers_cpu.json \\
        --keys 300000 --factor 0.1 --device cpu
    python -m bench.bench_serving_tiers --out $OUT/bench_serving_tiers.json --device cuda \\
        --keys 2774434 --factor 0.1            # the seed's shape (full Taobao vocabularies)

What it measures: the model path of a batch (``LoadedModel.predict``: the host-to-device copy,
the lookups, the dense program and the copy of the scores back; one CUDA graph replay a batch on
CUDA), not the gRPC server around it (``bench.bench_serving``), whose flags do not reach the
tiers yet. One synthetic bundle (``bench.bench_serving.make_bundle``: ``--keys`` keys split over
the six dynamic tables like the Taobao vocabularies, the seed config's real dense part with the
pair inputs) is loaded twice: HBM_ONLY, and every dynamic table CACHING with ``--factor`` of its
rows in HBM. The batches are ``--users`` users with ``--candidates`` candidates and
``--seq-len`` clicks each, every dynamic id drawn Zipf(``--alpha``) over its table's rows in
bundle order (row r is the r-th most popular; the synthetic bundle has no scores, so the cache
holds each table's first rows, which this traffic makes the hottest), dense ids uniform. Both
models score the same batches; the scores must be equal (``max_abs_diff``, 0 expected).

``--rounds`` rounds, each timing every variant in turn over the same batches (a shared
machine's drift falls on both); per variant the median over rounds of candidates/s and of the
p99 batch latency, and the ratio the median of the rounds' own ratios. Also per variant: the
table build seconds at load, the tables' HBM and host bytes, and the share of found keys read
from HBM (the cache's hit rate).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from bench.bench_serving import make_bundle
from serve.graphs import default_buckets
from serve.model import LoadedModel, synthetic_batch
from serve.tiers import TierConfig
from shared.batch import Batch
from shared.bundle import Bundle, read_bundle


def log(msg: str) -> None:
    print(f"[bench_serving_tiers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Zipf:
    """Row numbers below ``n``, row r drawn with weight 1 / (r + 1) ** alpha."""

    def __init__(self, n: int, alpha: float) -> None:
        self.cdf = np.cumsum(1.0 / np.arange(1, n + 1, dtype=np.float64) ** alpha)

    def rows(self, size: int, rng: np.random.Generator) -> np.ndarray:
        u = rng.random(size) * self.cdf[-1]
        return np.searchsorted(self.cdf, u).clip(max=len(self.cdf) - 1)


def _kjt(
    bundle: Bundle, kjt: KeyedJaggedTensor, zipf: dict[str, Zipf], rng: np.random.Generator
) -> KeyedJaggedTensor:
    """``kjt`` with Zipf ids of each dynamic feature's table, uniform ones of dense tables."""
    fs = bundle.feature_set
    values = []
    lengths = kjt.length_per_key()
    for name, n in zip(kjt.keys(), lengths, strict=True):
        table = fs.tables[fs.features[name].table]
        if table.is_dynamic:
            keys = bundle.hash_tables[table.name][0].numpy()
            values.append(keys[zipf[table.name].rows(n, rng)])
        else:
            values.append(rng.integers(0, int(table.num_rows or 1), n))
    flat = torch.from_numpy(np.concatenate(values).astype(np.int64))
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=flat,
        lengths=kjt.lengths(),
        stride=kjt.stride(),
        length_per_key=lengths,
    )


def make_batches(bundle: Bundle, a: argparse.Namespace) -> list[Batch]:
    rng = np.random.default_rng(a.seed)
    zipf = {n: Zipf(len(k), a.alpha) for n, (k, _) in bundle.hash_tables.items()}
    out = []
    for _ in range(a.batches):
        b = synthetic_batch(bundle.feature_set, a.users, a.users * a.candidates, (a.seq_len,))
        out.append(
            dataclasses.replace(
                b,
                user=_kjt(bundle, b.user, zipf, rng),
                item=_kjt(bundle, b.item, zipf, rng),
                sequence=_kjt(bundle, b.sequence, zipf, rng),
            )
        )
    return out


def time_variant(model: LoadedModel, batches: list[Batch]) -> dict[str, float]:
    seconds = []
    for batch in batches:
        t0 = time.perf_counter()
        model.predict(batch)  # scores on the CPU: the device is synchronized
        seconds.append(time.perf_counter() - t0)
    candidates = sum(int(b.item.stride()) for b in batches)
    return {
        "candidates_per_s": candidates / sum(seconds),
        "p50_ms": float(np.percentile(seconds, 50) * 1e3),
        "p99_ms": float(np.percentile(seconds, 99) * 1e3),
    }


def tables_summary(model: LoadedModel) -> dict[str, Any]:
    stats = [s for s in model.table_stats() if s.is_hashmap]
    hits = sum(s.hits for s in stats)
    host = sum(s.host_reads for s in stats)
    return {
        "modes": sorted({s.mode for s in stats}),
        "hbm_bytes": sum(s.hbm_bytes for s in model.table_stats()),
        "host_bytes": sum(s.host_bytes for s in model.table_stats()),
        "found_keys": hits,
        "hbm_hit_rate": (hits - host) / hits if hits else None,
        "table_build_s": model.startup.table_build,
        "startup_s": model.startup.total,
    }


def run(a: argparse.Namespace) -> dict[str, Any]:
    work = Path(a.work or tempfile.mkdtemp(prefix="bench_serving_tiers-"))
    work.mkdir(parents=True, exist_ok=True)
    log(f"bundle of {a.keys} keys under {work}")
    path, info = make_bundle(work, a.keys, seed=a.seed)
    bundle = read_bundle(path, verify_checksums=False)
    batches = make_batches(bundle, a)
    cuda = a.device == "cuda"
    buckets = default_buckets(a.users * a.candidates) if cuda and a.cuda_graphs == "on" else ()
    factors = {t.name: a.factor for t in bundle.feature_set.dynamic_tables}
    variants = {"hbm_only": None, "caching": TierConfig(factors)}
    models = {}
    for name, tiers in variants.items():
        log(f"loading {name}")
        models[name] = LoadedModel.load(path, device=a.device, graph_buckets=buckets, tiers=tiers)
    diff = 0.0
    for batch in batches:
        want = models["hbm_only"].predict(batch)
        diff = max(diff, float((models["caching"].predict(batch) - want).abs().max()))
    for model in models.values():
        model.tables.reset_stats()
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(a.rounds):
        rounds.append({name: time_variant(m, batches) for name, m in models.items()})
        log(f"round {r}: " + json.dumps(rounds[-1]))
    summary: dict[str, Any] = {}
    for name in variants:
        summary[name] = {
            k: statistics.median(rd[name][k] for rd in rounds)
            for k in ("candidates_per_s", "p50_ms", "p99_ms")
        } | tables_summary(models[name])
    ratios = {
        "candidates_per_s": statistics.median(
            rd["caching"]["candidates_per_s"] / rd["hbm_only"]["candidates_per_s"] for rd in rounds
        ),
        "p99": statistics.median(
            rd["caching"]["p99_ms"] / rd["hbm_only"]["p99_ms"] for rd in rounds
        ),
    }
    return {
        "bench": "bench_serving_tiers",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": " ".join(["python -m bench.bench_serving_tiers", *sys.argv[1:]]),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "bundle": info,
        "cuda_graphs": bool(buckets),
        "max_abs_diff": diff,
        "rounds": rounds,
        "variants": summary,
        "caching_over_hbm_only": ratios,
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_serving_tiers",
        description="Cached (host tier + HBM hot rows) against all-in-HBM serving tables.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  python -m bench.bench_serving_tiers --device cuda --keys 2774434 "
        "--factor 0.1 --out results/bench_serving_tiers_gpu.json",
    )
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    p.add_argument("--work", type=Path, default=None, help="scratch dir (default: a temp dir)")
    p.add_argument("--keys", type=int, default=300_000, help="dynamic keys of the bundle")
    p.add_argument("--factor", type=float, default=0.1, help="cache_load_factor of every table")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="serving device")
    p.add_argument(
        "--cuda-graphs", choices=["on", "off"], default="on", help="replay batches (CUDA)"
    )
    p.add_argument("--users", type=int, default=8, help="users a batch")
    p.add_argument("--candidates", type=int, default=100, help="candidates a user")
    p.add_argument("--seq-len", type=int, default=50, help="clicks a user")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids")
    p.add_argument("--batches", type=int, default=50, help="timed batches a round")
    p.add_argument("--rounds", type=int, default=3, help="rounds (variants in turn)")
    p.add_argument("--seed", type=int, default=0, help="bundle and traffic seed")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if not 0 < a.factor < 1:
        raise SystemExit(
            f"--factor must be in (0, 1) (a cache smaller than the table), got {a.factor}"
        )
    result = run(a)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, a.out)  # atomically
    v, r = result["variants"], result["caching_over_hbm_only"]
    for name, s in v.items():
        print(
            f"{name:9s} {s['candidates_per_s']:10.0f} cand/s p99 {s['p99_ms']:7.2f} ms "
            f"hbm {s['hbm_bytes'] / 2**20:8.1f} MiB host {s['host_bytes'] / 2**20:8.1f} MiB "
            f"hit rate {s['hbm_hit_rate']}"
        )
    print(f"caching/hbm_only: candidates/s {r['candidates_per_s']:.3f}x, p99 {r['p99']:.3f}x; "
          f"max |diff| {result['max_abs_diff']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
