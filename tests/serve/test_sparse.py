"""The fused lookups give exactly what the per-table reference path gives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from serve.batcher import concat_batches
from serve.fused import FusedTables, fusable
from serve.limits import Limits
from serve.model import synthetic_batch
from serve.sparse import SparseTables
from serve.validation import request_inputs
from shared.bundle import read_bundle
from shared.fg import request_columns_to_batch


def test_fused_equals_per_table_path(fs, bundle_v1: Path, requests) -> None:
    assert fusable(fs) is None
    bundle = read_bundle(bundle_v1)
    dev = torch.device("cpu")
    fused, ref = FusedTables(fs, bundle, dev), SparseTables.from_bundle(bundle, device=dev)
    parts = [
        request_columns_to_batch(fs, **vars(request_inputs(r, fs, Limits()))) for r in requests
    ]
    batches = [*parts[:3], concat_batches(parts), synthetic_batch(fs, 3, 7, (0, 4, 1))]
    for batch in batches:
        got, want = fused.embed(batch), ref.embed(batch)
        assert set(got) == set(want)
        for name in want:
            assert got[name].dtype == want[name].dtype, name
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    assert [(s.name, s.rows, s.hits, s.misses) for s in fused.stats()] == [
        (s.name, s.rows, s.hits, s.misses) for s in ref.stats()
    ]
    assert sum(s.hits for s in fused.stats()) > 0 and sum(s.misses for s in fused.stats()) > 0


def test_program_cache_reuses_the_graph_with_new_weights(
    fs, bundle_v1: Path, bundle_v2: Path, table
) -> None:
    from serve.program_cache import ProgramCache

    dev = torch.device("cpu")
    cache = ProgramCache()
    m1, kw1 = cache.load(bundle_v1 / "dense.pt2", dev, _full)
    m2, kw2 = cache.load(bundle_v2 / "dense.pt2", dev, _full)
    assert cache.reused == 1 and kw1 == kw2
    fresh, _ = _full(bundle_v2 / "dense.pt2", dev)
    for (n, a), (_, b) in zip(m2.state_dict().items(), fresh.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    assert not torch.equal(
        next(iter(m1.state_dict().values())), next(iter(m2.state_dict().values()))
    )


def _full(path: Path, device: torch.device):
    from serve.model import _full_load

    return _full_load(path, device)


def test_keys_beyond_the_fused_key_space(fs, bundle_v1: Path, tmp_path: Path) -> None:
    """A bundle key >= 2**60 means per-table lookups; a request id >= 2**60 is a miss."""
    from bench.synthetic_bundle import write_synthetic_bundle
    from serve.model import build_tables

    big = (1 << 62) + 5
    keys = {t.name: np.arange(1, 33, dtype=np.int64) for t in fs.dynamic_tables}
    normal = read_bundle(
        write_synthetic_bundle(
            tmp_path / "a", fs, keys=keys, program_path=bundle_v1 / "dense.pt2", version="a"
        )
    )
    keys["user_id_emb"] = np.append(keys["user_id_emb"], big)
    wide = read_bundle(
        write_synthetic_bundle(
            tmp_path / "b", fs, keys=keys, program_path=bundle_v1 / "dense.pt2", version="b"
        )
    )
    dev = torch.device("cpu")
    assert isinstance(build_tables(normal, dev), FusedTables)
    assert isinstance(build_tables(wide, dev), SparseTables)
    fused, ref = FusedTables(fs, normal, dev), SparseTables.from_bundle(normal, device=dev)
    batch = synthetic_batch(fs, 1, 2, (2,))
    ids = batch.user.values().clone()
    ids[0] = big  # user_id is the first user key
    batch.user._values = ids
    got, want = fused.embed(batch), ref.embed(batch)
    torch.testing.assert_close(got["user_deep"], want["user_deep"], rtol=0, atol=0)
    assert float(got["user_deep"][0, :16].abs().sum()) == 0.0  # user_id missed → zeros
