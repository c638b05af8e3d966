"""Training throughput of the shipped configs side by side, one run: the seed (dynamic) config,
the all-num_buckets config and the cold-ids config (or any list of configs).

First ``loader``: the Parquet loader alone (:func:`bench.bench_loader.measure`, batches pinned
and copied to the device, no model) at ``--num-workers`` and at one worker per core, at the
first config's batch size. Then for each config of ``--configs`` (default: the seed config
``dynamic`` and the all-num_buckets baseline ``buckets``; ``cold``: the cold-ids config;
``cached``: the seed config with ``cache_load_factor`` 0.1 on every dynamic table, derived at
run time by :mod:`bench.train_cached`; ``cached_prefetch``: the same trained with the static
prefetch, ``--static-prefetch``), on the same samples and device, each at its own
config's ``data_config.batch_size`` unless ``--batch`` sets one for all (batch size is the
user's: issue #53):

- ``step``: the training step on batches already on the device
  (:func:`bench.profile_train.profile_model`, the dense EMA included where the config has
  one): median step ms as the trainer runs it, phases, host syncs per step, GPU launches per
  step (by phase) and the GPU-busy fraction;
- ``end_to_end``: the trainer's own loop (:class:`train.trainer.Trainer`: the Parquet loader
  with ``--num-workers`` workers, the device prefetch, CUDA graphs on CUDA) over one epoch, or
  ``--e2e-max-steps`` steps: samples/s, seconds, and the eval AUC (overall, head, tail) after it
  (the trainer's final eval over the eval split, as ``python -m train train`` reports it); with
  a CACHING storage, ``row_cache``: its hit rate and misses a training step;
  ``samples_per_s_median_window``: the median of the trainer's log windows after the first, the
  steady rate without the start-up (loader start, graph captures, kernel compilation);
- ``step_warm``: the ``step`` figures again on the model the end-to-end run trained, its hash
  tables full after the epoch (new keys evict, the admission counter is full): the steady state
  of most of an epoch, which the first steps of a fresh model (``step``) do not reach;

Each config's ``end_to_end`` + ``step_warm`` and its ``step`` run in child processes of their
own (``--child``), so that no timed step or end-to-end run follows a torch.profiler in its
process: a profiler leaves overhead on every later launch there (on the H200, 2026-12-02: +20 %
to +26 % a step; ``step_ms_median_after_profiles`` beside ``step_ms_median`` shows it). Then
``summary`` (per config: batch, end-to-end samples/s, step ms, launches and syncs a step, GPU
busy), the ratios between the configs, the goals of issue #18 (end-to-end samples/s of the seed
config, its step against the baseline's, GPU busy: of ``step_warm`` where it ran, else of
``step``) and, with ``cold`` beside ``dynamic``, those of issue #53 (``cold_over_dynamic``:
the cold-ids config's end-to-end samples/s at least 1.3M and 0.8x the seed config's, 0 syncs
a step); with ``cached`` beside ``dynamic``, those of issue #52's item 2 (``cached_over_dynamic``:
end-to-end samples/s at least 0.85x the seed config's, eval AUC within 0.001 of it; and
``cached_prefetch_over_dynamic`` likewise).
``--e2e-rounds N`` runs ``end_to_end`` N times a config, all configs in turn each round (A B
A B: a host that slows down or speeds up during the run, as on the H100 on 2026-12-08, falls on
both): ``end_to_end_rounds`` keeps each round's samples/s and AUC (the later rounds' own
``step_warm`` is not kept), the summary's samples/s is their median, and each ratio the median
of the rounds' ratios (``*_rounds`` beside it).
``--padded-steps N`` also times the seed config's step with tzrec's padded DIN (pad to 100) for N
steps, as a reference.

    python -m bench.bench_train --size small --out out/bench_train.json
    python -m bench.bench_train --size full --device cuda --num-workers 12 --out $OUT/bench_train.json
    python -m bench.bench_train --samples /tmp/full/samples --configs dynamic,buckets,cold \
        --device cuda --out $OUT/bench_train_configs.json
    python -m bench.bench_train --size small --configs dynamic,cached --out out/bench_cached.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from bench.bench_loader import measure as measure_loader
from bench.goals import check
from bench.profile_train import batches_needed, device_batches, profile_model
from bench.py_spy import by_thread, find_py_spy, record_stacks
from bench.train_cached import (
    CacheCountingTrainer,
    cache_figures,
    cached_config,
    cached_ratios,
    e2e_ratio,
)
from shared.cli import Parser, plain, run_cli, write_result
from shared.cli import exit_code as _exit_code
from shared.config import load_config
from shared.features import build_feature_set
from shared.hashtable import host_memory
from train.data.loader import MESSAGE_ROWS, Loader
from train.data.synthetic import SIZES
from train.dense_ema import DenseEMA
from train.model.din import PaddedDIN
from train.model.multi_tower_din import MultiTowerDIN
from train.trainer import Trainer, TrainOptions, build_optimizers, cuda_graphs_for, train_step

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "dynamic": ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config",
    "buckets": ROOT / "configs" / "multi_tower_din_taobao.config",
    "cold": ROOT / "configs" / "multi_tower_din_taobao_dynamicemb_cold_ids.config",
}
# known names of configs derived at run time from one of CONFIGS (written beside --out)
DERIVED: dict[str, tuple[str, Callable[[Path, Path], Path]]] = {
    "cached": ("dynamic", cached_config),  # the seed config, cache_load_factor 0.1 everywhere
    "cached_prefetch": ("dynamic", cached_config),  # the same, trained with --static-prefetch
}
# names of configs trained with the static prefetch whatever --static-prefetch says (issue #52:
# the cached config with and without it in one run, against the seed config)
PREFETCHED = {"cached_prefetch"}


def prefetches(name: str, args: Any) -> bool:
    """Whether config ``name`` trains with the static prefetch (``--static-prefetch``, or a
    name of :data:`PREFETCHED`)."""
    return bool(args.static_prefetch) or name in PREFETCHED


GOALS = {  # issue #18
    "end_to_end_samples_per_s": 1.5e6,  # the seed config, one epoch of full data
    "dynamic_step_over_buckets": 1.15,
    "device_busy_fraction": 0.6,
}
COLD_GOALS = {  # issue #53: the cold-ids config against the seed config, same run
    "end_to_end_samples_per_s": 1.3e6,
    "end_to_end_over_dynamic": 0.8,
    "syncs_per_step": 0,
}
PY_SPY_RATE = 200  # samples per second of --py-spy-s
# what each child process measures (in_child), in this order: e2e first, the fresh step after
CHILD_PARTS = ("e2e", "step")
EXAMPLE = """examples:
  python -m bench.bench_train --size small --out out/bench_train.json
  python -m bench.bench_train --size full --device cuda --num-workers 12 --out out/train.json"""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batch_size(config_path: Path, args) -> int:
    """The rows of a training batch of ``config_path``: ``--batch``, else the config's own
    ``data_config.batch_size``."""
    return int(args.batch or load_config(config_path).data_config.batch_size)


def loader_figures(samples: Path, config_path: Path, args, device: torch.device) -> list[dict]:
    """The loader alone at ``--num-workers`` and at one worker per core (epoch 0, shuffled),
    at ``config_path``'s batch size (:func:`batch_size`)."""
    fs = build_feature_set(load_config(config_path))
    batch = batch_size(config_path, args)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    timing = SimpleNamespace(warmup=10, window=20, windows=5, copy="one")
    out = []
    for workers in sorted({args.num_workers, cores or 1}):
        loader = Loader(samples / "train", fs, batch_size=batch, num_workers=workers,
                        shuffle=True, seed=0, drop_last=True, message_rows=args.message_rows,
                        pin_memory=device.type == "cuda")  # fmt: skip
        out.append(measure_loader(loader, timing, device))
    return out


def step_figures(config_path: Path, batches, args, device: torch.device) -> dict[str, Any]:
    """:func:`profile_model` of a fresh model of ``config_path`` (graphs and dense EMA as the
    trainer)."""
    config = load_config(config_path)
    model = MultiTowerDIN.from_config(config, build_feature_set(config), device=device, seed=0)
    optimizers = build_optimizers(model, config.train_config)
    graphs = (
        cuda_graphs_for(
            model, static_prefetch=args.static_prefetch, cache_row_threads=args.cache_row_threads
        )  # fmt: skip
        if device.type == "cuda"
        else None
    )
    ema = DenseEMA.of_config(model.dense, config.train_config)
    found, _ = profile_model(model, optimizers, batches, warmup=args.warmup, steps=args.steps,
                             graphs=graphs, ema=ema)  # fmt: skip
    if graphs is not None:
        found["cuda_graphs"] = dict(graphs.stats)
        found["sparse_graphs"] = model.sparse.dynamic.static_stats()
    return found


def padded_step_ms(config_path: Path, batches, steps: int, device: torch.device) -> float:
    """Median step ms of ``config_path`` with tzrec's padded DIN (pad to 100), eagerly."""
    config = load_config(config_path)
    model = MultiTowerDIN.from_config(config, build_feature_set(config), device=device, seed=0)
    ref = PaddedDIN(model.dense.din.dim, model.dense.config.attn, max_length=100).to(device)
    ref.load_state_dict(model.dense.din.state_dict())
    model.dense.din = ref
    optimizers = build_optimizers(model, config.train_config)
    model.train()
    times = []
    for i, batch in enumerate(batches[: steps + 2]):
        _sync(device)
        t0 = time.perf_counter()
        train_step(model, optimizers, batch, i)
        _sync(device)
        if i >= 2:  # two warm-up steps
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def end_to_end(
    config_path: Path, samples: Path, args, device: torch.device
) -> tuple[dict[str, Any], Trainer]:
    """The trainer's loop over one epoch (or ``--e2e-max-steps``), then its final eval; and the
    trainer, its model trained (:func:`warm_step_figures`)."""
    with tempfile.TemporaryDirectory(prefix="bench_train_run_") as model_dir:
        t0 = time.perf_counter()
        trainer = CacheCountingTrainer(
            TrainOptions(
                config_path=config_path, model_dir=Path(model_dir), train_path=samples / "train",
                eval_path=samples / "eval", device=str(device),
                batch_size=batch_size(config_path, args),
                num_workers=args.num_workers, message_rows=args.message_rows,
                max_steps=args.e2e_max_steps,
                eval_max_batches=args.eval_max_batches, progress_bar=False,
                static_prefetch=args.static_prefetch, host_memory=args.host_memory,
                cache_row_threads=args.cache_row_threads,
            )
        )  # fmt: skip
        setup = time.perf_counter() - t0  # the model, its kernels, the loader's start
        result = trainer.fit()
    backends = {s.backend for s in trainer.model.sparse.dynamic._storages}
    paths = {k: v for b in backends for k, v in getattr(b, "paths", {}).items()}
    ev = result.final_eval
    loop = result.loop_times.seconds
    stepping = result.train_seconds - loop["checkpoint"] - loop["eval"]
    records = [r for r in result.history if r.get("kind") == "train"]
    summary = next((r for r in result.history if r.get("kind") == "summary"), {})
    figures = {
        "samples_per_s": result.samples_per_second,
        "train_seconds": result.train_seconds,
        # the Trainer's construction before it (the loader's workers start there, beside the
        # model's build): what a user waits for before the loop, not part of train_seconds
        "setup_seconds": setup,
        # the loop without its checkpoints (save_checkpoints_steps) and evaluations
        "samples_per_s_without_checkpoints": result.progress.samples / max(stepping, 1e-9),
        "loop_seconds": loop,
        "steps": result.progress.step,
        "samples": result.progress.samples,
        "num_workers": trainer.num_workers,
        # the trainer's log windows: does the step slow down as the tables fill?
        "windows": [
            {"step": r["step"], "samples_per_s": r["samples_per_s"]}
            | {k: r[k] for k in r if k.endswith("_seconds")}
            for r in records
        ],
        # the steady rate, without the first window's start-up (loader start, graph captures,
        # kernel compilation) that the end-to-end figure includes
        "samples_per_s_median_window": statistics.median(
            r["samples_per_s"] for r in records[1:] or records
        )
        if records
        else None,
        "tables": summary.get("tables"),
        # captures and replays of the dense graphs and of the sparse step
        "cuda_graphs": summary.get("cuda_graphs"),
        "sparse_graphs": summary.get("sparse_graphs"),
        "hash_table_paths": paths,  # CudaBackend: which insert/erase paths ran, how often
        "eval": ev.to_dict() if ev is not None else None,
        # CACHING storages: hit rate and misses a step of the training steps (none: {})
        "row_cache": cache_figures(trainer, result.progress.step),
    }
    return figures, trainer


def warm_step_figures(trainer: Trainer, batches, args, name: str) -> dict[str, Any]:
    """:func:`profile_model` of the model ``trainer`` trained, with its optimizers and graphs;
    the profile's tables (top operators and kernels by device time) go beside ``--out``, as
    ``<out>.<name>_warm.txt``."""
    found, text = profile_model(trainer.model, trainer.optimizers, batches, warmup=args.warmup,
                                steps=args.steps, graphs=trainer.graphs,
                                ema=trainer.dense_ema)  # fmt: skip
    tables = args.out.with_name(f"{args.out.stem}.{name}_warm.txt")
    tables.parent.mkdir(parents=True, exist_ok=True)
    tmp = tables.with_name(tables.name + ".tmp")
    tmp.write_text("\n".join(text) + "\n")
    tmp.replace(tables)
    return found


def _step(entry: dict[str, Any]) -> dict[str, Any]:
    """The step figures the goals use: on full tables (``step_warm``) where they were made."""
    return entry.get("step_warm") or entry["step"]


def summary(configs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per config, the figures the configs are compared by: batch, end-to-end samples/s (and
    its median log window), step ms, launches and syncs a step and GPU busy (of
    ``step_warm`` where it ran, else of ``step``), the end-to-end run's eval AUC, head
    and tail, and its row cache's hit rate and misses a training step (CACHING storages, all
    of them together; None without one)."""
    out = {}
    for name, entry in configs.items():
        step = _step(entry)
        e2e = entry.get("end_to_end", {})
        profile = step.get("profile", {})
        out[name] = {
            "batch": entry.get("batch"),
            "end_to_end_samples_per_s": _e2e_rate(entry),
            "end_to_end_rounds": len(entry.get("end_to_end_rounds") or ([e2e] if e2e else [])),
            "samples_per_s_median_window": e2e.get("samples_per_s_median_window"),
            "step_ms": step.get("step_ms_median"),
            "step_samples_per_s": entry["batch"] / step["step_ms_median"] * 1e3
            if entry.get("batch") and step.get("step_ms_median")
            else None,
            "launches_per_step": profile.get("launches_per_step"),
            "syncs_per_step": step.get("syncs_per_step"),
            "device_busy_fraction": profile.get("device_busy_fraction"),
            **{k: (e2e.get("eval") or {}).get(k) for k in ("auc", "head_auc", "tail_auc")},
            **_cache_summary(e2e.get("row_cache") or {}, e2e.get("steps")),
        }
    return out


def _e2e_rate(entry: dict[str, Any]) -> float | None:
    """A config's end-to-end samples/s: the median of its rounds (``--e2e-rounds``), else its
    one run's (None: no end-to-end run)."""
    rounds = entry.get("end_to_end_rounds")
    if rounds:
        return float(statistics.median(r["samples_per_s"] for r in rounds))
    return entry.get("end_to_end", {}).get("samples_per_s")


def _round(e2e: dict[str, Any]) -> dict[str, Any]:
    """One end-to-end round's figures (``end_to_end_rounds``)."""
    return {"samples_per_s": e2e["samples_per_s"],
            "samples_per_s_median_window": e2e.get("samples_per_s_median_window"),
            "auc": (e2e.get("eval") or {}).get("auc")}  # fmt: skip


def _cache_summary(caches: dict[str, dict[str, Any]], steps: int | None) -> dict[str, Any]:
    """The training steps' hit rate and misses a step over every CACHING storage of
    ``caches`` (:func:`bench.train_cached.cache_figures`; none: both None)."""
    if not caches:
        return {"cache_hit_rate": None, "cache_misses_per_step": None}
    total = {k: sum(c["train"][k] for c in caches.values())
             for k in ("cache_hits", "cache_misses", "cache_bypassed")}  # fmt: skip
    used = sum(total.values())
    return {
        "cache_hit_rate": total["cache_hits"] / used if used else None,
        "cache_misses_per_step": total["cache_misses"] / steps if steps else None,
    }


def summary_lines(result: dict[str, Any]) -> list[str]:
    """One line per config of ``result["summary"]``, then the cold/dynamic and cached/dynamic
    ratios."""

    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = []
    for name, s in result.get("summary", {}).items():
        lines.append(
            f"{name}: batch {s['batch']}, end to end {num(s['end_to_end_samples_per_s'], ',.0f')}"
            f" samples/s (median window {num(s['samples_per_s_median_window'], ',.0f')}), "
            f"step {num(s['step_ms'], '.2f')} ms, {num(s['launches_per_step'], '.0f')} "
            f"launches and {num(s['syncs_per_step'], 'd')} syncs a step, GPU busy "
            f"{num(s['device_busy_fraction'], '.2f')}, eval AUC {num(s['auc'], '.4f')}"
            + (
                f", cache hit rate {s['cache_hit_rate']:.3f}, "
                f"{num(s['cache_misses_per_step'], ',.0f')} misses a step"
                if s.get("cache_hit_rate") is not None
                else ""
            )
        )
    for name in ("cold", "cached", "cached_prefetch"):
        if result.get(f"{name}_over_dynamic"):
            lines.append(f"{name}/dynamic: " + json.dumps(result[f"{name}_over_dynamic"]))
    return lines


def ratios(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The comparisons and goals of the module docstring (where both configs ran)."""
    out: dict[str, Any] = {}
    cold = configs.get("cold")
    if cold and configs.get("dynamic"):
        out["cold_over_dynamic"] = cold_ratios(cold, configs["dynamic"])
    for name in ("cached", "cached_prefetch"):
        cached = configs.get(name)
        if cached and configs.get("dynamic"):
            step_ms = _step(cached)["step_ms_median"] / _step(configs["dynamic"])["step_ms_median"]
            out[f"{name}_over_dynamic"] = cached_ratios(cached, configs["dynamic"], step_ms)
    dyn, base = configs.get("dynamic"), configs.get("buckets")
    if dyn and base:
        out["dynamic_step_over_buckets"] = (
            _step(dyn)["step_ms_median"] / _step(base)["step_ms_median"]
        )
        if "end_to_end" in dyn and "end_to_end" in base:
            out["buckets_e2e_over_dynamic"] = e2e_ratio(base, dyn)[0]
    if dyn:
        busy = _step(dyn).get("profile", {}).get("device_busy_fraction")
        got = {
            "end_to_end_samples_per_s": _e2e_rate(dyn),
            "dynamic_step_over_buckets": out.get("dynamic_step_over_buckets"),
            "device_busy_fraction": busy,
        }
        out["goals"] = {
            k: check(got[k], g, at_most=k == "dynamic_step_over_buckets") for k, g in GOALS.items()
        }
    return out


def cold_ratios(cold: dict[str, Any], dyn: dict[str, Any]) -> dict[str, Any]:
    """The cold-ids config against the seed config of the same run (issue #53): end-to-end
    samples/s, step ms and samples/s of the step (each at its own batch), and the goals of
    :data:`COLD_GOALS`."""
    out: dict[str, Any] = {}
    rate, rounds = e2e_ratio(cold, dyn)
    if rate is not None:
        out["end_to_end_samples_per_s"] = rate
    if rounds is not None:
        out["end_to_end_samples_per_s_rounds"] = rounds
    cs, ds = _step(cold), _step(dyn)
    out["step_ms"] = cs["step_ms_median"] / ds["step_ms_median"]
    out["step_samples_per_s"] = (cold["batch"] / cs["step_ms_median"]) / (
        dyn["batch"] / ds["step_ms_median"]
    )
    got = {
        "end_to_end_samples_per_s": _e2e_rate(cold),
        "end_to_end_over_dynamic": out.get("end_to_end_samples_per_s"),
        "syncs_per_step": cs.get("syncs_per_step"),
    }
    out["goals"] = {
        k: check(got[k], g, at_most=k == "syncs_per_step") for k, g in COLD_GOALS.items()
    }
    return out


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_train", description=plain(__doc__), epilog=EXAMPLE)
    p.add_argument("--configs", default="dynamic,buckets",
                   help=f"comma-separated NAME or NAME=PATH (known: {', '.join([*CONFIGS, *DERIVED])})")  # fmt: skip
    p.add_argument("--samples", type=Path, help="samples dir with train/ and eval/; default: "
                   "generate --size into a temp dir")  # fmt: skip
    p.add_argument("--size", default="small", choices=list(SIZES),
                   help="synthetic data size to generate when --samples is not given")  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device to train on (default: cuda if this machine has one)")  # fmt: skip
    p.add_argument("--batch", type=int, default=None,
                   help="rows per training batch of every config (default: each config's own "
                   "data_config.batch_size)")  # fmt: skip
    p.add_argument("--steps", type=int, default=10, help="timed steps per step measurement")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    p.add_argument("--padded-steps", type=int, default=0,
                   help="also time the seed config with the padded DIN for N steps (0: skip)")  # fmt: skip
    p.add_argument("--num-workers", type=int, default=8, help="loader workers of end_to_end")
    p.add_argument("--message-rows", type=int, default=MESSAGE_ROWS,
                   help="rows a loader worker sends at once (default %(default)s; more: less "
                   "main-process CPU a batch, more shared memory in flight)")  # fmt: skip
    p.add_argument("--e2e-max-steps", type=int, default=None,
                   help="end_to_end: stop after N steps (default: one epoch)")  # fmt: skip
    p.add_argument("--eval-max-batches", type=int, default=None,
                   help="end_to_end: evaluate at most N batches (default: the eval set)")  # fmt: skip
    p.add_argument("--no-end-to-end", action="store_true", help="skip the end_to_end runs")
    p.add_argument("--e2e-rounds", type=int, default=1, metavar="N",
                   help="end_to_end N times a config, the configs in turn (A B A B: host noise "
                   "falls on both); samples/s and ratios are the rounds' medians")  # fmt: skip
    p.add_argument("--static-prefetch", action="store_true",
                   help="CACHING tables (the cached config) prefetch the next batch's rows beside "
                   "the step (train --static-prefetch)")  # fmt: skip
    p.add_argument("--cache-row-threads", type=int, default=None, metavar="N",
                   help="on CUDA, N host threads move cached tables' rows between the tiers "
                   "(train --cache-row-threads; configs without caches: no effect)")  # fmt: skip
    p.add_argument("--host-memory", choices=host_memory.KINDS, default="register",
                   help="on CUDA, how CACHING tables' host tiers are made (train --host-memory)")  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--py-spy-s", type=int, default=0,
                   help="record where each thread of each end_to_end run spends its time (py-spy "
                   "--idle) for N seconds (0: no; py-spy must be installed)")  # fmt: skip
    p.add_argument("--py-spy-after", type=float, default=26.0,
                   help="seconds after the end_to_end process starts to begin --py-spy-s (its imports "
                   "alone took 20 s on the H200 host: torchmetrics imports transformers there)")  # fmt: skip
    p.add_argument("--child", choices=CHILD_PARTS, default=None,
                   help="internal: measure only this part of the one config of --configs "
                   "(what the parent runs in a child process)")  # fmt: skip
    p.add_argument("--child-out", type=Path, default=None,
                   help="internal: where --child writes its figures (JSON)")  # fmt: skip
    return p


def _config_paths(spec: str, out_path: Path) -> dict[str, Path]:
    """``--configs``' names → config paths: NAME=PATH as given, a known name's shipped config,
    or a :data:`DERIVED` name's config written now beside ``out_path`` (``<out>.NAME.config``:
    the run keeps the config it trained)."""
    out = {}
    for item in spec.split(","):
        name, _, path = item.partition("=")
        if path:
            out[name] = Path(path)
        elif name in CONFIGS:
            out[name] = CONFIGS[name]
        elif name in DERIVED:
            base, derive = DERIVED[name]
            out[name] = derive(CONFIGS[base], out_path.with_name(f"{out_path.stem}.{name}.config"))
        else:
            raise SystemExit(
                f"error: --configs: {name!r} is not one of {', '.join([*CONFIGS, *DERIVED])}; "
                "give NAME=PATH for another config"
            )
    return out


def in_child(
    part: str, name: str, path: Path, samples: Path, args, *, spy: bool = True
) -> dict[str, Any]:
    """The figures of ``part`` (:data:`CHILD_PARTS`) of one config, measured by a child process
    of this module (``--child PART``) in which no torch.profiler has run before (see the module
    docstring). With ``--py-spy-s`` (and ``spy``), py-spy records where the wall-clock time of each thread of
    the ``e2e`` child goes, waiting included (``py_spy``; raw stacks beside ``--out``)."""
    with tempfile.TemporaryDirectory(prefix="bench_train_child_") as tmp:
        figures = Path(tmp) / "figures.json"
        cmd = [sys.executable, "-m", "bench.bench_train", "--configs", f"{name}={path}",
               "--samples", str(samples), "--device", args.device,
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--num-workers", str(args.num_workers), "--message-rows", str(args.message_rows),
               "--padded-steps", str(args.padded_steps), "--out", str(args.out),
               "--child", part, "--child-out", str(figures)]  # fmt: skip
        for flag, value in (("--batch", args.batch), ("--e2e-max-steps", args.e2e_max_steps),
                            ("--eval-max-batches", args.eval_max_batches),
                            ("--cache-row-threads", args.cache_row_threads)):  # fmt: skip
            if value is not None:
                cmd += [flag, str(value)]
        if args.static_prefetch:
            cmd.append("--static-prefetch")
        cmd += ["--host-memory", args.host_memory]
        child = subprocess.Popen(cmd, cwd=ROOT)
        spied = _spy(child.pid, name, args) if spy and part == "e2e" and args.py_spy_s > 0 else None
        if child.wait() != 0:
            raise SystemExit(f"error: the {part} run of {name!r} failed (rc {child.returncode})")
        out = json.loads(figures.read_text())
    if spied is not None:
        out["py_spy"] = spied()
    return out


def _spy(pid: int, name: str, args) -> Callable[[], dict[str, Any]]:
    """py-spy on ``pid`` (``--py-spy-s`` from ``--py-spy-after``); returns the call that waits
    for it and gives its figures."""
    py_spy = find_py_spy(None)
    if py_spy is None:
        return lambda: {"error": "py-spy not found (pip install py-spy; bench/run_serving_gpu.sh)"}
    raw = args.out.with_name(f"{args.out.stem}.{name}_pyspy.txt")
    raw.parent.mkdir(parents=True, exist_ok=True)
    spy = record_stacks(py_spy, pid, args.py_spy_s, PY_SPY_RATE, raw, after_s=args.py_spy_after,
                     threads=True, wall=True)  # fmt: skip

    def figures() -> dict[str, Any]:
        _, err = spy.communicate()
        if spy.returncode != 0 or not raw.is_file():
            return {"error": err.decode(errors="replace")[-800:]}
        threads = by_thread(raw.read_text(), PY_SPY_RATE, args.py_spy_s)
        return {"after_s": args.py_spy_after, "seconds": args.py_spy_s, "raw": raw.name,
                "threads": threads}  # fmt: skip

    return figures


def run_child_part(args, device: torch.device) -> int:
    """``--child PART``: one part of the one config of ``--configs``; its figures go to
    ``--child-out``. ``e2e``: the end_to_end run, then ``step_warm`` on the model it trained;
    ``step``: the ``step`` figures of a fresh model (and ``--padded-steps``)."""
    ((name, path),) = _config_paths(args.configs, args.out).items()
    args.static_prefetch = prefetches(name, args)
    host_memory.use(args.host_memory)  # the step part's model too (the trainer sets its own)
    fs = build_feature_set(load_config(path))
    n = batches_needed(args.warmup, args.steps)
    figures: dict[str, Any] = {}
    if args.child == "e2e":
        figures["end_to_end"], trainer = end_to_end(path, args.samples, args, device)
        batches = device_batches(args.samples, fs, batch_size(path, args), n, device)
        figures["step_warm"] = warm_step_figures(trainer, batches, args, name)
    else:
        batches = device_batches(args.samples, fs, batch_size(path, args),
                                 max(n, args.padded_steps + 2), device)  # fmt: skip
        figures["step"] = step_figures(path, batches, args, device)
        if args.padded_steps and name == "dynamic":
            figures["padded_step_ms_median"] = padded_step_ms(
                path, batches, args.padded_steps, device
            )
    write_result(args.child_out, figures, indent=None)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    host_memory.refuse_off_cuda(args.host_memory, args.device, "bench_train")
    if args.cache_row_threads is not None and not args.device.startswith("cuda"):
        raise SystemExit(f"error: --cache-row-threads {args.cache_row_threads}: the host's "
                         "threads move cached rows in the CUDA static step: give --device cuda")  # fmt: skip
    if args.e2e_rounds < 1 or (args.e2e_rounds > 1 and args.no_end_to_end):
        raise SystemExit(f"error: --e2e-rounds {args.e2e_rounds}: rounds of the end_to_end "
                         "runs must be >= 1, and without --no-end-to-end")  # fmt: skip
    device = torch.device(args.device)
    if args.child is not None:
        if args.samples is None or args.child_out is None:
            raise SystemExit("error: --child needs --samples and --child-out")
        return run_child_part(args, device)
    paths = _config_paths(args.configs, args.out)
    samples = args.samples
    tmp = None
    if samples is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench_train_")
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "train.data", "all", "--size", args.size, "--out", tmp.name,
             "--config", str(next(iter(paths.values())))], check=True, cwd=ROOT,
        )  # fmt: skip
        print(f"generated {args.size} in {time.perf_counter() - t0:.1f}s", flush=True)
        samples = Path(tmp.name) / "samples"
    result: dict[str, Any] = {"device": str(device), "torch": torch.__version__,
                              "batch": args.batch or "each config's own",
                              "message_rows": args.message_rows,
                              "static_prefetch": args.static_prefetch,
                              "host_memory": args.host_memory,
                              "cache_row_threads": args.cache_row_threads,
                              "samples": str(samples), "configs": {}}  # fmt: skip
    result["loader"] = loader_figures(samples, next(iter(paths.values())), args, device)
    print(json.dumps({"loader": result["loader"]}), flush=True)
    parts = CHILD_PARTS if not args.no_end_to_end else ("step",)
    for name, path in paths.items():
        entry = result["configs"][name] = {
            "config": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path),
            "batch": batch_size(path, args),
            "static_prefetch": prefetches(name, args),
        }
        for part in parts:
            entry.update(in_child(part, name, path, samples, args))
        print(json.dumps({name: {k: v for k, v in entry["step"].items() if k != "syncs"}}),
              flush=True)  # fmt: skip
        # the configs so far, in case the run is stopped (a device call's time limit)
        write_result(args.out, {**result, "complete": False, "summary": summary(result["configs"])})
    for _ in range(1, args.e2e_rounds):
        for name, path in paths.items():  # the configs in turn again (module doc)
            entry = result["configs"][name]
            # py-spy (--py-spy-s) records the first round only (its raw stacks' file is one)
            again = in_child("e2e", name, path, samples, args, spy=False)["end_to_end"]
            entry.setdefault("end_to_end_rounds", [_round(entry["end_to_end"])])
            entry["end_to_end_rounds"].append(_round(again))
            print(json.dumps({name: {"end_to_end_rounds": entry["end_to_end_rounds"]}}), flush=True)
            write_result(args.out, {**result, "complete": False,
                                    "summary": summary(result["configs"])})  # fmt: skip
    result["complete"] = True
    result["summary"] = summary(result["configs"])
    result.update(ratios(result["configs"]))
    write_result(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "configs"}, indent=2))
    for line in summary_lines(result):
        print(line)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
