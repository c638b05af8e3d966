from pathlib import Path

import torch

from serve.model import synthetic_batch
from shared.dense_inputs import assemble_dense_inputs, dense_layout, pool, pool_many
from shared.features import feature_set_from_text

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
