"""A static cache's write-backs off the step's path (opt-in:
:meth:`~shared.hashtable.row_cache_static.StaticCacheLines.write_back_beside`).

Why: at issue #52's item 1 (a 10 % cache of 100M rows at dim 16, 1M lookups a step) the static
step's fill writes about 108K dirty victims back to the host tier and reads as many misses, in
one kernel on the step's path. On an H100 (2026-12-07, ``bench/results/
bench_tiers_host_memory_register_s38_h100.json``) the step took 2.12x HBM-only's while the
cache was filling (no victims) and 2.76x once it evicted: the write-backs cost about 0.64x of
the whole HBM-only step, and nothing after the fill needs them. They only have to land before
anything reads those host rows again.

So the fill's write-backs are staged instead, in fixed shapes inside the step's forward (its
graph on CUDA): each dirty victim's payload (values, then accumulators) is copied within the
device to a staging row at its rank among the step's write-backs, with its host row beside it,
before the fill overwrites its line; victims past the staging rows' count are written back by
the fill itself, as without this. After the forward, :meth:`WriteBackBeside.flush` writes the
staged rows to the host tier with one kernel on a stream of its own (on the CPU at once), which
runs beside the rest of the step: the gather from the lines, the dense part, the backward.
Everything that reads or writes the host tier from then on waits for it first
(:meth:`~shared.hashtable.host_store.TensorHostStore.written_beside`): the next static step and
prefetch (their ``began``, before their graphs), the store's eager device paths (on their
stream) and its CPU paths (the whole device). The staging rows are written again only by the
next step's forward, after that wait.

Nothing the step computes changes: the rows written back, the evictions and their counts are
the same, in the same step; only when the host rows land moves. Bit for bit on CPU against the
fill's own write-backs (``tests/shared/hashtable/test_row_cache_static.py``).
"""

from __future__ import annotations

import torch

from shared.cuda_capture import capture_streams
from shared.hashtable.host_store import HostStore, TensorHostStore


class WriteBackBeside:
    """Staging for up to ``rows`` write-backs a step of a static cache over ``store`` (rows of
    ``2 * dim`` floats), on ``device``; the staged rows are written to ``store`` by
    :meth:`flush`, on a stream of its own on CUDA."""

    def __init__(self, store: HostStore, dim: int, rows: int, device: torch.device) -> None:
        if rows < 1:
            raise ValueError(f"write_back_beside: rows must be >= 1 (staging rows), got {rows}")
        if device.type == "cuda" and not (isinstance(store, TensorHostStore) and store.mapped):
            raise ValueError(
                "write_back_beside: a CUDA storage's host tier must be mapped (the static "
                "step's in-place fill) for its write-backs to be staged"
            )
        self.store, self.capacity, self.device = store, rows, device
        # the staging rows' host rows (-1: none) and payloads; one more each: the sink that the
        # positions not staged write to (its row stays -1)
        self.rows = torch.full((rows + 1,), -1, dtype=torch.int64, device=device)
        self.payload = torch.zeros(rows + 1, 2 * dim, dtype=torch.float32, device=device)
        # a stream no capture takes while this lives (shared.cuda_capture: torch hands streams
        # out of a pool, and a graph captured on this one would take the flush's launch into it)
        self._stream = capture_streams(device).take(self) if device.type == "cuda" else None

    def key(self) -> tuple[int, ...]:
        """The addresses a captured forward writes (the step compares them)."""
        return (self.rows.data_ptr(), self.payload.data_ptr())

    def stage(
        self, slots: torch.Tensor, back: torch.Tensor, values: torch.Tensor, accum: torch.Tensor
    ) -> torch.Tensor:
        """Inside the step's forward, before its fill: the payload of the slots ``slots`` [P]
        whose line goes back to host row ``back`` [P] (-1: clean, nothing to write) copied to
        the staging rows at their rank, up to :attr:`capacity`, in fixed shapes (captured on
        CUDA). ``values``, ``accum`` [*, dim]: the slots' arrays. Returns [P] the write-backs
        left to the fill (``back`` where a victim found no staging row, else -1)."""
        cap = self.capacity
        dirty = back >= 0
        rank = torch.cumsum(dirty, 0) - 1  # [P] each write-back's staging row
        staged = dirty & (rank < cap)
        self.rows.fill_(-1)
        # the positions not staged all write -1 to the sink row
        self.rows[torch.where(staged, rank, cap)] = torch.where(staged, back, -1)
        if self._stream is not None:
            from shared.hashtable.cuda import host_rows

            # the fill kernel's write-back alone (nothing read, nothing made), with the staging
            # rows as its "host": payload[rank[i]] = (values | accum)[slots[i]]
            host_rows.fill_slots(
                self.payload.data_ptr(), torch.where(staged, rank, -1), None,
                torch.where(staged, slots, -1), None, None, 0.0, values, accum,
            )  # fmt: skip
        else:
            at = torch.nonzero(staged).squeeze(1)  # [k] (a host read: free on the CPU)
            self.payload[rank[at]] = torch.cat([values[slots[at]], accum[slots[at]]], 1)
        return torch.where(staged, -1, back)

    def flush(self) -> None:
        """After the step's forward (on the host, outside any capture): the staged rows written
        to the host tier, on the stream of its own (CUDA: from where the forward's stream is
        now, beside what follows it), or at once (CPU)."""
        rows, payload = self.rows[: self.capacity], self.payload[: self.capacity]
        if self._stream is None:
            at = torch.nonzero(rows >= 0).squeeze(1)
            if at.numel():
                self.store.write(rows[at], payload[at])
            return
        from shared.hashtable.cuda import host_rows

        assert isinstance(self.store, TensorHostStore)
        pointer = self.store.device_pointer()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host_rows.scatter(pointer, rows, payload)  # rows of -1 skipped
            done = torch.cuda.Event()
            done.record(self._stream)
        self.store.written_beside(done, self.device)

    def join(self) -> None:
        """The current stream waits for the last :meth:`flush` (on the host, outside any
        capture: before the next graph or kernel that uses the host tier or the staging rows
        is queued there). Nothing on the CPU, whose flush is done when it returns."""
        if self._stream is not None:
            assert isinstance(self.store, TensorHostStore)
            self.store.join_writes(self.device)
