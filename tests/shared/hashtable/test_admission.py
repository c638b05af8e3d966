"""Frequency admission: the bounded counter and admission at exactly the threshold."""

from __future__ import annotations

import torch

from shared.features import InitializerSpec, InitMode
from shared.hashtable.admission import FrequencyCounter
from shared.hashtable.embedding import DynamicEmbeddingCollection
from shared.hashtable.initializers import KeyedInitializer

from .conftest import NORMAL, dyn_table


def test_counter_accumulates_and_stays_bounded():
    c = FrequencyCounter(8, 4)
    assert c.add(torch.tensor([1, 2]), torch.tensor([1, 3])).tolist() == [1, 3]
    assert c.add(torch.tensor([2, 3]), torch.tensor([2, 1])).tolist() == [5, 1]
    keys, counts = c.export()
    assert keys.tolist() == [1, 2, 3] and counts.tolist() == [1, 5, 1]
    c.erase(torch.tensor([2]))
    assert c.export()[0].tolist() == [1, 3]
    c.add(torch.arange(100, 140), torch.full((40,), 2))
    assert c.size <= c.capacity == 8 and c.evictions > 0
    assert c.export()[1].min().item() >= 1


def test_admits_exactly_at_threshold():
    adm_init = InitializerSpec(InitMode.CONSTANT, value=0.25)
    dec = DynamicEmbeddingCollection(
        [dyn_table("a_emb", threshold=3, admission_initializer=adm_init)], {}, lr=0.5, seed=1
    )
    fresh = KeyedInitializer(NORMAL, seed=1, table="a_emb")(torch.tensor([7]), 4)
    for step in (1, 2):
        out = dec({"a_emb": torch.tensor([7])})["a_emb"]
        assert out.tolist() == [[0.25] * 4]  # not admitted: admission value
        out.sum().backward()  # ... and no update
        assert dec.export_table("a_emb")[0].numel() == 0
        assert dec.table_state("a_emb").counter_counts.tolist() == [step]
    out = dec({"a_emb": torch.tensor([7])})["a_emb"]  # third lookup: admitted
    assert torch.equal(out.detach(), fresh)
    out.sum().backward()
    keys, values = dec.export_table("a_emb")
    assert keys.tolist() == [7] and torch.equal(values, fresh - 0.5)  # updated from now on
    state = dec.table_state("a_emb")
    assert state.counter_keys.numel() == 0  # admitted keys leave the counter
    assert state.scores.tolist() == [3]  # STEP: third forward
    stats = dec.stats()["a_emb"]
    assert stats["admission_rejections"] == 2.0 and stats["admitted"] == 1.0


def test_duplicates_in_one_batch_count():
    dec = DynamicEmbeddingCollection([dyn_table("a_emb", threshold=3)], {}, lr=0.1)
    out = dec({"a_emb": torch.tensor([4, 4, 9, 4])})["a_emb"]
    assert dec.export_table("a_emb")[0].tolist() == [4]
    assert out[2].tolist() == [0.0] * 4 and not torch.equal(out[0], out[2])
    assert dec.stats()["a_emb"]["admission_rejections"] == 1.0
