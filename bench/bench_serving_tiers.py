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
models score the same batches; the scores must be equal (``max_abs_diff``: 0 on CPU, on CUDA
within the tolerance below).

``--rounds`` rounds, each timing every variant in turn over the same batches (a shared
machine's drift falls on both); per variant the median over rounds of candidates/s and of the
p99 batch latency, and the ratio the median of the rounds' own ratios. Also per variant: the
table build seconds at load, the tables' HBM and host bytes, and the share of found keys read
from HBM (the cache's hit rate).

**Scale mode** (issue #52: "a 200M-key bundle serves from one GPU with <= 8 GiB of tables in
HBM; report startup time and p99")::

    python -m bench.bench_serving_tiers --out $OUT/bench_serving_scale.json --device cuda \
        --keys 200000000 --variants caching --hbm-budget-gib 8

- ``--hbm-budget-gib G`` places the CACHING variant's tables from an HBM budget instead of
  ``--factor``: ``TierConfig.from_flags([], G)`` given to ``LoadedModel.load``, the server's own
  path (``--hbm-budget-gib`` of ``python -m serve``), so the planner (``serve.tiers.plan_tiers``)
  chooses one factor for every table. The JSON gives per table its mode, factor (and whether the
  budget planned it), rows, HBM and host bytes (``variants.caching.tables``), the tables' total
  HBM bytes (dense tables too, as the planner counts them) and ``checks.within_budget``.
- ``--variants caching`` skips the HBM_ONLY load (at 200M keys it would need ~16 GB of HBM and
  a second host copy of the values); ``--variants hbm_only,caching`` (the default) compares them.
- Startup, per variant (``startup``): ``read`` (the bundle's files, sha256 verified, as a server
  does by default), ``table_build`` (keys sorted on the device, the host tier built and pinned,
  the hot rows copied; ``hash_tables``/``dense_tables`` its parts), ``program_load`` (in
  parallel with both), ``warmup`` and ``graphs`` (the warm-up batches and the CUDA graphs'
  capture), ``total`` (wall time to ready) and ``first_batch`` (the first batch of traffic
  after ready, not in ``total``). The bundle's write (``bundle.build_s``) is not startup.
- Scores: with both variants, every batch's scores of the two (``max_abs_diff``); always, the
  first ``--reference-batches`` batches against a reference model (``reference``): HBM_ONLY
  tables built from the bundle's rows those batches read (the generator knows them) and the
  padding key, the same program and graph buckets, so its tables do not grow with the bundle.
  Equal on CPU (0); on CUDA the pooling's atomic float adds make sums order-dependent, so
  within :data:`CUDA_SCORE_TOLERANCE`. ``checks`` holds every check; the exit status is 1 when
  one fails.
- Memory (``memory``): the process's peak RSS before the write, after it, after the loads and
  at the end, beside the values' bytes. ``make_bundle`` holds every table's values once while it
  writes, and one table's random draw besides (CPU, 20M keys: 1.27x the values above the peak
  before it); a load maps the files (their pages count in the RSS, page cache that the kernel
  may drop) and builds one host copy of the values (CPU, 20M keys, one CACHING load: 3.6x the
  values in all, the HBM lines there in RAM too). On CUDA each load's allocated and peak device
  bytes (the keys' sort at build needs more HBM than the tables keep).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
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
from serve.graphs import Bucket, default_buckets
from serve.lookup import PAD_ID, EmbeddingTables
from serve.model import LoadedModel, synthetic_batch
from serve.tiers import TierConfig
from shared.batch import Batch
from shared.bundle import Bundle, read_bundle

VARIANTS = ("hbm_only", "caching")
DEFAULT_FACTOR = 0.1
# CUDA pools bags with atomic float adds (index_add_), so sums depend on the order the adds
# land; a wrong row moves a score by far more (1e-3 and up with these N(0, 0.05) embeddings)
CUDA_SCORE_TOLERANCE = 1e-5
REFERENCE_BATCHES = 20
Rows = dict[str, list[np.ndarray]]  # dynamic table → the bundle rows some batches read


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
    bundle: Bundle,
    kjt: KeyedJaggedTensor,
    zipf: dict[str, Zipf],
    rng: np.random.Generator,
    read: Rows | None = None,
) -> KeyedJaggedTensor:
    """``kjt`` with Zipf ids of each dynamic feature's table, uniform ones of dense tables; the
    dynamic rows drawn are appended to ``read`` (if given)."""
    fs = bundle.feature_set
    values = []
    lengths = kjt.length_per_key()
    for name, n in zip(kjt.keys(), lengths, strict=True):
        table = fs.tables[fs.features[name].table]
        if table.is_dynamic:
            keys = bundle.hash_tables[table.name][0].numpy()
            rows = zipf[table.name].rows(n, rng)
            values.append(keys[rows])
            if read is not None:
                read.setdefault(table.name, []).append(rows)
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


def make_batches(bundle: Bundle, a: argparse.Namespace) -> tuple[list[Batch], Rows]:
    """``a.batches`` batches, and the dynamic rows the first ``a.reference_batches`` read."""
    rng = np.random.default_rng(a.seed)
    zipf = {n: Zipf(len(k), a.alpha) for n, (k, _) in bundle.hash_tables.items()}
    out: list[Batch] = []
    read: Rows = {}
    for i in range(a.batches):
        b = synthetic_batch(bundle.feature_set, a.users, a.users * a.candidates, (a.seq_len,))
        rows = read if i < a.reference_batches else None
        out.append(
            dataclasses.replace(
                b,
                user=_kjt(bundle, b.user, zipf, rng, rows),
                item=_kjt(bundle, b.item, zipf, rng, rows),
                sequence=_kjt(bundle, b.sequence, zipf, rng, rows),
            )
        )
    return out, read


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
    """The variant's tables: modes, bytes per tier, hit rate, and each dynamic table's plan."""
    stats = model.table_stats()
    dynamic = [s for s in stats if s.is_hashmap]
    hits = sum(s.hits for s in dynamic)
    host = sum(s.host_reads for s in dynamic)
    by_name = {s.name: s for s in stats}
    return {
        "modes": sorted({s.mode for s in dynamic}),
        "hbm_bytes": sum(s.hbm_bytes for s in stats),  # dense tables too, as the planner counts
        "host_bytes": sum(s.host_bytes for s in stats),
        "found_keys": hits,
        "hbm_hit_rate": (hits - host) / hits if hits else None,
        "table_build_s": model.startup.table_build,
        "startup_s": model.startup.total,
        "tables": {
            name: {
                "mode": p.mode.value,
                "factor": p.cache_load_factor,
                "planned": p.planned,  # the budget chose the factor
                "rows": by_name[name].rows,
                "hbm_bytes": by_name[name].hbm_bytes,
                "host_bytes": by_name[name].host_bytes,
            }
            for name, p in model.tables.placements.items()
        },
    }


def load_variant(
    path: Path, a: argparse.Namespace, tiers: TierConfig | None, buckets: tuple[Bucket, ...]
) -> tuple[LoadedModel, dict[str, Any]]:
    """The model, and its startup split (module docstring) with the device memory of the load."""
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    model = LoadedModel.load(path, device=a.device, graph_buckets=buckets, tiers=tiers)
    startup: dict[str, Any] = model.startup.as_dict()
    startup.update({f"{k}_build": v for k, v in model.tables.build_seconds.items()})
    memory = None
    if cuda:
        memory = {
            "allocated_bytes": torch.cuda.memory_allocated() - base,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated() - base,
        }
    return model, {"startup": startup, "cuda_memory": memory}


def first_batch_s(model: LoadedModel, batch: Batch) -> float:
    t0 = time.perf_counter()
    model.predict(batch)
    return time.perf_counter() - t0


def rows_bundle(bundle: Bundle, read: Rows) -> Bundle:
    """``bundle`` with each dynamic table cut to the rows in ``read`` and its padding key's row
    (graph buckets pad batches with :data:`PAD_ID`): the rows a reference needs, read straight
    from the bundle's values. No hotness (a reference is HBM_ONLY)."""
    tables = {}
    for name, (keys, values) in bundle.hash_tables.items():
        pad = np.flatnonzero(keys.numpy() == PAD_ID)
        rows = np.unique(np.concatenate([*read.get(name, []), pad]).astype(np.int64))
        index = torch.from_numpy(rows)
        tables[name] = (keys.index_select(0, index), values.index_select(0, index))
    return dataclasses.replace(bundle, hash_tables=tables, hash_scores={})


def sampled_reference(
    model: LoadedModel,
    bundle: Bundle,
    batches: list[Batch],
    read: Rows,
    buckets: tuple[Bucket, ...],
) -> dict[str, Any]:
    """``model``'s scores of ``batches`` against a reference: the same program and graph buckets
    over HBM_ONLY tables of only the rows those batches read (:func:`rows_bundle`), built by
    the server's table code from the bundle's values; affordable at any bundle size."""
    sub = rows_bundle(bundle, read)
    hbm_only = TierConfig({t.name: 1.0 for t in bundle.feature_set.dynamic_tables})
    tables = EmbeddingTables.from_bundle(sub, device=model.device, tiers=hbm_only)
    ref = LoadedModel(
        sub, tables, model.program, model.device, model.startup, graph_buckets=buckets
    )
    ref.warmup()
    diff = 0.0
    for batch in batches:
        diff = max(diff, float((model.predict(batch) - ref.predict(batch)).abs().max()))
    return {
        "batches": len(batches),
        "rows": sum(int(k.numel()) for k, _ in sub.hash_tables.values()),
        "max_abs_diff": diff,
    }


def _peak_rss() -> int:
    """This process's peak resident bytes so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _tiers(a: argparse.Namespace, bundle: Bundle) -> dict[str, TierConfig | None]:
    """The tier config of each variant asked for: HBM_ONLY is the fg.json's (None), CACHING
    the budget's (the server's flag path) or ``--factor`` on every dynamic table."""
    if a.hbm_budget_gib is not None:
        cached = TierConfig.from_flags([], a.hbm_budget_gib)
    else:
        cached = TierConfig({t.name: a.factor for t in bundle.feature_set.dynamic_tables})
    return {name: (cached if name == "caching" else None) for name in a.variants}


def run(a: argparse.Namespace) -> dict[str, Any]:
    work = Path(a.work or tempfile.mkdtemp(prefix="bench_serving_tiers-"))
    work.mkdir(parents=True, exist_ok=True)
    cuda = a.device == "cuda"
    memory: dict[str, Any] = {"peak_rss_before_write_bytes": _peak_rss()}
    log(f"bundle of {a.keys} keys under {work}")
    path, info = make_bundle(work, a.keys, seed=a.seed)
    memory["peak_rss_after_write_bytes"] = _peak_rss()
    log(f"bundle written in {info['build_s']:.1f}s")
    bundle = read_bundle(path, verify_checksums=False)
    memory["values_bytes"] = sum(v.numel() * 4 for _, v in bundle.hash_tables.values())
    batches, read = make_batches(bundle, a)
    buckets = default_buckets(a.users * a.candidates) if cuda and a.cuda_graphs == "on" else ()
    variants = _tiers(a, bundle)
    models, loads = {}, {}
    for name, tiers in variants.items():
        log(f"loading {name}")
        models[name], loads[name] = load_variant(path, a, tiers, buckets)
        loads[name]["startup"]["first_batch"] = first_batch_s(models[name], batches[0])
        log(f"{name} ready: " + json.dumps(loads[name]))
    memory["peak_rss_after_load_bytes"] = _peak_rss()
    diff = _variant_diff(models, batches)
    last = models[a.variants[-1]]
    reference = sampled_reference(last, bundle, batches[: a.reference_batches], read, buckets)
    log(f"reference of {a.variants[-1]}: {reference}")
    for model in models.values():
        model.tables.reset_stats()
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(a.rounds):
        rounds.append({name: time_variant(m, batches) for name, m in models.items()})
        log(f"round {r}: " + json.dumps(rounds[-1]))
    summary: dict[str, Any] = {
        name: {
            k: statistics.median(rd[name][k] for rd in rounds)
            for k in ("candidates_per_s", "p50_ms", "p99_ms")
        }
        | tables_summary(model)
        | loads[name]
        for name, model in models.items()
    }
    memory["peak_rss_bytes"] = _peak_rss()
    cached = variants.get("caching")
    budget = cached.hbm_budget if cached is not None else None
    tolerance = CUDA_SCORE_TOLERANCE if cuda else 0.0
    return {
        "bench": "bench_serving_tiers",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": " ".join(["python -m bench.bench_serving_tiers", *sys.argv[1:]]),
        "machine": _machine(cuda),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "bundle": info,
        "cuda_graphs": bool(buckets),
        "hbm_budget_bytes": budget,
        "max_abs_diff": diff,
        "reference": reference,
        "score_tolerance": tolerance,
        "checks": _checks(summary, budget, diff, reference, tolerance),
        "memory": memory,
        "rounds": rounds,
        "variants": summary,
        "caching_over_hbm_only": _ratios(rounds) if diff is not None else None,
    }


def _checks(
    summary: dict[str, Any],
    budget: int | None,
    diff: float | None,
    reference: dict[str, Any],
    tolerance: float,
) -> dict[str, bool]:
    """Each check that applies: the reference's scores, the variants' (both loaded), the
    caching tables' HBM bytes against the budget (one given)."""
    checks = {"reference_scores": reference["max_abs_diff"] <= tolerance}
    if diff is not None:
        checks["variant_scores"] = diff <= tolerance
    if budget is not None:
        checks["within_budget"] = summary["caching"]["hbm_bytes"] <= budget
    return checks


def _variant_diff(models: dict[str, LoadedModel], batches: list[Batch]) -> float | None:
    """Max |caching - hbm_only| over every batch's scores; None without both variants."""
    if len(models) < 2:
        return None
    diff = 0.0
    for batch in batches:
        want = models["hbm_only"].predict(batch)
        diff = max(diff, float((models["caching"].predict(batch) - want).abs().max()))
    return diff


def _machine(cuda: bool) -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def _ratios(rounds: list[dict[str, dict[str, float]]]) -> dict[str, float]:
    """Median over rounds of caching / hbm_only: candidates/s and p99."""
    return {
        "candidates_per_s": statistics.median(
            rd["caching"]["candidates_per_s"] / rd["hbm_only"]["candidates_per_s"] for rd in rounds
        ),
        "p99": statistics.median(
            rd["caching"]["p99_ms"] / rd["hbm_only"]["p99_ms"] for rd in rounds
        ),
    }


def _variants(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    bad = [n for n in names if n not in VARIANTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a comma list of {', '.join(VARIANTS)}, e.g. caching"
        )
    return tuple(n for n in VARIANTS if n in names)  # hbm_only first: the comparison's order


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_serving_tiers",
        description="Cached (host tier + HBM hot rows) against all-in-HBM serving tables.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  python -m bench.bench_serving_tiers --device cuda --keys 2774434 "
        "--factor 0.1 --out results/bench_serving_tiers_gpu.json\n"
        "  python -m bench.bench_serving_tiers --device cuda --keys 200000000 "
        "--variants caching --hbm-budget-gib 8 --out results/bench_serving_scale_gpu.json",
    )
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    p.add_argument("--work", type=Path, default=None, help="scratch dir (default: a temp dir)")
    p.add_argument("--keys", type=int, default=300_000, help="dynamic keys of the bundle")
    p.add_argument(
        "--variants",
        type=_variants,
        default=VARIANTS,
        help="comma list of hbm_only, caching (default both: compared)",
    )
    p.add_argument(
        "--factor",
        type=float,
        default=None,
        help=f"cache_load_factor of every table (default {DEFAULT_FACTOR} without a budget)",
    )
    p.add_argument(
        "--hbm-budget-gib",
        type=float,
        default=None,
        help="HBM budget of the caching variant's tables, planned as the server's flag does",
    )
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
    p.add_argument(
        "--reference-batches",
        type=int,
        default=None,
        help=f"batches checked against a reference (default {REFERENCE_BATCHES}, at most --batches)",
    )
    p.add_argument("--seed", type=int, default=0, help="bundle and traffic seed")
    return p


def _check_args(a: argparse.Namespace) -> None:
    """Refuse contradictory or unused options (SystemExit naming the flag)."""
    if "caching" not in a.variants and (a.factor is not None or a.hbm_budget_gib is not None):
        raise SystemExit("--factor and --hbm-budget-gib place the caching variant: add it to "
                         "--variants, or drop them")  # fmt: skip
    if a.factor is not None and a.hbm_budget_gib is not None:
        raise SystemExit(
            "--factor and --hbm-budget-gib both place the caching variant's tables: give one "
            "(the budget plans one factor for every table, as the server does)"
        )
    if a.hbm_budget_gib is not None and not a.hbm_budget_gib > 0:
        raise SystemExit(f"--hbm-budget-gib must be > 0, got {a.hbm_budget_gib}")
    if a.factor is None and a.hbm_budget_gib is None:
        a.factor = DEFAULT_FACTOR
    if a.factor is not None and not 0 < a.factor < 1:
        raise SystemExit(
            f"--factor must be in (0, 1) (a cache smaller than the table), got {a.factor}"
        )
    if a.reference_batches is None:
        a.reference_batches = min(REFERENCE_BATCHES, a.batches)
    if not 0 < a.reference_batches <= a.batches:
        raise SystemExit(
            f"--reference-batches must be in [1, --batches={a.batches}], got {a.reference_batches}"
        )


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    _check_args(a)
    result = run(a)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, a.out)  # atomically
    for name, s in result["variants"].items():
        st = s["startup"]
        print(
            f"{name:9s} {s['candidates_per_s']:10.0f} cand/s p99 {s['p99_ms']:7.2f} ms "
            f"hbm {s['hbm_bytes'] / 2**20:8.1f} MiB host {s['host_bytes'] / 2**20:8.1f} MiB "
            f"hit rate {s['hbm_hit_rate']}; ready in {st['total']:.1f}s (read {st['read']:.1f}s, "
            f"tables {st['table_build']:.1f}s, first batch {st['first_batch'] * 1e3:.1f} ms)"
        )
    r = result["caching_over_hbm_only"]
    if r is not None:
        print(f"caching/hbm_only: candidates/s {r['candidates_per_s']:.3f}x, p99 {r['p99']:.3f}x; "
              f"max |diff| {result['max_abs_diff']}")  # fmt: skip
    print(f"bundle write {result['bundle']['build_s']:.1f}s; peak RSS "
          f"{result['memory']['peak_rss_bytes'] / 2**30:.2f} GiB for "
          f"{result['memory']['values_bytes'] / 2**30:.2f} GiB of values; reference max |diff| "
          f"{result['reference']['max_abs_diff']}; checks {result['checks']}")  # fmt: skip
    failed = [k for k, ok in result["checks"].items() if not ok]
    if failed:
        print(f"FAILED checks: {', '.join(failed)} (see {a.out})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
