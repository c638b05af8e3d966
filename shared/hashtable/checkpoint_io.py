"""What every checkpoint layout shares: raw arrays, per-rank file sets, and the reader interface.

A layout (:mod:`shared.hashtable.checkpoint_dynamicemb`, :mod:`shared.hashtable.checkpoint_v1`) is
a :class:`CheckpointReader`: it lists the tables it finds (:class:`SavedTable`, one per table and
collection directory), describes each (:class:`TableInfo`: what the files say without a config),
and reads one into a :class:`~shared.hashtable.storage.TableState` in our semantics (absolute
scores, Adagrad sums ``[N, dim]``), saying in :attr:`ReadTable.notes` what it converted or left
out. :func:`shared.hashtable.checkpoint.open_checkpoint` picks the layout once, from what is on
disk; nothing else asks which layout a checkpoint has.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from shared.features import ScoreStrategy
from shared.hashtable.storage import TableState

KEY = "<i8"  # keys, scores, counter keys and frequencies
FLOAT = "<f4"  # values and optimizer states
RANK_FILE = re.compile(r"\.rank_(\d+)\.world_size_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked (the message says what was expected, what
    was found and what to do)."""


def write_array(path: Path, tensor: torch.Tensor, dtype: str) -> None:
    """Raw little-endian bytes, no header, flushed to disk."""
    arr = np.ascontiguousarray(tensor.detach().cpu().numpy().astype(dtype, copy=False))
    with open(path, "wb") as f:
        f.write(arr.reshape(-1).view(np.uint8).data)  # no copy (the GIL is not held for one)
        f.flush()
        os.fsync(f.fileno())


def read_array(path: Path, dtype: str) -> torch.Tensor:
    """A raw little-endian file as a 1-D tensor (native byte order)."""
    dt = np.dtype(dtype)
    size = path.stat().st_size
    if size % dt.itemsize:
        raise CheckpointError(
            f"{path}: {size} bytes is not a whole number of {dt} items; the file is truncated "
            "(copy the checkpoint again)"
        )
    arr = np.fromfile(path, dtype=dt).astype(dt.newbyteorder("="), copy=False)
    return torch.from_numpy(arr)


def saved_world_size(
    directory: Path, table: str, pattern: str, name: Callable[[int, int], str]
) -> int | None:
    """The world size of the files ``directory/pattern`` whose names are exactly
    ``name(rank, world_size)``; None without any. Every rank ``0..W-1`` must be there, and only
    one ``W`` (dynamicemb's ``find_files`` rules)."""
    sizes: set[int] = set()
    ranks: set[int] = set()
    for f in directory.glob(pattern):
        m = RANK_FILE.search(f.name)
        if m and f.name == name(int(m[1]), int(m[2])):
            ranks.add(int(m[1]))
            sizes.add(int(m[2]))
    if not sizes:
        return None
    if len(sizes) > 1:
        raise CheckpointError(
            f"{directory}: table {table!r} has files of several world sizes {sorted(sizes)}; "
            "save each checkpoint into a fresh directory (or delete the stale files)"
        )
    (w,) = sizes
    missing = sorted(set(range(w)) - ranks)
    if missing:
        raise CheckpointError(
            f"{directory}: table {table!r} was saved by {w} ranks but the files of ranks "
            f"{missing} are missing (incomplete checkpoint: copy every rank's files)"
        )
    return w


@dataclass(frozen=True)
class SavedTable:
    """One table's files in one collection directory of a checkpoint."""

    name: str  # e.g. "user_id_emb"
    collection: str  # the directory under dynamicemb/, e.g. "model.model.embedding_group..."
    directory: Path
    world_size: int | None  # of the key files; None: the table has no key files there

    @property
    def where(self) -> str:
        return f"{self.name} ({self.collection})"


@dataclass(frozen=True)
class TableInfo:
    """What the files say about a table without a config (None: they do not say)."""

    dim: int | None
    strategy: ScoreStrategy | None
    max_capacity: int | None = None
    admission_threshold: int | None = None


@dataclass(frozen=True)
class ReadRequest:
    """What a read needs from the caller: the config's ``dim`` / ``strategy`` (None: take them
    from the files), the Adagrad start for rows without sums, and the TIMESTAMP clock ``now``
    (µs) that stored ages are restored against."""

    dim: int | None
    strategy: ScoreStrategy | None
    initial_accumulator_value: float
    now: int


@dataclass
class ReadTable:
    """Every saved rank of a table, joined, in our semantics. ``part_rows``: the rows of each
    saving rank, in rank order (the state's rows are theirs one after another), so that a
    reader of the joined state can give each rank's part back (a bundle's ``part_R_W``)."""

    state: TableState
    part_rows: tuple[int, ...]
    notes: list[str] = field(default_factory=list)  # conversions and states left out

    @property
    def rows(self) -> int:
        return int(self.state.keys.numel())

    @property
    def counter_rows(self) -> int:
        ck = self.state.counter_keys
        return 0 if ck is None else int(ck.numel())


class CheckpointReader(Protocol):
    """One checkpoint layout (see the module docstring)."""

    @property
    def layout(self) -> str: ...  # "dynamicemb" | "dynrec-v1"

    @property
    def root(self) -> Path: ...

    @property
    def id_mode(self) -> str | None:
        """The ``IdMode`` value the saved keys were made in; None: not recorded (not ours)."""
        ...

    def tables(self) -> list[SavedTable]: ...

    def describe(self, table: SavedTable) -> TableInfo: ...

    def parts(self, table: SavedTable, dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys [N] int64, values [N, dim] float32) of each saving rank, in rank order."""
        ...

    def read(self, table: SavedTable, want: ReadRequest) -> ReadTable:
        """All ranks joined, in our semantics (see :class:`ReadRequest`)."""
        ...


def read_parts(
    table: SavedTable, dim: int, name: Callable[[str, str, int, int], str]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values [N, dim]) of each saving rank; ``name(table, kind, rank, world_size)`` is
    the layout's file name of kind ``keys`` / ``values``."""
    w = table.world_size
    assert w is not None
    out = []
    for r in range(w):
        keys = read_array(table.directory / name(table.name, "keys", r, w), KEY)
        path = table.directory / name(table.name, "values", r, w)
        if not path.is_file():
            raise CheckpointError(
                f"{path} is missing (incomplete checkpoint); copy every rank's files again"
            )
        values = read_array(path, FLOAT)
        check_rows(path, table.name, values.numel(), keys.numel(), dim, "floats")
        out.append((keys, values.view(-1, dim)))
    return out


def check_rows(path: Path, table: str, got: int, rows: int, per_row: int, what: str) -> None:
    if got != rows * per_row:
        raise CheckpointError(
            f"{path}: table {table!r}: {got} {what} for {rows} keys, expected {per_row} per key; "
            "the checkpoint is damaged or was written for another embedding_dim: copy it again "
            "or use the config it was trained with"
        )
