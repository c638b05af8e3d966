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

Who writes the staged rows is chosen here, once (``cores``): the device, one scatter kernel of
UVA writes to random host rows (the default), or the host's cores (``cores`` threads): on CUDA
the staged rows are copied to pinned rows in address order (the device's fast case) and a host
function on the same stream scatters them into the tier with the native mover
(:mod:`shared.hashtable.host_move`); on the CPU the same native code runs at once. Why the
cores: on an H100 (2026-12-08, ``bench/results/bench_tiers_write_back_*_s39_h100.json``) the
device's scatter beside the step made item 1's step slower, not faster (11.88 ms against the
fill's own write-backs' 10.67 ms): the device pays per random host row whichever stream writes
it, while the cores scatter rows at 100M+ a second and leave the device's host accesses to the
misses' reads.

Nothing the step computes changes: the rows written back, the evictions and their counts are
the same, in the same step; only when the host rows land moves. Bit for bit on CPU against the
fill's own write-backs (``tests/shared/hashtable/test_row_cache_static.py``).
"""

from __future__ import annotations

import weakref

import torch

from shared.cuda_capture import capture_streams
from shared.hashtable import host_move
from shared.hashtable.host_store import HostStore, TensorHostStore


class _ByCores:
    """The staged rows written into ``store`` by ``threads`` host threads (module doc): pinned
    copies of the staged rows and their tier rows (pinned on CUDA), and the native mover over
    them and the tier where it is now."""

    def __init__(self, store: TensorHostStore, width: int, rows: int, threads: int,
                 pin: bool) -> None:  # fmt: skip
        why = host_move.unavailable_reason()
        if why is not None:
            raise RuntimeError(f"write_back_beside: the host's cores cannot write back: {why}")
        self.store, self.threads = store, threads
        self.out = torch.zeros(rows, width, pin_memory=pin)
        self.back = torch.zeros(rows, dtype=torch.int64, pin_memory=pin)
        self.counts = torch.zeros(2, dtype=torch.int64, pin_memory=pin)  # [written, read: 0]
        self._no_reads = (torch.zeros(1, dtype=torch.int64, pin_memory=pin),
                          torch.zeros(1, width, pin_memory=pin))  # fmt: skip
        self._move: host_move.HostMove | None = None

    def moved(self) -> bool:
        """Whether the tier's rows moved since the mover was made (growth)."""
        return self._move is not None and self._move.params.host != self.store.address

    def spent(self) -> tuple[float, int]:
        """(seconds, moves) of the cores' writes so far ((0, 0) before the first; a mover
        made again over moved rows goes on from the last one's)."""
        return (0.0, 0) if self._move is None else self._move.spent()

    def mover(self) -> host_move.HostMove:
        """The mover over the tier's rows where they are now (made again where they moved:
        the caller has waited for the last move's host function)."""
        if self._move is None or self.moved():
            self._move = host_move.HostMove(self.store.rows, self.back, self.out,
                                            *self._no_reads, self.counts, threads=self.threads,
                                            after=self._move)  # fmt: skip
        return self._move


class WriteBackBeside:
    """Staging for up to ``rows`` write-backs a step of a static cache over ``store`` (rows of
    ``2 * dim`` floats), on ``device``; the staged rows are written to ``store`` by
    :meth:`flush`, on a stream of its own on CUDA, by the device or, given ``cores``, by that
    many host threads (module doc)."""

    def __init__(
        self, store: HostStore, dim: int, rows: int, device: torch.device,
        cores: int | None = None,
    ) -> None:  # fmt: skip
        if rows < 1:
            raise ValueError(f"write_back_beside: rows must be >= 1 (staging rows), got {rows}")
        if cores is not None and (cores < 1 or not isinstance(store, TensorHostStore)):
            raise ValueError(
                f"write_back_beside: cores must be >= 1 host threads over a host tier of rows "
                f"in memory (TensorHostStore), got {cores} over {type(store).__name__}"
            )
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
        self._cores = None
        if cores is not None:
            assert isinstance(store, TensorHostStore)
            self._cores = _ByCores(store, 2 * dim, rows, cores, pin=device.type == "cuda")
            if self._stream is not None:
                # a queued flush's host function reads the mover's parameters and the pinned
                # arrays: the stream is done with them before they go (replaced or dropped)
                weakref.finalize(self, self._stream.synchronize)
        # the staging rows' positions (the staged rows are their first k: ranks)
        self._positions = torch.arange(rows, dtype=torch.int64, device=device)

    @property
    def by_cores(self) -> bool:
        """Whether the host's cores write the staged rows (else the device or the store)."""
        return self._cores is not None

    def spent(self) -> tuple[float, int]:
        """(seconds, moves) of the cores' writes so far (their current mover's; (0, 0) for
        the device's)."""
        return (0.0, 0) if self._cores is None else self._cores.spent()

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
            self._flush_now(rows, payload)
            return
        from shared.hashtable.cuda import host_rows

        assert isinstance(self.store, TensorHostStore)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            if self._cores is None:
                host_rows.scatter(self.store.device_pointer(), rows, payload)  # -1 skipped
            else:
                self._by_cores_on_stream(rows, payload)
            done = torch.cuda.Event()
            done.record(self._stream)
        self.store.written_beside(done, self.device)

    def _flush_now(self, rows: torch.Tensor, payload: torch.Tensor) -> None:
        """The CPU's flush: the staged rows (the first k) written now, by the store or by the
        cores' native mover."""
        k = int((rows >= 0).sum())
        if k == 0:
            return
        if self._cores is None:
            self.store.write(rows[:k], payload[:k])
            return
        c = self._cores
        c.back[:k], c.out[:k] = rows[:k], payload[:k]
        c.counts[0], c.counts[1] = k, 0
        c.mover().run()

    def _by_cores_on_stream(self, rows: torch.Tensor, payload: torch.Tensor) -> None:
        """On the flush stream: the staged rows, their tier rows and their count copied to
        pinned memory by kernels (writes in address order, only the staged rows), then the
        cores' scatter into the tier as a host function after them (the stream's later work,
        and the event that everything touching the tier waits for, wait for it)."""
        from shared.hashtable.cuda import host_rows

        c = self._cores
        assert c is not None and self._stream is not None
        if c.moved():
            self._stream.synchronize()  # the last move's host function is done with its mover
        move = c.mover()
        staged = rows >= 0
        at = torch.where(staged, self._positions, -1)  # [R] the staged rows' own positions
        counts = torch.stack([staged.sum(), torch.zeros_like(at[0])])  # [2] int64
        host_rows.scatter_int64(c.counts.data_ptr(), self._positions[:1], counts)
        host_rows.scatter_int64(c.back.data_ptr(), at, rows)
        host_rows.scatter(c.out.data_ptr(), at, payload)
        host_move.launch_on_stream(move, self._stream)

    def join(self) -> None:
        """The current stream waits for the last :meth:`flush` (on the host, outside any
        capture: before the next graph or kernel that uses the host tier or the staging rows
        is queued there). Nothing on the CPU, whose flush is done when it returns."""
        if self._stream is not None:
            assert isinstance(self.store, TensorHostStore)
            self.store.join_writes(self.device)
