"""Offline scoring from a bundle alone: the reference the server's answers are checked against.

``score_rows(bundle_dir, table, tiled=False)`` scores sample rows the way training evaluates
them (one user row per sample); ``tiled=True`` first merges the rows whose user side (user
features and click sequences) is identical into one user row, as serving does for one request
with N candidates. Both must agree with each other and with the server (float tolerance)::

    probs = score_rows("exports/v3", pq.read_table("samples/eval/part-00000.parquet"), tiled=True)
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from serve.model import LoadedModel
from shared.batch import Batch
from shared.fg import table_to_batch


def score_rows(
    bundle_dir: str | Path,
    table: pa.Table,
    *,
    tiled: bool,
    device: str = "cpu",
    chunk_rows: int = 8192,
) -> np.ndarray:
    """Click probabilities [rows] (float32) of ``table``'s rows under the bundle's model."""
    model = LoadedModel.load(bundle_dir, device=device, warmup_rounds=0)
    return score_table(model, table, tiled=tiled, chunk_rows=chunk_rows)


def score_table(
    model: LoadedModel, table: pa.Table, *, tiled: bool, chunk_rows: int = 8192
) -> np.ndarray:
    out = []
    for start in range(0, table.num_rows, chunk_rows):
        batch = table_to_batch(model.fs, table.slice(start, chunk_rows))
        if tiled:
            batch = tile_users(batch)
        out.append(model.predict(batch).numpy())
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def tile_users(batch: Batch) -> Batch:
    """Merge user rows with identical user features and sequences; ``user_index`` remapped.

    Offline only (a Python pass over rows to build the keys); serving gets tiled requests.
    """
    user_keys = _row_keys(batch.user)
    seq_keys = _row_keys(batch.sequence)
    first: dict[tuple[object, ...], int] = {}
    new_of_old = np.empty(batch.num_users, np.int64)
    keep: list[int] = []
    for u in range(batch.num_users):
        key = (user_keys[u], seq_keys[u])
        if key not in first:
            first[key] = len(keep)
            keep.append(u)
        new_of_old[u] = first[key]
    rows = torch.tensor(keep, dtype=torch.int64)
    return replace(
        batch,
        user=select_rows(batch.user, rows),
        sequence=select_rows(batch.sequence, rows),
        user_index=torch.from_numpy(new_of_old)[batch.user_index],
    )


def _row_keys(kjt: KeyedJaggedTensor) -> list[tuple[object, ...]]:
    """Per row (bag index), a hashable tuple of its values under every key."""
    stride = kjt.stride()
    per_key = []
    for jt in kjt.to_dict().values():
        offsets = jt.offsets().tolist()
        values = jt.values().tolist()
        per_key.append([tuple(values[offsets[i] : offsets[i + 1]]) for i in range(stride)])
    return list(zip(*per_key, strict=True)) if per_key else [()] * stride


def select_rows(kjt: KeyedJaggedTensor, rows: torch.Tensor) -> KeyedJaggedTensor:
    """The bags ``rows`` [R] of every key, in that order (a jagged gather)."""
    keys = kjt.keys()
    lengths_out, values_out = [], []
    for jt in kjt.to_dict().values():
        lengths = jt.lengths().to(torch.int64)
        starts = jt.offsets()[:-1].to(torch.int64)[rows]  # [R]
        lens = lengths[rows]  # [R]
        total = int(lens.sum())
        seg = torch.repeat_interleave(torch.arange(len(rows)), lens, output_size=total)
        first = torch.cumsum(lens, 0) - lens  # [R] output offset of each bag
        idx = starts[seg] + torch.arange(total) - first[seg]  # [total]
        values_out.append(jt.values()[idx])
        lengths_out.append(lens)
    if not keys:
        return KeyedJaggedTensor(
            keys=[], values=kjt.values()[:0], lengths=kjt.lengths()[:0], stride=len(rows)
        )
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(values_out),
        lengths=torch.cat(lengths_out).to(kjt.lengths().dtype),
        stride=len(rows),
    )
