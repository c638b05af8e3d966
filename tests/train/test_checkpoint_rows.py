"""read_rows: a checkpoint's table files read once give the restored tables' rows, each saving
rank's part, and checkpoint_summaries' summaries; W ranks' files join to the one-process rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.hashtable.checkpoint import read_table
from shared.hashtable.summary import checkpoint_summaries
from tests.conftest import SEED_CONFIG
from train.checkpoint_rows import key_order, read_rows
from train.export import restore_model

NOW = 1_000_000  # the TIMESTAMP clock of every read here (the seed config's tables are LFU)


def test_rows_are_the_restored_tables(dyn_run) -> None:
    """The rows read from the checkpoint's files are what restoring the model's hash tables and
    exporting them gives (keys sorted, values bit for bit), each rank's part carries its rows'
    scores as read_table reads them, and the summaries of the same read are
    checkpoint_summaries' (its own read of the files)."""
    model, _, ckpt = restore_model(SEED_CONFIG, checkpoint=dyn_run.checkpoint)
    got = read_rows(ckpt, model.fs, now=NOW)
    assert set(got.reads) == {t.name for t in model.fs.dynamic_tables}
    for t in model.fs.dynamic_tables:
        keys, values = got.sorted_rows(t.name)
        want_keys, want_values = model.sparse.dynamic.export_table(t.name)
        assert keys.numel() > 0 and torch.equal(keys, want_keys), t.name
        assert torch.equal(values.view(torch.int32), want_values.view(torch.int32)), t.name
        ((part_keys, part_values, scores),) = got.parts(t.name)  # one process: one part
        state, _ = read_table(ckpt, t.name, spec=t, now=NOW)
        assert torch.equal(part_keys, state.keys) and torch.equal(part_values, state.values)
        assert scores.dtype == torch.int64 and torch.equal(scores, state.scores)
    assert got.summaries == checkpoint_summaries(ckpt, now=NOW)
    assert set(got.summaries) >= set(got.reads)


def _by_key(keys: torch.Tensor, *columns: torch.Tensor) -> list[torch.Tensor]:
    order = key_order(keys)
    return [keys[order], *(c[order] for c in columns)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_join_to_the_one_process_rows(dyn_ranks: dict[int, Path], world_size: int) -> None:
    """W ranks' files: W parts per table, rank R's keys those with key % W == R, and joined they
    are the one-process checkpoint's rows: keys, values, scores, Adagrad sums and admission
    counters alike; the summaries differ only in the files' world_size."""
    model, _, _ = restore_model(SEED_CONFIG, checkpoint=dyn_ranks[1], dynamic_tables=False)
    one, many = (
        read_rows(dyn_ranks[1], model.fs, now=NOW),
        read_rows(dyn_ranks[world_size], model.fs, now=NOW),
    )
    for t in model.fs.dynamic_tables:
        parts = many.parts(t.name)
        assert len(parts) == world_size
        assert all(bool((k % world_size == r).all()) for r, (k, _, _) in enumerate(parts))
        a, b = one.reads[t.name].state, many.reads[t.name].state
        assert b.keys.numel() == a.keys.numel() > 0
        for x, y in zip(
            _by_key(a.keys, a.values, a.scores, a.accumulators),
            _by_key(b.keys, b.values, b.scores, b.accumulators),
            strict=True,
        ):
            assert torch.equal(x, y), t.name
        for x, y in zip(one.sorted_rows(t.name), many.sorted_rows(t.name), strict=True):
            assert torch.equal(x, y), t.name
        assert (a.counter_keys is None) == (b.counter_keys is None)
        if a.counter_keys is not None and b.counter_keys is not None:
            assert a.counter_counts is not None and b.counter_counts is not None
            assert a.counter_keys.numel() > 0, "the seed config's admission counts keys"
            for x, y in zip(
                _by_key(a.counter_keys, a.counter_counts),
                _by_key(b.counter_keys, b.counter_counts),
                strict=True,
            ):
                assert torch.equal(x, y), t.name
    assert {n: s["world_size"] for n, s in many.summaries.items()} == dict.fromkeys(
        one.summaries, world_size
    )
    assert _but_world_size(many.summaries) == _but_world_size(one.summaries)


def _but_world_size(summaries: dict[str, dict]) -> dict[str, dict]:
    return {n: {k: v for k, v in s.items() if k != "world_size"} for n, s in summaries.items()}
