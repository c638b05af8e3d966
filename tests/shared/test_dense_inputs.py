from pathlib import Path

import numpy as np
import pytest
import torch

from serve.model import synthetic_batch
from shared.dense_inputs import (
    COLD_INPUT_NAMES,
    INPUT_NAMES,
    PAIR_INPUT_NAMES,
    Signature,
    assemble_dense_inputs,
    batch_pairs,
    cold_rows,
    dense_layout,
    joined,
    padded_pair_index,
    pair_count,
    pair_index,
    pair_index_torch,
    pool,
    pool_and_flag,
    pool_and_flag_features,
    pool_features,
    pool_many,
    program_input_names,
    signature_of,
)
from shared.features import feature_set_from_text
from tests.conftest import DEVICES

ROOT = Path(__file__).resolve().parents[2]
FS = feature_set_from_text(
    (ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config").read_text()
)


def test_pool_sum_mean_and_empty_bags() -> None:
    emb = torch.arange(12, dtype=torch.float32).view(6, 2)
    lengths = torch.tensor([2, 0, 3, 1])
    s = pool(emb, lengths, "sum")
    assert s.tolist() == [[2, 4], [0, 0], [18, 21], [10, 11]]
    m = pool(emb, lengths, "mean")
    assert m.tolist() == [[1, 2], [0, 0], [6, 7], [10, 11]]


def test_pool_many_equals_pool_per_feature() -> None:
    gen = torch.Generator().manual_seed(3)
    lengths = [torch.tensor([2, 0, 3, 1]), torch.tensor([1, 1, 0]), torch.tensor([0, 0])]
    embs = [
        torch.randn(int(n.sum()), d, generator=gen) for n, d in zip(lengths, (4, 4, 2), strict=True)
    ]
    poolings = ["sum", "mean", "sum"]
    got = pool_many(embs, lengths, poolings)
    for g, e, n, p in zip(got, embs, lengths, poolings, strict=True):
        assert torch.equal(g, pool(e, n, p))  # same sums in the same order
    assert [tuple(g.shape) for g in got] == [(4, 4), (3, 4), (2, 2)]


def _cold_by_definition(hits: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[R] bool: the bag has ids and none has a row (a loop over the bags)."""
    out, at = [], 0
    for n in lengths.tolist():
        out.append(n > 0 and not bool(hits[at : at + n].any()))
        at += n
    return torch.tensor(out, dtype=torch.bool)


def test_pool_and_flag_equals_pool_and_cold_rows_per_feature() -> None:
    """One bag index for the pooling and the hit counts: the sums, their gradients and the
    cold flags are each feature's own, bit for bit, whatever the order of the embeddings with
    and without hits (two widths, sum and mean, empty bags, bags without hits)."""
    gen = torch.Generator().manual_seed(5)
    lengths = [torch.randint(0, 4, (r,), generator=gen) for r in (6, 5, 7, 3, 4)]
    widths, poolings = (4, 4, 4, 2, 2), ["sum", "mean", "sum", "sum", "mean"]
    embs = [
        torch.randn(int(n.sum()), d, generator=gen, requires_grad=True)
        for n, d in zip(lengths, widths, strict=True)
    ]
    hits: list[torch.Tensor | None] = [
        None if k in (0, 3) else torch.rand(int(n.sum()), generator=gen) < 0.3
        for k, n in enumerate(lengths)
    ]
    got, cold = pool_and_flag(embs, lengths, poolings, hits)
    weights = [torch.randn(g.shape, generator=gen) for g in got]
    sum((g * w).sum() for g, w in zip(got, weights, strict=True)).backward()
    fast = [e.grad.clone() for e in embs]
    for e in embs:
        e.grad = None
    want = [pool(e, n, p) for e, n, p in zip(embs, lengths, poolings, strict=True)]
    sum((g * w).sum() for g, w in zip(want, weights, strict=True)).backward()
    for k, (g, w, e) in enumerate(zip(got, want, embs, strict=True)):
        assert torch.equal(g, w), k  # same sums in the same order
        assert torch.equal(fast[k], e.grad), k
    for k, (c, h, n) in enumerate(zip(cold, hits, lengths, strict=True)):
        if h is None:
            assert c is None, k
            continue
        assert c is not None and torch.equal(c, _cold_by_definition(h, n)), k
        assert torch.equal(c, cold_rows(h, n)), k
    assert bool(torch.cat([c for c in cold if c is not None]).any())  # some bags are cold


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_pool_and_flag_on_a_device_with_int32_and_int64_lengths(
    device: str, dtype: torch.dtype
) -> None:
    """The bag index is the lengths' own dtype (repeat_interleave of the lengths): int32 and
    int64 lengths pool and flag alike, on the CPU and on CUDA (the CPU's sums; equal up to
    the order of CUDA's atomic adds, and flags equal), with no host read."""
    gen = torch.Generator().manual_seed(9)
    lengths = [torch.randint(0, 4, (r,), generator=gen) for r in (300, 200)]
    embs = [torch.randn(int(n.sum()), 16, generator=gen) for n in lengths]
    hits: list[torch.Tensor | None] = [torch.rand(int(lengths[0].sum()), generator=gen) < 0.3, None]
    want, want_cold = pool_and_flag(embs, lengths, ["sum", "mean"], hits)
    on = [(n.to(device, dtype)) for n in lengths]
    found = [None if h is None else h.to(device) for h in hits]
    on_device = [e.to(device) for e in embs]  # (a pageable copy syncs: made before the guard)
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")  # a host read would raise
    try:
        got, cold = pool_and_flag(on_device, on, ["sum", "mean"], found)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-6, atol=1e-6)
    assert cold[1] is None and want_cold[0] is not None and cold[0] is not None
    assert torch.equal(cold[0].cpu(), want_cold[0])


def test_pool_and_flag_features_flags_pooled_and_sequence_parts() -> None:
    """pool_and_flag_features: every pooled feature's bags counted with the pooling's bag
    index and every sequence's elements in one negation give each feature's own flags (bags
    of 0, 1 and 3 ids), in the parts' order; the pooled and sequence embeddings are
    pool_features'."""
    gen = torch.Generator().manual_seed(0)
    parts, rows, hits = [], [], []
    for which, name, n_rows in (
        ("user", "user_id", 5), ("item", "price", 5), ("item", "adgroup_id", 5),
        ("sequence", "click_50_seq__adgroup_id", 0), ("sequence", "click_50_seq__brand", 0),
    ):  # fmt: skip
        lengths = torch.randint(0, 4, (n_rows,), generator=gen) if n_rows else torch.zeros(0)
        n = int(lengths.sum()) if n_rows else 7
        parts.append((which, name, torch.arange(n), lengths.to(torch.int64)))
        rows.append(torch.randn(n, 16, generator=gen))
        hits.append(None if name == "price" else torch.rand(n, generator=gen) < 0.5)
    pooled, sequences, cold = pool_and_flag_features(FS, parts, rows, hits)
    want_pooled, want_sequences = pool_features(FS, parts, rows)
    assert pooled.keys() == want_pooled.keys() and sequences.keys() == want_sequences.keys()
    assert all(torch.equal(pooled[n], want_pooled[n]) for n in pooled)
    assert all(sequences[n] is want_sequences[n] for n in sequences)
    assert list(cold) == ["user_id", "adgroup_id", "click_50_seq__adgroup_id",
                          "click_50_seq__brand"]  # fmt: skip
    for (which, name, _ids, lengths), found in zip(parts, hits, strict=True):
        if found is None:
            continue
        want = ~found if which == "sequence" else _cold_by_definition(found, lengths)
        assert torch.equal(cold[name], want), name
    assert pool_and_flag_features(FS, parts, rows, [None] * len(parts))[2] == {}


def test_joined_is_a_view_of_adjacent_pieces_else_a_concatenation() -> None:
    """joined: the pieces of one split, in order, give a view of their span (no copy); pieces
    out of order, with a gap, of other tensors or needing a gradient are concatenated. Either
    way the values are torch.cat's."""
    flags = torch.rand(10, generator=torch.Generator().manual_seed(0)) < 0.5
    a, b, c, _rest = torch.split(flags, [3, 0, 4, 3])
    for parts in ([a, b, c], [a, c]):
        got = joined(parts)
        assert torch.equal(got, torch.cat(parts))
        assert got.data_ptr() == flags.data_ptr()  # a view: no copy
    assert joined([a]) is a
    gap = torch.split(flags, [3, 1, 4, 2])
    other = torch.zeros(2, dtype=torch.bool)
    for parts in ([c, a], [gap[0], gap[2]], [a, other], [flags[::2][:2], flags[::2][2:]]):
        got = joined(parts)
        assert torch.equal(got, torch.cat(parts))
        assert got.data_ptr() not in (flags.data_ptr(), other.data_ptr())  # a copy
    x = torch.randn(6, requires_grad=True)
    got = joined(list(torch.split(x, [2, 4])))
    assert torch.equal(got, x) and got.grad_fn is not None and got.data_ptr() != x.data_ptr()


def test_layout_of_the_seed_config() -> None:
    lay = dense_layout(FS)
    assert lay.user_deep[0] == "user_id" and "pid" in lay.item_deep and "price" in lay.item_deep
    assert (lay.user_deep_dim, lay.item_deep_dim, lay.seq_dim) == (9 * 16, 7 * 16, 48)
    assert lay.query == ("adgroup_id", "cate_id", "brand")


def test_assemble_concatenates_in_layout_order() -> None:
    batch = synthetic_batch(FS, users=2, candidates=3, seq_lengths=(2, 1))
    lay = dense_layout(FS)
    rows = {**{n: 2 for n in lay.user_deep}, **{n: 3 for n in (*lay.item_deep, *lay.query)}}
    pooled = {n: torch.full((r, 16), float(i)) for i, (n, r) in enumerate(rows.items())}
    seqs = {n: torch.full((3, 16), 100.0 + i) for i, n in enumerate(lay.sequence)}
    x = assemble_dense_inputs(FS, batch, pooled, seqs)
    assert x["user_deep"].shape == (2, 144) and x["item_deep"].shape == (3, 112)
    assert x["query"].shape == (3, 48) and x["seq_values"].shape == (3, 48)
    assert x["seq_lengths"].tolist() == [2, 1] and x["user_index"].tolist() == [0, 1, 0]
    assert x["user_deep"][0, ::16].tolist() == [pooled[n][0, 0].item() for n in lay.user_deep]
    assert x["seq_values"][0, ::16].tolist() == [100.0, 101.0, 102.0]


# --------------------------------------------------------------------------- the pairs

PAIR_CASES = [
    ([2, 0, 1], [0, 0, 2, 1]),  # the module docstring's example
    ([5], [0] * 7),  # one user, many candidates (U != B)
    ([0, 0], [1, 0, 1]),  # only empty sequences: N = 0
    ([3, 0, 4], [1]),  # B = 1, an empty sequence
    ([4, 1], []),  # B = 0
    ([], []),  # U = B = 0
]


def _loop_pairs(lengths: list[int], user_index: list[int]) -> tuple[list[int], list[int]]:
    """The definition spelt out: by candidate, then by element of its user's sequence."""
    start = [sum(lengths[:u]) for u in range(len(lengths))]
    seg, elem = [], []
    for b, u in enumerate(user_index):
        for i in range(lengths[u]):
            seg.append(b)
            elem.append(start[u] + i)
    return seg, elem


@pytest.mark.parametrize(("lengths", "user_index"), PAIR_CASES)
def test_pair_index_numpy_and_torch_follow_the_definition(
    lengths: list[int], user_index: list[int]
) -> None:
    want = _loop_pairs(lengths, user_index)
    seg, elem = pair_index(np.array(lengths, np.int64), np.array(user_index, np.int64))
    assert (seg.dtype, elem.dtype) == (np.int64, np.int64)
    assert (seg.tolist(), elem.tolist()) == want
    tseg, telem = pair_index_torch(
        torch.tensor(lengths, dtype=torch.int64), torch.tensor(user_index, dtype=torch.int64)
    )
    assert (tseg.dtype, telem.dtype) == (torch.int64, torch.int64)
    assert (tseg.tolist(), telem.tolist()) == want


def test_pair_index_on_random_jagged_batches() -> None:
    rng = np.random.default_rng(7)
    for _ in range(50):
        u = int(rng.integers(1, 9))
        lengths = rng.integers(0, 6, size=u) * (rng.random(u) < 0.7)  # about 30 % empty
        user_index = rng.integers(0, u, size=int(rng.integers(1, 20)))
        want = _loop_pairs(lengths.tolist(), user_index.tolist())
        for lens in (lengths, lengths.astype(np.int32)):  # int32: a KJT's lengths
            seg, elem = pair_index(lens, user_index)
            assert (seg.dtype, elem.dtype) == (np.int64, np.int64)
            assert (seg.tolist(), elem.tolist()) == want


def test_pair_index_refuses_a_user_index_out_of_range() -> None:
    with pytest.raises(IndexError):
        pair_index(np.array([1, 2]), np.array([0, 2]))


def test_padded_pairs_are_pair_index_then_the_last_rows() -> None:
    """Random padded batches (stacked or not, dummy rows of a dummy user with any length):
    pair_index's pairs first, then the last row's with element 0, up to the capacity; and
    pair_count is their number."""
    rng = np.random.default_rng(11)
    for trial in range(200):
        u = int(rng.integers(0, 12))
        lengths = rng.integers(0, 7, size=u) * (rng.random(u) < 0.8)
        b = int(rng.integers(0, 30)) if u else 0
        user_index = rng.integers(0, max(u, 1), size=b)
        if trial % 2:
            user_index.sort()  # requests stacked: each user's candidates one run, in order
        want = _loop_pairs(lengths.tolist(), user_index.tolist())
        n = pair_count(lengths.astype(np.int32), user_index)
        assert n == len(want[0])
        rows, spare = max(b, u) + int(rng.integers(1, 4)), int(rng.integers(0, 5))
        padded_lengths = np.zeros(rows, np.int64)  # user rows: real, the dummy user, empty
        padded_lengths[:u] = lengths
        padded_lengths[u] = rng.integers(0, 50)  # the dummy user's bag of padding ids
        padded_users = np.full(rows, u, np.int64)  # dummy candidates: the dummy user
        padded_users[:b] = user_index
        seg, elem = padded_pair_index(
            torch.from_numpy(padded_lengths),
            torch.from_numpy(padded_users),
            torch.tensor([b]),
            n + spare,
        )
        assert (seg.dtype, elem.dtype) == (torch.int64, torch.int64)
        assert (seg[:n].tolist(), elem[:n].tolist()) == want
        assert seg[n:].tolist() == [rows - 1] * spare and elem[n:].tolist() == [0] * spare


def test_pair_count_refuses_a_user_index_out_of_range() -> None:
    with pytest.raises(IndexError, match="outside"):
        pair_count(np.array([1, 2]), np.array([0, 2]))
    with pytest.raises(IndexError, match="outside"):
        pair_count(np.array([1, 2]), np.array([-1, 0]))
    assert pair_count(np.array([3, 2]), np.array([0, 0, 1])) == 8


def test_batch_pairs_and_assembled_inputs() -> None:
    batch = synthetic_batch(FS, 3, 7, [2, 0, 3])
    lay = dense_layout(FS)
    seg, elem = batch_pairs(batch, lay)
    lengths = [2, 0, 3]
    assert (seg.tolist(), elem.tolist()) == _loop_pairs(lengths, batch.user_index.tolist())
    pooled = {n: torch.zeros(3 if n in lay.user_deep else 7, 16) for n in FS.features}
    sequences = {n: torch.zeros(5, 16) for n in lay.sequence}
    pairs = (torch.from_numpy(seg), torch.from_numpy(elem))
    inputs = assemble_dense_inputs(FS, batch, pooled, sequences, layout=lay, pairs=pairs)
    assert tuple(inputs) == PAIR_INPUT_NAMES
    assert inputs["pair_segment"] is pairs[0] and inputs["pair_element"] is pairs[1]
    assert tuple(assemble_dense_inputs(FS, batch, pooled, sequences)) == INPUT_NAMES


class _Six(torch.nn.Module):
    def forward(self, user_deep: torch.Tensor, item_deep: torch.Tensor) -> torch.Tensor:
        return item_deep.sum(1) + user_deep.sum()


def test_program_input_names_of_keyword_and_positional_programs() -> None:
    x = {"user_deep": torch.ones(2, 3), "item_deep": torch.ones(3, 2)}
    keyword = torch.export.export(_Six(), (), kwargs=x)
    positional = torch.export.export(_Six(), (x["user_deep"], x["item_deep"]))
    assert program_input_names(keyword) == ("user_deep", "item_deep")
    assert program_input_names(keyword.module()) == ("user_deep", "item_deep")
    assert program_input_names(positional) == ()
    assert program_input_names(torch.nn.Linear(2, 2)) == ()
    assert signature_of(PAIR_INPUT_NAMES) is Signature.PAIRS
    assert signature_of(INPUT_NAMES) is signature_of(()) is Signature.PLAIN
    assert signature_of(COLD_INPUT_NAMES) is Signature.COLD
    with pytest.raises(ValueError, match="are none of"):
        signature_of(("user_deep", "item_deep"))
