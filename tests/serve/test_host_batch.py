"""serve.host_batch: host batches merge (the one merge: serve.batcher.concat_batches builds
through it) into what hand-written golden merges and each part's bags in turn say."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence

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


def _bags(kjt: KeyedJaggedTensor) -> dict[str, list[list[int]]]:
    """Each key's bags as lists of ids, read from ``values``/``lengths`` in plain Python (the
    reference: neither merge computes it)."""
    ends = list(itertools.accumulate(kjt.lengths().tolist(), initial=0))
    values = kjt.values().tolist()
    bags = [values[a:b] for a, b in itertools.pairwise(ends)]  # [K * stride]
    s = kjt.stride()
    return {key: bags[i * s : (i + 1) * s] for i, key in enumerate(kjt.keys())}


def _promoted(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    """The dtype ``torch.cat`` gives ``tensors`` (int32 lengths with int64 ones: int64)."""
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors))


def assert_holds_parts(merged: Batch, parts: Sequence[Batch]) -> None:
    """``merged`` is ``parts`` in turn: each key's bags those of every part, ids per key and
    dtypes the parts' (promoted), each part's rows its ``user_index`` offset by the users before."""
    for which in ("user", "item", "sequence"):
        got, kjts = getattr(merged, which), [getattr(p, which) for p in parts]
        keys = got.keys()
        assert keys == kjts[0].keys() and got.stride() == sum(k.stride() for k in kjts)
        want = {key: [bag for k in kjts for bag in _bags(k)[key]] for key in keys}
        assert _bags(got) == want
        assert got.length_per_key() == [sum(map(len, want[key])) for key in keys]
        assert got.values().dtype == _promoted(k.values() for k in kjts)
        assert got.lengths().dtype == _promoted(k.lengths() for k in kjts)
    assert merged.user_index.dtype == torch.int64
    rows = users = 0
    for p in parts:
        assert torch.equal(merged.user_index[rows : rows + p.batch_size] - users, p.user_index)
        rows, users = rows + p.batch_size, users + p.num_users
    assert (merged.batch_size, merged.num_users) == (rows, users)


def test_merged_batches_hold_each_part_in_turn(fs: FeatureSet, requests: list) -> None:
    """Requests as feature generation makes them, merged by both entry points."""
    parts = _request_batches(fs, requests)
    parts += [synthetic_batch(fs, 3, 7, (0, 4, 2)), synthetic_batch(fs, 1, 1, (0,))]
    for n in (1, 2, len(parts)):
        merged = HostBatch.concat([HostBatch.of(p) for p in parts[:n]])
        assert merged.batch_size == sum(p.batch_size for p in parts[:n])
        assert merged.num_users == sum(p.num_users for p in parts[:n])
        assert_holds_parts(merged.to_batch(), parts[:n])
        assert_holds_parts(concat_batches(parts[:n]), parts[:n])


def _weighted(keys: list[str], lengths: list[int], values: list[int]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor(values),
        lengths=torch.tensor(lengths, dtype=torch.int32),
        weights=torch.arange(len(values), dtype=torch.float32),
    )


def test_weights_and_empty_keys_concatenate() -> None:
    """Ids per key of each part in turn (written out); weights dropped unless a part is alone."""
    a = _weighted(["x", "y"], [1, 0, 2, 1], [1, 2, 3, 4])  # x: [1] []     y: [2 3] [4]
    b = _weighted(["x", "y"], [2, 1], [5, 6, 7])  # x: [5 6]  y: [7]
    got = HostKjt.concat([HostKjt.of(a), HostKjt.of(b)]).to_kjt()
    assert got.stride() == 3 and got.length_per_key() == [3, 4]
    assert got.values().tolist() == [1, 5, 6, 2, 3, 4, 7]
    assert got.lengths().dtype == torch.int32 and got.lengths().tolist() == [1, 0, 2, 2, 1, 1]
    assert got.weights_or_none() is None
    one = HostKjt.concat([HostKjt.of(a)]).to_kjt()  # alone: the KJT itself, weights kept
    assert torch.equal(one.weights(), a.weights())
    empty = KeyedJaggedTensor(keys=[], values=torch.zeros(0), lengths=torch.zeros(0), stride=2)
    none = HostKjt.concat([HostKjt.of(empty), HostKjt.of(empty)])
    assert none.keys == () and none.stride == 4


def test_parts_with_equal_and_different_ids_per_key_concatenate() -> None:
    """Parts whose keys all have the same number of ids (a [K, n] block) among parts whose keys
    differ, and keys left empty: each key's bags those of every part in turn, dtypes kept."""

    def kjt(lengths: list[int], values: list[int]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            keys=["x", "y", "z"],
            values=torch.tensor(values, dtype=torch.int64),
            lengths=torch.tensor(lengths, dtype=torch.int32),
        )

    even = kjt([1, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6])  # 2 ids per key
    ragged = kjt([2, 0, 1], [7, 8, 9])  # 2, 0, 1
    empty = kjt([0, 0, 0], [])  # 0 ids per key: an empty block
    got = HostKjt.concat([HostKjt.of(k) for k in (ragged, even, empty)])
    assert got.per_key == (4, 2, 3) and got.stride == 4  # written out
    assert got.values.tolist() == [7, 8, 1, 2, 3, 4, 9, 5, 6]
    assert got.lengths.tolist() == [2, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 0]
    for kjts in ([even, ragged], [ragged, even, empty], [even, empty, even], [empty, empty]):
        merged = HostKjt.concat([HostKjt.of(k) for k in kjts]).to_kjt()
        want = {key: [bag for k in kjts for bag in _bags(k)[key]] for key in ("x", "y", "z")}
        assert _bags(merged) == want
        assert merged.length_per_key() == [sum(map(len, want[key])) for key in ("x", "y", "z")]
        assert merged.values().dtype == torch.int64 and merged.lengths().dtype == torch.int32


def test_different_keys_do_not_concatenate(fs: FeatureSet) -> None:
    a = HostKjt.of(synthetic_batch(fs, 1, 1, (0,)).user)
    b = HostKjt(("other",), 1, (0,), a.values[:0], a.lengths[:1])
    with pytest.raises(ValueError, match="cannot concatenate batches with keys"):
        HostKjt.concat([a, b])
    with pytest.raises(ValueError, match="at least one batch"):
        HostBatch.concat([])


# --------------------------------------------------------------------------- golden expectations


def _kjt(keys: list[str], lengths: list[int], values: list[int]) -> KeyedJaggedTensor:
    """A KJT of int64 ``values`` and ``lengths`` (key-major bags), as feature generation makes."""
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64),
    )


def golden_parts() -> list[Batch]:
    """Three hand-written requests: U = 1, 2, 1 and B = 2, 3, 1, with an empty bag (item i2 of
    a's first row), a key with no ids in a part (user u2 of b), sequences of equal lengths
    per key (a [K, n] block) and a part whose sequences are all empty (c)."""
    a = Batch(
        user=_kjt(["u1", "u2"], [1, 2], [10, 20, 21]),
        item=_kjt(["i1", "i2"], [1, 1, 0, 1], [30, 31, 40]),
        sequence=_kjt(["s1", "s2"], [3, 3], [50, 51, 52, 60, 61, 62]),
        user_index=torch.tensor([0, 0]),
    )
    b = Batch(
        user=_kjt(["u1", "u2"], [1, 1, 0, 0], [11, 12]),
        item=_kjt(["i1", "i2"], [1, 1, 1, 1, 1, 1], [32, 33, 34, 41, 42, 43]),
        sequence=_kjt(["s1", "s2"], [0, 2, 0, 2], [53, 54, 63, 64]),
        user_index=torch.tensor([0, 1, 1]),
    )
    c = Batch(
        user=_kjt(["u1", "u2"], [1, 1], [13, 22]),
        item=_kjt(["i1", "i2"], [0, 2], [44, 45]),
        sequence=_kjt(["s1", "s2"], [0, 0], []),
        user_index=torch.tensor([0]),
    )
    return [a, b, c]


# the merge of golden_parts(), written out: per KJT (lengths, values, ids per key)
GOLDEN = {
    "user": ([1, 1, 1, 1, 2, 0, 0, 1], [10, 11, 12, 13, 20, 21, 22], [4, 3]),
    "item": (
        [1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 2],
        [30, 31, 32, 33, 34, 40, 41, 42, 43, 44, 45],
        [5, 6],
    ),
    "sequence": ([3, 0, 2, 0, 3, 0, 2, 0], [50, 51, 52, 53, 54, 60, 61, 62, 63, 64], [5, 5]),
}
GOLDEN_USER_INDEX = [0, 0, 1, 2, 2, 3]  # [B = 6] in [0, U = 4)


def assert_golden(got: Batch) -> None:
    """``got`` is the literal merge of :func:`golden_parts` (int64 tensors, KJT metadata)."""
    for which, stride in (("user", 4), ("item", 6), ("sequence", 4)):
        kjt = getattr(got, which)
        lengths, values, per_key = GOLDEN[which]
        assert kjt.keys() == [f"{which[0]}1", f"{which[0]}2"] and kjt.stride() == stride
        assert kjt.lengths().dtype == kjt.values().dtype == torch.int64
        assert kjt.lengths().tolist() == lengths and kjt.values().tolist() == values
        assert kjt.length_per_key() == per_key
        assert kjt.offset_per_key() == [0, per_key[0], sum(per_key)]
        assert kjt.offsets().tolist() == [0, *itertools.accumulate(lengths)]
        assert kjt.weights_or_none() is None
    assert got.user_index.dtype == torch.int64 and got.user_index.tolist() == GOLDEN_USER_INDEX
    assert got.num_users == 4 and got.batch_size == 6


def test_golden_merge_of_hand_written_batches() -> None:
    """Both entry points give the merge written out in GOLDEN (computed by neither)."""
    parts = golden_parts()
    assert_golden(concat_batches(parts))
    host = HostBatch.concat([HostBatch.of(p) for p in parts])
    assert host.num_users == 4 and host.batch_size == 6
    assert_golden(host.to_batch())


def test_concat_batches_keeps_labels_and_oracle_only_if_every_batch_has_them() -> None:
    """Labels and oracle [B] are stacked when every part has them, else dropped; one batch
    alone is returned as it is (rows_are_users included)."""
    a, b, c = golden_parts()
    for p, labels in zip((a, b, c), ([1.0, 0.0], [0.0, 0.0, 1.0], [1.0]), strict=True):
        p.labels = torch.tensor(labels)
    b.oracle = torch.tensor([0.25, 0.5, 0.75])
    merged = concat_batches([a, b, c])
    assert merged.labels is not None and merged.labels.tolist() == [1, 0, 0, 0, 1, 1]
    assert merged.oracle is None  # a and c have none
    assert not merged.rows_are_users
    assert concat_batches([b]) is b
