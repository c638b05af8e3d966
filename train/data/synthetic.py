"""A generator for the four Taobao CSV files from a planted click model with a known oracle.

The files have the published headers and quirks (``user_profile.csv``'s trailing space, empty
pvalue_level / new_user_class_level fields, ~7 % of users without a profile row, ``NULL``
brands, pid strings such as ``430548_1007``, Unix-second timestamps with same-second ties).
Beside them, ``raw_sample_oracle.parquet`` holds each impression's true click probability
(row-aligned with ``raw_sample.csv``), which :func:`train.data.taobao.build_samples` attaches as
``_oracle_p``.

The world (all draws seeded, reproducible):

- cates with Zipf popularity and latent vectors; ads with a cate, campaign → customer → brand
  (a quarter of customers without brand), a log-normal price, Zipf popularity, and a latent
  vector near their cate's;
- users with a profile (gender × age → cms_group_id, ...), three favourite cates, and a latent
  vector from their favourite cates and demographics; activity (page views per user) follows a
  truncated power law with an exponential cut-off (Zipf-like: most users are seen a few times, a
  few hundreds of times), its exponent chosen for a mean click-sequence length of about 4; a
  page view shows 1 + Geometric(0.7) ads in the same second;
- exposure: an impression's ad comes from one of the user's favourite cates (prob. 0.6, the
  cate's popular ads first) or from global popularity (Zipf, exponent 1.3), which leaves many
  ads seen fewer than 3 times;
- click: ``logit = b0 + 0.6·match(user, ad) + user bias + ad bias + pid + price × pvalue_level
  + 0.7·log1p(#same cate) + 0.5·log1p(#same brand)`` among the user's last 20 clicks *strictly
  before the impression's second* — the same rule as the samples' click sequence, so the
  DIN tower sees what the oracle used. ``b0`` is calibrated on a pilot run for CTR ≈ 5 %.

Impressions are simulated in time order per user, vectorized across users: step ``k`` handles
every user's ``k``-th page view at once (users sorted by activity, so the active users are a
prefix), with ring buffers of each user's last clicks. Measured (seed 0): ``small`` 300K samples,
CTR 5.1 %, mean sequence 4.2, 1 s; ``full`` 26.6M samples, CTR 5.0 %, mean sequence 3.7 (max
250 earlier clicks), 20 % of ads and 32 % of users seen < 3 times, 43 s and 3.4 GB peak RSS;
``medium`` (every count of ``full`` / 8) 3.3M samples, CTR 5.0 %, mean sequence 3.7, 18 % of
ads and 32 % of users seen < 3 times, 13 s (``all``, with the build: 37 s, 0.8 GB peak RSS).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from train.data import taobao as tb

PIDS = ("430548_1007", "430539_1007")
SPAN_SECONDS = 8 * 86400  # 2017-05-06 .. 2017-05-13, UTC+8


@dataclass(frozen=True)
class SizeSpec:
    """Counts of one size; ``full`` is the public dataset's."""

    name: str
    users: int
    ads: int
    samples: int
    cates: int
    campaigns: int
    customers: int
    brands: int
    max_pageviews: int  # activity tail: page views of the most active users


SIZES = {
    "tiny": SizeSpec("tiny", 400, 800, 5_000, 40, 400, 250, 200, 300),
    "small": SizeSpec("small", 20_000, 30_000, 300_000, 600, 15_000, 9_000, 6_000, 2_000),
    # ``full`` / 8, every count (same ratios, same activity law: max_pageviews is per user)
    "medium": SizeSpec("medium", 142_716, 105_851, 3_319_745, 846, 52_930, 31_984, 12_477, 5_000),
    "full": SizeSpec(
        "full", 1_141_729, 846_811, 26_557_961, 6_769, 423_436, 255_875, 99_814, 5_000
    ),
}


@dataclass(frozen=True)
class ClickModel:
    """The planted model's parameters (see the module doc)."""

    ctr: float = 0.05
    dim: int = 8
    match: float = 0.6
    user_bias_sd: float = 0.3
    ad_bias_sd: float = 0.3
    pid_bias: tuple[float, float] = (0.0, -0.2)
    price: float = 0.15  # × (log price − mean) × sensitivity of pvalue_level
    hist_cate: float = 0.7
    hist_brand: float = 0.5
    history: int = 20  # clicks the model looks back at
    fav_exposure: float = 0.6
    pageview_continue: float = 0.3  # P(one more ad in the same page view / second)
    sequence_mean: float = 4.0  # mean earlier clicks per sample (before the cap of 100)
    ad_zipf: float = 1.3  # global ad popularity (rank + 20)^-ad_zipf
    fav_skew: float = 8.0  # within a favourite cate, ad = count · u^fav_skew (popular first)
    no_profile: float = 0.07
    null_brand_customers: float = 0.25
    pilot_users: int = 20_000


@dataclass
class _World:
    cate_emb: np.ndarray  # [C, d]
    ad_cate: np.ndarray  # [A] cate index; ads sorted by (cate, popularity desc)
    ad_brand: np.ndarray  # [A] brand index, -1 = NULL
    ad_campaign: np.ndarray
    ad_customer: np.ndarray
    ad_price: np.ndarray  # float64
    ad_emb: np.ndarray  # [A, d]
    ad_bias: np.ndarray
    ad_cdf: np.ndarray  # global popularity
    cate_start: np.ndarray  # [C + 1] ad index range per cate
    user_emb: np.ndarray  # [U, d]: favourite cates' mean + 0.5·demo_emb[group] + 0.5·noise
    demo_emb: np.ndarray  # [14, d] by cms_group_id
    user_bias: np.ndarray
    user_fav: np.ndarray  # [U, 3] cate index
    user_price_sens: np.ndarray  # by pvalue_level
    profile: dict[str, np.ndarray]  # raw profile columns (nullable via masks below)
    profile_missing: dict[str, np.ndarray]
    pageviews: np.ndarray  # [U] page views per user
    match_scale: float = 1.0
    mean_log_price: float = 0.0


@dataclass
class _Impressions:
    user: np.ndarray  # user index
    time: np.ndarray  # Unix seconds
    ad: np.ndarray  # ad index
    pid: np.ndarray  # index into PIDS
    clk: np.ndarray  # int8
    p: np.ndarray  # float32 true probability
    prior_clicks: np.ndarray  # the user's clicks strictly before this second
    same_cate: np.ndarray  # int8: of the user's last ``history`` clicks, those of the ad's cate
    same_brand: np.ndarray  # int8: ... of the ad's brand (never a NULL brand)


@dataclass
class GenerateReport:
    size: str
    seed: int
    samples: int
    users: int
    ads: int
    ctr: float
    b0: float
    mean_sequence_length: float  # prior clicks, capped at 100
    samples_at_100: int
    max_prior_clicks: int
    ads_seen_lt3: float  # fraction of ads with < 3 impressions
    users_seen_lt3: float
    seconds: float = 0.0


def _zipf_cdf(n: int, s: float, offset: float, rng: np.random.Generator) -> np.ndarray:
    """CDF of Zipf weights (rank + offset)^-s, ranks assigned to items at random."""
    w = (np.arange(n) + offset) ** -s
    w = w[rng.permutation(n)]
    cdf = np.cumsum(w)
    return cdf / cdf[-1]


def _draw(cdf: np.ndarray, rng: np.random.Generator, size: int) -> np.ndarray:
    return np.minimum(np.searchsorted(cdf, rng.random(size)), len(cdf) - 1)


def _activity_weights(m: np.ndarray, alpha: float, mean: float) -> np.ndarray:
    """P(m) ∝ m^-alpha · exp(-m/kappa) with kappa solved so that E[m] = mean."""
    lo, hi = 1.0, 1e7
    for _ in range(60):
        kappa = math.sqrt(lo * hi)
        w = m**-alpha * np.exp(-m / kappa)
        if (m * w).sum() / w.sum() > mean:
            hi = kappa
        else:
            lo = kappa
    return w / w.sum()


def _activity(spec: SizeSpec, model: ClickModel, rng: np.random.Generator) -> np.ndarray:
    """Page views per user, a truncated power law with cut-off (Zipf-like).

    The mean is fixed by samples/users; the exponent is chosen so that the mean number of
    earlier clicks per sample, ≈ ctr · ads per page view · E[m²]/E[m] / 2 (× 1.2 for the
    history's feedback on CTR), is ``model.sequence_mean``.
    """
    per_pv = 1 / (1 - model.pageview_continue)
    mean_pv = spec.samples / spec.users / per_pv
    want = model.sequence_mean / (model.ctr * per_pv / 2 * 1.2)  # target E[m²]/E[m]
    m = np.arange(1, spec.max_pageviews + 1, dtype=np.float64)
    best = None
    for alpha in np.arange(0.5, 2.5, 0.02):
        w = _activity_weights(m, float(alpha), mean_pv)
        if abs((m * w).sum() - mean_pv) > 0.01 * mean_pv:
            continue  # this exponent cannot reach the mean below max_pageviews
        ratio = (m * m * w).sum() / (m * w).sum()
        if best is None or abs(ratio - want) < best[0]:
            best = (abs(ratio - want), w)
    if best is None:
        raise ValueError(f"{spec.name}: no activity law has {mean_pv:.1f} page views per user")
    return (_draw(np.cumsum(best[1]), rng, spec.users) + 1).astype(np.int64)


def _make_world(spec: SizeSpec, model: ClickModel, rng: np.random.Generator) -> _World:
    d, n_ads, n_users = model.dim, spec.ads, spec.users
    cate_emb = rng.normal(size=(spec.cates, d)) / math.sqrt(d)
    cate_cdf = _zipf_cdf(spec.cates, 1.0, 2.0, rng)
    cate = np.concatenate(
        [np.arange(min(spec.cates, n_ads)), _draw(cate_cdf, rng, max(n_ads - spec.cates, 0))]
    )
    popularity = (rng.permutation(n_ads) + 20.0) ** -model.ad_zipf
    order = np.lexsort((-popularity, cate))  # ads sorted by (cate, popularity desc)
    cate, popularity = cate[order], popularity[order]
    campaign = rng.integers(spec.campaigns, size=n_ads)
    camp_customer = rng.integers(spec.customers, size=spec.campaigns)
    customer = camp_customer[campaign]
    cust_brand = rng.integers(spec.brands, size=spec.customers)
    cust_brand[rng.random(spec.customers) < model.null_brand_customers] = -1
    price = np.maximum(np.round(rng.lognormal(math.log(150), 1.0, n_ads), 2), 0.01)
    ad_cdf = np.cumsum(popularity)
    # users: profile, favourite cates, latent vector
    gender = rng.choice([1, 2], size=n_users, p=[0.35, 0.65])
    age = rng.choice(7, size=n_users, p=[0.01, 0.1, 0.3, 0.3, 0.17, 0.1, 0.02])
    profile = {
        "cms_segid": np.where(rng.random(n_users) < 0.8, 0, rng.integers(1, 97, n_users)),
        "cms_group_id": (gender - 1) * 7 + age,
        "final_gender_code": gender,
        "age_level": age,
        "pvalue_level": rng.choice([1, 2, 3], size=n_users, p=[0.3, 0.6, 0.1]),
        "shopping_level": rng.choice([1, 2, 3], size=n_users, p=[0.05, 0.15, 0.8]),
        "occupation": (rng.random(n_users) < 0.06).astype(np.int64),
        "new_user_class_level": rng.choice([1, 2, 3, 4], size=n_users, p=[0.1, 0.4, 0.3, 0.2]),
    }
    missing = {
        "pvalue_level": rng.random(n_users) < 0.5,
        "new_user_class_level": rng.random(n_users) < 0.3,
    }
    fav = _draw(cate_cdf, rng, 3 * n_users).reshape(n_users, 3)
    demo_emb = rng.normal(size=(14, d)) / math.sqrt(d)
    user_emb = (
        cate_emb[fav].mean(axis=1)
        + 0.5 * demo_emb[profile["cms_group_id"]]
        + 0.5 * rng.normal(size=(n_users, d)) / math.sqrt(d)
    )
    sens = np.array([0.0, 1.5, 1.0, 0.5])[profile["pvalue_level"]]
    sens[missing["pvalue_level"]] = 1.0  # the user has a sensitivity, the data does not show it
    world = _World(
        cate_emb=cate_emb,
        ad_cate=cate,
        ad_brand=cust_brand[customer],
        ad_campaign=campaign,
        ad_customer=customer,
        ad_price=price,
        ad_emb=cate_emb[cate] + 0.7 * rng.normal(size=(n_ads, d)) / math.sqrt(d),
        ad_bias=rng.normal(0, model.ad_bias_sd, n_ads),
        ad_cdf=ad_cdf / ad_cdf[-1],
        cate_start=np.searchsorted(cate, np.arange(spec.cates + 1)),
        user_emb=user_emb,
        demo_emb=demo_emb,
        user_bias=rng.normal(0, model.user_bias_sd, n_users),
        user_fav=fav,
        user_price_sens=sens,
        profile=profile,
        profile_missing=missing,
        pageviews=_activity(spec, model, rng),
        mean_log_price=float(np.log(price).mean()),
    )
    sample_u = rng.integers(n_users, size=20_000)
    sample_a = _draw(world.ad_cdf, rng, 20_000)
    world.match_scale = float((user_emb[sample_u] * world.ad_emb[sample_a]).sum(1).std()) or 1.0
    return world


def _layout(
    pageviews: np.ndarray, total: int | None, model: ClickModel, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Page views in step-major order (step k = every user's k-th page view; users by rank).

    Returns (pv_user [P] rank, pv_time [P], pv_off [steps + 1], sizes [P]).
    ``pageviews`` must be sorted descending. ``total``: adjust sizes to exactly this many ads.
    """
    n_users, steps = len(pageviews), int(pageviews[0])
    active = np.searchsorted(-pageviews, -np.arange(steps), side="left")  # users with m > k
    pv_off = np.zeros(steps + 1, np.int64)
    np.cumsum(active, out=pv_off[1:])
    n_pv = int(pv_off[-1])
    # times: per user m distinct seconds, sorted; drawn user-major, then placed step-major
    user_major = np.repeat(np.arange(n_users), pageviews)
    k = np.arange(n_pv) - np.repeat(np.cumsum(pageviews) - pageviews, pageviews)
    x = rng.integers(0, SPAN_SECONDS - pageviews[user_major])
    x = np.sort(user_major * SPAN_SECONDS + x) - user_major * SPAN_SECONDS
    t0 = tb.day_start(tb.TRAIN_FIRST_DAY)
    pv_time = np.empty(n_pv, np.int64)
    pv_time[pv_off[k] + user_major] = t0 + x + k  # strictly increasing per user
    pv_user = np.empty(n_pv, np.int64)
    pv_user[pv_off[k] + user_major] = user_major
    sizes = rng.geometric(1 - model.pageview_continue, n_pv)
    if total is not None:
        diff = total - int(sizes.sum())
        if diff > 0:
            np.add.at(sizes, rng.integers(n_pv, size=diff), 1)
        while diff < 0:
            big = np.flatnonzero(sizes > 1)
            if len(big) == 0:
                raise ValueError("cannot reach the sample count; raise samples or lower users")
            cut = rng.choice(big, size=min(-diff, len(big)), replace=False)
            sizes[cut] -= 1
            diff += len(cut)
    return pv_user, pv_time, pv_off, sizes


def _simulate(
    world: _World,
    users: np.ndarray,
    total: int | None,
    b0: float,
    model: ClickModel,
    rng: np.random.Generator,
) -> _Impressions:
    """Impressions of ``users`` (indices), step by step; see the module doc."""
    order = np.argsort(-world.pageviews[users], kind="stable")
    users = users[order]
    pv_user, pv_time, pv_off, sizes = _layout(world.pageviews[users], total, model, rng)
    n_imp = int(sizes.sum())
    imp_off = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=imp_off[1:])
    imp_pv = np.repeat(np.arange(len(sizes)), sizes)
    rank = pv_user[imp_pv]
    pv_pid = (rng.random(len(sizes)) < 0.4).astype(np.int8)
    # exposure: favourite cate (popular ads first) or global popularity
    fav = rng.random(n_imp) < model.fav_exposure
    ad = _draw(world.ad_cdf, rng, n_imp)
    cate = world.user_fav[users[rank[fav]], rng.integers(3, size=int(fav.sum()))]
    lo, cnt = world.cate_start[cate], np.diff(world.cate_start)[cate]
    skewed = cnt * rng.random(len(cate)) ** model.fav_skew
    ad[fav] = lo + np.minimum(skewed.astype(np.int64), cnt - 1)
    clk = np.zeros(n_imp, np.int8)
    p = np.zeros(n_imp, np.float32)
    prior = np.zeros(n_imp, np.int64)
    n_cate, n_brand = np.zeros(n_imp, np.int8), np.zeros(n_imp, np.int8)
    K = model.history
    hist_cate = np.full((len(users), K), -1, np.int64)
    hist_brand = np.full((len(users), K), -1, np.int64)
    hist_n = np.zeros(len(users), np.int64)
    for k in range(len(pv_off) - 1):
        a, b = imp_off[pv_off[k]], imp_off[pv_off[k + 1]]
        r, adk = rank[a:b], ad[a:b]
        u = users[r]
        c, br = world.ad_cate[adk], world.ad_brand[adk]
        same_c = (hist_cate[r] == c[:, None]).sum(1)
        same_b = (hist_brand[r] == np.where(br < 0, -3, br)[:, None]).sum(1)
        logit = (
            b0
            + model.match * (world.user_emb[u] * world.ad_emb[adk]).sum(1) / world.match_scale
            + world.user_bias[u]
            + world.ad_bias[adk]
            + np.asarray(model.pid_bias)[pv_pid[imp_pv[a:b]]]
            - model.price
            * world.user_price_sens[u]
            * (np.log(world.ad_price[adk]) - world.mean_log_price)
            + model.hist_cate * np.log1p(same_c)
            + model.hist_brand * np.log1p(same_b)
        )
        pk = 1.0 / (1.0 + np.exp(-logit))
        ck = rng.random(b - a) < pk
        p[a:b], clk[a:b], prior[a:b] = pk, ck, hist_n[r]
        n_cate[a:b], n_brand[a:b] = same_c, same_b
        hit = np.flatnonzero(ck)
        if len(hit):  # append the clicks to the ring buffers (impressions are grouped by user)
            rc = r[hit]
            first = np.r_[True, rc[1:] != rc[:-1]]
            starts = np.flatnonzero(first)
            j = np.arange(len(rc)) - np.repeat(starts, np.diff(np.r_[starts, len(rc)]))
            slot = (hist_n[rc] + j) % K
            hist_cate[rc, slot] = c[hit]
            hist_brand[rc, slot] = np.where(br[hit] < 0, -2, br[hit])
            np.add.at(hist_n, rc, 1)
    return _Impressions(
        users[rank], pv_time[imp_pv], ad, pv_pid[imp_pv], clk, p, prior, n_cate, n_brand
    )


def _calibrate(world: _World, model: ClickModel, seed: int) -> float:
    """b0 for CTR ≈ model.ctr, by a few secant steps on a pilot run (common random numbers)."""
    n_users = len(world.pageviews)
    pilot = np.random.default_rng([seed, 1])
    users = np.sort(pilot.choice(n_users, size=min(n_users, model.pilot_users), replace=False))
    target = math.log(model.ctr / (1 - model.ctr))
    b0 = target
    for _ in range(4):
        imp = _simulate(world, users, None, b0, model, np.random.default_rng([seed, 2]))
        ctr = float(imp.p.mean())
        b0 += target - math.log(ctr / (1 - ctr))
    return b0


def _write_csv(path: Path, header: tuple[str, ...], table: pa.Table) -> None:
    with path.open("wb") as f:
        f.write((",".join(header) + "\n").encode())
        pcsv.write_csv(
            table,
            f,
            pcsv.WriteOptions(include_header=False, quoting_style="none", batch_size=1 << 16),
        )


def _ids(rng: np.random.Generator, n: int, high: int) -> np.ndarray:
    """n distinct positive ids below ``high`` (at least n + 1), in random order."""
    return 1 + rng.choice(max(high, n + 1) - 1, size=n, replace=False)


@dataclass(frozen=True)
class _Ids:
    """The public ids of the world's users, ads, cates, ... (index → id)."""

    user: np.ndarray
    ad: np.ndarray
    cate: np.ndarray
    campaign: np.ndarray
    customer: np.ndarray
    brand: np.ndarray

    @classmethod
    def draw(cls, spec: SizeSpec, rng: np.random.Generator) -> _Ids:
        return cls(
            user=_ids(rng, spec.users, spec.users + 1),
            ad=_ids(rng, spec.ads, spec.ads + 1),
            cate=_ids(rng, spec.cates, 2 * spec.cates),
            campaign=_ids(rng, spec.campaigns, spec.campaigns + 1),
            customer=_ids(rng, spec.customers, spec.customers + 1),
            brand=_ids(rng, spec.brands, int(4.6 * spec.brands)),  # sparse, like the real ids
        )


def _write_ads(out: Path, world: _World, ids: _Ids, rng: np.random.Generator) -> None:
    brand = world.ad_brand
    ads = pa.table(
        {
            "adgroup_id": ids.ad,
            "cate_id": ids.cate[world.ad_cate],
            "campaign_id": ids.campaign[world.ad_campaign],
            "customer": ids.customer[world.ad_customer],
            "brand": np.where(brand < 0, "NULL", ids.brand[np.maximum(brand, 0)].astype(str)),
            "price": world.ad_price,
        }
    )
    _write_csv(out / tb.AD_FEATURE, tb.AD_FEATURE_HEADER, ads.take(rng.permutation(len(brand))))


def _write_profiles(
    out: Path, model: ClickModel, world: _World, ids: _Ids, rng: np.random.Generator
) -> None:
    rows = np.flatnonzero(rng.random(len(ids.user)) >= model.no_profile)
    prof = {"userid": ids.user[rows]}
    for name, values in world.profile.items():
        miss = world.profile_missing.get(name)
        prof[name] = pa.array(values[rows], mask=None if miss is None else miss[rows])
    _write_csv(out / tb.USER_PROFILE, tb.USER_PROFILE_HEADER, pa.table(prof))


def _write_samples(out: Path, imp: _Impressions, ids: _Ids, rng: np.random.Generator) -> None:
    """raw_sample.csv (shuffled: the file is not in time order) and the row-aligned oracle."""
    perm = rng.permutation(len(imp.user))
    pid = pa.DictionaryArray.from_arrays(pa.array(imp.pid[perm].astype(np.int32)), pa.array(PIDS))
    user, ad = ids.user[imp.user[perm]], ids.ad[imp.ad[perm]]
    raw = pa.table(
        {
            "user": user,
            "time_stamp": imp.time[perm],
            "adgroup_id": ad,
            "pid": pid.cast(pa.string()),
            "nonclk": (1 - imp.clk[perm]).astype(np.int8),
            "clk": imp.clk[perm],
        }
    )
    _write_csv(out / tb.RAW_SAMPLE, tb.RAW_SAMPLE_HEADER, raw)
    del raw
    oracle = pa.table({"user": user, "adgroup_id": ad, "p": imp.p[perm]})
    pq.write_table(oracle, out / tb.ORACLE_FILE)


def _write_behavior(
    out: Path, world: _World, imp: _Impressions, ids: _Ids, rng: np.random.Generator
) -> None:
    """A "pv" per click and some "cart"/"fav"/"buy" after it (build_samples does not use it)."""
    hit = np.flatnonzero(imp.clk == 1)
    extra = hit[rng.random(len(hit)) < 0.15]
    rows = np.concatenate([hit, extra])
    tags = np.concatenate([np.zeros(len(hit)), rng.integers(1, 4, len(extra))]).astype(np.int32)
    brand = world.ad_brand[imp.ad[rows]]
    btag = pa.DictionaryArray.from_arrays(tags, pa.array(["pv", "cart", "fav", "buy"]))
    log = pa.table(
        {
            "user": ids.user[imp.user[rows]],
            "time_stamp": imp.time[rows] + (tags > 0) * rng.integers(1, 600, len(rows)),
            "btag": btag.cast(pa.string()),
            "cate": ids.cate[world.ad_cate[imp.ad[rows]]],
            "brand": pa.array(ids.brand[np.maximum(brand, 0)], mask=brand < 0),
        }
    )
    _write_csv(out / tb.BEHAVIOR_LOG, tb.BEHAVIOR_LOG_HEADER, log.take(rng.permutation(len(rows))))


def _files_rng(seed: int) -> np.random.Generator:
    """The generator of the written files' draws (ids first, then the files' own)."""
    return np.random.default_rng([seed, 4])


def public_ids(spec: SizeSpec, seed: int) -> _Ids:
    """The ids :func:`generate` writes for world indices (``ids.user[i]`` is user i's id in the
    files), drawn as it draws them: to join diagnostics on :func:`simulate_world` to the files."""
    return _Ids.draw(spec, _files_rng(seed))


def _write_files(
    out: Path,
    spec: SizeSpec,
    model: ClickModel,
    world: _World,
    imp: _Impressions,
    rng: np.random.Generator,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    ids = _Ids.draw(spec, rng)  # the first draws of rng: public_ids
    _write_ads(out, world, ids, rng)
    _write_profiles(out, model, world, ids, rng)
    _write_samples(out, imp, ids, rng)
    _write_behavior(out, world, imp, ids, rng)


@dataclass
class Simulation:
    """The world and impressions that :func:`generate` writes, before any file is written."""

    spec: SizeSpec
    model: ClickModel
    world: _World
    b0: float  # the calibrated intercept of the click logit
    impressions: _Impressions  # in simulation order (raw_sample.csv is a permutation of it)


def simulate_world(
    size: str | SizeSpec, *, seed: int = 0, model: ClickModel | None = None
) -> Simulation:
    """The planted world and its impressions, drawn exactly as :func:`generate` draws them
    (same seeds and calls): for diagnostics that need more than the written files hold."""
    spec = SIZES[size] if isinstance(size, str) else size
    model = model or ClickModel()
    rng = np.random.default_rng([seed, 0])
    world = _make_world(spec, model, rng)
    b0 = _calibrate(world, model, seed)
    imp = _simulate(
        world, np.arange(spec.users), spec.samples, b0, model, np.random.default_rng([seed, 3])
    )
    return Simulation(spec, model, world, b0, imp)


def generate(
    size: str | SizeSpec, out_dir: str | Path, *, seed: int = 0, model: ClickModel | None = None
) -> GenerateReport:
    """Write ``out_dir/raw/{raw_sample,ad_feature,user_profile,behavior_log}.csv`` and the oracle.

    Example: ``generate("small", "data/small", seed=0)``; also writes
    ``out_dir/generate_report.json``.
    """
    started = time.perf_counter()
    sim = simulate_world(size, seed=seed, model=model)
    spec, model, world, b0, imp = sim.spec, sim.model, sim.world, sim.b0, sim.impressions
    out = Path(out_dir)
    _write_files(out / "raw", spec, model, world, imp, _files_rng(seed))
    ads_seen = np.bincount(imp.ad, minlength=spec.ads)
    users_seen = np.bincount(imp.user, minlength=spec.users)
    seq = np.minimum(imp.prior_clicks, 100)
    report = GenerateReport(
        size=spec.name,
        seed=seed,
        samples=len(imp.user),
        users=spec.users,
        ads=spec.ads,
        ctr=float(imp.clk.mean()),
        b0=b0,
        mean_sequence_length=float(seq.mean()),
        samples_at_100=int((seq == 100).sum()),
        max_prior_clicks=int(imp.prior_clicks.max()),
        ads_seen_lt3=float((ads_seen < 3).mean()),
        users_seen_lt3=float((users_seen < 3).mean()),
        seconds=time.perf_counter() - started,
    )
    (out / "generate_report.json").write_text(json.dumps(asdict(report), indent=2))
    return report


def oracle_auc(samples_dir: str | Path, split: str = "eval") -> tuple[float, int, float]:
    """(AUC of the true probabilities ``_oracle_p`` against ``clk``, rows, CTR) of one split.

    The ceiling a model can reach on this data (torchmetrics' BinaryAUROC, exact).
    """
    import torch
    from torchmetrics.classification import BinaryAUROC

    path = Path(samples_dir) / split
    files = sorted(path.glob("*.parquet"))
    if not files:
        raise FileNotFoundError(f"{path}: no Parquet files; run `python -m train.data build` first")
    schema = pq.read_schema(files[0])
    if tb.ORACLE_COLUMN not in schema.names:
        raise ValueError(f"{path}: no {tb.ORACLE_COLUMN} column; only generated data has an oracle")
    table = pq.read_table(path, columns=[tb.LABEL_COLUMN, tb.ORACLE_COLUMN])
    labels = torch.from_numpy(table.column(tb.LABEL_COLUMN).to_numpy().astype(np.int64))
    probs = torch.from_numpy(table.column(tb.ORACLE_COLUMN).to_numpy().copy())
    metric = BinaryAUROC()
    metric.update(probs, labels)
    return float(metric.compute()), table.num_rows, float(labels.float().mean())
