"""serve.host_batch: host batches merge and build into the very batches the KJT path makes
(serve.batcher.concat_batches), so every score downstream is the same."""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from serve.batcher import concat_batches
from serve.host_batch import HostBatch, HostKjt
from serve.limits import Limits
from serve.model import synthetic_batch
from serve.validation import request_inputs
from shared.batch import Batch
from shared.features import FeatureSet
from shared.fg_request import request_columns_to_batch


def _request_batches(fs: FeatureSet, requests: list) -> list[Batch]:
    return [request_columns_to_batch(fs, **vars(request_inputs(r, fs, Limits()))) for r in requests]


def assert_same_batch(got: Batch, want: Batch) -> None:
    """Keys, strides, ids per key and every tensor equal, dtypes included."""
    for x, y in ((got.user, want.user), (got.item, want.item), (got.sequence, want.sequence)):
        assert x.keys() == y.keys() and x.stride() == y.stride()
        assert x.length_per_key() == y.length_per_key()
        for a, b in ((x.values(), y.values()), (x.lengths(), y.lengths())):
            assert a.dtype == b.dtype and torch.equal(a, b)
        wx, wy = x.weights_or_none(), y.weights_or_none()
        assert (wx is None) == (wy is None) and (wx is None or torch.equal(wx, wy))
    assert got.user_index.dtype == want.user_index.dtype
    assert torch.equal(got.user_index, want.user_index)


def test_concat_then_build_equals_concat_batches(fs: FeatureSet, requests: list) -> None:
    parts = _request_batches(fs, requests)
    parts += [synthetic_batch(fs, 3, 7, (0, 4, 2)), synthetic_batch(fs, 1, 1, (0,))]
    for n in (1, 2, len(parts)):
        merged = HostBatch.concat([HostBatch.of(p) for p in parts[:n]])
        assert merged.batch_size == sum(p.batch_size for p in parts[:n])
        assert merged.num_users == sum(p.num_users for p in parts[:n])
        assert_same_batch(merged.to_batch(), concat_batches(parts[:n]))


def _weighted(keys: list[str], lengths: list[int], values: list[int]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor(values),
        lengths=torch.tensor(lengths, dtype=torch.int32),
        weights=torch.arange(len(values), dtype=torch.float32),
    )


def test_weights_and_empty_keys_concatenate_as_kjts_do() -> None:
    """As _concat_kjt: ids per key of each part in turn; weights dropped (it drops them)."""
    from serve.batcher import _concat_kjt

    a = _weighted(["x", "y"], [1, 0, 2, 1], [1, 2, 3, 4])
    b = _weighted(["x", "y"], [2, 1], [5, 6, 7])
    got = HostKjt.concat([HostKjt.of(a), HostKjt.of(b)]).to_kjt()
    want = _concat_kjt([a, b])
    assert got.length_per_key() == want.length_per_key() == [3, 4]
    assert torch.equal(got.values(), want.values())
    assert got.weights_or_none() is None and want.weights_or_none() is None
    one = HostKjt.concat([HostKjt.of(a)]).to_kjt()  # alone: the KJT itself, weights kept
    assert torch.equal(one.weights(), a.weights())
    assert torch.equal(got.lengths(), want.lengths())
    empty = KeyedJaggedTensor(keys=[], values=torch.zeros(0), lengths=torch.zeros(0), stride=2)
    none = HostKjt.concat([HostKjt.of(empty), HostKjt.of(empty)])
    assert none.keys == () and none.stride == 4


def test_parts_with_equal_and_different_ids_per_key_concatenate_as_kjts_do() -> None:
    """Parts whose keys all have the same number of ids (a [K, n] block) among parts whose keys
    differ, and keys left empty: values, lengths and ids per key as _concat_kjt gives them."""
    from serve.batcher import _concat_kjt

    def kjt(lengths: list[int], values: list[int]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            keys=["x", "y", "z"],
            values=torch.tensor(values, dtype=torch.int64),
            lengths=torch.tensor(lengths, dtype=torch.int32),
        )

    even = kjt([1, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6])  # 2 ids per key
    ragged = kjt([2, 0, 1], [7, 8, 9])  # 2, 0, 1
    empty = kjt([0, 0, 0], [])  # 0 ids per key: an empty block
    for kjts in ([even, ragged], [ragged, even, empty], [even, empty, even], [empty, empty]):
        got = HostKjt.concat([HostKjt.of(k) for k in kjts])
        want = _concat_kjt(kjts)
        assert list(got.per_key) == want.length_per_key()
        for a, b in ((got.values, want.values()), (got.lengths, want.lengths())):
            assert a.dtype == b.numpy().dtype and a.tolist() == b.tolist()


def test_different_keys_do_not_concatenate(fs: FeatureSet) -> None:
    a = HostKjt.of(synthetic_batch(fs, 1, 1, (0,)).user)
    b = HostKjt(("other",), 1, (0,), a.values[:0], a.lengths[:1])
    with pytest.raises(ValueError, match="cannot concatenate batches with keys"):
        HostKjt.concat([a, b])
    with pytest.raises(ValueError, match="at least one batch"):
        HostBatch.concat([])
