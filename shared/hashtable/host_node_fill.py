"""The static cache's line fill through a host node: the host's cores move the rows, not the
device's reads (opt-in: :meth:`~shared.hashtable.row_cache_static.StaticCacheLines.fill_with_host_node`).

Why: at item 1's 100M rows the device's fill reads 107K random host rows a step at about 35M
rows/s, a cost per row (``docs/design.md``, "Next: the misses' way across PCIe"), while the
host's cores gather 200-400M rows/s of the same tier. A captured step cannot call Python, but it
can run native code as a host node (:mod:`shared.hashtable.host_move`). The fill, in fixed
shapes and one stream, all inside the step's graph:

1. the positions that write a line back (``back`` >= 0) and that read a row (``read`` >= 0,
   not a new key) get ranks (cumsums); their counts and their tier rows go to pinned arrays at
   those ranks (UVA writes by :func:`~shared.hashtable.cuda.host_rows.scatter`);
2. the write-backs' line payload goes to pinned staging rows at their ranks, one after another
   (:func:`~shared.hashtable.cuda.host_rows.fill_slots` with the staging rows as its "host");
3. the host node: the write-backs scattered into the tier, then the reads gathered into pinned
   staging rows at their ranks, on every core (:c:func:`hm_move`);
4. the staged rows read into their lines (one after another: the device's fast case) and the
   new keys' lines made from their initializer rows (``fill_slots`` again).

The lines end as :meth:`StaticCacheLines._fill_slots`' device fill leaves them, bit for bit (rows
are copied, never computed). The pinned arrays are sized for the step's padded positions
(:meth:`HostNodeFill.ready`, called before any capture); where they or the tier move, the step
captures its graphs again (their addresses are in :meth:`HostNodeFill.key`). On an H100
(2026-12-07, ``bench_tiers --host-node``) it took item 1's step at a 10 % cache from 2.80x to
2.46x HBM-only, its steps varying from 8.1 to 11.6 ms (``docs/performance.md``). Two changes
came after it and are not yet measured: the native mover's thread pool, and no device sync in
:meth:`ready` and :meth:`key` (they read ``store.rows``, which waits for the device, at every
step until 2026-12-08; they compare ``store.address`` now).
"""

from __future__ import annotations

import torch

from shared.hashtable import host_move
from shared.hashtable.host_store import TensorHostStore


class HostNodeFill:
    """A CACHING storage's fill through a host node (module doc) over ``store`` (mapped, on
    CUDA), rows of ``2 * dim`` floats, moved by ``threads`` host threads."""

    def __init__(self, store: TensorHostStore, dim: int, threads: int) -> None:
        if not store.mapped or threads < 1:
            raise ValueError(
                f"the host-node fill needs a mapped host tier and threads >= 1, got mapped="
                f"{store.mapped}, threads={threads}"
            )
        why = host_move.unavailable_reason()
        if why is not None:
            raise RuntimeError(f"the host-node fill cannot run here: {why}")
        self.store, self.dim, self.threads = store, dim, threads
        self.positions = 0
        self._pinned: dict[str, torch.Tensor] = {}
        self._move: host_move.HostMove | None = None

    def ready(self, positions: int, device: torch.device) -> None:
        """Pinned arrays for ``positions`` positions and a mover over the tier's rows where
        they are now (outside any capture: the arrays move, and a step on them captures its
        graphs again). Where either is replaced, ``device`` (where the graphs run) is waited
        for first: a graph queued there may still run its host node on the old mover's
        parameters and copy through the old arrays, and both are freed with the last reference
        (on the H100, 2026-12-07, a prefetch's first call made them again for its own size
        while the step's graph was queued: the host node read the freed parameters, a
        segmentation fault)."""
        width = 2 * self.dim
        grows = positions > self.positions
        # the rows' address without waiting for the device (store.rows would: a sync a step)
        if self.fits(positions):
            return
        torch.cuda.synchronize(device)  # before the old arrays and mover go (docstring)
        rows = self.store.rows
        if grows:
            self._pinned = {
                "staging_in": torch.empty(positions, width, pin_memory=True),
                "staging_out": torch.empty(positions, width, pin_memory=True),
                "read_ids": torch.zeros(positions, dtype=torch.int64, pin_memory=True),
                "back_ids": torch.zeros(positions, dtype=torch.int64, pin_memory=True),
                "counts": torch.zeros(2, dtype=torch.int64, pin_memory=True),
            }
            self.positions = positions
        b = self._pinned
        self._move = host_move.HostMove(rows, b["back_ids"], b["staging_out"], b["read_ids"],
                                        b["staging_in"], b["counts"], threads=self.threads,
                                        after=self._move)  # fmt: skip

    def fits(self, positions: int) -> bool:
        """Whether a fill of ``positions`` positions may run on the pinned arrays and mover as
        they are (no :meth:`ready` needed: nothing moves)."""
        return (
            positions <= self.positions
            and self._move is not None
            and self._move.params.host == self.store.address
        )

    def spent(self) -> tuple[float, int]:
        """(seconds, moves) of this fill's moves so far (:meth:`host_move.HostMove.spent`; a
        mover made again by :meth:`ready` goes on from the last one's)."""
        return (0.0, 0) if self._move is None else self._move.spent()

    def key(self) -> tuple[int, ...]:
        """The addresses a captured fill reads and writes (the step compares them)."""
        return (*(t.data_ptr() for t in self._pinned.values()), self.store.address)

    def fill(
        self,
        slots: torch.Tensor,
        back: torch.Tensor,
        read: torch.Tensor,
        new: torch.Tensor | None,
        new_values: torch.Tensor | None,
        initial: float,
        values: torch.Tensor,
        accum: torch.Tensor,
    ) -> None:
        """:meth:`StaticCacheLines._fill_slots`' arguments ([P] each, ``new_values`` [P, dim];
        ``values``, ``accum`` the lines' arrays; ``new`` and ``new_values`` None: no new
        rows, as a prefetch's): the same lines, through the host node."""
        from shared.hashtable.cuda import host_rows

        p = slots.numel()
        if p > self.positions or self._move is None:
            raise RuntimeError(
                f"the host-node fill was made ready for {self.positions} positions, the step "
                f"has {p}: call ready() before the step (static_began does)"
            )
        b = self._pinned
        has = slots >= 0
        wb = has & (back >= 0)  # [P] lines written back
        rd = has & (read >= 0) if new is None else has & ~new & (read >= 0)  # [P] rows read
        rank_b = torch.where(wb, torch.cumsum(wb, 0) - 1, -1)  # [P] their staging rows
        rank_r = torch.where(rd, torch.cumsum(rd, 0) - 1, -1)
        counts = torch.stack([wb.sum(), rd.sum()])  # [2] int64
        first = torch.zeros(1, dtype=torch.int64, device=slots.device)
        host_rows.scatter_int64(b["counts"].data_ptr(), first, counts)
        host_rows.scatter_int64(b["back_ids"].data_ptr(), rank_b, back)
        host_rows.scatter_int64(b["read_ids"].data_ptr(), rank_r, read)
        host_rows.fill_slots(b["staging_out"].data_ptr(), rank_b, None, slots, None, None,
                             initial, values, accum)  # fmt: skip
        host_move.launch_on_stream(self._move, torch.cuda.current_stream(slots.device))
        host_rows.fill_slots(b["staging_in"].data_ptr(), None, rank_r, slots, new, new_values,
                             initial, values, accum)  # fmt: skip
