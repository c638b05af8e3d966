"""Model quality with and without the cold-id backoff (issue #22), one run.

Trains the seed config (``configs/multi_tower_din_taobao_dynamicemb.config``) twice on the same
samples with the same seed, one epoch each (or ``--max-steps``), with the project's trainer
(:class:`train.trainer.Trainer`: the Parquet loader, CUDA graphs on CUDA, the final eval of
:func:`train.evaluate.evaluate` on the eval split):

- ``off``: the seed config as it is (a key without a row gets the table's CONSTANT 0);
- ``on``: the same config with ``model_config.multi_tower_din.cold_backoff {}`` (such a key's
  embedding is a learned projection of the row's side features); with ``--id-dropout P``,
  ``cold_backoff { id_dropout: P }`` (a share P of the warm lookups of the features that back
  off treated as cold in training: ``train/model/id_dropout.py``), recorded as ``id_dropout``.

Both variants can also change the base config the same way, recorded in the JSON:
``--sparse-lr LR`` sets the sparse optimizer's learning rate (the seed's Adagrad at 0.001 leaves
the embeddings near their initial values in one epoch), ``--crosses all`` or
``--crosses USER:ITEM,...`` adds ``model_config.multi_tower_din.crosses`` (every user × item
feature cross, or the named ones: ``train/model/crosses.py``), and ``--ema-decay D`` sets (or
turns on) the dense parameters' EMA, ``train_config.dense_optimizer.ema`` (``train/dense_ema.py``),
``--admission user_id:5`` a dynamic feature's ``frequency_admission_strategy.threshold``, and
``--item-tower 64`` adds ``model_config.multi_tower_din.item_tower`` (an MLP of those hidden
units over the item side's embeddings, to a logit term: ``train/model/dense_arch.py``),
``--table-lr cate_id:4`` gives a dynamic feature's table its own multiple of the sparse rate
(``train_config.sparse_optimizer.table_learning_rates``: the table then has a storage of its
own, holding its own capacity), and ``--max-capacity cate_id:10000`` sets a dynamic feature's
``max_capacity``.

``--seeds 0,1,2`` trains every variant once per seed (the trainer's seed: initial weights, batch
order, id dropout) and reports each figure's median over the seeds, beside every seed's run;
``--jobs N`` runs N of those trainings at once, each in a process of its own (on the H200 two at a
time gave about 1.5x the runs an hour: an epoch of full data is bound by its loader and Python,
not the GPU). On full data one seed's tail AUC moves by up to ±0.008 between seeds at a 50×
sparse rate, so a single run decides nothing there.

Per variant: overall, head and tail AUC (head/tail: users seen at least / fewer than
train.evaluate.TAIL_THRESHOLD times in training), logloss, the oracle's AUC, rows, train
seconds, samples/s, and per dynamic table the share of lookups without a row (the backoff's
share when it is on): misses/lookups in training, eval_misses/eval_lookups in the final eval
(from the tables' stats(); None where a counter is missing). Then ``on - off`` and the goal of
issue #22 on ``full`` data: tail AUC >= 0.632 with overall and head AUC not lower than ``off``'s
(on the medians; reported as met or not, never asserted), and ``on - off`` per seed.

    python -m bench.bench_quality --size small --out out/bench_quality.json
    python -m bench.bench_quality --size small --capacity-scale 0.025 --id-dropout 0.2 \\
        --out /tmp/bench_quality_drop.json
    python -m bench.bench_quality --samples /tmp/full/samples --device cuda --num-workers 12 \\
        --out $OUT/bench_quality_full.json
    python -m bench.bench_quality --size medium --variants off --sparse-lr 0.05 \\
        --crosses cms_group_id:cate_id,cms_group_id:adgroup_id --out /tmp/q_crosses.json
    python -m bench.bench_quality --samples /tmp/full/samples --device cuda --num-workers 6 \\
        --seeds 0,1,2 --jobs 2 --sparse-lr 0.05 \\
        --crosses cms_group_id:cate_id,cms_group_id:adgroup_id --out $OUT/q_seeds.json
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from google.protobuf import text_format

from protos import pipeline_pb2
from shared.cli import Parser, check_device, plain, run_cli, write_result
from shared.cli import exit_code as _exit_code
from shared.config import load_config
from shared.features import build_feature_set
from train.data.synthetic import SIZES
from train.evaluate import TAIL_THRESHOLD
from train.model.crosses import crosses_of
from train.trainer import Trainer, TrainOptions

ROOT = Path(__file__).resolve().parents[1]
SEED_CONFIG = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config"
VARIANTS = ("off", "on")
GOAL_TAIL_AUC = 0.632  # issue #22, full data
# the changes made to both variants alike, by their key in the result
BOTH = ("sparse_lr", "crosses", "ema_decay", "admission", "item_tower", "table_lr", "max_capacity")
NO_CHECKPOINTS = 10**9  # checkpoint_every: none inside the epoch (the final one is written)
EXAMPLE = """examples:
  python -m bench.bench_quality --size small --out out/bench_quality.json
  python -m bench.bench_quality --size small --capacity-scale 0.025 --id-dropout 0.2 \\
      --out /tmp/bench_quality_drop.json
  python -m bench.bench_quality --samples /tmp/full/samples --device cuda --num-workers 6 \\
      --seeds 0,1,2 --jobs 2 --out out/bench_quality_full.json"""
# the figures compared between the variants (on - off)
COMPARED = ("auc", "head_auc", "tail_auc", "logloss", "train_seconds", "samples_per_s")


def variant_config(
    base: Path,
    variant: str,
    out_dir: Path,
    *,
    capacity_scale: float = 1.0,
    id_dropout: float = 0.0,
    sparse_lr: float | None = None,
    crosses: str | None = None,
    ema_decay: float | None = None,
    admission: str | None = None,
    item_tower: str | None = None,
    table_lr: str | None = None,
    max_capacity: str | None = None,
) -> Path:
    """``base`` itself for ``off`` at scale 1; else a copy written under ``out_dir`` (the
    trainer reads a config path): for ``on`` with ``cold_backoff {}`` set (``{ id_dropout: P }``
    for ``id_dropout`` P > 0; ``off`` ignores it), and with every dynamic table's max_capacity
    scaled by ``capacity_scale`` (init capacity at most that), so that small data meets the
    table pressure of the full data's capacities; with ``sparse_lr`` as the sparse optimizer's
    learning rate, with the feature crosses of ``crosses`` (:func:`crosses_config`) and with
    the dense EMA at ``ema_decay`` (``train_config.dense_optimizer.ema``), with the admission
    thresholds of ``admission`` (:func:`set_admission`), with the item-only tower of
    ``item_tower`` (:func:`item_tower_units`), with the table rates of ``table_lr``
    (:func:`set_table_lr`) and with the capacities of ``max_capacity`` (applied before
    ``capacity_scale``), both variants alike."""
    changes = (sparse_lr, crosses, ema_decay, admission, item_tower, table_lr, max_capacity)
    if variant == "off" and capacity_scale == 1.0 and all(c is None for c in changes):
        return base
    config = load_config(base)
    suffix = ""
    if sparse_lr is not None:
        which = config.train_config.sparse_optimizer.WhichOneof("optimizer")
        if which is None:
            raise ValueError(f"--sparse-lr: {base} has no sparse_optimizer to set the rate of")
        getattr(config.train_config.sparse_optimizer, which).lr = sparse_lr
        suffix += f"_slr{sparse_lr:g}"
    if crosses is not None:
        config.model_config.multi_tower_din.crosses.CopyFrom(crosses_config(crosses))
        suffix += "_crosses"
    if ema_decay is not None:
        config.train_config.dense_optimizer.ema.decay = ema_decay
        suffix += f"_ema{ema_decay:g}"
    if admission is not None:
        thresholds = set_admission(config, admission)
        suffix += "_adm" + "_".join(f"{name}{n}" for name, n in thresholds.items())
    if item_tower is not None:
        units = item_tower_units(item_tower)
        tower = config.model_config.multi_tower_din.item_tower
        tower.Clear()
        tower.hidden_units.extend(units)
        suffix += "_it" + "-".join(map(str, units))
    if table_lr is not None:
        scales = set_table_lr(config, table_lr)
        suffix += "_tlr" + "_".join(f"{name}{v:g}" for name, v in scales.items())
    if max_capacity is not None:
        capacities = set_max_capacity(config, max_capacity)
        suffix += "_cap" + "_".join(f"{name}{n}" for name, n in capacities.items())
    if variant == "on":
        config.model_config.multi_tower_din.cold_backoff.SetInParent()
        if id_dropout:
            config.model_config.multi_tower_din.cold_backoff.id_dropout = id_dropout
            suffix += f"_drop{id_dropout:g}"
    for dyn in dynamic_tables(config).values():
        dyn.max_capacity = max(1, round(dyn.max_capacity * capacity_scale))
        if dyn.HasField("init_capacity_per_rank"):
            dyn.init_capacity_per_rank = min(dyn.init_capacity_per_rank, dyn.max_capacity)
    path = out_dir / f"{base.stem}_{variant}{suffix}_x{capacity_scale:g}.config"
    path.write_text(text_format.MessageToString(config))
    return path


def dynamic_tables(config: pipeline_pb2.EasyRecConfig) -> dict[str, Any]:
    """Feature name → the ``dynamicemb`` message of each dynamic id feature (in place)."""
    return {
        fc.id_feature.feature_name: fc.id_feature.dynamicemb
        for fc in config.feature_configs
        if fc.WhichOneof("feature") == "id_feature" and fc.id_feature.HasField("dynamicemb")
    }


def set_admission(config: pipeline_pb2.EasyRecConfig, spec: str) -> dict[str, int]:
    """``FEATURE:N,...``: set each named dynamic feature's frequency admission threshold to N
    (a key gets a row once seen N times; before that it takes the backoff, or 0 without one).
    Returns the thresholds set."""
    wanted = _pairs("--admission", spec, int, "N", ">= 1")
    dynamic = _dynamic(config, "--admission", spec, list(wanted))
    for name, n in wanted.items():
        dynamic[name].frequency_admission_strategy.threshold = n
    return wanted


def _pairs(
    flag: str, spec: str, value: Callable[[str], float], what: str, bound: str
) -> dict[str, Any]:
    """``FEATURE:V,...`` → {feature: value(V)}; ValueError naming ``flag`` for a bad part."""
    out: dict[str, Any] = {}
    for part in (p.strip() for p in spec.split(",")):
        feature, sep, text = part.partition(":")
        try:
            v = value(text.strip()) if sep and feature.strip() else None
        except ValueError:
            v = None
        if v is None or not (math.isfinite(v) and v > 0):
            raise ValueError(
                f"{flag} {spec}: give FEATURE:{what} pairs ({what} {bound}), comma-separated"
            )
        out[feature.strip()] = v
    return out


def _dynamic(
    config: pipeline_pb2.EasyRecConfig, flag: str, spec: str, names: list[str]
) -> dict[str, Any]:
    """:func:`dynamic_tables` of ``config``; ValueError naming ``flag`` if one of ``names`` is
    not a dynamic id feature."""
    dynamic = dynamic_tables(config)
    for name in names:
        if name not in dynamic:
            raise ValueError(f"{flag} {spec}: {name!r} is not a dynamic id feature of the "
                             f"config (those are {', '.join(dynamic)})")  # fmt: skip
    return dynamic


def set_table_lr(config: pipeline_pb2.EasyRecConfig, spec: str) -> dict[str, float]:
    """``FEATURE:SCALE,...``: each named dynamic feature's table at SCALE × the sparse rate
    (``train_config.sparse_optimizer.table_learning_rates``, replacing the config's entries).
    Returns the scales set."""
    scales = _pairs("--table-lr", spec, float, "SCALE", "> 0")
    _dynamic(config, "--table-lr", spec, list(scales))
    entries = config.train_config.sparse_optimizer.table_learning_rates
    del entries[:]
    for name, scale in scales.items():
        entries.add(feature_name=name, lr_scale=scale)
    return scales


def set_max_capacity(config: pipeline_pb2.EasyRecConfig, spec: str) -> dict[str, int]:
    """``FEATURE:N,...``: each named dynamic feature's ``max_capacity``. Returns them."""
    capacities = _pairs("--max-capacity", spec, int, "N", ">= 1")
    dynamic = _dynamic(config, "--max-capacity", spec, list(capacities))
    for name, n in capacities.items():
        dynamic[name].max_capacity = n
    return capacities


def item_tower_units(spec: str) -> list[int]:
    """``64`` or ``64,32``: the item-only tower's hidden units."""
    parts = [p.strip() for p in spec.split(",")]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--item-tower {spec}: give hidden units > 0, comma-separated (e.g. 64)")
    return [int(p) for p in parts]


def crosses_config(spec: str) -> pipeline_pb2.FeatureCrosses:
    """``all`` (every user × item pair: no pairs named) or ``USER:ITEM,USER:ITEM``."""
    config = pipeline_pb2.FeatureCrosses()
    if spec.strip() == "all":
        return config
    for part in (p.strip() for p in spec.split(",")):
        user, sep, item = part.partition(":")
        if not sep or not user.strip() or not item.strip():
            raise ValueError(f"--crosses {spec}: give all or USER:ITEM pairs, comma-separated")
        config.pairs.add(user_feature=user.strip(), item_feature=item.strip())
    return config


def _share(part: float | None, whole: float | None) -> float | None:
    return None if part is None or not whole else float(part) / float(whole)


def backoff_shares(stats: dict[str, dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Per dynamic table (and ``all`` of them): lookups, misses and their share in training
    and in eval; None where the tables do not count them."""
    out: dict[str, dict[str, Any]] = {}
    for name, table in stats.items():
        row = {k: table.get(k) for k in ("lookups", "misses", "eval_lookups", "eval_misses")}
        out[name] = row
    if out:
        out["all"] = {
            k: None if any(r[k] is None for r in out.values()) else sum(r[k] for r in out.values())
            for k in ("lookups", "misses", "eval_lookups", "eval_misses")
        }
    for row in out.values():
        row["train_share"] = _share(row["misses"], row["lookups"])
        row["eval_share"] = _share(row["eval_misses"], row["eval_lookups"])
    return out


def run_variant(
    config_path: Path, samples: Path, args: Any, model_dir: Path, seed: int
) -> dict[str, Any]:
    """One epoch (or ``--max-steps``) of the trainer on ``samples/train``, its final eval on
    ``samples/eval``, and the tables' lookup counters after both."""
    trainer = Trainer(
        TrainOptions(
            config_path=config_path, model_dir=model_dir, train_path=samples / "train",
            eval_path=samples / "eval", device=str(args.device), batch_size=args.batch,
            num_workers=args.num_workers, max_steps=args.max_steps,
            eval_max_batches=args.eval_max_batches, checkpoint_every=NO_CHECKPOINTS,
            seed=seed, progress_bar=False,
        )
    )  # fmt: skip
    t0 = time.perf_counter()
    result = trainer.fit()
    fit_seconds = time.perf_counter() - t0
    ev = result.final_eval.to_dict() if result.final_eval is not None else {}
    return {
        "config": str(config_path.relative_to(ROOT) if config_path.is_relative_to(ROOT)
                      else config_path.name),
        **{k: ev.get(k) for k in ("auc", "head_auc", "tail_auc", "logloss", "oracle_auc",
                                  "auc_vs_oracle", "rows", "tail_rows", "ctr")},
        "steps": result.progress.step,
        "samples": result.progress.samples,
        "train_seconds": result.train_seconds,
        "samples_per_s": result.samples_per_second,
        "fit_seconds": fit_seconds,  # training, final checkpoint, eval, summary
        "num_workers": trainer.num_workers,
        "backoff_share": backoff_shares(trainer.model.sparse.dynamic.stats()),
    }  # fmt: skip


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


def differences(variants: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """``on - off`` of :data:`COMPARED` (None where either is missing)."""
    off, on = variants.get("off"), variants.get("on")
    if off is None or on is None:
        return {}
    out = {}
    for k in COMPARED:
        a, b = _number(off.get(k)), _number(on.get(k))
        out[k] = None if a is None or b is None else b - a
    return out


def _median(values: list[Any]) -> float | None:
    numbers = [_number(v) for v in values]
    found = [n for n in numbers if n is not None]
    return statistics.median(found) if found and len(found) == len(numbers) else None


def aggregate(runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One variant over its seeds: every number of a run (and of its ``backoff_share``) as the
    median over ``runs`` (seed → run), the rest as the lowest seed's; ``runs`` kept as they are."""
    seeds = sorted(runs)
    first = runs[seeds[0]]
    out: dict[str, Any] = {}
    for k, v in first.items():
        if k == "backoff_share":
            out[k] = {
                table: {c: _median([runs[s][k][table][c] for s in seeds]) for c in row}
                for table, row in v.items()
            }
        elif _number(v) is not None and not isinstance(v, bool):
            out[k] = _median([runs[s].get(k) for s in seeds])
        else:
            out[k] = v
    out["seeds"] = seeds
    out["runs"] = {str(s): runs[s] for s in seeds}
    return out


def paired_differences(variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """``on - off`` per seed that both variants ran (seed → :func:`differences`)."""
    off, on = variants.get("off"), variants.get("on")
    if off is None or on is None:
        return {}
    both = [s for s in off["runs"] if s in on["runs"]]
    return {s: differences({"off": off["runs"][s], "on": on["runs"][s]}) for s in both}


def _at_least(got: Any, floor: Any) -> bool | None:
    got, floor = _number(got), _number(floor)
    return None if got is None or floor is None else got >= floor


def goal(variants: dict[str, dict[str, Any]], size: str | None) -> dict[str, Any]:
    """Issue #22's goal for ``on``: tail AUC >= 0.632, overall and head AUC >= ``off``'s (each
    variant's figures: the medians over its seeds). ``met`` is None where a figure is missing;
    the goal is set for ``full`` data only."""
    off, on = variants.get("off", {}), variants.get("on", {})
    checks = {
        "tail_auc": {"goal": f">= {GOAL_TAIL_AUC}", "got": on.get("tail_auc"),
                     "met": _at_least(on.get("tail_auc"), GOAL_TAIL_AUC)},
        "auc": {"goal": ">= off", "got": on.get("auc"), "off": off.get("auc"),
                "met": _at_least(on.get("auc"), off.get("auc"))},
        "head_auc": {"goal": ">= off", "got": on.get("head_auc"), "off": off.get("head_auc"),
                     "met": _at_least(on.get("head_auc"), off.get("head_auc"))},
    }  # fmt: skip
    found = [c["met"] for c in checks.values()]
    met = None if None in found else all(found)
    note = None if size == "full" else f"the goal is set for full data; this is {size or '?'}"
    return {"checks": checks, "met": met, "data_size": size, "applies": size == "full",
            "note": note}  # fmt: skip


def data_info(samples: Path) -> dict[str, Any]:
    """What the samples are: their generator's size (``../generate_report.json``) and the
    rows of their build (``_build_report.json``), where those files are."""
    info: dict[str, Any] = {"samples": str(samples), "size": None}
    gen, build = samples.parent / "generate_report.json", samples / "_build_report.json"
    if gen.is_file():
        info["size"] = json.loads(gen.read_text()).get("size")
    if build.is_file():
        report = json.loads(build.read_text())
        info.update(train_rows=report.get("train_rows"), eval_rows=report.get("eval_rows"))
    return info


def generate(size: str, out: Path, config: Path) -> Path:
    """Synthetic ``size`` data built for ``config``'s features into ``out`` (a config that
    names a feature the seed config lacks, e.g. a second embedding of one input, gets its
    column); returns its samples."""
    from shared.features import build_feature_set
    from train.data import synthetic, taobao

    t0 = time.perf_counter()
    synthetic.generate(size, out, seed=0)
    taobao.build_samples(out / "raw", out / "samples", build_feature_set(load_config(config)))
    print(f"generated {size} in {time.perf_counter() - t0:.1f}s", flush=True)
    return out / "samples"


def _fmt(x: Any, spec: str = ".4f") -> str:
    n = _number(x)
    if n is None:
        return "-"
    return format(int(n), spec) if spec.endswith("d") else format(n, spec)


def summary(result: dict[str, Any]) -> str:
    """A short table: one line per variant, ``on - off``, and the goal."""
    head = (f"{'':6} {'auc':>7} {'head':>7} {'tail':>7} {'logloss':>8} {'oracle':>7} "
            f"{'rows':>9} {'train_s':>8} {'samples/s':>10} {'miss_tr':>7} {'miss_ev':>7}")  # fmt: skip
    lines = [head]
    several = len(result["seeds"]) > 1
    for name, v in result["variants"].items():
        rows = [(f"{name} med" if several else name, v)]
        if several:
            rows += [(f"{name} s{s}", run) for s, run in v["runs"].items()]
        for label, r in rows:
            share = r["backoff_share"].get("all", {})
            lines.append(
                f"{label:6} {_fmt(r['auc']):>7} {_fmt(r['head_auc']):>7} "
                f"{_fmt(r['tail_auc']):>7} {_fmt(r['logloss']):>8} {_fmt(r['oracle_auc']):>7} "
                f"{_fmt(r['rows'], ',d'):>9} {_fmt(r['train_seconds'], '.1f'):>8} "
                f"{_fmt(r['samples_per_s'], ',.0f'):>10} "
                f"{_fmt(share.get('train_share'), '.3f'):>7} "
                f"{_fmt(share.get('eval_share'), '.3f'):>7}"
            )
    d = result["on_minus_off"]
    if d:
        lines.append(
            f"{'on-off':6} {_fmt(d['auc'], '+.4f'):>7} {_fmt(d['head_auc'], '+.4f'):>7} "
            f"{_fmt(d['tail_auc'], '+.4f'):>7} {_fmt(d['logloss'], '+.4f'):>8}"
        )
    if result.get("id_dropout"):
        lines.append(f"on: cold_backoff {{ id_dropout: {result['id_dropout']:g} }}")
    if any(result.get(k) is not None for k in BOTH):
        lines.append(f"both: sparse lr {result.get('sparse_lr')}, crosses {result.get('crosses')}, "
                     f"dense EMA decay {result.get('ema_decay')}, "
                     f"admission {result.get('admission')}, "
                     f"item tower {result.get('item_tower')}, "
                     f"table lr {result.get('table_lr')}, "
                     f"max capacity {result.get('max_capacity')}")  # fmt: skip
    g = result["goal"]
    met = {True: "met", False: "not met", None: "unknown"}[g["met"]]
    on_medians = (
        " on the medians over seeds " + ",".join(map(str, result["seeds"])) if several else ""
    )
    lines.append(f"goal (issue #22, tail >= {GOAL_TAIL_AUC}, auc and head >= off){on_medians}: {met}"
                 + (f" ({g['note']})" if g["note"] else ""))  # fmt: skip
    return "\n".join(lines)


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_quality", description=plain(__doc__), epilog=EXAMPLE)
    p.add_argument("--samples", type=Path, help="samples dir with train/ and eval/ (made by "
                   "python -m train.data all); default: generate --size into a temp dir")  # fmt: skip
    p.add_argument("--size", default="small", choices=list(SIZES),
                   help="synthetic data size to generate when --samples is not given")  # fmt: skip
    p.add_argument("--config", type=Path, default=SEED_CONFIG,
                   help="the config of the off variant (on: the same with cold_backoff {})")  # fmt: skip
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated variants to train (of {', '.join(VARIANTS)})")  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device to train on (default: cuda if this machine has one)")  # fmt: skip
    p.add_argument("--batch", type=int, default=None,
                   help="rows per training batch (default: the config's batch_size)")  # fmt: skip
    p.add_argument("--num-workers", type=int, default=8, help="loader workers of the trainer")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop each variant after N steps (default: one epoch)")  # fmt: skip
    p.add_argument("--eval-max-batches", type=int, default=None,
                   help="evaluate at most N batches (default: the whole eval split)")  # fmt: skip
    p.add_argument("--seeds", default="0", metavar="S,S,...",
                   help="the trainer's seeds: every variant trains once per seed, figures are "
                   "medians over them (default: 0)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="trainings at once, each in a process of its own with --num-workers "
                   "loader workers (default: 1, in this process)")  # fmt: skip
    p.add_argument(
        "--capacity-scale",
        type=float,
        default=1.0,
        help="scale every dynamic table's max_capacity (e.g. 0.025 on small data "
        "for the table pressure of the seed capacities on full data)",
    )
    p.add_argument("--id-dropout", type=float, default=0.0, metavar="P",
                   help="the on variant's cold_backoff.id_dropout: treat a share P (0 <= P < 1) "
                   "of the warm lookups of the features that back off as cold in training")  # fmt: skip
    p.add_argument("--sparse-lr", type=float, default=None, metavar="LR",
                   help="both variants: the sparse optimizer's learning rate "
                   "(default: the config's)")  # fmt: skip
    p.add_argument("--crosses", default=None, metavar="SPEC",
                   help="both variants: feature crosses, 'all' or USER:ITEM,... "
                   "(model_config.multi_tower_din.crosses; default: the config's)")  # fmt: skip
    p.add_argument("--ema-decay", type=float, default=None, metavar="D",
                   help="both variants: the dense EMA's decay (train_config.dense_optimizer.ema; "
                   "on where the config has none; default: the config's)")  # fmt: skip
    p.add_argument("--admission", default=None, metavar="SPEC",
                   help="both variants: frequency admission thresholds, FEATURE:N,... of dynamic "
                   "id features (a key gets a row once seen N times; default: the config's)")  # fmt: skip
    p.add_argument("--item-tower", default=None, metavar="UNITS",
                   help="both variants: an item-only tower of these hidden units, e.g. 64 or "
                   "64,32 (model_config.multi_tower_din.item_tower; default: the config's)")  # fmt: skip
    p.add_argument("--table-lr", default=None, metavar="SPEC",
                   help="both variants: FEATURE:SCALE,... a dynamic feature's table at SCALE x the "
                   "sparse rate, in a storage of its own (default: the config's)")  # fmt: skip
    p.add_argument("--max-capacity", default=None, metavar="SPEC",
                   help="both variants: FEATURE:N,... a dynamic feature's max_capacity "
                   "(default: the config's)")  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    return p


def _seeds(spec: str) -> list[int]:
    try:
        seeds = [int(v) for v in spec.split(",") if v.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"--seeds {spec}: give distinct seeds >= 0, comma-separated (0,1,2)")
    return seeds


def _variants(spec: str) -> list[str]:
    names = [v.strip() for v in spec.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        raise ValueError(f"--variants {spec}: give some of {', '.join(VARIANTS)}")
    return list(dict.fromkeys(names))


def _check(args: Any, names: list[str]) -> None:
    """Every argument error before any data is made or trained on."""
    if not 0.0 <= args.id_dropout < 1.0:
        raise ValueError(f"--id-dropout {args.id_dropout}: give a probability in [0, 1)")
    if args.id_dropout and "on" not in names:
        raise ValueError(f"--id-dropout applies to the on variant: add it to --variants {names}")
    if args.sparse_lr is not None and not args.sparse_lr > 0:
        raise ValueError(f"--sparse-lr {args.sparse_lr}: give a learning rate > 0")
    if args.ema_decay is not None and not 0.0 < args.ema_decay < 1.0:
        raise ValueError(f"--ema-decay {args.ema_decay}: give a decay in (0, 1), e.g. 0.999")
    if args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs}: give 1 or more trainings at once")
    if args.item_tower is not None:
        item_tower_units(args.item_tower)
    specs = (args.crosses, args.admission, args.table_lr, args.max_capacity)
    if all(spec is None for spec in specs):
        return
    config = load_config(args.config)  # a bad spec or feature name fails here
    if args.crosses is not None:
        crosses_of(build_feature_set(config), crosses_config(args.crosses))
    if args.admission is not None:
        set_admission(config, args.admission)
    if args.table_lr is not None:
        set_table_lr(config, args.table_lr)
    if args.max_capacity is not None:
        set_max_capacity(config, args.max_capacity)


def check_args(argv: list[str] | None, device: bool = False) -> tuple[Any, list[str], list[int]]:
    """The parsed command line, its variants and seeds, after every check that can fail before a
    run; the device's only with ``device`` (a sweep checks its recipes on any host)."""
    args = _parser().parse_args(argv)
    if device:
        check_device(args.device)
    names, seeds = _variants(args.variants), _seeds(args.seeds)
    _check(args, names)
    return args, names, seeds


def _samples(args: Any, work: Path) -> Path:
    samples = (
        args.samples
        if args.samples is not None
        else generate(args.size, work / "data", args.config)
    )
    for split in ("train", "eval"):
        if not (samples / split).is_dir():
            raise FileNotFoundError(
                f"--samples {samples}: no {split}/ in it; make one with `python -m "
                "train.data all --size small --out DIR` and pass DIR/samples"
            )
    return samples


def _run_here(name: str, seed: int, samples: Path, args: Any, work: Path) -> dict[str, Any]:
    """One variant at one seed in this process."""
    path = variant_config(args.config, name, work, capacity_scale=args.capacity_scale,
                          id_dropout=args.id_dropout, sparse_lr=args.sparse_lr,
                          crosses=args.crosses, ema_decay=args.ema_decay,
                          admission=args.admission, item_tower=args.item_tower,
                          table_lr=args.table_lr, max_capacity=args.max_capacity)  # fmt: skip
    entry = run_variant(path, samples, args, work / f"run_{name}_s{seed}", seed)
    entry["id_dropout"] = args.id_dropout if name == "on" else None
    return entry


def child_argv(name: str, seed: int, samples: Path, args: Any, out: Path) -> list[str]:
    """This module's arguments for one variant at one seed (a ``--jobs`` child)."""
    argv = ["--samples", str(samples), "--config", str(args.config), "--variants", name,
            "--seeds", str(seed), "--device", str(args.device),
            "--num-workers", str(args.num_workers), "--capacity-scale", repr(args.capacity_scale),
            "--out", str(out)]  # fmt: skip
    optional = {"--batch": args.batch, "--max-steps": args.max_steps,
                "--eval-max-batches": args.eval_max_batches, "--sparse-lr": args.sparse_lr,
                "--crosses": args.crosses, "--ema-decay": args.ema_decay,
                "--admission": args.admission, "--item-tower": args.item_tower,
                "--table-lr": args.table_lr, "--max-capacity": args.max_capacity,
                "--id-dropout": args.id_dropout if name == "on" and args.id_dropout else None}  # fmt: skip
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, value if isinstance(value, str) else repr(value)]
    return argv


@dataclass(frozen=True)
class ChildRun:
    """``python -m bench.bench_quality ARGV`` in a process of its own, whose ``argv`` writes the
    JSON ``out``; its output goes to :attr:`log` beside it. ``key`` names it to the caller."""

    key: tuple[str, int]
    argv: list[str]
    out: Path

    @property
    def log(self) -> Path:
        return self.out.with_suffix(".log")


def run_children(
    runs: list[ChildRun],
    jobs: int,
    finished: Callable[[ChildRun, dict[str, Any]], None],
    *,
    start_until: float | None = None,
) -> list[ChildRun]:
    """``runs`` in order, ``jobs`` at a time, ``finished(run, its JSON)`` as each ends. None
    starts once ``time.monotonic()`` has passed ``start_until``: those are returned, not run. A
    run that fails raises with the tail of its log, and stops the others."""
    pending = list(runs)
    running: list[tuple[ChildRun, subprocess.Popen[bytes]]] = []

    def may_start() -> bool:
        return bool(pending) and (start_until is None or time.monotonic() <= start_until)

    try:
        while running or may_start():
            while len(running) < jobs and may_start():
                run = pending.pop(0)
                cmd = [sys.executable, "-m", "bench.bench_quality", *run.argv]
                with run.log.open("wb") as f:
                    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
                running.append((run, proc))
            time.sleep(0.2)
            _collect(running, finished)
    finally:
        for _, proc in running:
            proc.kill()
    return pending


def _collect(
    running: list[tuple[ChildRun, subprocess.Popen[bytes]]],
    finished: Callable[[ChildRun, dict[str, Any]], None],
) -> None:
    for run, proc in [r for r in running if r[1].poll() is not None]:
        running.remove((run, proc))
        if proc.returncode != 0:
            tail = run.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{' '.join(run.argv)} failed (exit {proc.returncode}):\n{tail}")
        finished(run, json.loads(run.out.read_text()))


def _run_children(
    plan: list[tuple[str, int]], samples: Path, args: Any, work: Path
) -> dict[tuple[str, int], dict[str, Any]]:
    """``plan``'s runs, ``args.jobs`` at a time, each in a process of its own."""
    done: dict[tuple[str, int], dict[str, Any]] = {}

    def finished(run: ChildRun, result: dict[str, Any]) -> None:
        name, seed = run.key
        done[run.key] = result["variants"][name]["runs"][str(seed)]
        _print_run(name, seed, done[run.key])

    runs = []
    for name, seed in plan:
        out = work / f"{name}_s{seed}.json"
        runs.append(ChildRun((name, seed), child_argv(name, seed, samples, args, out), out))
    run_children(runs, args.jobs, finished)
    return done


def _print_run(name: str, seed: int, entry: dict[str, Any]) -> None:
    shown = {k: v for k, v in entry.items() if k != "backoff_share"}
    print(json.dumps({name: {"seed": seed, **shown}}), flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, names, seeds = check_args(argv, device=True)
    plan = [(name, seed) for seed in seeds for name in names]  # a seed's variants together
    with tempfile.TemporaryDirectory(prefix="bench_quality_") as tmp:
        work = Path(tmp)
        samples = _samples(args, work)
        info = data_info(samples)
        info["size"] = info["size"] or (args.size if args.samples is None else None)
        info["generated"] = args.samples is None  # into a temp dir, removed at the end
        if args.jobs > 1:
            runs = _run_children(plan, samples, args, work)
        else:
            runs = {}
            for name, seed in plan:
                runs[(name, seed)] = _run_here(name, seed, samples, args, work)
                _print_run(name, seed, runs[(name, seed)])
    variants = {n: aggregate({s: runs[(n, s)] for s in seeds}) for n in names}
    result: dict[str, Any] = {
        "device": str(args.device), "torch": torch.__version__, "data": info,
        "tail_threshold": TAIL_THRESHOLD, "max_steps": args.max_steps, "seeds": seeds,
        "jobs": args.jobs, "capacity_scale": args.capacity_scale, "id_dropout": args.id_dropout,
        "sparse_lr": args.sparse_lr, "crosses": args.crosses, "ema_decay": args.ema_decay,
        "admission": args.admission, "item_tower": args.item_tower, "table_lr": args.table_lr,
        "max_capacity": args.max_capacity, "variants": variants,
        "on_minus_off": differences(variants), "on_minus_off_by_seed": paired_differences(variants),
        "goal": goal(variants, info["size"]),
    }  # fmt: skip
    write_result(args.out, result)
    print(summary(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
