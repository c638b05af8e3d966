"""The static training lookup (shared.hashtable.static_step) against the eager one.

Two DynamicEmbeddingCollections built alike take the same training batches; one runs the
eager lookup, the other the static step: eagerly on CPU, replayed from CUDA graphs on CUDA
(against the CUDA backend's eager kernels; marked gpu). After every step the rows, hit flags,
table contents (keys, values, scores, accumulators), admission counters and stats must be
equal, bit for bit, through full buckets (evictions and refusals), admission and misses.
"""

from __future__ import annotations

import pytest
import torch

from shared.features import LfuDecaySpec, ScoreStrategy
from shared.hashtable.embedding import DynamicEmbeddingCollection
from shared.hashtable.static_insert import count_per_table, put_where, sum_per_table
from shared.hashtable.static_step import StaticStep, padded_size, supports

from .conftest import NEEDS_CUDA_KERNELS, dyn_table

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, NEEDS_CUDA_KERNELS]),
]


def _pair(
    strategy: ScoreStrategy,
    threshold: int | None,
    *,
    init_capacity: int = 256,
    device: str = "cpu",
    lfu_decay: LfuDecaySpec | None = None,
):
    tables = [
        dyn_table("a", strategy=strategy, threshold=threshold, max_capacity=256,
                  init_capacity=init_capacity, lfu_decay=lfu_decay),
        dyn_table("b", strategy=strategy, threshold=threshold, max_capacity=256,
                  init_capacity=init_capacity, lfu_decay=lfu_decay),
    ]  # fmt: skip

    def make() -> DynamicEmbeddingCollection:
        dec = DynamicEmbeddingCollection(tables, {"g": ["a", "b"]}, lr=0.05, seed=3, device=device)
        dec.train()
        return dec

    eager, static = make(), make()
    static.use_static_step(capture=device == "cuda")
    return eager, static


def _batch(gen: torch.Generator, step: int) -> dict[str, torch.Tensor]:
    # a skewed key range larger than the tables: hits, new keys, full buckets, duplicates
    span = 400 + 40 * step
    a = (torch.rand(300, generator=gen) ** 2 * span).long()
    b = torch.randint(0, 600, (120 + step,), generator=gen)
    if step % 4 == 3:  # a burst of new keys, each 3 times: more than a bucket takes at once
        burst = torch.arange(1000 * step, 1000 * step + 400)
        a = torch.cat([a, burst, burst, burst])
    return {"a": a, "b": b}


def _state(dec: DynamicEmbeddingCollection) -> dict[str, object]:
    out: dict[str, object] = {}
    for name in dec.tables:
        s = dec.table_state(name)
        state = (s.keys, s.values, s.scores, s.accumulators, s.counter_keys, s.counter_counts)
        out[name] = tuple(None if x is None else x.cpu() for x in state)
    out["stats"] = dec.stats()
    return out


def _assert_same(x: object, y: object, where: str) -> None:
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype, where
        assert torch.equal(x, y), where
    elif isinstance(x, tuple | list):
        assert isinstance(y, tuple | list) and len(x) == len(y), where
        for i, (a, b) in enumerate(zip(x, y, strict=True)):
            _assert_same(a, b, f"{where}[{i}]")
    elif isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), where
        for k in x:
            _assert_same(x[k], y[k], f"{where}.{k}")
    else:
        assert x == y, where


@pytest.mark.parametrize(
    "strategy, threshold",
    [(ScoreStrategy.LFU, 3), (ScoreStrategy.STEP, None), (ScoreStrategy.LFU, None),
     (ScoreStrategy.STEP, 2)],
)  # fmt: skip
@pytest.mark.parametrize("device", DEVICES)
def test_static_step_equals_eager(
    strategy: ScoreStrategy, threshold: int | None, device: str
) -> None:
    eager, static = _pair(strategy, threshold, device=device)
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 9):
        keys = {n: k.to(device) for n, k in _batch(gen, step).items()}
        grads = {n: torch.randn(k.numel(), 4, generator=gen).to(device) for n, k in keys.items()}
        results = []
        for dec in (eager, static):
            dec.set_step(step)
            rows, hits = dec.lookup(keys, hits=True)
            loss = sum((rows[n] * grads[n]).sum() for n in keys)
            loss.backward()  # type: ignore[union-attr]
            results.append(({n: r.cpu() for n, r in rows.items()},
                            {n: h.cpu() for n, h in hits.items()}))  # fmt: skip
        _assert_same(results[0], results[1], f"step {step} lookups")
        _assert_same(_state(eager), _state(static), f"step {step} state")
    ran = static.static_stats()["g"]
    if device == "cuda":  # padded sizes repeat: captured once each, replayed every step
        assert ran["replays"] == 8 and 0 < ran["captures"] < 8
    else:
        assert ran["eager"] == 8
    stats = static.stats()["a"]
    assert stats["evictions"] + stats["refusals"] > 0  # the full buckets were exercised


@pytest.mark.parametrize("strategy", [ScoreStrategy.LFU, ScoreStrategy.STEP])
@pytest.mark.parametrize("device", DEVICES)
def test_the_step_score_is_staged_only_where_it_is_read(
    strategy: ScoreStrategy, device: str
) -> None:
    """LFU scores are use counts: the static step never writes the step's score into its
    inputs (test_static_step_equals_eager shows nothing reads it); STEP gets the step. The
    table ids are staged again whenever the parts' layout changes (the results stay eager's)."""
    eager, static = _pair(strategy, None, device=device)
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 5):
        keys = {n: k.to(device) for n, k in _batch(gen, step).items()}
        if step == 4:  # one layout again, then tables in the other order: the ids restaged
            keys = dict(reversed(list(keys.items())))
        for dec in (eager, static):
            dec.set_step(step)
            rows, _hits = dec.lookup(keys, hits=True)
            sum(r.sum() for r in rows.values()).backward()  # type: ignore[union-attr]
        _assert_same(_state(eager), _state(static), f"step {step} state")
    ran = static.static_stats()["g"]
    assert ran["replays" if device == "cuda" else "eager"] == 4  # the static step each time
    (storage,) = static._storages
    assert isinstance(storage.static, StaticStep)
    scores = {int(e.score) for e in storage.static._entries.values()}
    assert scores == {0} if strategy is ScoreStrategy.LFU else 0 not in scores


@pytest.mark.parametrize("device", DEVICES)
def test_the_gradient_buffer_is_zero_past_each_steps_keys(device: str) -> None:
    """Steps of one padded size, with fewer keys, then more: the gradient buffer's rows past
    each step's keys are zero when its update runs (apply_gradients' precondition; the stage
    zeroes only the rows a larger earlier step wrote); the results stay the eager lookup's."""
    eager, static = _pair(ScoreStrategy.LFU, None, device=device)
    gen = torch.Generator().manual_seed(0)
    for step, n in enumerate((100, 98, 103, 99), start=1):
        keys = {"a": torch.randint(0, 600, (n,), generator=gen).to(device)}
        grad = (torch.randn(n, 4, generator=gen) + 2.0).to(device)  # no zero rows
        for dec in (eager, static):
            dec.set_step(step)
            (dec({"a": keys["a"]})["a"] * grad).sum().backward()
        _assert_same(_state(eager), _state(static), f"step {step} state")
        (storage,) = static._storages
        assert isinstance(storage.static, StaticStep)
        (entry,) = storage.static._entries.values()  # padded_size: 104 for each
        assert entry.grad_rows == n and bool((entry.grad[:n] != 0).all())
        assert not entry.grad[n:].any(), step
    ran = static.static_stats()["g"]
    assert ran["replays" if device == "cuda" else "eager"] == 4


@pytest.mark.parametrize("threshold", [3, None])
@pytest.mark.parametrize("device", DEVICES)
def test_static_step_with_lfu_decay_equals_eager(threshold: int | None, device: str) -> None:
    """LFU counts halved every 3 steps (an in-place shift of the score array between the
    static step's replays, on CUDA with no host read): the same rows, counts and evictions as
    the eager lookup's, and fewer counts than without the decay."""
    decay = LfuDecaySpec(interval_steps=3)
    eager, static = _pair(ScoreStrategy.LFU, threshold, device=device, lfu_decay=decay)
    plain = _pair(ScoreStrategy.LFU, threshold, device=device)[0]
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 9):
        keys = {n: k.to(device) for n, k in _batch(gen, step).items()}
        grads = {n: torch.randn(k.numel(), 4, generator=gen).to(device) for n, k in keys.items()}
        for dec in (eager, static, plain):
            dec.set_step(step)
            if device == "cuda" and dec is static and step % 3 == 0:
                torch.cuda.set_sync_debug_mode("error")  # the decay reads nothing to the host
                try:
                    dec._storages[0].decay_scores(step)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            rows = dec(keys)
            sum((rows[n] * grads[n]).sum() for n in keys).backward()  # type: ignore[union-attr]
        _assert_same(_state(eager), _state(static), f"step {step} state")
    ran = static.static_stats()["g"]
    assert ran["replays" if device == "cuda" else "eager"] == 8
    decayed, counted = static.table_state("a").scores, plain.table_state("a").scores
    assert int(decayed.sum()) < int(counted.sum())  # the counts did decay


def test_static_step_waits_for_max_capacity() -> None:
    eager, static = _pair(ScoreStrategy.LFU, 2, init_capacity=32)
    storage = static._storages[0]
    assert supports(storage) == "the table may still grow"
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 7):
        keys = _batch(gen, step)
        for dec in (eager, static):
            dec.set_step(step)
            rows = dec(keys)
            sum(r.sum() for r in rows.values()).backward()  # type: ignore[union-attr]
        _assert_same(_state(eager), _state(static), f"step {step}")
    assert supports(storage) is None  # it grew to its max: the later steps took the static path
    assert 0 < static.static_stats()["g"]["eager"] < 6


def test_static_step_refuses_a_negative_key_at_the_next_check() -> None:
    _, static = _pair(ScoreStrategy.LFU, None)
    static.set_step(1)
    rows = static({"a": torch.tensor([3, -5, 3]), "b": torch.tensor([1])})
    assert torch.equal(rows["a"][0], rows["a"][2])
    with pytest.raises(ValueError, match="negative key"):
        static.stats()


def test_padded_size() -> None:
    assert padded_size(1) == 16
    assert padded_size(17) == 18  # 2**4 .. 2**5 in steps of 2
    assert padded_size(640_000) == 655_360  # steps of 2**16
    sizes = {padded_size(n) for n in range((1 << 16) + 1, (1 << 17) + 1)}
    assert len(sizes) == 8
    assert all(padded_size(n) >= n for n in range(1, 5000))


def test_put_where_writes_only_the_selected() -> None:
    dst = torch.arange(6).float()
    put_where(dst, torch.tensor([4, -1, 1, 9]), torch.tensor([40.0, 7.0, 10.0, 8.0]),
              torch.tensor([True, False, True, False]))  # fmt: skip
    assert dst.tolist() == [0.0, 10.0, 2.0, 3.0, 40.0, 5.0]
    put_where(dst, torch.tensor([-1, 2]), torch.tensor([7.0, 8.0]), torch.tensor([False, False]))
    assert dst.tolist() == [0.0, 10.0, 2.0, 3.0, 40.0, 5.0]


def test_per_table_counts_and_sums() -> None:
    tids = torch.tensor([0, 0, 1, 3, 3, 3, 5])  # sorted; 5: past the tables (padding)
    values = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [100, 100]])
    assert sum_per_table(tids, values, 4).tolist() == [[4, 6], [5, 6], [0, 0], [27, 30]]
    assert count_per_table(torch.tensor([3, -1, 0, 3, 9]), 4).tolist() == [1, 0, 0, 2]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_per_table_sums_equal_a_loop_over_random_sorted_ids(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    ids = torch.sort(torch.randint(0, 7, (200,), generator=gen)).values  # 5, 6: past the tables
    values = torch.randint(-3, 10, (200, k), generator=gen)
    want = torch.stack([values[ids == t].sum(0) for t in range(5)])
    assert torch.equal(sum_per_table(ids, values, 5), want)


def test_the_periodic_check_reports_a_negative_key_a_round_later() -> None:
    _, static = _pair(ScoreStrategy.LFU, None)
    step = static._storages[0].static
    assert step is not None
    static.set_step(1)
    static({"a": torch.tensor([4, -2]), "b": torch.tensor([1])})
    step._check_later()  # copies the flags: nothing read yet
    with pytest.raises(ValueError, match="negative key"):
        step._check_later()
    step._check_later()  # reported once: the flags are clear again
    step._check_later()


def test_two_forwards_before_a_backward_are_refused() -> None:
    _, static = _pair(ScoreStrategy.LFU, None)
    static.set_step(1)
    first = static({"a": torch.tensor([4, 5]), "b": torch.tensor([1])})
    second = static({"a": torch.tensor([4, 6]), "b": torch.tensor([2])})
    second["a"].sum().backward()  # the latest lookup's backward is fine
    with pytest.raises(RuntimeError, match="one backward per forward"):
        first["a"].sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_a_new_learning_rate_reaches_the_captured_step(device: str) -> None:
    """The rate changes after the graphs were captured (a schedule): the replayed static
    step applies it as the eager one does, and not the rate it was captured with."""
    eager, static = _pair(ScoreStrategy.LFU, None, device=device)
    frozen, _ = _pair(ScoreStrategy.LFU, None, device=device)  # keeps lr 0.05
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 7):
        keys = {n: k.to(device) for n, k in _batch(gen, step).items()}
        grads = {n: torch.randn(k.numel(), 4, generator=gen).to(device) for n, k in keys.items()}
        if step >= 4:  # padded sizes captured in steps 1-3 are replayed at the new rate
            for dec in (eager, static):
                dec.set_learning_rate(0.05 * 0.5 ** (step - 3))
        for dec in (eager, static, frozen):
            dec.set_step(step)
            rows, _ = dec.lookup(keys, hits=True)
            sum((rows[n] * grads[n]).sum() for n in keys).backward()  # type: ignore[union-attr]
        _assert_same(_state(eager), _state(static), f"step {step} state")
        values = [_state(dec)["a"][1] for dec in (eager, frozen)]  # type: ignore[index]
        assert torch.equal(*values) == (step < 4), step
    if device == "cuda":
        assert static.static_stats()["g"]["replays"] == 6
