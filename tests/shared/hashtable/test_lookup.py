"""StaticLookupTable: serving's read-only table."""

from __future__ import annotations

import pytest
import torch

from shared.hashtable.lookup import StaticLookupTable


def test_lookup_rows_fill_and_counts():
    keys = torch.tensor([40, 10, 1 << 62, 0])
    vals = torch.arange(8, dtype=torch.float32).view(4, 2)
    t = StaticLookupTable.from_keys_values(keys, vals)
    out = t.lookup(torch.tensor([10, 11, 1 << 62, 10, 0]))
    assert out.tolist() == [[2.0, 3.0], [0.0, 0.0], [4.0, 5.0], [2.0, 3.0], [6.0, 7.0]]
    assert (t.hits, t.misses) == (4, 1)
    idx, found = t.find(torch.tensor([40, 41]))
    assert found.tolist() == [True, False] and torch.equal(t.values[idx[0]], vals[0])


def test_fill_value_empty_table_and_errors():
    t = StaticLookupTable.from_keys_values(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 3))
    assert t.lookup(torch.tensor([1, 2])).tolist() == [[0.0] * 3] * 2 and t.misses == 2
    t = StaticLookupTable.from_keys_values(torch.tensor([1]), torch.ones(1, 2), fill_value=-1.0)
    assert t.lookup(torch.tensor([2])).tolist() == [[-1.0, -1.0]]
    with pytest.raises(ValueError, match="key 3 appears more than once"):
        StaticLookupTable.from_keys_values(torch.tensor([3, 4, 3]), torch.zeros(3, 1))
    with pytest.raises(ValueError, match="negative"):
        t.lookup(torch.tensor([-2]))


def test_large_build_matches():
    g = torch.Generator().manual_seed(0)
    keys = torch.randperm(200_000, generator=g) * 31
    vals = torch.randn(200_000, 4, generator=g)
    t = StaticLookupTable.from_keys_values(keys, vals)
    q = torch.randint(0, 200_000, (5000,), generator=g)
    assert torch.equal(t.lookup(keys[q]), vals[q])


def test_free_slots_are_no_keys_and_take_new_contents_in_the_same_tensors():
    t = StaticLookupTable.from_keys_values(
        torch.tensor([7, 3]), torch.tensor([[7.0], [3.0]]), spare=2, fill_value=-1.0
    )
    assert (t.size, t.capacity) == (2, 4)
    ptrs = (t.keys.data_ptr(), t.values.data_ptr())
    spare_key = torch.iinfo(torch.int64).max
    assert t.lookup(torch.tensor([3, 7, 5, spare_key])).tolist() == [[3.0], [7.0], [-1.0], [-1.0]]
    assert (t.hits, t.misses) == (2, 2)  # a free slot's key is no key

    same = t.prepare(torch.tensor([7, 3]), torch.tensor([[70.0], [3.0]]))  # the same keys
    assert same is not None and same.keys is None and same.rows.tolist() == [1]
    same.apply()
    assert t.lookup(torch.tensor([7, 3])).tolist() == [[70.0], [3.0]]

    grown = t.prepare(torch.tensor([9, 1, 3, 8]), torch.tensor([[9.0], [1.0], [3.0], [8.0]]))
    assert grown is not None
    grown.apply()
    assert (t.size, t.capacity) == (4, 4) and (t.keys.data_ptr(), t.values.data_ptr()) == ptrs
    assert t.lookup(torch.tensor([1, 3, 7, 8, 9])).tolist() == [[1.0], [3.0], [-1.0], [8.0], [9.0]]

    shrunk = t.prepare(torch.tensor([5]), torch.tensor([[5.0]]))
    assert shrunk is not None
    shrunk.apply()
    assert t.size == 1 and t.keys.tolist() == [5, spare_key, spare_key, spare_key]
    assert t.values.tolist() == [[5.0], [-1.0], [-1.0], [-1.0]]
    assert t.lookup(torch.tensor([5, 9])).tolist() == [[5.0], [-1.0]]

    assert t.prepare(torch.arange(5), torch.zeros(5, 1)) is None  # more keys than capacity
    with pytest.raises(ValueError, match="key 2 appears more than once"):
        t.prepare(torch.tensor([2, 2]), torch.zeros(2, 1))


def test_a_table_without_free_slots_takes_only_as_many_keys():
    t = StaticLookupTable.from_keys_values(torch.tensor([1, 2]), torch.zeros(2, 1))
    assert t.prepare(torch.tensor([1]), torch.zeros(1, 1)) is None
    write = t.prepare(torch.tensor([4, 1]), torch.ones(2, 1))
    assert write is not None
    write.apply()
    assert t.lookup(torch.tensor([1, 2, 4])).tolist() == [[1.0], [0.0], [1.0]]
    with pytest.raises(ValueError, match="spare must be >= 0"):
        StaticLookupTable.from_keys_values(torch.tensor([1]), torch.zeros(1, 1), spare=-1)
