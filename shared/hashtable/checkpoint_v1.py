"""dynrec's first checkpoint layout (format ``dynrec-dynamicemb/1``, written until git ``ac1a3bb``):
read only, so that older checkpoints keep loading. Golden files: ``tests/fixtures/dynrec_v1_ckpt/``.

In ``<ckpt>/dynamicemb/<module>/`` (``sparse.dynamic`` for training checkpoints), for table ``T``::

    T_keys|values|scores|opt_values.rank_R.world_size_W      (no "_emb_" after the table name)
    T_counter_keys|frequencies.rank_R.world_size_W          (admission only)
    T_opt_args.json                                         every rank; "format", "dim", ...

Rows sorted by key; TIMESTAMP scores are absolute microseconds; the Adagrad sums are [N, dim].
A directory is in this layout when its ``_opt_args.json`` files carry ``"format":
"dynrec-dynamicemb/1"``.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import torch

from shared.features import ScoreStrategy
from shared.hashtable.checkpoint_dynamicemb import collection_dirs
from shared.hashtable.checkpoint_io import (
    FLOAT,
    KEY,
    CheckpointError,
    ReadRequest,
    ReadTable,
    SavedTable,
    TableInfo,
    check_rows,
    read_array,
    read_parts,
    saved_world_size,
)
from shared.hashtable.storage import TableState

LAYOUT = "dynrec-v1"
FORMAT = "dynrec-dynamicemb/1"


def file_name(table: str, kind: str, rank: int, world_size: int) -> str:
    """``file_name("user_id_emb", "keys", 0, 1) == "user_id_emb_keys.rank_0.world_size_1"``."""
    return f"{table}_{kind}.rank_{rank}.world_size_{world_size}"


def _args(directory: Path) -> dict[str, dict[str, Any]]:
    """Table → opt_args of the v1 tables of one directory."""
    out = {}
    for p in sorted(directory.glob("*_opt_args.json")):
        try:
            args = json.loads(p.read_text())
        except ValueError:
            continue
        if isinstance(args, dict) and args.get("format") == FORMAT:
            out[str(args.get("table", p.name[: -len("_opt_args.json")]))] = args
    return out


def v1_dirs(root: Path) -> list[Path]:
    """The module directories of ``<root>/dynamicemb/`` written in this layout."""
    return [d for d in collection_dirs(root) if _args(d)]


class V1Reader:
    layout = LAYOUT
    id_mode = "dynrec"  # the layout predates the TZREC id mode

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._args = {d.name: _args(d) for d in v1_dirs(self.root)}

    def tables(self) -> list[SavedTable]:
        out = []
        for d in v1_dirs(self.root):
            for name in self._args[d.name]:
                w = saved_world_size(
                    d,
                    name,
                    f"{name}_keys.rank_*.world_size_*",
                    partial(file_name, name, "keys"),
                )
                out.append(SavedTable(name, d.name, d, w))
        return out

    def _meta(self, table: SavedTable) -> dict[str, Any]:
        return self._args[table.collection][table.name]

    def describe(self, table: SavedTable) -> TableInfo:
        a = self._meta(table)
        threshold = a.get("admission_threshold")
        return TableInfo(
            int(a["dim"]),
            ScoreStrategy(a.get("score_strategy", "STEP")),
            a.get("max_capacity"),
            None if threshold is None else int(threshold),
        )

    def _world_size(self, table: SavedTable) -> int:
        if table.world_size is None:
            raise CheckpointError(
                f"{table.directory}: no key files for table {table.name!r}; the checkpoint is "
                "incomplete: copy it again"
            )
        return table.world_size

    def _check_dim(self, table: SavedTable, dim: int | None) -> int:
        saved = int(self._meta(table)["dim"])
        if dim is not None and dim != saved:
            raise CheckpointError(
                f"{table.directory / (table.name + '_opt_args.json')}: dim {saved} but table "
                f"{table.name!r} has dim {dim}; the checkpoint was written for another config: use "
                f"the config it was trained with (embedding_dim {saved})"
            )
        return saved

    def parts(self, table: SavedTable, dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self._world_size(table)
        return read_parts(table, self._check_dim(table, dim), file_name)

    def read(self, table: SavedTable, want: ReadRequest) -> ReadTable:
        """As saved: the first layout stored absolute times, so ``want.now`` is not used."""
        dim = self._check_dim(table, want.dim)
        w = self._world_size(table)
        parts = self.parts(table, dim)
        keys = torch.cat([k for k, _ in parts])
        cols: dict[str, list[torch.Tensor]] = {"scores": [], "opt_values": []}
        counters: dict[str, list[torch.Tensor]] = {"counter_keys": [], "counter_frequencies": []}
        for r, (k, _) in enumerate(parts):
            for kind, per_row in (("scores", 1), ("opt_values", dim)):
                path = table.directory / file_name(table.name, kind, r, w)
                if not path.is_file():
                    raise CheckpointError(
                        f"{path} is missing (incomplete checkpoint); copy every rank's files again"
                    )
                t = read_array(path, KEY if kind == "scores" else FLOAT)
                check_rows(path, table.name, t.numel(), k.numel(), per_row, kind)
                cols[kind].append(t)
            for kind in counters:
                path = table.directory / file_name(table.name, kind, r, w)
                if path.is_file():
                    counters[kind].append(read_array(path, KEY))
        ck = torch.cat(counters["counter_keys"]) if counters["counter_keys"] else None
        cc = torch.cat(counters["counter_frequencies"]) if counters["counter_frequencies"] else None
        if (ck is None) != (cc is None) or (
            ck is not None and cc is not None and ck.numel() != cc.numel()
        ):
            raise CheckpointError(
                f"{table.directory}: table {table.name!r}: counter files do not pair up; copy "
                "them again or delete all counter files of the table"
            )
        state = TableState(
            keys,
            torch.cat([v for _, v in parts]),
            torch.cat(cols["scores"]),
            torch.cat(cols["opt_values"]).view(-1, dim),
            ck,
            cc,
        )
        return ReadTable(state, tuple(k.numel() for k, _ in parts), [])
