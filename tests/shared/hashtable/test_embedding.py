"""DynamicEmbeddingCollection: lookups, sparse Adagrad, eval mode, fusion, eviction, stats."""

from __future__ import annotations

import logging

import pytest
import torch

from shared.features import InitializerSpec, InitMode, LfuDecaySpec, ScoreStrategy
from shared.hashtable.embedding import DynamicEmbeddingCollection, lookup_by_table
from shared.hashtable.initializers import KeyedInitializer

from .conftest import NEEDS_CUDA_KERNELS, NORMAL, dyn_table


def _dec(tables, groups=None, **kw) -> DynamicEmbeddingCollection:
    kw.setdefault("lr", 0.1)
    return DynamicEmbeddingCollection(tables, groups or {}, **kw)


def test_new_keys_get_initializer_values_and_module_has_no_parameters():
    dec = _dec([dyn_table("a_emb")], seed=7)
    assert list(dec.parameters()) == [] and dec.state_dict() == {}
    keys = torch.tensor([3, 1 << 50, 3])
    out = dec({"a_emb": keys})["a_emb"]
    expected = KeyedInitializer(NORMAL, seed=7, table="a_emb")(keys, 4)
    assert torch.equal(out.detach(), expected) and out.requires_grad
    exported_keys, exported_values = dec.export_table("a_emb")
    assert exported_keys.tolist() == [3, 1 << 50]
    assert torch.equal(exported_values, expected[:2])


def _dyadic(n: int, dim: int, seed: int) -> torch.Tensor:
    """Gradients whose sums are exact in any order (small multiples of 1/8)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, (n, dim), generator=g).float() / 8


@pytest.mark.parametrize("exact", [True, False])
def test_adagrad_equals_torch_adagrad_on_dense_copy(exact: bool):
    tables = [dyn_table("a_emb", dim=16), dyn_table("b_emb", dim=16)]
    dec = _dec(tables, {"g": ["a_emb", "b_emb"]}, lr=0.05, initial_accumulator_value=0.1)
    steps = [
        {"a_emb": torch.tensor([5, 9, 5, 2, 9, 5]), "b_emb": torch.tensor([5, 7])},
        {"a_emb": torch.tensor([2, 2, 2, 2, 5]), "b_emb": torch.tensor([7, 7, 8])},
        {"a_emb": torch.tensor([9, 11]), "b_emb": torch.tensor([5, 8, 8])},
    ]
    # dense copy: one row per (table, key) seen, initialised with the hash rows' initial values
    names = sorted({(t, k) for s in steps for t, v in s.items() for k in v.tolist()})
    index = {p: i for i, p in enumerate(names)}
    with torch.no_grad():  # inserts (train mode) without an update
        init = {
            t: dec({t: torch.tensor([k for tt, k in names if tt == t])})[t]
            for t in ("a_emb", "b_emb")
        }
    param = torch.nn.Parameter(torch.cat([init["a_emb"], init["b_emb"]]))
    opt = torch.optim.Adagrad(
        [param], lr=0.05, eps=1e-10, initial_accumulator_value=0.1, foreach=False
    )
    for i, batch in enumerate(steps):
        out = dec(batch)
        coef = {t: _dyadic(v.numel(), 16, 10 * i + j) if exact else torch.randn(v.numel(), 16) for j, (t, v) in enumerate(batch.items())}  # fmt: skip
        sum((out[t] * coef[t]).sum() for t in batch).backward()
        idx = {t: torch.tensor([index[(t, k)] for k in v.tolist()]) for t, v in batch.items()}
        opt.zero_grad()
        sum((param[idx[t]] * coef[t]).sum() for t in batch).backward()
        opt.step()
    for t in ("a_emb", "b_emb"):
        state = dec.table_state(t)
        rows = torch.tensor([index[(t, k)] for k in state.keys.tolist()])
        if exact:
            assert torch.equal(state.values, param.detach()[rows])
            assert torch.equal(state.accumulators, opt.state[param]["sum"][rows])
        else:  # duplicate sums in another order: last-bit differences only
            torch.testing.assert_close(state.values, param.detach()[rows], rtol=1e-6, atol=1e-7)


def test_eval_mode_changes_nothing():
    eval_init = InitializerSpec(InitMode.CONSTANT, value=0.5)
    tables = [dyn_table("a_emb", eval_initializer=eval_init), dyn_table("b_emb", threshold=3)]
    dec = _dec(tables, {"g": ["a_emb", "b_emb"]})
    for _ in range(2):
        out = dec({"a_emb": torch.tensor([1, 2]), "b_emb": torch.tensor([1, 1, 1, 4])})
        sum(v.sum() for v in out.values()).backward()
    before = {t: dec.table_state(t) for t in ("a_emb", "b_emb")}
    stats = dec.stats()
    assert before["b_emb"].counter_keys.tolist() == [4]
    dec.eval()
    out = dec({"a_emb": torch.tensor([2, 99]), "b_emb": torch.tensor([1, 4, 77])})
    a_rows = before["a_emb"]
    assert torch.equal(out["a_emb"][0], a_rows.values[a_rows.keys.tolist().index(2)])
    assert out["a_emb"][1].tolist() == [0.5] * 4  # unseen: eval initializer
    b_rows = before["b_emb"]
    assert torch.equal(out["b_emb"][0], b_rows.values[0])  # admitted key 1
    assert out["b_emb"][1:].tolist() == [[0.0] * 4] * 2  # unadmitted 4, unseen 77
    assert not out["a_emb"].requires_grad
    # training: a's keys were inserted at once; b's key 4 was below its threshold both times
    assert [stats["a_emb"][k] for k in ("lookups", "misses")] == [4.0, 0.0]
    assert [stats["b_emb"][k] for k in ("lookups", "misses")] == [8.0, 2.0]
    after_stats = dec.stats()  # eval counts its own lookups and misses, and changes nothing else
    assert [after_stats["a_emb"][k] for k in ("eval_lookups", "eval_misses")] == [2.0, 1.0]
    assert [after_stats["b_emb"][k] for k in ("eval_lookups", "eval_misses")] == [3.0, 2.0]
    for t in stats:
        for k in ("eval_lookups", "eval_misses"):
            after_stats[t][k] = stats[t][k]
    assert after_stats == stats
    for t, b in before.items():
        after = dec.table_state(t)
        for f in ("keys", "values", "scores", "accumulators", "counter_keys", "counter_counts"):
            x, y = getattr(b, f), getattr(after, f)
            assert (x is None and y is None) or torch.equal(x, y), (t, f)


def test_table_fusion_separates_key_spaces():
    tables = [dyn_table("a_emb"), dyn_table("b_emb"), dyn_table("c_emb", dim=8)]
    dec = _dec(tables, {"deep": ["a_emb", "b_emb", "c_emb"]})
    assert dec.storages == {"deep/0": ["a_emb", "b_emb"], "deep/1": ["c_emb"]}
    out = dec({"a_emb": torch.tensor([7]), "b_emb": torch.tensor([7]), "c_emb": torch.tensor([7])})
    assert not torch.equal(out["a_emb"], out["b_emb"]) and out["c_emb"].shape == (1, 8)
    (out["a_emb"].sum() * 0 + out["b_emb"].sum()).backward()  # a's row gets a zero gradient
    a_keys, a_vals = dec.export_table("a_emb")
    b_keys, b_vals = dec.export_table("b_emb")
    assert a_keys.tolist() == b_keys.tolist() == [7]
    assert torch.equal(a_vals, out["a_emb"].detach())  # unchanged by a zero gradient
    assert torch.equal(b_vals, out["b_emb"].detach() - 0.1)  # first Adagrad step: -lr * sign
    stats = dec.stats()
    assert stats["a_emb"]["size"] == stats["b_emb"]["size"] == 1.0
    assert stats["a_emb"]["capacity"] == stats["b_emb"]["capacity"]  # one shared storage


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static-step"])
def test_lookup_parts_is_the_lookup_of_each_tables_pieces_concatenated(static: bool):
    """lookup_parts (pieces of a table handed to its storage as they are, the rows split once
    a storage) and lookup_by_table (the sharded collection's: concatenated per table, split
    back) give each piece its part of the table's lookup, hits included, and three steps of
    them leave the tables (keys, rows, accumulators, scores, admission counts) bit for bit as
    the concatenated lookups do (fused storage, a table alone, admission)."""
    tables = [dyn_table("a_emb", threshold=2), dyn_table("b_emb"), dyn_table("c_emb", dim=8)]
    groups = {"g": ["a_emb", "b_emb"]}
    gen = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(3):
        pieces = [(t, torch.randint(0, 12, (n,), generator=gen))
                  for t, n in (("a_emb", 5), ("c_emb", 3), ("a_emb", 4), ("b_emb", 6),
                               ("c_emb", 2))]  # fmt: skip
        steps.append(pieces)
    decs = [_dec(tables, groups, seed=3) for _ in range(3)]
    if static:
        for dec in decs:
            dec.use_static_step(capture=False)
            dec.reserve_max_capacity()
    for step, pieces in enumerate(steps):
        grads = [_dyadic(k.numel(), 8 if t == "c_emb" else 4, 10 * step + i)
                 for i, (t, k) in enumerate(pieces)]  # fmt: skip
        keys: dict[str, list[torch.Tensor]] = {}
        for t, k in pieces:
            keys.setdefault(t, []).append(k)
        rows, found = decs[0].lookup({t: torch.cat(ks) for t, ks in keys.items()}, hits=True)
        want_rows, want_hits, at = [], [], dict.fromkeys(keys, 0)
        for t, k in pieces:  # each piece's part of its table's lookup
            want_rows.append(rows[t][at[t] : at[t] + k.numel()])
            want_hits.append(found[t][at[t] : at[t] + k.numel()])
            at[t] += k.numel()
        sum((r * g).sum() for r, g in zip(want_rows, grads, strict=True)).backward()
        got = [decs[1].lookup_parts(pieces, hits=True),
               lookup_by_table(decs[2].lookup, pieces, hits=True)]  # fmt: skip
        for got_rows, got_hits in got:
            for k, (r, h) in enumerate(zip(got_rows, got_hits, strict=True)):
                assert torch.equal(r, want_rows[k]) and torch.equal(h, want_hits[k]), (step, k)
            sum((r * g).sum() for r, g in zip(got_rows, grads, strict=True)).backward()
    for t in ("a_emb", "b_emb", "c_emb"):
        want = decs[0].table_state(t)
        for dec in decs[1:]:
            state = dec.table_state(t)
            for f in ("keys", "values", "scores", "accumulators", "counter_keys",
                      "counter_counts"):  # fmt: skip
                x, y = getattr(want, f), getattr(state, f)
                assert (x is None and y is None) or torch.equal(x, y), (t, f)
    assert _dec(tables, groups).lookup_parts(steps[0], hits=False)[1] == []


def test_fusion_group_errors():
    with pytest.raises(ValueError, match="names table 'x_emb'"):
        _dec([dyn_table("a_emb")], {"g": ["a_emb", "x_emb"]})
    with pytest.raises(ValueError, match="two fusion groups"):
        _dec([dyn_table("a_emb")], {"g": ["a_emb"], "h": ["a_emb"]})


def _one_bucket(strategy: ScoreStrategy, **kw) -> DynamicEmbeddingCollection:
    table = dyn_table(
        "a_emb", max_capacity=4, init_capacity=4, bucket_capacity=4, strategy=strategy
    )
    return _dec([table], **kw)


def _train(dec: DynamicEmbeddingCollection, keys: list[int]) -> dict[str, torch.Tensor]:
    out = dec({"a_emb": torch.tensor(keys)})
    out["a_emb"].sum().backward()
    return out


def test_step_strategy_evicts_least_recently_used_step():
    dec = _one_bucket(ScoreStrategy.STEP)
    for step, keys in enumerate([[1], [2], [3], [4], [1], [5]], start=1):
        dec.set_step(step)
        _train(dec, keys)
    assert dec.export_table("a_emb")[0].tolist() == [1, 3, 4, 5]  # 2 (step 2) left
    assert dec.stats()["a_emb"]["evictions"] == 1.0


def test_timestamp_strategy_evicts_oldest_time():
    now = [0]
    dec = _one_bucket(ScoreStrategy.TIMESTAMP, clock=lambda: now[0])
    for t, keys in [(100, [1, 2]), (200, [3]), (300, [4, 2]), (400, [1]), (500, [5])]:
        now[0] = t
        _train(dec, keys)
    assert dec.export_table("a_emb")[0].tolist() == [1, 2, 4, 5]  # 3 (time 200) left
    assert dec.table_state("a_emb").scores.tolist() == [400, 300, 300, 500]


def test_lfu_strategy_evicts_least_used():
    dec = _one_bucket(ScoreStrategy.LFU)
    _train(dec, [1, 1, 1, 2, 3, 3, 4])
    _train(dec, [4])  # use counts: 1:3, 2:1, 3:2, 4:2
    _train(dec, [5, 5])  # new key used twice: the least used key (2) leaves
    assert dec.export_table("a_emb")[0].tolist() == [1, 3, 4, 5]
    assert dec.table_state("a_emb").scores.tolist() == [3, 2, 2, 2]
    assert dec.stats()["a_emb"]["evictions"] == 1.0


def _lfu_decayed(interval: int, shift: int = 1, **kw) -> DynamicEmbeddingCollection:
    """One bucket of 4 LFU rows whose counts decay every ``interval`` steps."""
    table = dyn_table(
        "a_emb", max_capacity=4, init_capacity=4, bucket_capacity=4, strategy=ScoreStrategy.LFU,
        lfu_decay=LfuDecaySpec(interval_steps=interval, shift=shift),
    )  # fmt: skip
    return _dec([table], **kw)


def test_lfu_decay_halves_the_counts_at_multiples_of_its_interval_before_the_step():
    dec = _lfu_decayed(3)
    want = {1: [8], 2: [9], 3: [4 + 1], 4: [6], 5: [7], 6: [3 + 1], 7: [5]}
    for step in range(1, 8):  # key 1 used 8 times at step 1, then once a step
        dec.set_step(step)
        _train(dec, [1] * 8 if step == 1 else [1])
        assert dec.table_state("a_emb").scores.tolist() == want[step], step
    # the same step again (a second lookup in step 6): no second decay
    dec.set_step(6)
    _train(dec, [1])
    assert dec.table_state("a_emb").scores.tolist() == [6]


def test_lfu_decay_by_more_bits_and_with_the_auto_step():
    dec = _lfu_decayed(2, shift=3)
    _train(dec, [1] * 40 + [2] * 7)  # step 1 (forwards counted): 1:40, 2:7
    _train(dec, [2])  # step 2: 40 >> 3 = 5 and 7 >> 3 = 0, then 2 used once
    assert dec.table_state("a_emb").scores.tolist() == [5, 1]


def _hot_set_changes(dec: DynamicEmbeddingCollection) -> list[int]:
    """Keys 1-4 are hot for 20 steps (8 uses a step), then keys 11-14 (2 uses a step) for 20
    steps, in a table of 4 rows: the keys it holds at the end."""
    for step in range(1, 41):
        dec.set_step(step)
        hot = [1, 2, 3, 4] if step <= 20 else [11, 12, 13, 14]
        _train(dec, hot * (8 if step <= 20 else 2))
    return dec.export_table("a_emb")[0].tolist()


def test_lfu_decay_lets_keys_hot_now_evict_keys_hot_long_ago():
    """Without decay the old keys' counts (160 each) outweigh the new keys' (2 a step, and a
    new key must beat them to enter), so the table keeps the old hot set for good; with the
    counts halved every 4 steps the old ones fall to 0 and the new hot set takes the table."""
    assert _hot_set_changes(_one_bucket(ScoreStrategy.LFU)) == [1, 2, 3, 4]
    dec = _lfu_decayed(4)
    assert _hot_set_changes(dec) == [11, 12, 13, 14]
    stats = dec.stats()["a_emb"]
    assert stats["evictions"] == 4.0 and stats["size"] == 4.0  # within max_capacity


def test_without_lfu_decay_the_counts_are_the_exact_use_counts():
    """No lfu_decay: nothing shifts the counts, however many steps (today's LFU), and a decay
    whose interval the run never reaches leaves every row, count and stat bit for bit alike."""
    plain = _one_bucket(ScoreStrategy.LFU, seed=5)
    late = _lfu_decayed(1000, seed=5)
    for step in range(1, 30):
        for dec in (plain, late):
            dec.set_step(step)
            _train(dec, [1, 2, 2] + [3] * (step % 3))
    assert plain.table_state("a_emb").scores.tolist() == [29, 58, 30]  # 30: sum of step % 3
    a, b = plain.table_state("a_emb"), late.table_state("a_emb")
    for f in ("keys", "values", "scores", "accumulators"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert plain.stats() == late.stats()


def test_tables_with_another_lfu_decay_get_a_storage_of_their_own():
    decay = LfuDecaySpec(interval_steps=10)
    lfu = {"strategy": ScoreStrategy.LFU}
    tables = [
        dyn_table("a_emb", **lfu, lfu_decay=decay),  # type: ignore[arg-type]
        dyn_table("b_emb", **lfu, lfu_decay=decay),  # type: ignore[arg-type]
        dyn_table("c_emb", **lfu),  # type: ignore[arg-type]
    ]
    dec = _dec(tables, {"g": ["a_emb", "b_emb", "c_emb"]})
    assert dec.storages == {"g/0": ["a_emb", "b_emb"], "g/1": ["c_emb"]}


def test_a_checkpoint_keeps_the_decayed_counts_and_the_decay_goes_on_at_its_steps(tmp_path):
    dec = _lfu_decayed(3)
    for step in range(1, 5):  # 1: 12 uses; 2: 13; 3: decayed to 6, + 1; 4: 8
        dec.set_step(step)
        _train(dec, [1] * 12 if step == 1 else [1])
    assert dec.table_state("a_emb").scores.tolist() == [8]
    dec.save(tmp_path, "sparse")
    resumed = _lfu_decayed(3)
    resumed.load(tmp_path, "sparse")
    assert resumed.table_state("a_emb").scores.tolist() == [8]
    for d in (dec, resumed):
        for step in (5, 6):  # 5: 9; 6: decayed to 4, then 5
            d.set_step(step)
            _train(d, [1])
        assert d.table_state("a_emb").scores.tolist() == [5]


def test_keys_of_the_current_batch_are_not_evicted():
    dec = _one_bucket(ScoreStrategy.LFU)
    _train(dec, [1, 2, 3, 4])  # all count 1
    out = _train(dec, [1, 6, 6])  # 6 (count 2) evicts one of 2, 3, 4 - never 1 (in use)
    kept = dec.export_table("a_emb")[0].tolist()
    assert 1 in kept and 6 in kept
    assert out["a_emb"][1:].requires_grad


def test_no_eviction_refuses_counts_and_logs(caplog):
    dec = _one_bucket(ScoreStrategy.NO_EVICTION, seed=3)
    _train(dec, [1, 2, 3, 4])
    before = dec.table_state("a_emb")
    out = _train(dec, [5, 1])
    # counted on the device, warned about when the stats are read (the trainer's log interval)
    with caplog.at_level(logging.WARNING, logger="shared.hashtable.storage"):
        assert dec.stats()["a_emb"]["refusals"] == 1.0
    assert "has refused 1 new keys" in caplog.text and "'a_emb'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shared.hashtable.storage"):
        dec.stats()  # the same total is not warned about twice
    assert "refused" not in caplog.text
    assert dec.export_table("a_emb")[0].tolist() == [1, 2, 3, 4]
    # the refused key still gets a (deterministic, unstored) initial row and no update
    expected = KeyedInitializer(NORMAL, seed=3, table="a_emb")(torch.tensor([5]), 4)
    assert torch.equal(out["a_emb"][:1].detach(), expected)
    after = dec.table_state("a_emb")
    assert torch.equal(after.values[1:], before.values[1:])  # only key 1 was updated


def test_growth_inside_the_module_keeps_rows():
    dec = _dec([dyn_table("a_emb", init_capacity=16, bucket_capacity=8, max_capacity=4096)])
    seen = {}
    with torch.no_grad():
        for step in range(6):
            keys = torch.arange(step * 150, (step + 1) * 150)
            out = dec({"a_emb": keys})["a_emb"]
            seen.update(zip(keys.tolist(), out, strict=True))
    keys, values = dec.export_table("a_emb")
    assert keys.tolist() == sorted(seen) and dec.stats()["a_emb"]["capacity"] > 16
    assert torch.equal(values, torch.stack([seen[k] for k in keys.tolist()]))


def test_reserve_max_capacity_keeps_rows_and_lookups(caplog):
    dec = _dec([dyn_table("a_emb", init_capacity=16, bucket_capacity=8, max_capacity=4096)])
    keys = torch.arange(100)
    with torch.no_grad():
        want = dec({"a_emb": keys})["a_emb"]
    with caplog.at_level(logging.INFO, logger="shared.hashtable.embedding"):
        dec.reserve_max_capacity()
    assert dec.stats()["a_emb"]["capacity"] == 4096
    assert "4096 rows allocated" in caplog.text
    dec.eval()
    with torch.no_grad():
        assert torch.equal(dec({"a_emb": keys})["a_emb"], want)  # stored rows, moved


def test_step_counts_forwards_unless_set():
    dec = _dec([dyn_table("a_emb")])
    _train(dec, [1])
    _train(dec, [2])
    assert dec.table_state("a_emb").scores.tolist() == [1, 2]
    dec.set_step(10)
    _train(dec, [1])
    assert dec.table_state("a_emb").scores.tolist() == [10, 2]


def test_bad_input_errors():
    dec = _dec([dyn_table("a_emb")])
    with pytest.raises(KeyError, match="unknown dynamic tables"):
        dec({"b_emb": torch.tensor([1])})
    with pytest.raises(ValueError, match="negative"):
        dec({"a_emb": torch.tensor([1, -3])})
    dense = dyn_table("d_emb")
    dense = type(dense)(dense.name, dense.dim, 10, None, "sum")
    with pytest.raises(ValueError, match="not dynamic"):
        _dec([dense])


def _script(device: str) -> dict:
    tables = [
        dyn_table("a_emb", init_capacity=16, bucket_capacity=8, max_capacity=256, strategy=ScoreStrategy.LFU),
        dyn_table("b_emb", init_capacity=16, bucket_capacity=8, max_capacity=256, strategy=ScoreStrategy.LFU, threshold=2, initializer=InitializerSpec(InitMode.TRUNCATED_NORMAL, std_dev=0.1, lower=-0.1, upper=0.2)),
    ]  # fmt: skip
    dec = _dec(tables, {"g": ["a_emb", "b_emb"]}, device=device, lr=0.03)
    g = torch.Generator().manual_seed(0)
    outs = []
    for step in range(8):
        dec.set_step(step)
        batch = {t: torch.randint(0, 400, (300,), generator=g) for t in ("a_emb", "b_emb")}
        out = dec(batch)
        coef = {t: torch.randn(300, 4, generator=g) for t in batch}
        sum((out[t] * coef[t].to(device)).sum() for t in batch).backward()
        outs.append({t: v.detach().cpu() for t, v in out.items()})
    states = {t: dec.table_state(t) for t in ("a_emb", "b_emb")}
    return {"outs": outs, "states": states, "stats": dec.stats()}


def test_script_is_deterministic_on_cpu():
    a, b = _script("cpu"), _script("cpu")
    for t in ("a_emb", "b_emb"):
        assert torch.equal(a["states"][t].values, b["states"][t].values)
    assert a["stats"]["a_emb"]["evictions"] > 0  # the script exercises eviction


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: compares CPU and GPU tables")
def test_cpu_and_cuda_give_identical_tables():
    """Same key sets, scores, admission counters and stats; float rows equal to ~1 ulp.

    Measured on the H200: the rows differ by at most 3.7e-9 from step 3 on (float32 ulp level),
    with or without the CuPy kernels; the discrete state (which keys, scores, evictions) is equal.
    """
    cpu, gpu = _script("cpu"), _script("cuda")
    for o1, o2 in zip(cpu["outs"], gpu["outs"], strict=True):
        for t in o1:
            torch.testing.assert_close(o1[t], o2[t], rtol=1e-6, atol=1e-7, msg=t)
    for t in ("a_emb", "b_emb"):
        s1, s2 = cpu["states"][t], gpu["states"][t]
        for f in ("keys", "scores", "counter_keys", "counter_counts"):
            x, y = getattr(s1, f), getattr(s2, f)
            assert (x is None and y is None) or torch.equal(x, y.cpu()), (t, f)
        for f in ("values", "accumulators"):
            x, y = getattr(s1, f), getattr(s2, f)
            torch.testing.assert_close(x, y.cpu(), rtol=1e-6, atol=1e-7, msg=f"{t}.{f}")
    assert cpu["stats"] == gpu["stats"]


def test_set_learning_rate_updates_as_a_collection_made_at_that_rate():
    tables = [dyn_table("a_emb", dim=8)]
    moved, made = _dec(tables, lr=0.5), _dec(tables, lr=0.02)
    moved.set_learning_rate(0.02)
    keys = {"a_emb": torch.tensor([4, 8, 4, 15])}
    for dec in (moved, made):
        out = dec(keys)["a_emb"]
        (out * torch.linspace(-1, 1, 8)).sum().backward()
    a, b = moved.table_state("a_emb"), made.table_state("a_emb")
    assert torch.equal(a.values, b.values) and torch.equal(a.accumulators, b.accumulators)
    assert moved.adagrad.lr == 0.5  # the configured rate, which checkpoints record


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, NEEDS_CUDA_KERNELS])],
)
def test_a_table_at_its_own_rate_trains_as_a_collection_made_at_that_rate(device: str):
    """lr_scales: the scaled table leaves its fusion group for a storage of its own and updates
    as a collection at lr × scale does, in every later set_learning_rate too; the other tables
    keep the group's storage and rate. On CUDA through the kernels' per-storage rate."""
    tables = [dyn_table("a_emb", dim=8), dyn_table("b_emb", dim=8)]
    scaled = _dec(
        tables, {"g": ["a_emb", "b_emb"]}, lr=0.02, lr_scales={"a_emb": 4.0}, device=device
    )
    assert scaled.storages == {"g": ["b_emb"], "a_emb": ["a_emb"]}
    assert scaled.table_adagrad("a_emb").lr == pytest.approx(0.08)
    assert scaled.table_adagrad("b_emb") == scaled.adagrad
    at_a = _dec(tables[:1], lr=0.02 * 4, device=device)
    at_b = _dec(tables[1:], lr=0.02, device=device)
    for lr in (None, 0.005):
        if lr is not None:
            scaled.set_learning_rate(lr)
            at_a.set_learning_rate(lr * 4)
            at_b.set_learning_rate(lr)
        keys = {"a_emb": torch.tensor([4, 8, 4, 15]), "b_emb": torch.tensor([4, 9])}
        keys = {t: k.to(device) for t, k in keys.items()}
        weight = torch.linspace(-1, 1, 8, device=device)
        out = scaled(keys)
        sum((v * weight).sum() for v in out.values()).backward()
        for dec, name in ((at_a, "a_emb"), (at_b, "b_emb")):
            (dec({name: keys[name]})[name] * weight).sum().backward()
            a, b = scaled.table_state(name), dec.table_state(name)
            assert torch.equal(a.values, b.values), (lr, name)
            assert torch.equal(a.accumulators, b.accumulators), (lr, name)
    alone = _dec(tables, {"g": ["a_emb", "b_emb"]}, lr_scales={"a_emb": 1.0})
    assert alone.storages == {"g": ["b_emb"], "a_emb": ["a_emb"]}  # named: alone, at any scale
    assert alone.table_adagrad("a_emb") == alone.adagrad


def test_lr_scales_errors():
    tables = [dyn_table("a_emb")]
    with pytest.raises(ValueError, match="'c_emb', which is not among the dynamic tables"):
        _dec(tables, lr_scales={"c_emb": 2.0})
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="give a finite scale > 0"):
            _dec(tables, lr_scales={"a_emb": bad})
