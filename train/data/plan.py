"""The plan of an epoch, from Parquet metadata alone: the row groups of the files
(:func:`list_row_groups`), the shuffled epoch's windows per stream (:func:`plan_streams`, steps
1–2 of :mod:`train.data.loader`'s doc), the unshuffled epoch's slices (:func:`in_order_slices`),
a rank's part of a global batch (:func:`part_range`), where a resumed round-robin stands
(:func:`resume_point`) and the round-robin over batches rebuilt from the one over messages
(:func:`interleave`, step 4). Pure functions: no reading of rows, no processes.

The streams are played by :mod:`train.data.streams`, the slices by :mod:`train.data.in_order`;
:class:`~train.data.loader.Loader` puts the plan and the players together.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from shared.batch import Batch


@dataclass(frozen=True)
class RowGroup:
    path: str
    index: int
    rows: int


@dataclass(frozen=True)
class Window:
    """Row groups whose rows are shuffled together; ``index`` seeds the shuffle."""

    index: int
    groups: tuple[RowGroup, ...]

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)


def list_row_groups(path: str | Path) -> list[RowGroup]:
    """Row groups of ``path`` (a Parquet file, or a directory of ``*.parquet``), in name order."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: no such samples file or directory; build it with python -m train.data "
            "build, or point --train/--eval (or the config's *_input_path) at it"
        )
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"{path}: no Parquet files (expected part-*.parquet)")
    groups = []
    for f in files:
        meta = pq.ParquetFile(f).metadata
        groups += [
            RowGroup(str(f), i, meta.row_group(i).num_rows) for i in range(meta.num_row_groups)
        ]
    return groups


def plan_streams(
    groups: list[RowGroup], *, streams: int, shuffle: bool, seed: int, epoch: int, shuffle_rows: int
) -> list[list[Window]]:
    """The windows of each stream for one epoch (steps 1–2 of the module doc)."""
    order = (
        np.random.default_rng([seed, epoch]).permutation(len(groups))
        if shuffle
        else range(len(groups))
    )
    windows: list[Window] = []
    pending: list[RowGroup] = []
    for i in order:
        pending.append(groups[i])
        if sum(g.rows for g in pending) >= shuffle_rows:
            windows.append(Window(len(windows), tuple(pending)))
            pending = []
    if pending:
        windows.append(Window(len(windows), tuple(pending)))
    return [windows[s::streams] for s in range(streams)]


def in_order_slices(
    groups: list[RowGroup], rows: int, batch_size: int, min_rows: int
) -> list[tuple[int, int]]:
    """(start, end) of the slices of an unshuffled epoch: its first ``rows`` rows in file order
    (``groups`` in order), cut where a row group ends once a slice has ``min_rows`` rows, rounded up
    to a whole batch so that every slice starts a batch. A worker reading a slice decodes its row
    groups once, the rows before its start (less than a batch, the previous slice's) in its first
    one, and the head of the next group (:func:`~train.data.in_order.file_rows`); slices cut at
    ``min_rows`` alone would split each large row group between workers that all decode it (a third
    more CPU per row with groups of twice the message rows)."""
    bounds, at, last = [], 0, 0
    for g in groups:
        at += g.rows
        end = min(-(-at // batch_size) * batch_size, rows)
        if at - last >= min_rows and end > last:
            bounds.append((last, end))
            last = end
    if last < rows:
        bounds.append((last, rows))
    return bounds


def stream_batches(rows: int, batch_size: int, drop_last: bool, min_rows: int = 1) -> int:
    return rows // batch_size + (0 if drop_last or rows % batch_size < min_rows else 1)


def part_range(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """(start, length) of rank ``rank``'s contiguous part of a global batch of ``rows``."""
    base, extra = divmod(rows, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def resume_point(counts: list[int], skip: int) -> tuple[list[int], list[int]]:
    """Where a round-robin over streams with ``counts`` batches stands after ``skip`` batches.

    Returns per stream the batches already taken, and the stream order that continues the
    interleaving (a DataLoader always starts its round-robin at worker 0). Round ``r`` takes one
    batch from each stream with ``counts > r``, in stream order.
    """
    taken = [0] * len(counts)
    rnd, left = 0, skip
    while True:
        active = [s for s in range(len(counts)) if counts[s] > rnd]
        if not active or left == 0:
            return taken, active + [s for s in range(len(counts)) if s not in active]
        full = min(min(counts[s] for s in active) - rnd, left // len(active))
        if full == 0:  # stop inside round `rnd`: continue with the rest of it
            done, rest = active[:left], active[left:]
            for s in done:
                taken[s] += 1
            return taken, rest + done + [s for s in range(len(counts)) if s not in active]
        for s in active:
            taken[s] += full
        rnd, left = rnd + full, left - full * len(active)


def interleave(messages: Iterator[list[Batch]], counts: list[int]) -> Iterator[Batch]:
    """The batches of a round-robin over streams (step 4 of the module doc), from the
    round-robin over their messages: ``counts[i]`` messages from DataLoader slot ``i``, each of
    consecutive batches of its stream, all of the same length but a stream's last one.

    Message round ``j`` holds message ``j`` of every slot with ``counts > j``, in slot order; batch
    ``r`` of those messages is batch round ``j·k + r``, which takes one batch from each stream
    whose message has more than ``r``.
    """
    for j in range(max(counts, default=0)):
        group = [next(messages, None) for c in counts if c > j]
        if any(g is None for g in group):
            raise RuntimeError(
                f"loader: the workers sent fewer messages than the epoch plan's {sum(counts)}; "
                "were the Parquet files changed during the epoch?"
            )
        msgs: list[list[Batch]] = [g for g in group if g is not None]
        for r in range(max(map(len, msgs))):
            yield from (m[r] for m in msgs if r < len(m))
