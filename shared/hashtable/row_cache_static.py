"""The static step's form of a CACHING storage's resolve: fixed shapes, no host read.

:class:`StaticCacheLines` adds to the cache's lines (:mod:`shared.hashtable.row_cache_lines`) the
methods of the :class:`~shared.hashtable.payload.RowPayload` seam that
:mod:`shared.hashtable.static_step` calls (``static_*``, :meth:`~StaticCacheLines.why_not_static`),
so that a CACHING storage's training step is captured in a CUDA graph like HBM_ONLY's.
:class:`~shared.hashtable.row_cache.RowCache` (:mod:`shared.hashtable.row_cache`: the cache as a
whole, and its eager resolve) is a :class:`StaticCacheLines`; both resolves share the lines, the
clock hand, the tick and the counters, all device tensors.

:meth:`StaticCacheLines.static_resolve` is the eager resolve with fixed shapes and no host read.
The step's P padded distinct rows (a validity mask) resolve through masks: a cumsum over "needs
a line" gives each such row its victim among a window of ``min(L, 2P)`` lines after the clock
hand (sorted by stamp, this call's last: :meth:`~CacheLines._clock_window`), one
:meth:`HostStore.swap` of P slots (-1: nothing) writes the dirty victims back and reads the
stored rows, and a new key's line takes its initializer row at once (dirty), never crossing to
the host and back. The lookup then gathers from lines and the backward's Adagrad updates lines
(dirty marked): HBM_ONLY's arithmetic on other slots. A step with more distinct rows than lines
(or than the lines it does not use itself) bypasses the rest in fixed shapes too: ``P - L``
staging slots after the lines' sink (made on the host before the step,
:meth:`StaticCacheLines.static_began`) take their payload in the forward's swap, and the
backward writes them back to the host tier in one write of P slots (-1 skipped), which only
steps of more keys than lines issue. Lines the eager path thinks never used are forgotten once a
static step ran (``_fresh``): the window finds them by their stamp (-1 sorts first).
"""

from __future__ import annotations

import torch

from shared.hashtable.row_cache_lines import KEEP, CacheLines


class StaticCacheLines(CacheLines):
    """The cache's lines with the static step's fixed-shape resolve (see the module doc)."""

    def why_not_static(self) -> str | None:
        """Why the static step cannot take this cache (None: it can): the host tier must be
        reachable with no host read (:meth:`HostStore.why_not_static`)."""
        why = self.store.why_not_static(self.values.device)
        return None if why is None else f"the CACHING storage's host tier: {why}"

    def static_began(self, padded: int) -> int:
        """A static lookup of ``padded`` keys is about to run (on the host, before its
        forward's graph or code): its resolve may evict lines, so the lines an eager lookup
        resolved are stale from now on, lines the eager resolve thinks never used may be taken,
        and a replay's swap uses the host tier; a step of more keys than lines may bypass rows,
        which need staging slots (allocated here, outside any capture: the arrays move, so the
        step captures its graphs again). Returns the version its backward checks
        (:meth:`static_version`)."""
        self._version += 1
        self._fresh = self.lines
        self.store.used_by_device(self.values.device)
        if padded - self.lines > self._staged:
            self._stage(max(padded - self.lines, 2 * self._staged))
        return self._version

    def _stage(self, n: int) -> None:
        """``n`` staging slots after the lines' sink (the lines kept): where the static step
        keeps the rows it bypasses between its forward and its backward."""
        big = self.lines + 1
        for name in ("_values", "_accum"):
            old = getattr(self, name)
            grown = torch.zeros(big + n, self.dim, dtype=torch.float32, device=old.device)
            grown[:big] = old[:big]
            setattr(self, name, grown)
        self.values, self.accum = self._values[: self.lines], self._accum[: self.lines]
        self._staged = n

    def static_version(self) -> int:
        """Bumped whenever a line may have left its row (a static step's backward compares it
        with its forward's: an eager resolve between the two may have taken its lines)."""
        return self._version

    def static_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, accumulators) [L + 1 + staged, dim]: the lines, the sink, the staging
        slots: what :meth:`static_resolve`'s slots index."""
        return self._values, self._accum

    def static_key(self) -> tuple[object, ...]:
        """What a captured step reads at fixed addresses: changes when one of them moves."""
        arrays = (self._values, self._accum, self._line_map, self._row_of_line, self._stamps,
                  self._dirty, self._tick, self._hand, self._evicted, self._static)  # fmt: skip
        return (*(a.data_ptr() for a in arrays), self._store_moves)

    def static_resolve(
        self, rows: torch.Tensor, found: torch.Tensor, new_values: torch.Tensor
    ) -> torch.Tensor:
        """[P] int64: the slot in :meth:`static_arrays` of each of a static step's distinct
        ``rows`` [P] (-1: no row), with fixed-size ops and no host read (captured on CUDA).
        ``found`` [P] bool: the row was stored before the step (its payload is in the host
        tier or a line); the other rows belong to keys the step inserted, whose payload is
        ``new_values`` [P, dim] and the initial accumulators.

        - A row with a line is stamped (a hit, or a new key's row whose evicted key left a
          line there: the line is reused).
        - The rows without a line take one each from a window of ``min(L, 2P)`` lines after
          the clock hand (the hand, a device tensor, moves past it): the window's lines sorted
          by stamp, this call's last, and the i-th such row (a cumsum over the mask) takes the
          i-th line, if that line is not this call's. With ``L >= P`` every row gets one (the
          call stamps at most ``P - k`` lines when ``k`` rows need one). Never-used lines
          (stamp -1) sort first.
        - Rows left without a line (a step of more distinct rows than lines) are *bypassed*:
          the i-th of them takes staging slot i after the lines (:meth:`static_began` made
          ``P - L`` of them), and the backward writes it back to the host tier
          (:meth:`static_updated`); a bypassed new key's initializer row is written there at
          once (a step without a backward leaves it as HBM_ONLY's insert does).
        - One :meth:`HostStore.swap` of P slots: dirty victims written back, the stored rows
          read, -1 elsewhere; a new key's line takes its initializer row and is dirty at once,
          so its row never crosses to the host and back (the eager path writes it to the host
          tier and reads it at the next resolve).
        - Maps, stamps and dirty bits are scattered with the sink slots for unused positions;
          hits, misses, new rows, bypassed rows, evictions and write-backs are counted on the
          device."""
        big, dev = self.lines, self.values.device
        p, sink_row = rows.numel(), self.line_of_row.numel()
        assert p - big <= self._staged, "static_began(padded) makes the staging slots first"
        self._tick += 1
        tick = self._tick  # [] int64
        stored = rows >= 0
        new = stored & ~found
        line = torch.where(stored, self.line_of_row[rows.clamp(min=0)].to(torch.int64), -1)
        has = line >= 0  # [P]
        self._stamps[torch.where(has, line, big)] = tick
        need = stored & ~has  # [P] rows that take a line now
        gets, taken = self._static_victims(need, tick)  # [P] each
        back = self._unmap(taken, gets)  # [P] the row each dirty victim goes back to, or -1
        read = torch.where(need & found, rows, -1)
        payload = self.store.swap(back, self._packed(taken), read)  # [P, 2 * dim]
        payload = payload.to(dev, non_blocking=True)
        init = torch.cat(
            [new_values, torch.full_like(new_values, self.initial_accumulator_value)], 1
        )
        payload = torch.where(new.unsqueeze(1), init, payload)
        slots = torch.where(has, line, torch.where(gets, taken, -1))  # [P]
        bypass = need & ~gets
        if p > big:  # a step that may bypass rows (its size decides: no host read)
            # the i-th bypassed row: staging slot i (after the sink)
            slots = torch.where(bypass, big + torch.cumsum(bypass, 0), slots)
            # a bypassed new key's row goes to the host tier now, as a line would hold it:
            # with no backward (no update) nothing else would write it there
            self.store.write(torch.where(bypass & new, rows, -1), init)
        fill = torch.where(need | new, slots, big)  # [P] slots written: misses', new keys'
        self._unpack(fill, payload)
        lined = torch.where(gets | (new & has), slots, big)  # [P] lines (re)mapped
        self._row_of_line[lined] = rows
        self._line_map[torch.where(gets, rows, sink_row)] = slots.to(torch.int32)
        self._stamps[lined] = tick
        self._dirty[lined] = new
        counts = [found & has, found & gets, new & ~bypass, bypass]
        self._static += torch.stack([c.sum() for c in counts])
        return slots

    def _static_victims(
        self, need: torch.Tensor, tick: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([P] bool: the row got a line; [P] that line, the lines' sink where none) for the
        rows ``need`` [P] marks, in fixed shapes: the i-th such row (a cumsum over the mask)
        takes the i-th line of the clock window (:meth:`~CacheLines._clock_window`, width
        ``min(L, 2P)``) sorted by stamp, unless that line is call ``tick``'s own."""
        big, p = self.lines, need.numel()
        rank = torch.cumsum(need, 0) - 1  # [P] each one's victim
        width = min(big, 2 * p)
        window, candidate = self._clock_window(width, tick)  # [width] each
        ranked, by_age = torch.sort(candidate, stable=True)
        n_victims = min(width, p)
        victims = window[by_age[:n_victims]]  # [n_victims] oldest first
        at = rank.clamp(0, n_victims - 1)
        gets = need & (rank < n_victims) & (ranked[:n_victims][at] < KEEP)  # not this call's
        taken = torch.where(gets, victims[at], big)  # [P] the sink: none
        return gets, taken

    def static_updated(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """The static backward's Adagrad updated slots ``slots`` [P] of ``rows`` [P] (-1:
        none): their lines are dirty now, and bypassed rows (staging slots, where a step has
        more keys than lines) go back to the host tier in one fixed-size write (-1 skipped)."""
        big = self.lines
        lined = (slots >= 0) & (slots < big)
        self._dirty.index_fill_(0, torch.where(lined, slots, big), True)  # (captured: no setitem)
        if rows.numel() > big:  # a step that may bypass rows (its size decides: no host read)
            staged = slots > big
            at = torch.where(staged, slots, big)
            self.store.write(torch.where(staged, rows, -1), self._packed(at))
