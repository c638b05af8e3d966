"""Which planted terms a trained model's scores miss on the tail (issue #22): per-row regression.

:mod:`bench.bench_tail_ceiling` says what the tail can reach at all; this says where a trained
model stands against it, term by term. It joins a model's prediction of every eval row
(``python -m train evaluate --predictions FILE``) to the planted click model's terms of the same
impression (:func:`train.data.synthetic.simulate_world` regenerates the world; rows are joined on
the public user and ad ids, the second, the label and the stored oracle p, and every eval row
must join), then fits, on the tail rows (the prediction file's ``tail``), a logistic regression
of the label on the model's logit plus one planted term at a time::

    label ~ a + b * logit + c * term

and reports the AUC of that score beside the model's own. A term whose ``c`` is near 0 and which
adds no AUC is one the model's logit already carries; one that adds AUC is information the
model lacks. The fits are two-fold by user (fit on one half of the users, score the other), so
no row scores with coefficients fitted on itself. Terms (float64, as in the ceiling bench):
``demographic_match`` (the match with ``user_emb`` = 0.5·the ``cms_group_id`` embedding: what a
profile tells), ``other_match`` (the rest of the match: favourite cates and per-user noise,
knowable only from clicks), ``price`` (the ad's log price × the ``pvalue_level`` sensitivity),
``ad_bias``, ``pid``, ``history`` (the two click-history terms), ``user_bias`` (unknowable
for a user not seen), and ``knowable``: ``demographic_match`` + ``price`` + ``ad_bias`` + ``pid``
+ ``history``, fitted as one term per part.

The true ad terms are more than any learner can know: an ad has a bias and a vector of its own,
seen only through its few impressions, and its cate's vector is seen only through the cate's
impressions (few for most cates: their popularity is Zipf). ``ad_bias_learnable`` and
``demographic_match_learnable`` put in their place what an idealised learner gets from the
training impressions (:func:`learned_terms`: every other term known exactly, the world's
priors), and ``learnable`` is ``knowable`` with them. ``learnable_alone`` fits the label on
those terms without the model: what a model that learned every term as well as the data allow,
from the profile and the ad, would score (no user bias, no clicks). ``expressed`` says how
strongly the model's logit carries each true term (its least-squares coefficients on them all)
and the learnable ad terms theirs; ``by_cate_popularity`` splits the demographic match into its
cate and ad parts by the cate's training impressions (:func:`by_cate_popularity`). Measured on
full data (seed 0, CPU, 2 cores): 166 s idle (7.1 GB peak RSS while the Newton designs were
kept; 5.3 GB since they are made per step, 335 s beside a training)::

    python -m train evaluate --config C --model-dir M --train /tmp/full/samples/train \\
        --eval /tmp/full/samples/eval --predictions /tmp/preds.parquet
    python -m bench.bench_tail_misses --size full --samples /tmp/full/samples \\
        --predictions /tmp/preds.parquet --out bench/results/tail_misses_full.json
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow.parquet as pq
import torch

from bench.bench_tail_ceiling import _match, _total, auc, logit_terms, split_rows
from shared.cli import Parser, plain, run_cli, write_result
from shared.cli import exit_code as _exit_code
from train.data import synthetic
from train.data import taobao as tb

TERMS = ("demographic_match", "other_match", "price", "ad_bias", "pid", "history", "user_bias",
         "demographic_match_learnable", "ad_bias_learnable")  # fmt: skip
KNOWABLE = ("demographic_match", "price", "ad_bias", "pid", "history")
LEARNABLE = ("demographic_match_learnable", "price", "ad_bias_learnable", "pid", "history")
EXAMPLE = """example:
  python -m bench.bench_tail_misses --size full --samples /tmp/full/samples \\
      --predictions /tmp/preds.parquet --out bench/results/tail_misses_full.json"""


class Learned(NamedTuple):
    """What an idealised learner gets from the training impressions (:func:`learned_terms`)."""

    ad_bias: np.ndarray  # [A]
    ad_offset: np.ndarray  # [A, d]: the ad-specific part of its vector, ad_emb - cate_emb[cate]
    cate_emb: np.ndarray  # [C, d]: each cate's vector


def eval_terms(
    sim: synthetic.Simulation,
    rows: np.ndarray,
    learned: Learned | None = None,
) -> dict[str, np.ndarray]:
    """The terms of :data:`TERMS` (float64) for impressions ``rows``, and the demographic
    match's cate part (``demographic_cate``: its match with the cate's vector, without the
    ad's own); the learnable ones only given ``learned``, :func:`learned_terms`'s estimates."""
    w = sim.world
    t = logit_terms(sim, rows)
    demo_user = 0.5 * w.demo_emb[w.profile["cms_group_id"]]
    demo = _match(demo_user, sim, rows)
    learnable = {}
    if learned is not None:
        learnable = {
            "demographic_cate_learnable": _match(
                demo_user, sim, rows, ad_emb=learned.cate_emb[w.ad_cate]
            ),
            "demographic_match_learnable": _match(
                demo_user, sim, rows, ad_emb=learned.cate_emb[w.ad_cate] + learned.ad_offset
            ),
            "ad_bias_learnable": learned.ad_bias[sim.impressions.ad[rows]],
        }
    return {
        "demographic_match": demo,
        "demographic_cate": _match(demo_user, sim, rows, ad_emb=w.cate_emb[w.ad_cate]),
        "other_match": t["match"] - demo,
        "price": t["price"],
        "ad_bias": t["ad_bias"],
        "pid": t["pid"],
        "history": t["hist_cate"] + t["hist_brand"],
        "user_bias": t["user_bias"],
        **learnable,
    }


def learned_terms(sim: synthetic.Simulation, train: np.ndarray, iterations: int = 3) -> Learned:
    """Each ad's bias and own vector, and each cate's vector, as well as the training
    impressions ``train`` (mask) tell them: posterior modes under the world's own priors (the
    bias N(0, ad_bias_sd²), the ad's offset N(0, 0.7²/d) and the cate's vector N(0, 1/d) per
    dim) of the logistic model of the clicks with every other term of the planted logit known
    exactly (the user's whole vector too), by ``iterations`` Newton steps from 0, per ad and
    per cate (each estimated with the other's true value). An idealised learner: no model
    trained on the same rows can know these terms better, so a term built from them bounds what
    the ad's side can add. (At a CTR of 6 % each impression adds about 0.057 to the precision of
    an ad's bias, and the prior's is 11: an ad needs about 200 impressions before its data weigh
    as much as the prior. A cate's vector pools every impression of its ads.)"""
    w, m, imp = sim.world, sim.model, sim.impressions
    rows = np.flatnonzero(train)
    d = w.ad_emb.shape[1]
    scale = m.match / w.match_scale
    true_offset = w.ad_emb - w.cate_emb[w.ad_cate]  # [A, d]
    chunks = np.array_split(rows, max(1, len(rows) // 2_000_000))
    totals = [_total(logit_terms(sim, chunk)) for chunk in chunks]  # once: 23M rows on full

    def user_of(chunk: np.ndarray) -> np.ndarray:
        return scale * w.user_emb[imp.user[chunk]]  # [n, d]: the match's weight of a vector

    def ad_design(chunk: np.ndarray) -> np.ndarray:
        return np.concatenate([np.ones((len(chunk), 1)), user_of(chunk)], 1)  # bias, offset

    ad = _posterior_modes(
        imp,
        chunks,
        [t - w.ad_bias[imp.ad[c]] - (user_of(c) * true_offset[imp.ad[c]]).sum(1)
         for c, t in zip(chunks, totals, strict=True)],
        lambda c: imp.ad[c],
        ad_design,
        np.array([1 / m.ad_bias_sd**2] + [d / 0.7**2] * d),
        len(w.ad_bias),
        iterations,
    )  # fmt: skip
    cate = _posterior_modes(
        imp,
        chunks,
        [t - (user_of(c) * w.cate_emb[w.ad_cate[imp.ad[c]]]).sum(1)
         for c, t in zip(chunks, totals, strict=True)],
        lambda c: w.ad_cate[imp.ad[c]],
        user_of,
        np.full(d, float(d)),
        len(w.cate_emb),
        iterations,
    )  # fmt: skip
    return Learned(ad[:, 0], ad[:, 1:], cate)


def _posterior_modes(
    imp: synthetic._Impressions,
    chunks: list[np.ndarray],
    known: list[np.ndarray],
    key_of: Callable[[np.ndarray], np.ndarray],
    design_of: Callable[[np.ndarray], np.ndarray],
    precision: np.ndarray,
    n_keys: int,
    iterations: int,
) -> np.ndarray:
    """[n_keys, k]: per key, the mode of N(0, diag(1/precision)) × the logistic likelihood of
    the clicks of the impressions ``chunks`` (arrays of impression rows), whose logit is
    ``known + design_of(rows) · theta[key_of(rows)]`` (``known``: per chunk, [n]; the design
    [n, k] is made again per step, not kept: 23M × k float64 on full data), by Newton from 0
    (batched k×k solves)."""
    prec = torch.from_numpy(precision)
    k = len(precision)
    theta = torch.zeros(n_keys, k, dtype=torch.float64)
    for _ in range(iterations):
        grad = -theta * prec
        hess = torch.diag_embed(prec.expand(n_keys, k)).clone()
        for chunk, offset in zip(chunks, known, strict=True):
            keys, z = torch.from_numpy(key_of(chunk)), torch.from_numpy(design_of(chunk))
            p = torch.sigmoid(torch.from_numpy(offset) + (z * theta[keys]).sum(1))
            y = torch.from_numpy(imp.clk[chunk].astype(np.float64))
            grad.index_add_(0, keys, z * (y - p)[:, None])
            hess.index_add_(0, keys, (p * (1 - p))[:, None, None] * z[:, :, None] * z[:, None, :])
        theta += torch.linalg.solve(hess, grad)
    return theta.numpy()


def join_rows(sim: synthetic.Simulation, rows: np.ndarray, samples: Path, seed: int) -> np.ndarray:
    """For each eval sample (``samples/eval``, files in name order, as the unshuffled eval loader
    reads them), the impression index into ``rows`` it was built from; ValueError if any sample
    does not join."""
    ids = synthetic.public_ids(sim.spec, seed)
    imp = sim.impressions
    files = sorted((samples / "eval").glob("*.parquet"))
    if not files:
        raise FileNotFoundError(f"{samples}/eval: no Parquet files; build the samples first")
    cols = ["user_id", "adgroup_id", "time_stamp", tb.LABEL_COLUMN, tb.ORACLE_COLUMN]
    table = pq.read_table(files, columns=cols)
    if table.num_rows != len(rows):
        raise ValueError(
            f"{samples}/eval has {table.num_rows} rows, the simulation's eval day {len(rows)}: "
            "were the samples generated with this --size and --seed?"
        )
    mine = [
        ids.user[imp.user[rows]],
        ids.ad[imp.ad[rows]],
        imp.time[rows],
        imp.clk[rows].astype(np.int64),
        imp.p[rows].view(np.int32).astype(np.int64),
    ]
    theirs = [table[c].fill_null(-1).to_numpy().astype(np.int64) for c in cols[:-1]] + [
        table[tb.ORACLE_COLUMN].to_numpy().astype(np.float32).view(np.int32).astype(np.int64)
    ]
    a, b = np.lexsort(mine), np.lexsort(theirs)  # the same order of the same keys
    for m, t, name in zip(mine, theirs, ["user_id", *cols[1:]], strict=True):
        if not np.array_equal(m[a], t[b]):
            raise ValueError(
                f"{samples}/eval does not join the simulation's eval impressions on {name}: "
                "were the samples generated with this --size and --seed?"
            )
    out = np.empty(len(rows), np.int64)
    out[b] = a
    return out


def _fit_logistic(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Weights w (with the intercept last) of the logistic regression of ``y`` on ``x``."""
    xb = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    w = torch.zeros(xb.shape[1], dtype=x.dtype, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=200, tolerance_grad=1e-9, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(xb @ w, y)
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


def cross_fitted(features: np.ndarray, labels: np.ndarray, fold: np.ndarray) -> dict[str, Any]:
    """Two-fold fit of ``labels`` on ``features`` [N, K] (fold: bool per row): the out-of-fold
    score's AUC and each fold's coefficients."""
    x = torch.from_numpy(features.astype(np.float64))
    y = torch.from_numpy(labels.astype(np.float64))
    score = torch.empty(len(y), dtype=torch.float64)
    coefs = []
    for f in (True, False):
        train = torch.from_numpy(fold != f)
        w = _fit_logistic(x[train], y[train])
        score[~train] = x[~train] @ w[:-1] + w[-1]
        coefs.append([round(float(c), 5) for c in w])
    return {"auc": auc(score.numpy(), labels), "coefficients": coefs}


def misses(
    logit: np.ndarray,
    labels: np.ndarray,
    terms: dict[str, np.ndarray],
    users: np.ndarray,
    cate_seen: np.ndarray,
) -> dict[str, Any]:
    """The model alone, then + each term, + the knowable terms, + the learnable terms, on one
    set of rows; the learnable terms alone (no model); the terms the logit carries, overall
    and by the popularity of the row's cate (``cate_seen``: its training impressions)."""
    fold = (users % 2) == 0
    base = cross_fitted(logit[:, None], labels, fold)
    out: dict[str, Any] = {"rows": len(labels), "model_auc": auc(logit, labels),
                           "model_refit": base, "plus": {}}  # fmt: skip
    for name in TERMS:
        fit = cross_fitted(np.stack([logit, terms[name]], 1), labels, fold)
        fit["auc_gain"] = fit["auc"] - base["auc"]
        fit["term_alone_auc"] = auc(terms[name], labels)
        out["plus"][name] = fit
    for name, parts in (("knowable", KNOWABLE), ("learnable", LEARNABLE)):
        fit = cross_fitted(np.stack([logit, *(terms[k] for k in parts)], 1), labels, fold)
        fit["auc_gain"] = fit["auc"] - base["auc"]
        out["plus"][name] = fit
    out["learnable_alone"] = cross_fitted(np.stack([terms[k] for k in LEARNABLE], 1), labels, fold)
    out["expressed"] = expressed(logit, terms)
    out["by_cate_popularity"] = by_cate_popularity(logit, terms, cate_seen)
    return out


def expressed(logit: np.ndarray, terms: dict[str, np.ndarray]) -> dict[str, Any]:
    """How strongly the logit carries each true term: its least-squares coefficients on the
    true terms of :data:`TERMS` at once (1 for the oracle's logit); and how strongly the
    learnable ad terms carry the true ones (the slope of each on its true term: the most a
    model of this data can express)."""
    true = [k for k in TERMS if not k.endswith("_learnable")]
    x = np.stack([*(terms[k] for k in true), np.ones(len(logit))], 1)
    coef = np.linalg.lstsq(x, logit, rcond=None)[0]
    carried = {k: round(float(c), 4) for k, c in zip(true, coef[:-1], strict=True)}
    out: dict[str, Any] = {"logit": carried}
    out["learnable"] = {
        k: round(float(np.polyfit(terms[k], terms[f"{k}_learnable"], 1)[0]), 4)
        for k in ("ad_bias", "demographic_match")
        if f"{k}_learnable" in terms
    }
    return out


CATE_BUCKETS = (0, 1_000, 10_000, 100_000)  # a cate's training impressions: bucket edges


def by_cate_popularity(
    logit: np.ndarray, terms: dict[str, np.ndarray], cate_seen: np.ndarray
) -> dict[str, Any]:
    """Per bucket of the row's cate's training impressions (:data:`CATE_BUCKETS`): how strongly
    the logit carries the demographic match's cate part and its ad part (least-squares
    coefficients on the true terms, the match split in two), and how strongly the learnable
    cate part carries the true one. A bucket of fewer than 1,000 rows is left out."""
    parts = [k for k in TERMS if not k.endswith("_learnable") and k != "demographic_match"]
    cate = terms["demographic_cate"]
    split = {"demographic_cate": cate, "demographic_ad": terms["demographic_match"] - cate}
    named = {**split, **{k: terms[k] for k in parts}}
    out: dict[str, Any] = {}
    for lo, hi in zip(CATE_BUCKETS, (*CATE_BUCKETS[1:], None), strict=True):
        rows = (cate_seen >= lo) & (cate_seen < (hi or np.inf))
        if rows.sum() < 1000:
            continue
        x = np.stack([*(v[rows] for v in named.values()), np.ones(int(rows.sum()))], 1)
        coef = np.linalg.lstsq(x, logit[rows], rcond=None)[0]
        out[f"[{lo}, {hi or 'inf'})"] = {
            "rows": int(rows.sum()),
            "logit": {k: round(float(coef[i]), 4) for i, k in enumerate(split)},
            "learnable_cate": round(float(np.polyfit(
                cate[rows], terms["demographic_cate_learnable"][rows], 1)[0]), 4),
        }  # fmt: skip
    return out


def tail_misses(size: str, seed: int, samples: Path, predictions: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    sim = synthetic.simulate_world(size, seed=seed)
    train, evaluation = split_rows(sim.impressions.time)
    rows = np.flatnonzero(evaluation)
    order = join_rows(sim, rows, samples, seed)  # sample i is impression rows[order[i]]
    preds = pq.read_table(predictions)
    if preds.num_rows != len(rows):
        raise ValueError(f"{predictions}: {preds.num_rows} rows, the eval samples {len(rows)}")
    labels = preds["label"].to_numpy().astype(np.int8)
    if not np.array_equal(labels, sim.impressions.clk[rows][order]):
        raise ValueError(
            f"{predictions}: its labels are not the eval samples' in order; write it with "
            "python -m train evaluate --predictions on these samples"
        )
    if preds["tail"].null_count:
        raise ValueError(f"{predictions}: no tail column; evaluate with --train")
    tail = preds["tail"].to_numpy(zero_copy_only=False).astype(bool)
    p = np.clip(preds["probability"].to_numpy().astype(np.float64), 1e-7, 1 - 1e-7)
    logit = np.log(p) - np.log1p(-p)
    learned = learned_terms(sim, train)
    terms = {k: v[order] for k, v in eval_terms(sim, rows, learned).items()}
    users = sim.impressions.user[rows][order]
    w, imp = sim.world, sim.impressions
    cate_seen = np.bincount(w.ad_cate[imp.ad[train]], minlength=len(w.cate_emb))
    row_cate_seen = cate_seen[w.ad_cate[imp.ad[rows]]][order]
    return {
        "bench": "tail_misses",
        "size": size,
        "seed": seed,
        "samples": str(samples),
        "predictions": str(predictions),
        "eval_rows": len(rows),
        "tail": misses(logit[tail], labels[tail], {k: v[tail] for k, v in terms.items()},
                       users[tail], row_cate_seen[tail]),
        "head": misses(logit[~tail], labels[~tail], {k: v[~tail] for k, v in terms.items()},
                       users[~tail], row_cate_seen[~tail]),
        "seconds": time.perf_counter() - t0,
    }  # fmt: skip


def summary(result: dict[str, Any]) -> str:
    lines = []
    for part in ("tail", "head"):
        r = result[part]
        lines.append(f"{part}: {r['rows']:,} rows, model AUC {r['model_auc']:.4f} "
                     f"(refit {r['model_refit']['auc']:.4f}); the learnable terms alone "
                     f"{r['learnable_alone']['auc']:.4f}")  # fmt: skip
        lines.append(f"  the logit carries the terms at {r['expressed']['logit']}; the learnable "
                     f"ad terms carry theirs at {r['expressed']['learnable']}")  # fmt: skip
        lines.append(f"  {'+ term':18} {'auc':>8} {'gain':>8} {'alone':>8}  coef (fold 1)")
        for name, fit in r["plus"].items():
            alone = fit.get("term_alone_auc")
            lines.append(f"  {name:18} {fit['auc']:8.4f} {fit['auc_gain']:+8.4f} "
                         f"{'       -' if alone is None else f'{alone:8.4f}'}  "
                         f"{fit['coefficients'][0][:-1]}")  # fmt: skip
        lines.append("  by the cate's training impressions: the logit carries the demographic "
                     "match's cate and ad parts at; the learnable cate part carries it at")  # fmt: skip
        for bucket, b in r["by_cate_popularity"].items():
            lines.append(f"    {bucket:18} {b['rows']:>9,} rows  {b['logit']}  "
                         f"{b['learnable_cate']}")  # fmt: skip
    return "\n".join(lines)


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_tail_misses", description=plain(__doc__),
               epilog=EXAMPLE)  # fmt: skip
    p.add_argument("--size", default="small", choices=list(synthetic.SIZES),
                   help="the synthetic data size the samples were generated at")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the generator's seed")
    p.add_argument("--samples", type=Path, required=True, help="the samples dir (with eval/)")
    p.add_argument("--predictions", type=Path, required=True,
                   help="python -m train evaluate --predictions's file for these samples")  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    result = tail_misses(args.size, args.seed, args.samples, args.predictions)
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    write_result(args.out, result)
    print(summary(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
