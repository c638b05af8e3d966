"""The fused lookups give exactly what looking each table up on its own gives."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from serve.batcher import concat_batches
from serve.limits import Limits
from serve.lookup import EmbeddingTables
from serve.model import synthetic_batch
from serve.validation import request_inputs
from shared.batch import Batch
from shared.bundle import Bundle, read_bundle
from shared.dense_inputs import assemble_dense_inputs, feature_parts, parts_by_table, pool_features
from shared.fg_request import request_columns_to_batch
from shared.hashtable.lookup import StaticLookupTable

from .conftest import KEYS_PER_TABLE


def reference_embed(
    bundle: Bundle, batch: Batch
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, int]]]:
    """(dense inputs, (hits, misses) per dynamic table) the slow way: each table on its own
    (``StaticLookupTable.lookup``, ``index_select``), pooled and assembled as training does."""
    fs = bundle.feature_set
    parts = feature_parts(batch)
    rows: list[torch.Tensor] = [torch.empty(0)] * len(parts)
    counts = {}
    for name, idx in parts_by_table(fs, parts).items():
        ids = torch.cat([parts[i][2] for i in idx])
        if fs.tables[name].is_dynamic:
            table = StaticLookupTable.from_keys_values(*bundle.hash_tables[name])
            found = table.lookup(ids)
            counts[name] = (table.hits, table.misses)
        else:
            found = bundle.dense_tables[name].float().index_select(0, ids)
        for i, chunk in zip(
            idx, torch.split(found, [parts[i][2].numel() for i in idx]), strict=True
        ):
            rows[i] = chunk  # [n_i, dim]
    pooled, sequences = pool_features(fs, parts, rows)
    return assemble_dense_inputs(fs, batch, pooled, sequences), counts


def _multi_valued(bundle: Bundle, batch: Batch, seed: int = 0) -> Batch:
    """``batch`` with bags of 0 to 3 random ids in its user and item KJTs (mean pooling then
    differs from sum)."""
    fs = bundle.feature_set
    gen = torch.Generator().manual_seed(seed)

    def bags(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        s = kjt.stride()
        lengths = (torch.arange(len(kjt.keys()) * s) % 4).view(len(kjt.keys()), s)  # [K, S]
        values = []
        for k, name in enumerate(kjt.keys()):
            table = fs.tables[fs.features[name].table]
            high = table.num_rows if not table.is_dynamic else 2 * KEYS_PER_TABLE
            values.append(torch.randint(0, int(high), (int(lengths[k].sum()),), generator=gen))
        return KeyedJaggedTensor(
            keys=kjt.keys(), values=torch.cat(values), lengths=lengths.reshape(-1), stride=s
        )

    return replace(batch, user=bags(batch.user), item=bags(batch.item))


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("which", ["seed", "mixed dims"])
def test_embed_equals_per_table_lookups(
    which: str, fs, bundle_v1: Path, fs_mixed, bundle_mixed: Path, requests
) -> None:
    bundle = read_bundle(bundle_v1 if which == "seed" else bundle_mixed)
    fs = bundle.feature_set
    assert len({t.dim for t in fs.tables.values()}) == (1 if which == "seed" else 4)
    tables = EmbeddingTables.from_bundle(bundle, device="cpu")
    parts = [
        request_columns_to_batch(fs, **vars(request_inputs(r, fs, Limits()))) for r in requests
    ]
    synthetic = synthetic_batch(fs, 3, 7, (0, 4, 1))
    batches = [*parts[:3], concat_batches(parts), synthetic, _multi_valued(bundle, synthetic)]
    total: dict[str, np.ndarray] = {}
    for batch in batches:
        want, counts = reference_embed(bundle, batch)
        _assert_same(tables.embed(batch), want)
        for name, c in counts.items():
            total[name] = total.get(name, np.zeros(2, np.int64)) + c
    stats = tables.stats()
    assert [s.name for s in stats] == list(fs.tables)
    assert [(s.name, s.dim, s.rows) for s in stats] == [
        (t.name, t.dim, len(bundle.hash_tables[t.name][0]) if t.is_dynamic else t.num_rows)
        for t in fs.tables.values()
    ]
    assert {s.name: (s.hits, s.misses) for s in stats if s.is_hashmap} == {
        n: tuple(c) for n, c in total.items()
    }
    assert sum(s.hits for s in stats) > 0 and sum(s.misses for s in stats) > 0
    tables.reset_stats()
    assert all(s.hits == s.misses == 0 for s in tables.stats())


def test_program_cache_reuses_the_graph_with_new_weights(
    fs, bundle_v1: Path, bundle_v2: Path, table
) -> None:
    from serve.program_cache import ProgramCache

    dev = torch.device("cpu")
    cache = ProgramCache()
    m1, kw1, d1 = cache.load(bundle_v1 / "dense.pt2", dev, _full)
    m2, kw2, d2 = cache.load(bundle_v2 / "dense.pt2", dev, _full)
    assert cache.reused == 1 and kw1 == kw2 and d1 == d2  # one graph, one digest
    fresh, _ = _full(bundle_v2 / "dense.pt2", dev)
    for (n, a), (_, b) in zip(m2.state_dict().items(), fresh.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    assert not torch.equal(
        next(iter(m1.state_dict().values())), next(iter(m2.state_dict().values()))
    )


def _full(path: Path, device: torch.device):
    from serve.model import _full_load

    return _full_load(path, device)


def _bundle(fs, tmp_path: Path, name: str, keys: dict[str, np.ndarray], program: Path) -> Bundle:
    from bench.synthetic_bundle import write_synthetic_bundle

    path = write_synthetic_bundle(
        tmp_path / name, fs, keys=keys, program_path=program, version=name
    )
    return read_bundle(path)


def test_keys_beyond_the_shared_key_space(fs, bundle_v1: Path, tmp_path: Path) -> None:
    """A bundle key >= 2**60 is found (its table gets a key space of its own); a request id
    >= 2**60 of a table in the shared key space is a miss."""
    big = (1 << 62) + 5
    keys = {t.name: np.arange(1, 33, dtype=np.int64) for t in fs.dynamic_tables}
    normal = _bundle(fs, tmp_path, "a", keys, bundle_v1 / "dense.pt2")
    keys["user_id_emb"] = np.append(keys["user_id_emb"], big)
    wide = _bundle(fs, tmp_path, "b", keys, bundle_v1 / "dense.pt2")
    batch = synthetic_batch(fs, 1, 2, (2,))
    ids = batch.user.values().clone()
    ids[0] = big  # user_id is the first user key
    batch.user._values = ids
    for bundle, found in ((normal, False), (wide, True)):
        tables = EmbeddingTables.from_bundle(bundle, device="cpu")
        got = tables.embed(batch)
        _assert_same(got, reference_embed(bundle, batch)[0])
        user_id = got["user_deep"][0, :16]
        assert bool(user_id.abs().sum() > 0) == found  # a miss gives zeros
        stats = {s.name: (s.hits, s.misses) for s in tables.stats()}
        assert stats["user_id_emb"] == ((1, 0) if found else (0, 1))


def test_empty_dynamic_tables_miss_everything(fs, bundle_v1: Path, tmp_path: Path) -> None:
    keys = {t.name: np.zeros(0, dtype=np.int64) for t in fs.dynamic_tables}
    bundle = _bundle(fs, tmp_path, "empty", keys, bundle_v1 / "dense.pt2")
    tables = EmbeddingTables.from_bundle(bundle, device="cpu")
    batch = synthetic_batch(fs, 2, 5, (3, 0))
    _assert_same(tables.embed(batch), reference_embed(bundle, batch)[0])
    assert all(s.hits == 0 for s in tables.stats())
    assert sum(s.misses for s in tables.stats()) > 0
