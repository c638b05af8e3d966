"""What an export takes from a checkpoint's dynamic-table files, each file read once.

A full bundle needs each config table's rows as every saving rank wrote them (keys, values and
scores: the bundle's ``part_R_W`` and their hotness, :mod:`train.export`), a delta needs them
joined and sorted by key (:mod:`train.tools.delta`), and both carry the summaries of every saved
table (:mod:`shared.hashtable.summary`). All of it comes from one
:func:`~shared.hashtable.summary.read_saved_tables`: a checkpoint saved by ``W`` ranks has ``W``
files of each kind per table, and each is read once. The full export read a table's key and
value files three times (the parts; the scores, matched to the keys by a second read; the
summaries) and its score, optimizer and counter files twice.

No hash table is built: restoring the tables and exporting them gives the same rows
(``export_table``: admitted keys), but inserting every key took 24 of a delta export's 27 s at
the full config's capacities on CPU. Example::

    rows = read_rows(ckpt, fs)
    rows.parts("user_id_emb")        # [(keys_0, values_0, scores_0), (keys_1, ...)]: W parts
    rows.sorted_rows("user_id_emb")  # (keys [N] sorted, values [N, dim]): every rank's, joined
    rows.summaries["user_id_emb"]    # {"size": N, "world_size": W, ...}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.features import FeatureSet
from shared.hashtable.checkpoint import collection_paths, open_checkpoint, select_tables
from shared.hashtable.checkpoint_io import ReadTable
from shared.hashtable.summary import read_saved_tables, summaries_of


def key_order(keys: torch.Tensor) -> torch.Tensor:
    """The permutation that sorts ``keys`` (int64 [N], distinct), as ``torch.argsort``.
    numpy's stable sort (timsort) takes a few ms for a checkpoint's keys, which every rank saves
    sorted, where torch.argsort of 280K keys took 0.1-0.9 s on a busy 2-core CPU."""
    return torch.from_numpy(np.argsort(keys.numpy(), kind="stable"))


@dataclass(frozen=True)
class CheckpointRows:
    """A checkpoint's dynamic tables as read once (:func:`read_rows`)."""

    reads: dict[str, ReadTable]  # the config's tables: every saving rank's files, joined
    summaries: dict[str, dict[str, Any]]  # every saved table (shared.hashtable.summary)

    def parts(self, name: str) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(keys [N_r] int64, values [N_r, dim], scores [N_r] int64) of each saving rank, in
        rank order, as its files hold them: a bundle's ``part_R_W`` with the rows' hotness
        (the training table's scores; STEP: last step seen, TIMESTAMP: µs, LFU: count)."""
        got = self.reads[name]
        state, sizes = got.state, list(got.part_rows)
        keys, values = state.keys.split(sizes), state.values.split(sizes)
        scores = state.scores.to(torch.int64).split(sizes)
        return list(zip(keys, values, scores, strict=True))

    def sorted_rows(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [N] int64 sorted, values [N, dim]) of every saving rank, joined: what restoring
        the table and exporting it gives, sorted."""
        state = self.reads[name].state
        order = key_order(state.keys)  # a merge of the ranks' sorted runs
        return state.keys[order], state.values[order]


def read_rows(ckpt: Path, fs: FeatureSet, *, now: int | None = None) -> CheckpointRows:
    """The rows of every dynamic table of ``fs`` (read with the config's dim and score
    strategy, from the collection the config maps it to: ``select_tables``) and the summaries
    of every saved table, from one read of each table file of ``ckpt``. ``now``: the TIMESTAMP
    clock (µs, default the wall clock) that saved ages become scores against, for the rows
    and the summaries alike."""
    reader = open_checkpoint(ckpt)
    names = [t.name for t in fs.dynamic_tables]
    chosen = select_tables(reader, names, collection_paths(fs))[0] if names else {}
    specs = {chosen[t.name]: t for t in fs.dynamic_tables}
    reads = read_saved_tables(reader, specs=specs, now=now)
    by_table = {r.table: r.got for r in reads}
    tables = {name: by_table[chosen[name]] for name in names}
    return CheckpointRows(tables, summaries_of(reads, reader.layout))
