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
