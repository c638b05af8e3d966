"""One rank of the ShardedDynamicEmbedding check (run by test_sharded_dynamic.py under torchrun).

Every rank builds the same global batch of keys and upstream gradients, a single-process
DynamicEmbeddingCollection that sees the whole batch (the reference), and a sharded collection
that sees only this rank's part. After each step both must agree: the rows returned, and the
rows, Adagrad state, scores and admission counters the rank owns. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from shared.config import load_config  # noqa: E402
from shared.features import build_feature_set  # noqa: E402
from shared.hashtable.embedding import DynamicEmbeddingCollection  # noqa: E402
from train.distributed.comm import CommStats  # noqa: E402
from train.distributed.env import DistEnv, init_from_env, shutdown  # noqa: E402
from train.distributed.replicated import all_reduce_row_sparse  # noqa: E402
from train.distributed.sharded_dynamic import ShardedDynamicEmbedding  # noqa: E402

CONFIG = (
    Path(__file__).resolve().parents[3] / "configs" / "multi_tower_din_taobao_dynamicemb.config"
)


def global_batch(step: int, world: int) -> dict[str, list[torch.Tensor]]:
    """Per table, the keys of each rank. Small key ranges: duplicates within and across ranks,
    keys reaching the admission threshold (3) only when the ranks' counts are added; the brand
    table is empty on the last rank, campaign_id is empty everywhere."""
    g = torch.Generator().manual_seed(100 + step)
    out: dict[str, list[torch.Tensor]] = {}
    for name, hi, n in (("user_id_emb", 40, 30), ("adgroup_id_emb", 25, 50), ("brand_emb", 12, 9)):
        out[name] = [torch.randint(0, hi, (n + 3 * r,), generator=g) for r in range(world)]
    out["brand_emb"][-1] = out["brand_emb"][-1][:0]
    out["campaign_id_emb"] = [torch.zeros(0, dtype=torch.int64) for _ in range(world)]
    return out


def check_owned(
    ref: DynamicEmbeddingCollection, mine: ShardedDynamicEmbedding, rank: int, world: int
) -> None:
    for name in ref.tables:
        a, b = ref.table_state(name), mine.table_state(name)
        own = a.keys % world == rank
        assert torch.equal(a.keys[own], b.keys), name
        torch.testing.assert_close(a.values[own], b.values, rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(a.accumulators[own], b.accumulators, rtol=1e-5, atol=1e-7)
        assert torch.equal(a.scores[own], b.scores), name
        if a.counter_keys is not None:
            assert b.counter_keys is not None and b.counter_counts is not None
            ck = a.counter_keys % world == rank
            ra = sorted(
                zip(a.counter_keys[ck].tolist(), a.counter_counts[ck].tolist(), strict=True)
            )
            rb = sorted(zip(b.counter_keys.tolist(), b.counter_counts.tolist(), strict=True))
            assert ra == rb, name


def check_table_grads(env: DistEnv) -> None:
    """num_buckets tables: the summed row-sparse gradients over ranks equal the gradient of one
    process on the concatenated lookups, on the dense path (10 rows), the gather path (50 rows)
    and for a table nobody looked up (no gradient)."""
    rank, world = env.rank, env.world_size
    shapes = [(10, 4), (50, 3), (30, 2)]
    torch.manual_seed(0)
    mine = [torch.nn.Embedding(n, d, sparse=True) for n, d in shapes]
    ref = [torch.nn.Embedding(n, d, sparse=True) for n, d in shapes]
    for a, b in zip(mine, ref, strict=True):
        b.load_state_dict(a.state_dict())
    g = torch.Generator().manual_seed(7)
    for t, (n, d) in enumerate(shapes[:2]):
        ids = [torch.randint(0, n, (5 + 4 * r,), generator=g) for r in range(world)]
        ups = [torch.randn(len(i), d, generator=g) for i in ids]
        (mine[t](ids[rank]) * ups[rank]).sum().backward()
        (ref[t](torch.cat(ids)) * torch.cat(ups)).sum().backward()
    all_reduce_row_sparse([e.weight for e in mine], dense_max_rows=20)
    for a, b in zip(mine[:2], ref[:2], strict=True):
        assert a.weight.grad is not None and a.weight.grad.is_sparse
        want = b.weight.grad.to_dense()  # type: ignore[union-attr]
        torch.testing.assert_close(a.weight.grad.to_dense(), want, rtol=1e-6, atol=1e-6)
    assert mine[2].weight.grad is None


def main() -> None:
    env = init_from_env("cpu")
    assert env is not None
    rank, world = env.rank, env.world_size
    fs = build_feature_set(load_config(CONFIG))
    # brand at dim 8: the fusion group splits into two storages, the row buffer mixes dims
    tables = [replace(t, dim=8) if t.name == "brand_emb" else t for t in fs.dynamic_tables]
    kw = dict(lr=0.05, seed=3)
    ref = DynamicEmbeddingCollection(tables, fs.fusion_groups, **kw)
    stats = CommStats(torch.device("cpu"))
    mine = ShardedDynamicEmbedding(
        DynamicEmbeddingCollection(tables, fs.fusion_groups, **kw), env, stats
    )
    dims = {t.name: t.dim for t in tables}
    for step in range(4):
        batch = global_batch(step, world)
        g = torch.Generator().manual_seed(200 + step)
        grads = {
            n: [torch.randn(len(k), dims[n], generator=g) for k in ks] for n, ks in batch.items()
        }
        ref.set_step(step)
        mine.set_step(step)
        want, want_hits = ref.lookup({n: torch.cat(ks) for n, ks in batch.items()}, hits=True)
        got, got_hits = mine.lookup({n: ks[rank] for n, ks in batch.items()}, hits=True)
        loss_ref = sum((want[n] * torch.cat(grads[n])).sum() for n in batch)
        loss_mine = sum((got[n] * grads[n][rank]).sum() for n in batch)
        for n, ks in batch.items():
            start = sum(len(k) for k in ks[:rank])
            assert got[n].shape == (len(ks[rank]), dims[n]), n
            part = want[n][start : start + len(ks[rank])]
            torch.testing.assert_close(got[n], part, rtol=1e-5, atol=1e-7, msg=f"{step} {n}")
            hits = want_hits[n][start : start + len(ks[rank])]  # the owners' answer, per key
            assert torch.equal(got_hits[n], hits), (step, n)
        loss_ref.backward()
        loss_mine.backward()
        check_owned(ref, mine, rank, world)
    # the whole table: sizes and admission counters add up to the reference's
    merged = mine.global_stats(env)
    for name, s in ref.stats().items():
        for k in ("size", "admitted", "admission_rejections", "evictions"):
            assert merged[name][k] == s[k], (name, k, merged[name][k], s[k])
    assert ref.stats()["adgroup_id_emb"]["size"] > 0
    local = mine.stats()  # this rank's shard only
    assert (
        set(local) == set(merged) and local["user_id_emb"]["size"] <= merged["user_id_emb"]["size"]
    )
    # eval: nothing inserted, unseen keys get the eval initializer (zeros)
    mine.eval()
    ref.eval()
    unseen = torch.arange(10_000 + rank, 10_020 + rank)
    out = mine({"user_id_emb": unseen, "adgroup_id_emb": torch.arange(0, 25)})
    assert torch.equal(out["user_id_emb"], torch.zeros(20, 16))
    torch.testing.assert_close(
        out["adgroup_id_emb"], ref({"adgroup_id_emb": torch.arange(0, 25)})["adgroup_id_emb"]
    )
    assert mine.global_stats(env)["user_id_emb"]["size"] == ref.stats()["user_id_emb"]["size"]
    check_table_grads(env)
    took = stats.take(steps=5, wall_seconds=1.0)
    assert took["bytes_rows"] > 0 and took["bytes_grads"] > 0 and took["calls"] > 0
    shutdown(env)
    print(f"rank {rank}: ok")


if __name__ == "__main__":
    main()
