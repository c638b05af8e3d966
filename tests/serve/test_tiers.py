"""serve.tiers: a server whose dynamic tables live in host memory with an HBM cache of hot rows
gives the all-in-HBM server's inputs and scores, counts its tiers, and plans or refuses a budget;
the versions it holds share one host copy of equal rows, written copy-on-write."""

from __future__ import annotations

import dataclasses
import gc
import logging
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from bench.synthetic_bundle import write_synthetic_bundle
from serve.batcher import concat_batches
from serve.limits import Limits
from serve.lookup import EmbeddingTables, InPlaceUnavailableError
from serve.metrics import ServingMetrics
from serve.model import LoadedModel, synthetic_batch
from serve.spare import Spare, adopt
from serve.tiers import KEY_BYTES, KEY_HEADROOM, LINE_BYTES, TierConfig, TieredRows, plan_tiers
from serve.validation import request_inputs
from shared.batch import Batch
from shared.bundle import Bundle, read_bundle, write_bundle
from shared.dense_inputs import feature_parts, parts_by_table
from shared.features import FeatureSet
from shared.fg_request import request_columns_to_batch
from shared.hashtable.placement import GIB, PlacementError, StorageMode

from .conftest import export_tiny_program
from .test_lookup import _assert_same, _multi_valued


def _batches(bundle: Bundle, requests) -> list[Batch]:
    fs = bundle.feature_set
    parts = [
        request_columns_to_batch(fs, **vars(request_inputs(r, fs, Limits()))) for r in requests
    ]
    synthetic = synthetic_batch(fs, 3, 7, (0, 4, 1))
    return [*parts[:3], concat_batches(parts), synthetic, _multi_valued(bundle, synthetic)]


def _few_rows(bundle: Bundle, rows: int = 3) -> TierConfig:
    """Every dynamic table CACHING with ``rows`` rows in HBM (of its KEYS_PER_TABLE)."""
    return TierConfig(
        {n: rows / k.numel() for n, (k, _) in bundle.hash_tables.items()}, hbm_budget=None
    )


def _with_scores(bundle: Bundle, seed: int = 0) -> Bundle:
    """``bundle`` with random distinct scores for every dynamic table's rows."""
    gen = torch.Generator().manual_seed(seed)
    scores = {
        n: (k, torch.randperm(k.numel(), generator=gen)) for n, (k, _) in bundle.hash_tables.items()
    }
    return dataclasses.replace(bundle, hash_scores=scores)


@pytest.mark.parametrize("which", ["seed", "mixed dims"])
def test_a_cache_of_a_few_rows_gives_the_hbm_only_inputs_bit_for_bit(
    which: str, bundle_v1: Path, bundle_mixed: Path, requests
) -> None:
    bundle = _with_scores(read_bundle(bundle_v1 if which == "seed" else bundle_mixed))
    hbm = EmbeddingTables.from_bundle(bundle, device="cpu")
    cached = EmbeddingTables.from_bundle(bundle, device="cpu", tiers=_few_rows(bundle))
    assert {p.mode for p in cached.placements.values()} == {StorageMode.CACHING}
    assert {p.mode for p in hbm.placements.values()} == {StorageMode.HBM_ONLY}
    for batch in _batches(bundle, requests):
        _assert_same(cached.embed(batch), hbm.embed(batch))
        _assert_same(cached.embed(batch, cold=True), hbm.embed(batch, cold=True))
    want = {s.name: (s.hits, s.misses) for s in hbm.stats()}
    assert {s.name: (s.hits, s.misses) for s in cached.stats()} == want


def test_hits_are_counted_by_the_tier_they_were_read_from(bundle_v1: Path, requests) -> None:
    bundle = _with_scores(read_bundle(bundle_v1))
    fs = bundle.feature_set
    tables = EmbeddingTables.from_bundle(bundle, device="cpu", tiers=_few_rows(bundle, 5))
    batches = _batches(bundle, requests)
    host_reads = dict.fromkeys(bundle.hash_tables, 0)
    hbm_reads = dict.fromkeys(bundle.hash_tables, 0)
    for batch in batches:
        tables.embed(batch)
        parts = feature_parts(batch)
        for name, idx in parts_by_table(fs, parts).items():
            if name not in bundle.hash_tables:
                continue
            keys = bundle.hash_tables[name][0].tolist()
            scores = bundle.hotness(name)
            assert scores is not None
            hot = {keys[i] for i in torch.argsort(scores, descending=True)[:5].tolist()}
            for i in idx:
                for key in parts[i][2].tolist():
                    if key in hot:
                        hbm_reads[name] += 1
                    elif key in keys:
                        host_reads[name] += 1
    stats = {s.name: s for s in tables.stats()}
    for name in bundle.hash_tables:
        s = stats[name]
        assert s.mode == "CACHING"
        assert (s.host_reads, s.hits - s.host_reads) == (host_reads[name], hbm_reads[name])
        rows = s.rows
        assert s.host_bytes == rows * 16 * 4
        assert s.hbm_bytes == rows * (KEY_BYTES + LINE_BYTES) + 5 * 16 * 4
    assert sum(host_reads.values()) > 0 and sum(hbm_reads.values()) > 0
    tables.reset_stats()
    assert all(s.host_reads == 0 for s in tables.stats())


def test_the_hot_rows_are_the_highest_scores_or_the_first_rows(
    bundle_v1: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plain = read_bundle(bundle_v1)
    assert plain.hash_scores == {}  # a bundle exported before the scores
    name = "user_id_emb"
    keys = plain.hash_tables[name][0]
    tiers = TierConfig({name: 4 / keys.numel()})
    with caplog.at_level(logging.WARNING, logger="serve.tiers"):
        first = EmbeddingTables.from_bundle(plain, device="cpu", tiers=tiers)
    assert f"table {name}: the bundle has no row scores" in caplog.text
    scored = _with_scores(plain)
    by_score = EmbeddingTables.from_bundle(scored, device="cpu", tiers=tiers)
    scores = scored.hotness(name)
    assert scores is not None
    hottest = torch.argsort(scores, descending=True)[:4]
    for tables, want in ((first, torch.arange(4)), (by_score, hottest)):
        (group,) = [g for g in tables._groups if g.tiers is not None]
        assert group.tiers is not None and group.hash is not None
        idx, found = group.hash.find(keys)  # a one-table group: keys as they are
        assert bool(found.all())
        in_hbm = group.tiers.line_of_row[idx] >= 0
        assert sorted(torch.nonzero(in_hbm).squeeze(1).tolist()) == sorted(want.tolist())


def test_factors_flags_over_fg_json_and_the_budget_plans_the_rest(bundle_v1: Path) -> None:
    bundle = read_bundle(bundle_v1)
    fs = bundle.feature_set
    rows = {n: k.numel() for n, (k, _) in bundle.hash_tables.items()}
    dim = 16
    user = fs.tables["user_id_emb"]
    assert user.dynamic is not None
    from_fg = dataclasses.replace(
        user, dynamic=dataclasses.replace(user.dynamic, cache_load_factor=0.5)
    )
    fs_fg = dataclasses.replace(fs, tables={**fs.tables, "user_id_emb": from_fg})
    plans = {p.table: p for p in plan_tiers(fs_fg, rows, TierConfig(), dense_bytes=0, headroom=0)}
    assert plans["user_id_emb"].cache_load_factor == 0.5  # fg.json's
    assert plans["brand_emb"].mode is StorageMode.HBM_ONLY
    flagged = TierConfig.from_flags(["user_id_emb=0.25"], None)
    plans = {p.table: p for p in plan_tiers(fs_fg, rows, flagged, dense_bytes=0, headroom=0)}
    assert plans["user_id_emb"].cache_load_factor == 0.25  # the flag beats fg.json
    # a budget below the HBM-only bytes: the tables without a factor share a planned one
    hbm_only = sum(r * (KEY_BYTES + 4 * dim) for r in rows.values())
    budget = TierConfig({"user_id_emb": 0.25}, hbm_budget=hbm_only // 2)
    plans = {p.table: p for p in plan_tiers(fs, rows, budget, dense_bytes=0, headroom=0)}
    others = [p for n, p in plans.items() if n != "user_id_emb"]
    assert {p.planned for p in others} == {True} and not plans["user_id_emb"].planned
    assert len({p.cache_load_factor for p in others}) == 1
    assert 0.01 <= others[0].cache_load_factor < 1.0
    assert sum(p.hbm_bytes for p in plans.values()) <= hbm_only // 2


def test_a_budget_that_cannot_fit_is_refused_with_the_table_and_bytes(bundle_v1: Path) -> None:
    bundle = read_bundle(bundle_v1)
    tiers = TierConfig.from_flags([], hbm_budget_gib=1e-6)  # 1073 bytes
    with pytest.raises(PlacementError) as err:
        EmbeddingTables.from_bundle(bundle, device="cpu", tiers=tiers)
    msg = str(err.value)
    assert "--hbm-budget-gib is 0.000 GiB" in msg
    assert "the biggest is " in msg and "mode=HBM_ONLY" in msg
    assert "Raise the budget, or lower a table's --cache-load-factor" in msg
    with pytest.raises(PlacementError, match="'nope_emb', not a dynamic table of the bundle"):
        EmbeddingTables.from_bundle(bundle, device="cpu", tiers=TierConfig({"nope_emb": 0.5}))


@pytest.mark.parametrize(
    "flag", ["user_id_emb", "user_id_emb=0", "user_id_emb=1.5", "=0.5", "user_id_emb=x"]
)
def test_bad_factor_flags_are_refused(flag: str) -> None:
    with pytest.raises(ValueError, match=r"expected TABLE=F with 0 < F <= 1"):
        TierConfig.from_flags([flag], None)
    with pytest.raises(ValueError, match="given twice"):
        TierConfig.from_flags(["a=0.5", "a=0.2"], None)
    with pytest.raises(ValueError, match="--hbm-budget-gib must be > 0"):
        TierConfig.from_flags([], 0)
    assert TierConfig.from_flags(["a=1"], 2.0) == TierConfig({"a": 1.0}, 2 * GIB)


@pytest.mark.parametrize("headroom", [-0.1, float("nan"), 1001.0])
def test_a_key_headroom_outside_its_range_is_refused(headroom: float) -> None:
    with pytest.raises(ValueError, match=r"--key-headroom must be in \[0, 1000\]"):
        TierConfig.from_flags([], None, headroom)
    assert TierConfig.from_flags([], None, 3.0).headroom == 3.0
    assert TierConfig.from_flags([], None).headroom == KEY_HEADROOM


def test_new_values_of_the_same_keys_are_written_into_both_tiers(bundle_v1: Path, requests) -> None:
    bundle = read_bundle(bundle_v1)
    tables = EmbeddingTables.from_bundle(bundle, device="cpu", tiers=_few_rows(bundle, 8))
    hashed = {n: (k, v.clone()) for n, (k, v) in bundle.hash_tables.items()}
    for _, v in hashed.values():
        v[::2] += 1.0  # every other row, among them hot ones (the first 8: no scores)
    new = dataclasses.replace(bundle, hash_tables=hashed)
    write = tables.prepare_update(new)
    batches = _batches(bundle, requests)
    hbm_old = EmbeddingTables.from_bundle(bundle, device="cpu")
    _assert_same(tables.embed(batches[3]), hbm_old.embed(batches[3]))  # nothing written yet
    write()
    hbm_new = EmbeddingTables.from_bundle(new, device="cpu")
    for batch in batches:
        _assert_same(tables.embed(batch), hbm_new.embed(batch))
    k, v = bundle.hash_tables["user_id_emb"]
    dropped = {**bundle.hash_tables, "user_id_emb": (k[1:], v[1:])}
    with pytest.raises(InPlaceUnavailableError, match="only when the keys stay the same"):
        tables.prepare_update(dataclasses.replace(bundle, hash_tables=dropped))


def _delta(base: Bundle, root: Path, keys: str) -> tuple[Path, Path]:
    """(a delta of ``base``, the full bundle of its tables): new values of rows 1-8 (among them
    the first 8: hot without scores), and with ``keys`` "changed" the first key dropped and one
    added."""
    from shared.delta import diff_tables, write_delta

    hashed = {}
    for name, (k, v) in base.hash_tables.items():
        v = v.clone()
        v[1:9] += 0.5  # hot rows (the first 8) and cold ones
        if keys == "changed":
            k, v = torch.cat([k[1:], k.max().view(1) + 1]), torch.cat([v[1:], v[:1]])
        hashed[name] = (k, v)
    delta = write_delta(
        root / "d1",
        tables=diff_tables(base.dense_tables, base.hash_tables, base.dense_tables, hashed),
        base_manifest=base.manifest,
        delta_id="d1",
        target_version="d1-full",
        config_digest=base.config_digest,
    )
    full = write_bundle(
        root / "d1-full",
        dense_tables=base.dense_tables,
        hash_tables={n: [kv] for n, kv in hashed.items()},
        feature_set=base.feature_set,
        dense_program_path=base.dense_program_path,
        config_digest=base.config_digest,
    )
    return delta, full


@pytest.mark.parametrize("keys", ["same", "changed"])
def test_a_delta_on_a_cached_server(bundle_v1: Path, tmp_path: Path, keys: str) -> None:
    """serve.delta: new values of the same keys go in place into both tiers; a delta that adds
    or drops keys takes the rebuild. Either way the scores are those of the delta's tables."""
    from serve.delta import ApplyPath, apply_delta

    base = read_bundle(bundle_v1)
    delta, full = _delta(base, tmp_path, keys)
    cached = LoadedModel.load(bundle_v1, device="cpu", tiers=_few_rows(base, 8))
    applied = apply_delta(cached, delta)
    want = ApplyPath.IN_PLACE if keys == "same" else ApplyPath.REBUILD
    assert applied.path is want, applied.reason
    target = LoadedModel.load(full, device="cpu", warmup_rounds=0)
    for seed in range(3):
        batch = _multi_valued(base, synthetic_batch(base.feature_set, 3, 7, (0, 4, 1)), seed)
        torch.testing.assert_close(
            applied.model.predict(batch), target.predict(batch), rtol=0, atol=0
        )


def test_a_cached_model_scores_as_the_hbm_only_one_and_shows_its_tiers(bundle_v1: Path) -> None:
    bundle = read_bundle(bundle_v1)
    tiers = _few_rows(bundle, 32)  # half the rows
    hbm = LoadedModel.load(bundle_v1, device="cpu", warmup_rounds=0)
    cached = LoadedModel.load(bundle_v1, device="cpu", warmup_rounds=0, tiers=tiers)
    batch = _multi_valued(bundle, synthetic_batch(bundle.feature_set, 40, 40, (0, 4, 1)))
    torch.testing.assert_close(cached.predict(batch), hbm.predict(batch), rtol=0, atol=0)
    text = generate_latest(ServingMetrics(lambda: cached).registry).decode()
    stats = {s.name: s for s in cached.table_stats()}
    user = stats["user_id_emb"]
    assert user.hits > 0
    line = 'dynrec_serving_table_tier_reads_total{table="user_id_emb",tier="host"}'
    assert f"{line} {float(user.host_reads)}" in text
    ratio = (user.hits - user.host_reads) / user.hits
    want = f'dynrec_serving_table_hbm_hit_ratio{{mode="CACHING",table="user_id_emb"}} {ratio}'
    assert 0 < ratio < 1 and want in text
    assert (
        f'dynrec_serving_table_bytes{{table="user_id_emb",tier="host"}} {float(user.host_bytes)}'
        in text
    )
    hbm_text = generate_latest(ServingMetrics(lambda: hbm).registry).decode()
    assert 'dynrec_serving_table_bytes{table="user_id_emb",tier="host"} 0.0' in hbm_text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_cuda_cached_scores_equal_hbm_only(din_bundles: tuple[Path, Path], graphs: bool) -> None:
    from serve.graphs import Bucket
    from shared.hashtable.cuda import runtime

    reason = runtime.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    path = din_bundles[1]  # format 3: the program takes the pairs, so batches can be graphs
    bundle = read_bundle(path)
    buckets = (Bucket(64, 64, 8), Bucket(1024, 1024, 64)) if graphs else ()
    hbm = LoadedModel.load(path, device="cuda", graph_buckets=buckets)
    cached = LoadedModel.load(path, device="cuda", graph_buckets=buckets, tiers=_few_rows(bundle))
    assert (cached.graphs is not None) == graphs
    cached.tables.reset_stats()
    stats = cached.graph_stats()
    before = (stats.replays, sum(stats.eager.values())) if stats is not None else (0, 0)
    for seed in range(3):
        batch = _multi_valued(bundle, synthetic_batch(bundle.feature_set, 3, 7, (0, 4, 1)), seed)
        # not bit for bit on CUDA (the H100 run of 2026-12-06 failed at atol=0; the seed-shape
        # bench's gap is 6e-8, as large as Predict's own between two calls of one request in
        # bench_oip): likely the pooled sums, which CUDA's index_add_ adds in atomics' order, and
        # cached tables are lookup groups of their own. The CPU tests above check the inputs bit
        # for bit; here the serving tolerance of graph padding.
        torch.testing.assert_close(cached.predict(batch), hbm.predict(batch), rtol=0, atol=1e-6)
    assert sum(s.host_reads for s in cached.table_stats()) > 0  # misses read from host memory
    if stats is not None:  # every batch replayed (the lookup's misses inside the graph)
        assert (stats.replays, sum(stats.eager.values())) == (before[0] + 3, before[1])


# --------------------------------------------------------------------------- shared host rows


def _tiered(tables: EmbeddingTables) -> list[TieredRows]:
    return [g.tiers for g in tables._groups if g.tiers is not None]


def _next_version(fs: FeatureSet, base: Path, root: Path, seed: int = 2) -> Path:
    """Version "2" of ``base``: its keys (so it can be written into a CACHING spare), other
    values and program weights (the same program graph)."""
    program = export_tiny_program(fs, root / "dense.pt2", seed)
    keys = {n: k.numpy() for n, (k, _) in read_bundle(base).hash_tables.items()}
    return write_synthetic_bundle(
        root / "2", fs, keys=keys, program_path=program, version="2", seed=seed
    )


def _scores(model: LoadedModel, bundle: Bundle) -> list[torch.Tensor]:
    return [
        model.predict(
            _multi_valued(bundle, synthetic_batch(bundle.feature_set, 3, 7, (0, 4, 1)), s)
        )
        for s in range(3)
    ]


def _assert_scores(got: LoadedModel, want: LoadedModel, bundle: Bundle) -> None:
    for a, b in zip(_scores(got, bundle), _scores(want, bundle), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_two_loads_of_one_bundle_hold_one_host_copy(bundle_v1: Path) -> None:
    bundle = read_bundle(bundle_v1)
    tiers = _few_rows(bundle, 8)
    served = LoadedModel.load(bundle_v1, device="cpu", warmup_rounds=0, tiers=tiers)
    spare = LoadedModel.load(bundle_v1, device="cpu", warmup_rounds=0, tiers=tiers)
    alone = LoadedModel.load(bundle_v1, device="cpu", warmup_rounds=0, tiers=_few_rows(bundle, 8))
    groups = _tiered(served.tables)
    assert groups and len(groups) == len(_tiered(spare.tables))
    one_copy = sum(t.store.nbytes for t in groups)
    assert one_copy == sum(s.host_bytes for s in served.table_stats())
    for a, b, c in zip(groups, _tiered(spare.tables), _tiered(alone.tables), strict=True):
        assert a.store is b.store and a.store.rows.data_ptr() == b.store.rows.data_ptr()
        assert c.store.rows.data_ptr() != a.store.rows.data_ptr()  # another server's registry
        assert tiers.host.holders(a.store) == 2
    # with sharing: two versions, one copy; without (a registry each): a copy per version
    assert (tiers.host.copies, tiers.host.nbytes) == (len(groups), one_copy)
    assert tiers.host.nbytes + alone.tables.host_tiers.nbytes == 2 * one_copy
    text = generate_latest(ServingMetrics(lambda m=served: m).registry).decode()
    assert f"dynrec_serving_host_tier_bytes {float(one_copy)}" in text
    assert f"dynrec_serving_host_tier_copies {float(len(groups))}" in text
    hbm = LoadedModel.load(bundle_v1, device="cpu", warmup_rounds=0)
    _assert_scores(served, hbm, bundle)
    _assert_scores(spare, hbm, bundle)
    del served, spare, groups, a, b  # (a, b: the loop's last groups)
    gc.collect()
    assert (tiers.host.copies, tiers.host.nbytes) == (0, 0)  # freed with the last version


def test_a_version_written_into_a_spare_sharing_its_rows_leaves_the_served_ones(
    fs: FeatureSet, bundle_v1: Path, tmp_path: Path
) -> None:
    """serve.spare on a CACHING server: the startup spare shares the served version's host
    rows; the next version written into it gets a store of its own (copy-on-write), the served
    version keeps scoring as before, and the spare's next write is in place."""
    bundle = read_bundle(bundle_v1)
    tiers = _few_rows(bundle, 8)
    served = LoadedModel.load(bundle_v1, device="cpu", warmup_rounds=0, tiers=tiers)
    kept = LoadedModel.load(bundle_v1, device="cpu", warmup_rounds=0, tiers=tiers)
    shared = [t.store for t in _tiered(served.tables)]
    pointers = [s.rows.data_ptr() for s in shared]
    spare = Spare()
    assert spare.offer(kept, serving=served)
    v2 = _next_version(fs, bundle_v1, tmp_path)
    model = adopt(spare, v2, verify_checksums=True, warmup_candidates=10)
    assert model is not None and model.tables is kept.tables  # written into the spare
    groups = _tiered(model.tables)
    assert [t.store for t in _tiered(served.tables)] == shared  # untouched
    assert [s.rows.data_ptr() for s in shared] == pointers
    assert all(t.store not in shared for t in groups)
    one_copy = sum(s.nbytes for s in shared)
    assert (tiers.host.copies, tiers.host.nbytes) == (2 * len(shared), 2 * one_copy)
    _assert_scores(served, LoadedModel.load(bundle_v1, device="cpu", warmup_rounds=0), bundle)
    fresh = LoadedModel.load(v2, device="cpu", warmup_rounds=0)
    _assert_scores(model, fresh, bundle)
    # the spare's store is its own now: the next version (v1 again) is written in place
    own = [t.store.rows.data_ptr() for t in groups]
    model.tables.prepare_update(bundle)()
    assert [t.store.rows.data_ptr() for t in groups] == own
    for seed in range(3):  # the tables only (the program keeps v2's weights)
        batch = _multi_valued(bundle, synthetic_batch(bundle.feature_set, 3, 7, (0, 4, 1)), seed)
        _assert_same(model.tables.embed(batch), served.tables.embed(batch))


def test_a_store_being_written_in_place_is_not_shared_by_a_load_meanwhile(
    bundle_v1: Path, requests
) -> None:
    """The only version holding its rows claims them when it prepares an update: a load
    between the prepare and the write (rows still equal) gets a copy of its own."""
    bundle = read_bundle(bundle_v1)
    tiers = _few_rows(bundle, 8)
    first = EmbeddingTables.from_bundle(bundle, device="cpu", tiers=tiers)
    hashed = {n: (k, v + 1.0) for n, (k, v) in bundle.hash_tables.items()}
    new = dataclasses.replace(bundle, hash_tables=hashed)
    write = first.prepare_update(new)
    meanwhile = EmbeddingTables.from_bundle(bundle, device="cpu", tiers=tiers)
    for a, b in zip(_tiered(first), _tiered(meanwhile), strict=True):
        assert a.store is not b.store and tiers.host.holders(a.store) == 1
    before = [t.store for t in _tiered(first)]
    write()
    assert [t.store for t in _tiered(first)] == before  # written in place
    batches = _batches(bundle, requests)
    hbm_old = EmbeddingTables.from_bundle(bundle, device="cpu")
    hbm_new = EmbeddingTables.from_bundle(new, device="cpu")
    for batch in batches:
        _assert_same(meanwhile.embed(batch), hbm_old.embed(batch))
        _assert_same(first.embed(batch), hbm_new.embed(batch))


def test_a_delta_in_place_on_the_served_version_leaves_the_spare_sharing_its_rows(
    bundle_v1: Path, tmp_path: Path
) -> None:
    """serve.delta in place on a served version whose host rows the spare shares: the served
    version's successor gets its own rows (the delta's), the spare keeps scoring the base."""
    from serve.delta import ApplyPath, apply_delta

    base = read_bundle(bundle_v1)
    tiers = _few_rows(base, 8)
    served = LoadedModel.load(bundle_v1, device="cpu", warmup_rounds=0, tiers=tiers)
    kept = LoadedModel.load(bundle_v1, device="cpu", warmup_rounds=0, tiers=tiers)
    shared = [t.store for t in _tiered(kept.tables)]
    assert [t.store for t in _tiered(served.tables)] == shared
    delta, full = _delta(base, tmp_path, "same")
    applied = apply_delta(served, delta)
    assert applied.path is ApplyPath.IN_PLACE, applied.reason
    assert all(t.store not in shared for t in _tiered(applied.model.tables))
    assert [t.store for t in _tiered(kept.tables)] == shared
    _assert_scores(applied.model, LoadedModel.load(full, device="cpu", warmup_rounds=0), base)
    _assert_scores(kept, LoadedModel.load(bundle_v1, device="cpu", warmup_rounds=0), base)


def test_rows_equal_but_for_the_sign_of_a_zero_are_not_shared(bundle_v1: Path) -> None:
    """Sharing compares bits: -0.0 is not 0.0 (scores stay bit for bit the version's own)."""
    bundle = read_bundle(bundle_v1)
    tiers = _few_rows(bundle, 8)
    name = "user_id_emb"
    k, v = bundle.hash_tables[name]
    zeros, negative = v.clone(), v.clone()
    zeros[0], negative[0] = 0.0, -0.0
    a = dataclasses.replace(bundle, hash_tables={**bundle.hash_tables, name: (k, zeros)})
    b = dataclasses.replace(bundle, hash_tables={**bundle.hash_tables, name: (k, negative)})
    ta = EmbeddingTables.from_bundle(a, device="cpu", tiers=tiers)
    tb = EmbeddingTables.from_bundle(b, device="cpu", tiers=tiers)
    stores = [(x.store, y.store) for x, y in zip(_tiered(ta), _tiered(tb), strict=True)]
    assert sum(x is y for x, y in stores) == len(stores) - 1  # all but user_id_emb's group


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_a_spare_sharing_host_rows_takes_the_next_version_through_its_graphs(
    din_bundles: tuple[Path, Path], tmp_path: Path
) -> None:
    """CUDA with graphs: served and spare share the pinned, mapped host rows; the next version
    written into the spare swaps its own rows in through the address cell its captured graphs
    read (no capture), and the served version's graphs keep reading the shared rows."""
    from serve.graphs import Bucket
    from shared.hashtable.cuda import runtime

    reason = runtime.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    path = din_bundles[1]  # format 3: graphs
    bundle = read_bundle(path)
    buckets = (Bucket(64, 64, 8), Bucket(1024, 1024, 64))
    tiers = _few_rows(bundle)
    served = LoadedModel.load(path, device="cuda", graph_buckets=buckets, tiers=tiers)
    kept = LoadedModel.load(path, device="cuda", graph_buckets=buckets, tiers=tiers)
    assert served.graphs is not None and kept.graphs is not None
    shared = [t.store for t in _tiered(served.tables)]
    assert [t.store for t in _tiered(kept.tables)] == shared and tiers.host.copies == len(shared)
    graphs, captures = kept.graphs, kept.graphs.stats.captures
    spare = Spare()
    assert spare.offer(kept, serving=served)
    hashed = {n: (k, v + 0.5) for n, (k, v) in bundle.hash_tables.items()}
    v2 = write_bundle(
        tmp_path / "2",
        dense_tables=bundle.dense_tables,
        hash_tables={n: [kv] for n, kv in hashed.items()},
        feature_set=bundle.feature_set,
        dense_program_path=bundle.dense_program_path,
        config_digest=bundle.config_digest,
    )
    model = adopt(spare, v2, verify_checksums=True, warmup_candidates=10)
    assert model is not None and model.graphs is graphs and graphs.stats.captures == captures
    assert all(t.store not in shared for t in _tiered(model.tables))
    assert [t.store for t in _tiered(served.tables)] == shared
    eager = {v2: LoadedModel.load(v2, device="cuda"), path: LoadedModel.load(path, device="cuda")}
    for got, want in ((model, eager[v2]), (served, eager[path])):
        for a, b in zip(_scores(got, bundle), _scores(want, bundle), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # CUDA: see the test above
    assert sum(s.host_reads for s in model.table_stats()) > 0  # rows read from the new store
