"""Several :mod:`bench.bench_quality` recipes over seeds, N trainings at a time, in one JSON.

A sweep file (TOML) names the recipes. Each run is ``python -m bench.bench_quality`` with the
file's ``args``, then the recipe's ``args``, then ``--seeds S``, in a process of its own::

    args = "--samples /tmp/full/samples --device cuda --num-workers 6 --variants on"

    [recipes.lr05]
    what = "sparse lr 0.05 + crosses + the user backoff"
    args = "--sparse-lr 0.05 --crosses cms_group_id:cate_id,cms_group_id:adgroup_id"
    seeds = [0, 1, 2]

    [recipes.cold_ids]
    what = "the same at batch 4096 with the dense EMA (decay 0.999)"
    args = "--config configs/multi_tower_din_taobao_dynamicemb_cold_ids.config"
    seeds = [0, 1, 2]
    reference = "lr05"

Per recipe the JSON has its command, every variant's medians over the seeds with each seed's run
(:func:`bench.bench_quality.aggregate`), issue #22's goal on them, and, with ``reference``
(another recipe of the file), the recipe minus the reference per seed both ran (AUC, head and
tail AUC): on full data one seed's tail moves by up to ±0.008, so the paired differences are what
decide a change.

Before the first run every recipe's arguments pass bench_quality's own checks (flags, crosses,
admission, ...; not the device), so a mistake in the last recipe costs no device time. Runs go
seed by seed (every recipe at its first seed, then at its second, ...), so a sweep cut
short by ``--stop-after`` (no run starts after that many seconds: the device's time limit) still
has paired runs; the seeds not run are listed per recipe. The JSON is written again after every
run (temp + rename), so a sweep killed by a time limit keeps what it finished, and
``--resume THAT.json`` runs only what it lacks (a recipe whose arguments changed since is an
error), keeping its runs in the new JSON. ``SWEEP=FILE bash bench/run_quality_gpu.sh`` is the
device call.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.bench_quality import ChildRun, aggregate, check_args, goal, run_children
from shared.cli import Parser, exit_code, plain, run_cli, write_result

EXAMPLE = """examples:
  python -m bench.quality_sweep bench/sweeps/issue22_batch_ema.toml --jobs 2 \\
      --stop-after 420 --out $OUT/quality_sweep.json
  python -m bench.quality_sweep bench/sweeps/issue22_batch_ema.toml --jobs 2 \\
      --resume out/quality_sweep.json --out $OUT/quality_sweep.json"""
RECIPE_KEYS = {"what", "args", "seeds", "reference"}
PAIRED = ("auc", "head_auc", "tail_auc")


@dataclass(frozen=True)
class Recipe:
    name: str
    what: str
    args: list[str]
    seeds: list[int]
    reference: str | None


def _field(path: Path, where: str, value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise ValueError(f"{path}: {where}: give {what}")
    return value


def _args(path: Path, where: str, value: Any) -> list[str]:
    """bench_quality's arguments from a string, without the ones the sweep sets itself."""
    args = shlex.split(_field(path, where, value, str, "a string of arguments"))
    if {"--seeds", "--out", "--jobs"} & set(args):
        raise ValueError(f"{path}: {where}: the sweep sets --seeds, --jobs and --out")
    return args


def load_sweep(path: Path) -> tuple[list[str], list[Recipe]]:
    """The common arguments and the recipes of a sweep file; every error names its field."""
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not TOML: {e}") from e
    unknown = set(doc) - {"args", "recipes"}
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {sorted(unknown)}: give args and [recipes.NAME]")
    common = _args(path, "args", doc.get("args", ""))
    tables = _field(path, "recipes", doc.get("recipes"), dict, "one or more [recipes.NAME]")
    if not tables:
        raise ValueError(f"{path}: recipes: give one or more [recipes.NAME]")
    recipes = [_recipe(path, name, table) for name, table in tables.items()]
    for r in recipes:
        if r.reference is not None and r.reference not in tables:
            raise ValueError(f"{path}: recipes.{r.name}.reference: no recipe {r.reference!r}")
        if r.reference == r.name:
            raise ValueError(f"{path}: recipes.{r.name}.reference: give another recipe")
    return common, recipes


def check_recipes(path: Path, common: list[str], recipes: list[Recipe]) -> None:
    """Each recipe's bench_quality arguments checked before any run starts, so that a mistake
    in the last recipe does not surface after the device time of the first ones."""
    for r in recipes:
        try:
            check_args([*common, *r.args, "--seeds", str(r.seeds[0]), "--out", os.devnull])
        except SystemExit as e:  # argparse's error, already printed as one "error:" line
            raise ValueError(f"{path}: recipes.{r.name}: args and the common args are "
                             "not bench_quality's (its error is printed above)") from e  # fmt: skip
        except ValueError as e:
            raise ValueError(f"{path}: recipes.{r.name}: {e}") from e


def _recipe(path: Path, name: str, table: Any) -> Recipe:
    where = f"recipes.{name}"
    table = _field(path, where, table, dict, "a table")
    unknown = set(table) - RECIPE_KEYS
    if unknown:
        raise ValueError(f"{path}: {where}: unknown key(s) {sorted(unknown)}: give {RECIPE_KEYS}")
    seeds = _field(path, f"{where}.seeds", table.get("seeds"), list, "a list of seeds, [0, 1, 2]")
    if (
        not seeds
        or len(set(seeds)) != len(seeds)
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
    ):
        raise ValueError(f"{path}: {where}.seeds: give distinct seeds >= 0, [0, 1, 2]")
    args = _args(path, f"{where}.args", table.get("args", ""))
    reference = table.get("reference")
    if reference is not None:
        _field(path, f"{where}.reference", reference, str, "another recipe's name")
    what = _field(path, f"{where}.what", table.get("what", ""), str, "a description")
    return Recipe(name, what, args, list(seeds), reference)


def plan(recipes: list[Recipe]) -> list[tuple[Recipe, int]]:
    """Seed by seed: every recipe at its first seed, then at its second, ..."""
    depth = max(len(r.seeds) for r in recipes)
    return [(r, r.seeds[i]) for i in range(depth) for r in recipes if i < len(r.seeds)]


def minus_reference(
    variants: dict[str, dict[str, Any]], reference: dict[str, dict[str, Any]]
) -> dict[str, dict[str, dict[str, float]]]:
    """Per variant both have, per seed both ran: this minus the reference (:data:`PAIRED`)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, v in variants.items():
        ref = reference.get(name)
        if ref is None:
            continue
        out[name] = {
            seed: {k: run[k] - ref["runs"][seed][k] for k in PAIRED}
            for seed, run in v["runs"].items()
            if seed in ref["runs"]
        }
    return out


def result(
    common: list[str],
    recipes: list[Recipe],
    runs: dict[tuple[str, int], dict[str, dict[str, Any]]],
    info: dict[str, Any],
) -> dict[str, Any]:
    """The JSON: ``runs`` maps (recipe, seed) to that run's variants."""
    variants: dict[str, dict[str, dict[str, Any]]] = {}
    for r in recipes:
        by_variant: dict[str, dict[int, dict[str, Any]]] = {}
        for seed in r.seeds:
            for name, run in runs.get((r.name, seed), {}).items():
                by_variant.setdefault(name, {})[seed] = run
        variants[r.name] = {n: aggregate(by_seed) for n, by_seed in by_variant.items()}
    out: dict[str, Any] = {"bench": "quality_sweep", **info, "args": common, "recipes": {}}
    for r in recipes:
        v = variants[r.name]
        ran = [s for s in r.seeds if (r.name, s) in runs]
        out["recipes"][r.name] = {
            "what": r.what, "args": r.args, "seeds": ran,
            "not_run": [s for s in r.seeds if s not in ran], "variants": v,
            "reference": r.reference,
            "minus_reference_by_seed": (
                minus_reference(v, variants[r.reference]) if r.reference else None),
            "goal": goal(v, info.get("data", {}).get("size")) if v else None,
        }  # fmt: skip
    return out


def resumed(
    path: Path, common: list[str], recipes: list[Recipe]
) -> dict[tuple[str, int], dict[str, dict[str, Any]]]:
    """The runs of an earlier sweep JSON of these recipes, as (recipe, seed) → variants."""
    doc = json.loads(path.read_text())
    if doc.get("bench") != "quality_sweep" or doc.get("args") != common:
        raise ValueError(f"--resume {path}: not a sweep with these args ({shlex.join(common)})")
    runs: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in recipes:
        old = doc["recipes"].get(r.name)
        if old is None:
            continue
        if old["args"] != r.args:
            raise ValueError(f"--resume {path}: recipes.{r.name}.args changed since "
                             f"({shlex.join(old['args'])}); give it another name")  # fmt: skip
        for seed in old["seeds"]:
            if seed in r.seeds:
                runs[(r.name, seed)] = {v: x["runs"][str(seed)] for v, x in old["variants"].items()}
    return runs


def _write(path: Path, doc: dict[str, Any]) -> None:
    write_result(path, doc, indent=1)  # indent 1: a sweep's file is large


def _parser() -> Parser:
    p = Parser(prog="python -m bench.quality_sweep", description=plain(__doc__), epilog=EXAMPLE)
    p.add_argument("sweep", type=Path, help="the sweep file (TOML: args, [recipes.NAME])")
    p.add_argument("--jobs", type=int, default=2, help="trainings at once (2 on one H200)")
    p.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="start no run after this many seconds (the device's time limit)")  # fmt: skip
    p.add_argument("--resume", type=Path, default=None, metavar="JSON",
                   help="an earlier JSON of this sweep: run only the seeds it lacks")  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    if args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs}: give 1 or more trainings at once")
    common, recipes = load_sweep(args.sweep)
    check_recipes(args.sweep, common, recipes)
    started = time.monotonic()
    until = None if args.stop_after is None else started + args.stop_after
    runs = resumed(args.resume, common, recipes) if args.resume else {}
    info: dict[str, Any] = {"sweep": str(args.sweep), "jobs": args.jobs}
    if args.resume:
        info.update({k: v for k, v in json.loads(args.resume.read_text()).items()
                     if k in ("device", "torch", "data")})  # fmt: skip

    def finished(run: ChildRun, child: dict[str, Any]) -> None:
        name, seed = run.key
        runs[run.key] = {v: r["runs"][str(seed)] for v, r in child["variants"].items()}
        info.update(device=child["device"], torch=child["torch"], data=child["data"])
        _write(args.out, result(common, recipes, runs, info))
        tails = {v: round(r["tail_auc"], 4) for v, r in runs[run.key].items()}
        print(f"{name} seed {seed}: tail {tails} at {time.monotonic() - started:.0f} s", flush=True)

    with tempfile.TemporaryDirectory(prefix="quality_sweep_") as tmp:
        work = Path(tmp)
        children = []
        for r, seed in plan(recipes):
            if (r.name, seed) not in runs:
                out = work / f"{r.name}_s{seed}.json"
                argv = [*common, *r.args, "--seeds", str(seed), "--out", str(out)]
                children.append(ChildRun((r.name, seed), argv, out))
        skipped = run_children(children, args.jobs, finished, start_until=until)
    doc = result(common, recipes, runs, info)
    _write(args.out, doc)
    if skipped:
        print(f"not run (--stop-after {args.stop_after:g}): "
              + ", ".join(f"{c.key[0]} seed {c.key[1]}" for c in skipped), flush=True)  # fmt: skip
    return doc


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: exit_code(main(argv))))
