"""How much of the oracle's AUC on tail users is knowable at all (issue #22): AUC ceilings.

The synthetic click model (``train/data/synthetic.py``) gives each user a random ``user_bias``
and a latent vector ``user_emb = mean(cate_emb[favourite cates]) + 0.5·demo_emb[cms_group_id] +
0.5·noise``. A user seen a few times in training cannot have the bias or the noise estimated, so
part of the oracle's signal on the tail is out of any model's reach. This bench regenerates the
world and impressions of ``--size``/``--seed`` with the generator's own code path
(:func:`train.data.synthetic.simulate_world`: the same draws as the written files, which it
does not write), takes the eval split's rows as :func:`train.data.taobao.build_samples` does
(UTC+8 day 2017-05-13; train: 05-06..05-12) and scores them with:

- ``oracle_p`` (a): the true click probability as stored (float32; what ``oracle_auc`` scores);
- ``no_user_bias`` (b): the oracle logit without the ``user_bias`` term;
- ``knowable_user_emb`` (c): (b) with ``user_emb`` replaced by its knowable part, the mean of
  the favourite cates' embeddings + 0.5·the demographic embedding (the 0.5·noise term dropped;
  the same ``match_scale``);
- ``no_match`` (d): (b) without the match term: b0, ad bias, pid, price × pvalue sensitivity and
  the history terms only (the favourite cates are themselves seen only through clicks);
- ``demographic_match`` (e): (b) with ``user_emb`` = 0.5·the demographic embedding alone: the
  part of the match a user's profile (``cms_group_id``) tells without any click;
- ``demographic_no_price`` (f): (e) without the price term (the ad's log price × the
  sensitivity of the user's ``pvalue_level``): what a model that cannot cross the two loses;
- ``demographic_cate_match`` (g): (e) with the ad's vector replaced by its cate's (no per-ad
  part): what a model that learns the demographics' taste per cate only is left with.

The logits (b)-(d) are the planted terms recomputed in float64 from the world and the
impressions (the history counts the simulation recorded), summed in the simulation's order;
``reconstruction`` reports how far sigmoid(sum of all terms) is from the stored p. Per variant:
AUC overall, on head and on tail rows, where tail means what :func:`train.evaluate.evaluate`
means: the row's user has fewer than ``train.evaluate.TAIL_THRESHOLD`` samples in the train split
(never seen included); head is the rest. AUCs are torchmetrics' exact ``binary_auroc``, as in
evaluation. No files are written but ``--out``. Measured (seed 0, CPU, 2 cores): ``small`` 8 s
and 0.47 GB peak RSS; ``full`` 50 s and 3.6 GB (simulation 32 s, scoring 14 s)::

    python -m bench.bench_tail_ceiling --size small --out bench/results/tail_ceiling_small.json
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchmetrics.functional.classification import binary_auroc

from shared.cli import Parser, plain, run_cli
from shared.cli import exit_code as _exit_code
from train.data import synthetic
from train.data import taobao as tb
from train.evaluate import TAIL_THRESHOLD

GOAL_TAIL_AUC = 0.632  # issue #22, full data
VARIANTS = {
    "oracle_p": "(a) the oracle click probability as stored",
    "no_user_bias": "(b) the oracle logit without user_bias",
    "knowable_user_emb": "(c) (b) with user_emb = mean(favourite cate_emb) + 0.5*demo_emb "
    "(no per-user noise)",
    "no_match": "(d) (b) without the match term (b0, ad bias, pid, price, history terms)",
    "demographic_match": "(e) (b) with user_emb = 0.5*demo_emb only (what the profile tells)",
    "demographic_no_price": "(f) (e) without the price x pvalue sensitivity term",
    "demographic_cate_match": "(g) (e) with the ad's vector = its cate's (no per-ad part)",
}
EXAMPLE = """examples:
  python -m bench.bench_tail_ceiling --size small --out bench/results/tail_ceiling_small.json
  python -m bench.bench_tail_ceiling --size full --out bench/results/tail_ceiling_full.json"""


def split_rows(time_stamp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) masks of impressions, by UTC+8 calendar day exactly as build_samples splits
    (rows of other days are in neither)."""
    days = tb.sample_days(time_stamp)
    first, last = tb.day_index(tb.TRAIN_FIRST_DAY), tb.day_index(tb.EVAL_DAY)
    return (days >= first) & (days < last), days == last


def tail_of(users: np.ndarray, train: np.ndarray, rows: np.ndarray, n_users: int) -> np.ndarray:
    """Per row of ``rows``: its user has fewer than TAIL_THRESHOLD train samples."""
    train_counts = np.bincount(users[train], minlength=n_users)
    return train_counts[users[rows]] < TAIL_THRESHOLD


def _match(
    user_emb: np.ndarray,
    sim: synthetic.Simulation,
    rows: np.ndarray,
    ad_emb: np.ndarray | None = None,
) -> np.ndarray:
    """The match term with user vectors ``user_emb`` [U, d] and ad vectors ``ad_emb`` [A, d]
    (default: the world's), for impressions ``rows``."""
    w, imp = sim.world, sim.impressions
    ads = w.ad_emb if ad_emb is None else ad_emb
    dot = (user_emb[imp.user[rows]] * ads[imp.ad[rows]]).sum(1)
    return sim.model.match * dot / w.match_scale


def knowable_user_emb(world: synthetic._World) -> np.ndarray:
    """[U, d]: ``user_emb`` without its per-user noise (favourite cates + demographics)."""
    return (
        world.cate_emb[world.user_fav].mean(axis=1)
        + 0.5 * world.demo_emb[world.profile["cms_group_id"]]
    )


def logit_terms(sim: synthetic.Simulation, rows: np.ndarray) -> dict[str, np.ndarray]:
    """The planted logit's terms (float64) of impressions ``rows``, in the simulation's order;
    their sum is the oracle's logit."""
    w, m, imp = sim.world, sim.model, sim.impressions
    u, ad = imp.user[rows], imp.ad[rows]
    return {
        "b0": np.full(len(rows), sim.b0),
        "match": _match(w.user_emb, sim, rows),
        "user_bias": w.user_bias[u],
        "ad_bias": w.ad_bias[ad],
        "pid": np.asarray(m.pid_bias)[imp.pid[rows]],
        "price": -m.price * w.user_price_sens[u] * (np.log(w.ad_price[ad]) - w.mean_log_price),
        # float64 counts: log1p of the stored int8 would be float16
        "hist_cate": m.hist_cate * np.log1p(imp.same_cate[rows].astype(np.float64)),
        "hist_brand": m.hist_brand * np.log1p(imp.same_brand[rows].astype(np.float64)),
    }


def _total(terms: dict[str, np.ndarray]) -> np.ndarray:
    out = np.zeros(len(next(iter(terms.values()))))
    for value in terms.values():  # left to right, as the simulation adds them
        out = out + value
    return out


def _sigmoid(logit: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-logit))


def ceiling_scores(sim: synthetic.Simulation, rows: np.ndarray) -> dict[str, np.ndarray]:
    """Per variant of :data:`VARIANTS`, the scores of impressions ``rows`` (probabilities)."""
    terms = logit_terms(sim, rows)
    no_bias = {k: v for k, v in terms.items() if k != "user_bias"}
    knowable = no_bias | {"match": _match(knowable_user_emb(sim.world), sim, rows)}
    no_match = {k: v for k, v in no_bias.items() if k != "match"}
    demo = 0.5 * sim.world.demo_emb[sim.world.profile["cms_group_id"]]
    demographic = no_bias | {"match": _match(demo, sim, rows)}
    no_price = {k: v for k, v in demographic.items() if k != "price"}
    by_cate = demographic | {
        "match": _match(demo, sim, rows, sim.world.cate_emb[sim.world.ad_cate])
    }
    return {
        "oracle_p": sim.impressions.p[rows],
        "no_user_bias": _sigmoid(_total(no_bias)),
        "knowable_user_emb": _sigmoid(_total(knowable)),
        "no_match": _sigmoid(_total(no_match)),
        "demographic_match": _sigmoid(_total(demographic)),
        "demographic_no_price": _sigmoid(_total(no_price)),
        "demographic_cate_match": _sigmoid(_total(by_cate)),
    }


def reconstruction(sim: synthetic.Simulation, rows: np.ndarray) -> dict[str, Any]:
    """How far sigmoid(all terms) is from the stored p (float32) on ``rows``."""
    p = sim.impressions.p[rows]
    rebuilt = _sigmoid(_total(logit_terms(sim, rows)))
    return {
        "max_abs_diff": float(np.abs(rebuilt - p.astype(np.float64)).max()) if len(p) else 0.0,
        "rows_differing_in_float32": int((rebuilt.astype(np.float32) != p).sum()),
    }


def auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """torchmetrics' exact binary AUROC, as train.evaluate computes it; None with one class."""
    if len(labels) == 0 or labels.min() == labels.max():
        return None
    return float(binary_auroc(torch.from_numpy(scores), torch.from_numpy(labels.astype(np.int64))))


def measure(sim: synthetic.Simulation) -> dict[str, Any]:
    """Split, tail and the AUC ceilings of one simulation (see the module doc)."""
    imp = sim.impressions
    train, evaluation = split_rows(imp.time)
    rows = np.flatnonzero(evaluation)
    tail = tail_of(imp.user, train, rows, sim.spec.users)
    labels = imp.clk[rows]
    ceilings = {}
    for name, scores in ceiling_scores(sim, rows).items():
        ceilings[name] = {
            "what": VARIANTS[name],
            "auc": auc(scores, labels),
            "head_auc": auc(scores[~tail], labels[~tail]),
            "tail_auc": auc(scores[tail], labels[tail]),
        }
    return {
        "train_rows": int(train.sum()),
        "eval_rows": len(rows),
        "dropped_rows": int(len(imp.time) - train.sum() - len(rows)),
        "eval_ctr": float(labels.mean()) if len(rows) else None,
        "tail_threshold": TAIL_THRESHOLD,
        "tail_rows": int(tail.sum()),
        "head_rows": int((~tail).sum()),
        "tail_users": len(np.unique(imp.user[rows][tail])),
        "reconstruction": reconstruction(sim, rows),
        "ceilings": ceilings,
    }


def tail_ceiling(size: str, seed: int = 0) -> dict[str, Any]:
    """:func:`measure` of the world ``synthetic.generate(size, ..., seed=seed)`` writes."""
    t0 = time.perf_counter()
    sim = synthetic.simulate_world(size, seed=seed)
    simulate_seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    result = measure(sim)
    return {
        "bench": "tail_ceiling",
        "size": size,
        "seed": seed,
        "samples": len(sim.impressions.p),
        "b0": sim.b0,
        **result,
        "goal_tail_auc": GOAL_TAIL_AUC,
        "simulate_seconds": simulate_seconds,
        "measure_seconds": time.perf_counter() - t1,
    }


def summary(result: dict[str, Any]) -> str:
    lines = [f"{result['size']} seed {result['seed']}: eval rows {result['eval_rows']:,}, "
             f"tail rows {result['tail_rows']:,} (train samples < {result['tail_threshold']})",
             f"{'':18} {'auc':>8} {'head':>8} {'tail':>8}"]  # fmt: skip
    for name, c in result["ceilings"].items():
        figures = (c["auc"], c["head_auc"], c["tail_auc"])
        lines.append(f"{name:18} " + " ".join("       -" if x is None else f"{x:8.5f}"
                                              for x in figures))  # fmt: skip
    return "\n".join(lines)


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_tail_ceiling", description=plain(__doc__),
               epilog=EXAMPLE)  # fmt: skip
    p.add_argument("--size", default="small", choices=list(synthetic.SIZES),
                   help="synthetic data size to simulate")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the generator's seed")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    result = tail_ceiling(args.size, args.seed)
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(summary(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
