"""Storage tiers: the embedding step of a CACHING table (an HBM cache over host memory) against
the same table HBM_ONLY, in the same run (issue #52, "Done when" part 1).

    python -m bench.bench_tiers --out bench/results/bench_tiers_cpu.json            # CPU, small
    python -m bench.bench_tiers --device cuda --rows 100000000 --rows-128 40000000 \\
        --lookups 1000000 --out out/bench_tiers_gpu.json                          # the device

For each dim (``--dims``, 16 and 128): one dynamic table of ``--rows`` keys (``--rows-128`` for
dims above 64, where HBM_ONLY's payload must still fit the card), filled to a load of 0.8
(``max_capacity = rows / 0.8``, STEP scores, no admission), then the same batches of
``--lookups`` keys drawn Zipf(``--alpha``, 1.05) over the rows (rank r is a random key, so hot
keys spread over buckets). Variants, built one at a time on the same keys:

- ``hbm_only``: every row on the device (today's path, the baseline);
- ``cache_10``, ``cache_50``, ``cache_100``: CACHING with cache lines for 10 %, 50 % and 100 %
  of the rows (``cache_load_factor = pct * rows / max_capacity``).

A step is the embedding step alone: a training lookup of the batch and the backward of a fixed
gradient (sparse Adagrad on the rows), up to a device sync; ``--warmup`` steps first (they warm
the cache), then ``--steps`` timed; ``--rounds`` times, the variants in turn (a shared machine's
drift then falls on all of them; the ratio is the median of the rounds' ratios). The JSON has
per dim and variant the median step ms, its ratio to ``hbm_only`` (same run), the cache's hit
rate over the timed steps (rows found in a line / rows the lookups touched: the backward's
Adagrad takes the lines its lookup resolved, and resolves its rows again, counted too, only when
the lookup bypassed some), misses, bypassed rows, evictions and write-backs a step (the counters
are read outside the timed region: they live on the device) and the host tier rows they imply
(:func:`host_rows`), the bytes per tier (device: the index and the cache lines or the payload;
host: every row's payload), the peak device memory (CUDA), and whether the rows of a probe of
keys equal the baseline's after the run (they should: the tier is transparent).

``--static``: every variant takes the static sparse step (:mod:`shared.hashtable.static_step`,
captured in CUDA graphs on CUDA, eager elsewhere; the tables are at their max capacity from the
start), as training with CUDA graphs does: for CACHING the fixed-shape resolve with no host
read. Without it both run the eager lookup (one host read a resolve for CACHING). Each
variant's ``static_runs`` says which path ran.

``--prefetch``: each step then brings the next batch's stored rows into the cache as training
does (``DynamicEmbeddingCollection.prefetch`` after the backward is issued, inside the timed
step; with ``--static`` on CUDA the static prefetch on a side stream from the end of the
lookup on, beside the backward). The step alone has little to hide it behind (the backward;
training also has the dense part), and it repeats the next lookup's unique and find: the
figure says what is left.

``--write-back-beside ROWS`` (with ``--static``): the caches' fill stages up to ``ROWS`` dirty
victims a step, written to the host tier after the forward on a stream of their own, beside
the rest of the step (:mod:`shared.hashtable.write_back_beside`); the step's time runs to a
sync of the whole device, so it includes them.

``--profile N``: after every timed run (a profiler slows the launches that follow it in its
process), each variant is built again, warmed by the same ``--warmup`` steps and profiled over
``N`` steps (:mod:`bench.step_profile`): its ``profile`` in the JSON (kernels and device ms a
step on CUDA; operators, host ms and bytes allocated a step everywhere) and the top kernels by
self device time (operators by self CPU time) in ONE file, ``<out stem>.profiles.txt``, a
section a dim and variant (written after each dim): a device call returns at most 8 files, and
a file a variant (8 at two dims) with the JSON and logs passed that (2026-12-07: no JSON back).

Each variant's log line (stderr) carries its step ms and, for a cache, the hit rate and host
rows read and written a step, so the log alone holds the figures if the JSON does not come back.
A cache whose timed steps did not all evict (its lines filled up during them: too few warm-up
steps for the steady state, where each step writes victims back) says so in its line and in
the JSON (``evicting_steps``, ``step_ms_median_evicting``).
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.step_profile import profile_steps
from shared.cli import Parser, check_device, plain, run_cli, write_result
from shared.cli import exit_code as _exit_code
from shared.features import CONSTANT_ZERO, DynamicTableSpec, ScoreStrategy, TableSpec
from shared.hashtable import host_memory
from shared.hashtable.embedding import DynamicEmbeddingCollection

TABLE = "bench_emb"
LOAD = 0.8  # keys / slots after the fill
COUNTERS = ("hits", "misses", "bypassed", "evictions", "writebacks", "prefetched")
VARIANTS = {"hbm_only": None, "cache_10": 0.10, "cache_50": 0.50, "cache_100": 1.00}
EXAMPLE = """examples:
  python -m bench.bench_tiers --out bench/results/bench_tiers_cpu.json
  python -m bench.bench_tiers --device cuda --rows 100000000 --rows-128 40000000 --lookups 1000000 --out out/bench_tiers_gpu.json"""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def zipf_ranks(n: int, alpha: float, count: int, gen: torch.Generator) -> torch.Tensor:
    """[count] int64 ranks in [0, n), rank r drawn with probability ~ (r + 1) ** -alpha."""
    device = gen.device
    cdf = torch.arange(1, n + 1, dtype=torch.float64, device=device).pow_(-alpha).cumsum_(0)
    cdf /= cdf[-1].clone()
    u = torch.rand(count, dtype=torch.float64, device=device, generator=gen)
    ranks = torch.searchsorted(cdf, u).clamp_(max=n - 1)
    del cdf
    return ranks


def spec(dim: int, slots: int, factor: float | None) -> TableSpec:
    dyn = DynamicTableSpec(
        slots, slots, 128, ScoreStrategy.STEP, CONSTANT_ZERO, CONSTANT_ZERO, None, None, factor
    )
    return TableSpec(TABLE, dim, None, dyn, "sum")


def build(
    dim: int, slots: int, factor: float | None, keys: torch.Tensor
) -> DynamicEmbeddingCollection:
    """A filled table: every key of ``keys`` inserted (zeros, score 0) in chunks."""
    dec = DynamicEmbeddingCollection(
        [spec(dim, slots, factor)], {}, lr=0.01, device=keys.device, max_load_factor=1.0
    )
    storage = dec._storages[0]
    chunk = 1 << 22
    for a in range(0, keys.numel(), chunk):
        k = keys[a : a + chunk]
        storage.payload.insert_or_assign(
            k, torch.zeros(k.numel(), dim, device=keys.device), torch.zeros_like(k), table_ids=None
        )
    storage.mutations += 1
    return dec


def index_bytes(dec: DynamicEmbeddingCollection) -> int:
    t = dec._storages[0].table
    arrays = (t._slot_fp, t._slot_row, t._row_key, t._row_tid, t._row_score, t._bucket_count)
    return sum(a.nbytes for a in arrays)


@dataclass
class StepTimes:
    """What :func:`time_steps` measured over the timed steps (after the warm-up)."""

    seconds: list[float]  # each timed step's wall time, up to a device sync
    hit_rate: float  # rows of the forward lookups found in a cache line / rows they touched
    per_step: dict[str, float]  # COUNTERS a step (both calls of a step)
    evicting: list[bool]  # each timed step: whether a cache line was evicted in it
    # each timed step's wall time of the host's cores in each native mover (the host-node fill
    # and the write-backs by cores: a host function's time shows in no device profile), ms
    host_moves: dict[str, list[float]] = field(default_factory=dict)


def time_steps(
    dec: DynamicEmbeddingCollection,
    batches: list[torch.Tensor],
    grad: torch.Tensor,
    warmup: int,
    prefetch: bool = False,
) -> StepTimes:
    """The embedding step of each batch (training lookup + backward of ``grad``; with
    ``prefetch``, then the next batch's prefetch), the first ``warmup`` untimed; cache
    counters read outside the timed region (a read syncs)."""
    device = grad.device
    times: list[float] = []
    fwd_hits = fwd_rows = 0.0  # rows of the timed forward lookups: found in a line, and all
    totals: dict[str, float] = {}  # per-step cache counters of the timed steps (both calls)
    evicting: list[bool] = []
    moves: dict[str, list[float]] = {}
    for i, batch in enumerate(batches):
        s0 = dec.tier_stats()[TABLE]  # before the timed region (a read of device counters)
        _sync(device)
        m0 = host_move_seconds(dec)
        t = time.perf_counter()
        _step(dec, i, batch, grad, _upcoming(batches, i, prefetch))
        _sync(device)
        if i < warmup:
            continue
        times.append(time.perf_counter() - t)
        # read after the timed region: the counters live on the device (a read syncs). The
        # backward reuses its lookup's lines (no second count) unless the lookup bypassed rows
        s2 = dec.tier_stats()[TABLE]
        if dec.tiered:
            fwd_hits += s2["cache_hits"] - s0["cache_hits"]
            fwd_rows += sum(s2[k] - s0[k] for k in ("cache_hits", "cache_misses", "cache_bypassed"))
        for k in COUNTERS:
            totals[k] = totals.get(k, 0.0) + s2.get(f"cache_{k}", 0.0) - s0.get(f"cache_{k}", 0.0)
        evicting.append(s2.get("cache_evictions", 0.0) > s0.get("cache_evictions", 0.0))
        for name, spent in host_move_seconds(dec).items():  # synced: no host function queued
            moves.setdefault(name, []).append((spent - m0.get(name, 0.0)) * 1e3)
    per_step = {k: round(v / max(1, len(times)), 1) for k, v in totals.items()}
    hit_rate = fwd_hits / fwd_rows if fwd_rows else 0.0
    return StepTimes(times, hit_rate, per_step, evicting, moves)


def host_move_seconds(dec: DynamicEmbeddingCollection) -> dict[str, float]:
    """The seconds the host's cores spent in each kind of native move so far (the caches'
    :meth:`~shared.hashtable.row_cache_static.StaticCacheLines.host_move_spent`, summed over
    the storages; none without a host-node fill or write-backs by cores)."""
    out: dict[str, float] = {}
    for storage in dec._storages:
        spent = getattr(storage.payload, "host_move_spent", None)
        for name, (seconds, _) in (spent() if spent is not None else {}).items():
            out[name] = out.get(name, 0.0) + seconds
    return out


def filling(seconds: list[float], evicting: list[bool]) -> dict[str, Any]:
    """``evicting_steps``: how many timed steps evicted a line; where only some did (the cache
    filled up during the timed steps: not yet the steady state, whose steps write victims
    back), also ``step_ms_median_evicting``, the median of those that did (on an H100,
    2026-12-07, 60 warm-up steps at item 1's 10 % cache timed 8.0 ms steps before and 10.5 ms
    after the lines were full)."""
    out: dict[str, Any] = {"evicting_steps": sum(evicting)}
    if 0 < sum(evicting) < len(evicting):
        kept = [t for t, e in zip(seconds, evicting, strict=True) if e]
        out["step_ms_median_evicting"] = statistics.median(kept) * 1e3
    return out


def host_rows(per_step: dict[str, float]) -> dict[str, float]:
    """Host tier rows a step from the counters a step: ``read`` = misses + bypassed (a resolve
    reads the rows it bypasses), ``written`` = write-backs + bypassed (the backward writes a
    bypassed row back). Exact for the static step and stored keys (its backward reuses the
    forward's slots); an upper bound on ``written`` for the eager step, which counts a row
    bypassed by its lookup and again by its backward, which alone writes it."""
    bypassed = per_step.get("bypassed", 0.0)
    return {
        "read": per_step.get("misses", 0.0) + bypassed,
        "written": per_step.get("writebacks", 0.0) + bypassed,
    }


def log_line(dim: int, r: int, name: str, res: dict[str, Any], static: bool) -> str:
    """A variant's line in the log: its step ms and, for a cache, the hit rate and host rows
    a step (:func:`host_rows`; ``<=`` where ``written`` is an upper bound)."""
    line = f"dim {dim} round {r} {name}: {res['step_ms_median']:.2f} ms"
    if "per_step" not in res:
        return line
    c, rows = res["per_step"], res["host_rows"]
    at_most = "" if static else "<= "
    line = (
        f"{line}, hit rate {res['hit_rate']:.3f}, host rows a step: read {rows['read']:.0f} "
        f"(misses {c['misses']:.0f} + bypassed {c['bypassed']:.0f}), written {at_most}"
        f"{rows['written']:.0f} (write-backs {c['writebacks']:.0f} + bypassed "
        f"{c['bypassed']:.0f}), evictions {c['evictions']:.0f}"
    )
    if "host_move_ms_median" in res:
        cores = ", ".join(f"{k} {v:.2f} ms" for k, v in res["host_move_ms_median"].items())
        line += f"; the host's cores a step: {cores}"
    if "step_ms_median_evicting" in res:
        line += (
            f"; only {res['evicting_steps']} of {len(res['step_ms'])} timed steps evicted (the "
            f"cache filled during them; those {res['step_ms_median_evicting']:.2f} ms): raise "
            "--warmup for the steady state"
        )
    return line


@dataclass(frozen=True)
class StepPath:
    """How every variant's step runs: the static sparse step (``static``; captured on CUDA;
    with ``prefetch``, its prefetch of the next batch on), and for a cache the fill through a
    host node (``host_node``: ``StaticCacheLines.fill_with_host_node`` on ``threads`` host
    threads; None: the process's cores) or its write-backs staged and written beside the step
    (``write_back_rows``: ``StaticCacheLines.write_back_beside``, that many staging rows;
    ``write_back_cores``: written by that many host threads, else by the device)."""

    static: bool = False
    host_node: bool = False
    threads: int | None = None
    prefetch: bool = False
    write_back_rows: int | None = None
    write_back_cores: int | None = None

    @classmethod
    def of(cls, args: Any) -> StepPath:
        return cls(args.static, args.host_node, args.host_node_threads, args.prefetch,
                   args.write_back_beside, args.write_back_cores)  # fmt: skip

    def apply(self, dec: DynamicEmbeddingCollection) -> None:
        if self.static:
            dec.use_static_step(capture=dec.device.type == "cuda", prefetch=self.prefetch)
        for storage in dec._storages:
            cache = storage.payload  # a CACHING storage's (HBM_ONLY has no fill)
            if self.host_node and hasattr(cache, "fill_with_host_node"):
                cache.fill_with_host_node(self.threads)
            if self.write_back_rows is not None and hasattr(cache, "write_back_beside"):
                cache.write_back_beside(self.write_back_rows, self.write_back_cores)


def run_variant(
    dim: int, slots: int, factor: float | None, keys: torch.Tensor, batches: list[torch.Tensor],
    grad: torch.Tensor, probe: torch.Tensor, warmup: int, path: StepPath,
) -> tuple[dict[str, Any], torch.Tensor]:  # fmt: skip
    device = keys.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    dec = build(dim, slots, factor, keys)
    path.apply(dec)
    _sync(device)
    build_s = time.perf_counter() - t0
    steps = time_steps(dec, batches, grad, warmup, path.prefetch)
    times = steps.seconds
    after = dec.tier_stats()[TABLE]
    dec.eval()
    probed = dec({TABLE: probe})[TABLE].detach().cpu()
    result: dict[str, Any] = {
        "step_ms_median": statistics.median(times) * 1e3,
        "step_ms": [round(x * 1e3, 3) for x in times],
        "build_s": round(build_s, 2),
        "bytes": {
            "device_index": index_bytes(dec),
            "device_payload": int(after["hbm_payload_bytes"]),
            "host_payload": int(after.get("host_payload_bytes", 0)),
        },
    }
    if path.static:
        result["static_runs"] = dec.static_stats()[TABLE]
    if factor is not None:
        result["cache_load_factor"] = factor
        result["cache_lines"] = int(after["cache_lines"])
        result["hit_rate"] = steps.hit_rate
        result["per_step"] = steps.per_step
        result["host_rows"] = host_rows(steps.per_step)
        result.update(filling(times, steps.evicting))
        if steps.host_moves:  # the cores' time a step (median), beside the step's
            result["host_move_ms_median"] = {
                name: statistics.median(ms) for name, ms in steps.host_moves.items()
            }
    if device.type == "cuda":
        result["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    del dec
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result, probed


@dataclass
class Workload:
    """One dim's table and batches (the same for every variant; :func:`workload` remakes them
    from the seed)."""

    rows: int
    slots: int
    keys: torch.Tensor  # [rows] rank -> key
    batches: list[torch.Tensor]  # warmup + steps batches of lookups keys
    grad: torch.Tensor  # [lookups, dim] the backward's gradient
    probe: torch.Tensor  # keys whose rows are compared with the baseline's after the run


def workload(args: Any, dim: int, device: torch.device) -> Workload:
    rows = args.rows_128 if dim > 64 and args.rows_128 else args.rows
    gen = torch.Generator(device=device).manual_seed(args.seed)
    keys = torch.randperm(rows, device=device, generator=gen)  # rank -> key
    batches = [
        keys[zipf_ranks(rows, args.alpha, args.lookups, gen)]
        for _ in range(args.warmup + args.steps)
    ]
    grad = torch.randn(args.lookups, dim, device=device, generator=gen) * 1e-3
    return Workload(rows, math.ceil(rows / LOAD), keys, batches, grad, batches[-1][:4096])


def factor_of(pct: float | None, w: Workload) -> float | None:
    """A variant's ``cache_load_factor``: ``pct`` of the rows over the table's slots."""
    return None if pct is None else min(1.0, pct * w.rows / w.slots)


def run_dim(args: Any, dim: int, device: torch.device) -> dict[str, Any]:
    w = workload(args, dim, device)
    rows, slots, keys, batches, grad, probe = w.rows, w.slots, w.keys, w.batches, w.grad, w.probe
    distinct = statistics.median(int(torch.unique(b).numel()) for b in batches)
    out: dict[str, Any] = {"rows": rows, "slots": slots, "distinct_keys_a_step": distinct}
    base_probe = None
    per_round: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):  # the variants in turn, each round: drift hits them alike
        for name, pct in VARIANTS.items():
            factor = factor_of(pct, w)
            res, probed = run_variant(
                dim,
                slots,
                factor,
                keys,
                batches,
                grad,
                probe,
                args.warmup,
                StepPath.of(args),
            )
            per_round[name].append(res["step_ms_median"])
            if base_probe is None:
                base_probe = probed
            elif name != "hbm_only":
                res["equal_to_hbm_only"] = bool(torch.equal(probed, base_probe))
                res["max_abs_diff_to_hbm_only"] = float((probed - base_probe).abs().max())
            if r == 0:
                out[name] = res  # its counters, bytes and hit rate: the first round's
            else:
                out[name]["step_ms"] += res["step_ms"]
                if "equal_to_hbm_only" in res:
                    out[name]["equal_to_hbm_only"] &= res["equal_to_hbm_only"]
            print(log_line(dim, r, name, res, args.static), file=sys.stderr, flush=True)
    for name in VARIANTS:
        v = out[name]
        v["step_ms_median"] = statistics.median(v["step_ms"])
        v["round_medians_ms"] = [round(x, 3) for x in per_round[name]]
        # the median over rounds of this round's ratio (both measured in the same round)
        v["ratio_to_hbm_only"] = statistics.median(
            x / b for x, b in zip(per_round[name], per_round["hbm_only"], strict=True)
        )
    return out


def run(args: Any) -> dict[str, Any]:
    check_device(args.device)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    result: dict[str, Any] = {
        "what": "embedding step (training lookup + sparse Adagrad backward), CACHING vs HBM_ONLY",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "alpha": args.alpha,
        "lookups": args.lookups,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "static": args.static,
        "host_node": args.host_node,
        "host_node_threads": args.host_node_threads,
        "prefetch": args.prefetch,
        "write_back_beside": args.write_back_beside,
        "write_back_cores": args.write_back_cores,
        "host_memory": args.host_memory,
        "load": LOAD,
        "dims": {},
    }
    for dim in args.dims:
        result["dims"][str(dim)] = run_dim(args, dim, device)
        write_result(args.out, result)  # each dim as it ends: a run cut short keeps the others
    if args.profile:  # after every timed step: a profiler slows later launches in its process
        sections: list[str] = []
        for dim in args.dims:
            for name, (figures, text) in profile_dim(args, dim, device).items():
                result["dims"][str(dim)][name]["profile"] = figures
                sections.append(f"{'=' * 24} dim {dim} {name} {'=' * 24}\n{text.rstrip()}\n")
            profiles_path(args.out).write_text("\n".join(sections))  # each dim as it ends
            write_result(args.out, result)
    return result


def profiles_path(out: Path) -> Path:
    """Where ``--profile`` writes every variant's tables, a section each: beside the JSON."""
    return out.with_name(f"{out.stem}.profiles.txt")


def profile_dim(args: Any, dim: int, device: torch.device) -> dict[str, tuple[dict[str, Any], str]]:
    """Each variant of ``dim`` built again, warmed by the same ``--warmup`` steps as its timed
    run (the cache as warm, the same padded sizes captured), then ``--profile`` steps on the
    next batches under torch.profiler (:func:`bench.step_profile.profile_steps`): per variant
    (figures a step, text tables)."""
    w = workload(args, dim, device)
    out: dict[str, tuple[dict[str, Any], str]] = {}
    for name, pct in VARIANTS.items():
        dec = build(dim, w.slots, factor_of(pct, w), w.keys)
        StepPath.of(args).apply(dec)
        for i in range(args.warmup):
            _step(dec, i, w.batches[i], w.grad)
        _sync(device)

        def step(i: int, dec: DynamicEmbeddingCollection = dec) -> None:
            at = args.warmup + i % args.steps
            _step(dec, at, w.batches[at], w.grad, _upcoming(w.batches, at, args.prefetch))

        out[name] = profile_steps(step, args.profile, device)
        print(f"dim {dim} {name}: profiled {out[name][0]}", file=sys.stderr, flush=True)
        del dec
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _upcoming(batches: list[torch.Tensor], i: int, prefetch: bool) -> torch.Tensor | None:
    """The batch after ``i``, whose rows step ``i`` prefetches (with ``prefetch``; none after
    the last)."""
    return batches[i + 1] if prefetch and i + 1 < len(batches) else None


def _step(
    dec: DynamicEmbeddingCollection,
    i: int,
    batch: torch.Tensor,
    grad: torch.Tensor,
    upcoming: torch.Tensor | None = None,
) -> None:
    """The embedding step of batch ``i``: its training lookup and the backward of ``grad``,
    then the prefetch of the ``upcoming`` batch's rows where given (the trainer's order)."""
    dec.set_step(i + 1)
    out = dec({TABLE: batch})[TABLE]  # [lookups, dim]
    out.backward(grad)
    if upcoming is not None:
        with dec.prefetch_stream():
            dec.prefetch({TABLE: upcoming})


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_tiers", description=plain(__doc__), epilog=EXAMPLE)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--rows", type=int, default=200_000, help="keys in the table")
    p.add_argument("--rows-128", type=int, default=0, help="keys for dims > 64 (0: --rows)")
    p.add_argument("--dims", type=int, nargs="+", default=[16, 128], help="embedding dims")
    p.add_argument("--lookups", type=int, default=20_000, help="keys a step looks up")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the keys")
    p.add_argument("--steps", type=int, default=15, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first (warm the cache)")
    p.add_argument("--rounds", type=int, default=1, help="times every variant is run, in turn")
    p.add_argument("--seed", type=int, default=0, help="keys, batches and gradients")
    p.add_argument(
        "--static", action="store_true", help="the static sparse step (CUDA graphs on CUDA)"
    )
    p.add_argument(
        "--host-node",
        action="store_true",
        help="with --static on CUDA: the caches' fill moves rows with the host's cores, as a host "
        "node of the step's graph (shared.hashtable.host_node_fill), not the device's reads",
    )
    p.add_argument(
        "--host-node-threads", type=int, default=None, metavar="N",
        help="with --host-node: the host threads that move the rows (default: the process's "
        "cores; the thread waiting on the device and the driver's need cores too)",
    )  # fmt: skip
    p.add_argument(
        "--prefetch",
        action="store_true",
        help="each step then prefetches the next batch's rows (with --static on CUDA: on a side "
        "stream, beside the backward)",
    )
    p.add_argument(
        "--write-back-beside", type=int, default=None, metavar="ROWS",
        help="with --static: the caches' fill stages up to ROWS dirty victims a step and they "
        "are written to the host tier after the forward, on a stream of their own "
        "(shared.hashtable.write_back_beside), not by the fill",
    )  # fmt: skip
    p.add_argument(
        "--write-back-cores", type=int, default=None, metavar="N",
        help="with --write-back-beside: N host threads write the staged rows into the host "
        "tier (a host function on the flush's stream), not the device's scatter",
    )  # fmt: skip
    p.add_argument(
        "--host-memory", choices=host_memory.KINDS, default="register",
        help="how the caches' host tiers are made on CUDA (shared.hashtable.host_memory): "
        "page-locked by cudaHostRegister, or the CUDA driver's cuMemCreate host memory",
    )  # fmt: skip
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="after the timed runs, profile STEPS steps of each variant (0: none)",
    )
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.host_node and not (args.static and args.device.startswith("cuda")):
        raise ValueError(
            "bench_tiers: --host-node is the static step's fill on CUDA: give it with --static "
            "and --device cuda"
        )
    host_memory.refuse_off_cuda(args.host_memory, args.device, "bench_tiers")
    if args.write_back_beside is not None and not args.static:
        raise ValueError(
            f"bench_tiers: --write-back-beside {args.write_back_beside} stages the static "
            "step's write-backs: give it with --static"
        )
    if args.write_back_cores is not None and (
        args.write_back_beside is None or args.write_back_cores < 1
    ):
        raise ValueError(
            f"bench_tiers: --write-back-cores {args.write_back_cores} is the host threads that "
            "write --write-back-beside's staged rows: give it with --write-back-beside, >= 1"
        )
    if args.host_node_threads is not None and (not args.host_node or args.host_node_threads < 1):
        raise ValueError(
            f"bench_tiers: --host-node-threads {args.host_node_threads}: give a count >= 1, "
            "with --host-node"
        )
    with host_memory.using(args.host_memory):
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
