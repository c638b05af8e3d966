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
hand (sorted by stamp, this call's last: :meth:`~CacheLines._window`), the slots that take a
row are filled in place (:meth:`StaticCacheLines._fill_slots`: on CUDA one kernel over the P
positions that writes the dirty victims back and reads the stored rows straight into their
lines, no staging tensor of P rows), and a new key's line takes its initializer row at once
(dirty), never crossing to the host and back. The lookup then gathers from lines and the
backward's Adagrad updates lines (dirty marked): HBM_ONLY's arithmetic on other slots. A step
with more distinct rows than lines (or than the lines it does not use itself) bypasses the rest
in fixed shapes too: ``P - L`` staging slots after the lines' sink (made on the host before the step,
:meth:`StaticCacheLines.static_began`) take their payload in the forward's fill, and the
backward writes them back to the host tier in one write of P slots (-1 skipped), which only
steps of more keys than lines issue. Lines the eager path thinks never used are forgotten once a
static step ran (``_fresh``): the window finds them by their stamp (-1 sorts first). Opt-in, the
fill's write-backs may be staged in the forward and written after it, beside the rest of the step
(:meth:`StaticCacheLines.write_back_beside`, :mod:`shared.hashtable.write_back_beside`).
"""

from __future__ import annotations

import os

import torch

from shared.hashtable.host_node_fill import HostNodeFill
from shared.hashtable.host_store import TensorHostStore
from shared.hashtable.row_cache_lines import CacheLines
from shared.hashtable.write_back_beside import WriteBackBeside

# write_back_beside's default staging rows a step: 256K (32 MiB at dim 16, 256 MiB at dim 128);
# a 10 % cache of 100M rows at dim 16 writes back about 108K a step (bench_tiers, H100)
WRITE_BACK_ROWS = 1 << 18


class StaticCacheLines(CacheLines):
    """The cache's lines with the static step's fixed-shape resolve (see the module doc)."""

    _host_node: HostNodeFill | None = None  # the fill through a host node (opt-in)
    _beside: WriteBackBeside | None = None  # the write-backs staged, then written beside (opt-in)
    _node_wanted = 0  # the largest prefetch the host-node fill turned away (static_began sizes)

    def fill_with_host_node(self, threads: int | None = None) -> None:
        """From now on the static step's fill moves the rows with the host's cores, as a host
        node of its graph (:mod:`shared.hashtable.host_node_fill`; ``threads``: default the
        process's cores), instead of the device's reads. Needs the mapped host tier of a CUDA
        storage and a C compiler; the step captures its graphs again."""
        if not self._fills_in_place:
            raise ValueError(
                "fill_with_host_node: the host-node fill needs a CUDA storage whose host tier "
                "is mapped (the static step's in-place fill)"
            )
        assert isinstance(self.store, TensorHostStore)
        cores = threads if threads is not None else len(os.sched_getaffinity(0))
        self._host_node = HostNodeFill(self.store, self.dim, cores)

    def write_back_beside(self, rows: int = WRITE_BACK_ROWS, cores: int | None = None) -> None:
        """From now on the static step's fill stages the payload of its dirty victims (up to
        ``rows`` a step; the others as before) and they are written to the host tier after the
        forward, on a stream of their own, beside the rest of the step
        (:mod:`shared.hashtable.write_back_beside`), instead of by the fill on the step's path
        (with the host-node fill, :meth:`fill_with_host_node`, its cores then only read): by
        the device, or given ``cores``, by that many host threads (a C compiler needed). On
        CUDA it needs the mapped host tier of the in-place fill; the step captures its graphs
        again."""
        if self._beside is not None:  # the last flush lands before its staging goes
            self._beside.join()
        self._beside = WriteBackBeside(self.store, self.dim, rows, self.values.device, cores)

    def move_rows_with_cores(self, threads: int) -> None:
        """From now on ``threads`` host threads move this cache's rows between the tiers in the
        static step: the fill's reads through a host node (:meth:`fill_with_host_node`) and
        the write-backs staged and written beside the step (:meth:`write_back_beside`, by
        cores): no random host row crosses by the device's reads or writes. What
        ``train --cache-row-threads`` asks for."""
        self.fill_with_host_node(threads)
        # no step writes back more victims than there are lines
        self.write_back_beside(min(WRITE_BACK_ROWS, self.lines), cores=threads)

    def host_move_spent(self) -> dict[str, tuple[float, int]]:
        """(seconds, moves) of the host's cores in each native mover this cache has: ``fill``
        (:meth:`fill_with_host_node`) and ``write_back`` (:meth:`write_back_beside` by cores);
        read with the device synchronized (a queued host function still adds)."""
        out = {}
        if self._host_node is not None:
            out["fill"] = self._host_node.spent()
        if self._beside is not None and self._beside.by_cores:
            out["write_back"] = self._beside.spent()
        return out

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
        if self._beside is not None:
            self._beside.join()  # the last step's write-backs land before this one's fill
        self._version += 1
        self._fresh = self.lines
        self._last_padded = padded
        self.store.used_by_device(self.values.device)
        if padded - self.lines > self._staged:
            self._stage(max(padded - self.lines, 2 * self._staged))
        if self._host_node is not None:  # sized for the prefetches turned away too
            self._host_node.ready(max(padded, self._node_wanted), self.values.device)
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
        with its forward's: an eager resolve between the two may have taken its lines), except
        by :meth:`static_prefetch`, which never takes the lines of the step in flight."""
        return self._version - self._prefetch_bumps

    def static_prefetch_began(self, padded: int) -> bool:
        """A static prefetch of ``padded`` rows is about to run (on the host, before its graph
        or code): whether it may. Not while the last static step may bypass rows (a step of
        more keys than lines: its backward writes bypassed rows to the host tier, which the
        prefetch could read beside it), nor for more rows than lines."""
        if max(padded, self._last_padded) > self.lines:
            return False
        if self._host_node is not None and not self._host_node.fits(padded):
            # its arrays would move now, and with them the step's graphs, whose backward is
            # still to come (it would find its graphs gone): this prefetch is left out (the
            # step reads its rows itself), the next step makes them ready for its size
            self._node_wanted = max(self._node_wanted, padded)
            return False
        if self._beside is not None:
            self._beside.join()  # the step's write-backs land before the prefetch's fill
        self._version += 1  # eager lookups' lines may be taken ...
        self._prefetch_bumps += 1  # ... but never the static step's (static_version)
        self._fresh = self.lines
        self.store.used_by_device(self.values.device)
        return True

    def static_prefetch(self, rows: torch.Tensor) -> None:
        """Bring stored ``rows`` [P] (-1: none) into lines ahead of the static step that will
        look them up, in fixed shapes with no host read (captured on CUDA), while the step
        before it may still run its backward (on another stream): the window's victims are
        taken only among lines older than the current tick, so the lines of the step in flight
        (stamped with it) are neither evicted nor written back. Each row with a line is
        stamped (kept from this call's victims), the others take a line each where the window
        has one (rows left without stay in the host tier; nothing is bypassed), their dirty
        victims are written back and their rows read, clean, in one fill
        (:meth:`_fill_slots`, in row order). Counts the rows read as misses and
        ``prefetched`` (as the eager :meth:`RowCache.prefetch` does); the step's resolve then
        finds them as hits. Nothing a step computes changes: which rows
        are in lines is the cache's own business (the tier is transparent)."""
        tick = self._tick  # [] the step in flight's: its lines are no victims
        stored, line, has = self._stamp_lined(rows, tick)
        need = stored & ~has
        gets, taken, back, order = self._victims_in_row_order(need, need, rows, tick)
        slots = torch.where(gets, taken, -1)
        self._fill_slots(slots, back, torch.where(gets, rows, -1), None, None, order)
        clean = torch.zeros_like(gets)
        self._map_lines(torch.where(gets, slots, self.lines), gets, rows, slots, tick, clean)
        read_rows = gets.sum()
        self._static[1] += read_rows  # misses, as the eager prefetch counts its reads
        self._static[4] += read_rows

    def static_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, accumulators) [L + 1 + staged, dim]: the lines, the sink, the staging
        slots: what :meth:`static_resolve`'s slots index."""
        return self._values, self._accum

    def static_key(self) -> tuple[object, ...]:
        """What a captured step reads at fixed addresses: changes when one of them moves."""
        arrays = (self._values, self._accum, self._line_map, self._row_of_line, self._stamps,
                  self._dirty, self._tick, self._hand, self._evicted, self._static)  # fmt: skip
        node = () if self._host_node is None else self._host_node.key()
        beside = () if self._beside is None else self._beside.key()
        return (*(a.data_ptr() for a in arrays), self._store_moves, *node, *beside)

    def static_looked_up(self) -> None:
        """After a static forward (on the host, outside its graph): its staged write-backs go
        to the host tier beside what follows (:meth:`write_back_beside`; else nothing)."""
        if self._beside is not None:
            self._beside.flush()

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
        - The slots taking a row filled in place (:meth:`_fill_slots`): dirty victims
          written back, the stored rows read; a new key's line takes its initializer row and
          is dirty at once,
          so its row never crosses to the host and back (the eager path writes it to the host
          tier and reads it at the next resolve).
        - Maps, stamps and dirty bits are scattered with the sink slots for unused positions;
          hits, misses, new rows, bypassed rows, evictions and write-backs are counted on the
          device."""
        big, p = self.lines, rows.numel()
        assert p - big <= self._staged, "static_began(padded) makes the staging slots first"
        self._tick += 1
        tick = self._tick  # [] int64
        stored, line, has = self._stamp_lined(rows, tick)
        new = stored & ~found
        need = stored & ~has  # [P] rows that take a line now
        # [P] each: the rows that got a line, their victim lines, the rows those go back to
        # (-1: clean), the fill's order
        gets, taken, back, order = self._victims_in_row_order(need, need & found, rows, tick)
        if self._beside is not None:  # the victims' payload staged: written back after the forward
            back = self._beside.stage(taken, back, self._values, self._accum)
        read = torch.where(need & found, rows, -1)
        slots = torch.where(has, line, torch.where(gets, taken, -1))  # [P]
        bypass = need & ~gets
        if p > big:  # a step that may bypass rows (its size decides: no host read)
            # the i-th bypassed row: staging slot i (after the sink)
            slots = torch.where(bypass, big + torch.cumsum(bypass, 0), slots)
        # [P] slots written: misses' (their victims written back first), new keys'
        self._fill_slots(torch.where(need | new, slots, -1), back, read, new, new_values, order)
        if p > big:
            # a bypassed new key's row goes to the host tier now (from its staging slot, just
            # filled), as a line would hold it: with no backward (no update) nothing else
            # would write it there
            self._write_slots(torch.where(bypass & new, rows, -1), slots)
        lined = torch.where(gets | (new & has), slots, big)  # [P] lines (re)mapped
        self._map_lines(lined, gets, rows, slots, tick, new)
        counts = torch.stack([found & has, found & gets, new & ~bypass, bypass])  # [4, P]
        self._static[:4] += counts.sum(1)
        return slots

    def _stamp_lined(
        self, rows: torch.Tensor, tick: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """([P] bool: a stored row, [P] its line or -1, [P] bool: it has one) for ``rows``
        [P] (-1: none); the lines found are stamped with ``tick`` (kept from this call's
        victims)."""
        stored = rows >= 0
        line = torch.where(stored, self.line_of_row[rows.clamp(min=0)].to(torch.int64), -1)
        has = line >= 0
        self._stamps[torch.where(has, line, self.lines)] = tick
        return stored, line, has

    def _victims_in_row_order(
        self, need: torch.Tensor, reads: torch.Tensor, rows: torch.Tensor, tick: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows ``need`` [P] marks take a line each where call ``tick``'s window has one
        (:meth:`_static_victims`), their victims unmapped (:meth:`_unmap`) and re-paired
        with them in row order (:meth:`_pair_in_row_order`; ``reads`` [P]: the rows that
        will be read from the host tier). Returns (gets, taken, back, order), [P] each."""
        gets, taken = self._static_victims(need, tick)
        back = self._unmap(taken, gets)  # [P] the row each dirty victim goes back to, or -1
        taken, back, order = self._pair_in_row_order(
            gets, taken, back, torch.where(reads, rows, -1)
        )
        return gets, taken, back, order

    def _map_lines(
        self,
        lined: torch.Tensor,
        gets: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
        tick: torch.Tensor,
        dirty: torch.Tensor,
    ) -> None:
        """Lines ``lined`` [P] (the sink: none) now hold ``rows`` [P], stamped ``tick`` and
        dirty where ``dirty`` [P]; the rows that got a line (``gets`` [P]) map to their
        ``slots`` [P]. Fixed shapes: unused positions go to the sink slots."""
        self._row_of_line[lined] = rows
        self._line_map[torch.where(gets, rows, self.line_of_row.numel())] = slots.to(torch.int32)
        self._stamps[lined] = tick
        self._dirty[lined] = dirty

    def _pair_in_row_order(
        self, gets: torch.Tensor, taken: torch.Tensor, back: torch.Tensor, read: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows that get a line (``gets`` [P]) re-paired with this call's victim lines
        (``taken`` [P], each one's write-back row ``back`` [P], -1: clean) so that the k-th
        smallest row read (``read`` [P], -1: a new key's, none) takes the line of the victim
        with the k-th smallest write-back row. Returns (taken, back) so paired and ``order``
        [P]: the positions by their row read, those getting a line first.

        Which victim line a row takes changes nothing but where it lives (the victims, the
        rows evicted and written back are the same), and it lets one fill launch touch the
        host tier in ascending order both ways at once (:meth:`_fill_slots` walks
        ``order``): the device's reads of random host rows cost it about the same per row, in
        address order 5.7x less at 128-B rows and 1.7x at 1 KiB (bench_host_pages, H100);
        writes and reads cross PCIe in both directions together. Positions without a line sort
        last (their ``taken`` is the sink and ``back`` -1, and stay so). Fixed shapes: two
        sorts of P keys, 32-bit where the host tier's rows fit."""
        end = self.store.capacity  # above every row id: the positions without a line
        by_read = _ascending(torch.where(gets, read, end), end)  # [P]
        by_back = _ascending(torch.where(gets, back, end), end)  # [P]
        paired_taken = torch.empty_like(taken).index_copy_(0, by_read, taken[by_back])
        paired_back = torch.empty_like(back).index_copy_(0, by_read, back[by_back])
        return paired_taken, paired_back, by_read

    def _initial(self, new_values: torch.Tensor) -> torch.Tensor:
        """[n, 2 * dim]: new rows' packed payload: ``new_values`` [n, dim], then the initial
        accumulators."""
        return torch.cat(
            [new_values, torch.full_like(new_values, self.initial_accumulator_value)], 1
        )

    def _fill_slots(
        self,
        slots: torch.Tensor,
        back: torch.Tensor,
        read: torch.Tensor,
        new: torch.Tensor | None,
        new_values: torch.Tensor | None,
        order: torch.Tensor | None = None,
    ) -> None:
        """Slots ``slots`` [P] (-1: none) take their payload: each one's old payload goes back
        to host row ``back`` [P] (-1: none) first, then it takes ``new_values`` [P, dim] and
        the initial accumulators (``new`` [P]; ``new`` and ``new_values`` None: no new rows)
        or host row ``read`` [P] (-1: none). ``order``
        [P] (None: in turn): the order the device's fill takes the positions in
        (:meth:`_pair_in_row_order`).

        Only the slots given move, in place: on a mapped host tier (CUDA) one kernel reads
        and writes them (:func:`shared.hashtable.cuda.host_rows.fill_slots`, walking the
        positions in ``order``; a position without a slot costs a load), elsewhere (the CPU)
        the same in torch ops on the slots given, picked by a host read, which costs nothing
        there (no device to wait for; a CUDA storage takes the static step only with a
        mapped tier: :meth:`StaticCacheLines.why_not_static`). Until 2026-12-07 every position's packed
        payload [P, 2 * dim] was swapped through the store, the new rows' taken in, and the
        whole scattered into the slots, positions without a slot into the sink row: at the
        H100's P = 1M at dim 128, 5.5 GiB of payload temporaries a step (about 12 GiB read
        and written) and two 1M-row scatters onto one row, for the 2 to 12 % of positions that
        needed a slot (bench_tiers' misses at 100 % and 10 %)."""
        if self._fills_in_place:
            from shared.hashtable.cuda import host_rows

            assert isinstance(self.store, TensorHostStore)
            init = None if new_values is None else new_values.to(torch.float32).contiguous()
            if self._host_node is not None:
                self._host_node.fill(slots, back, read, new, init,
                                     self.initial_accumulator_value, self._values, self._accum)  # fmt: skip
            else:
                host_rows.fill_slots(
                    self.store.device_pointer(), back, read, slots, new, init,
                    self.initial_accumulator_value, self._values, self._accum, order=order,
                )  # fmt: skip
            self.store.used_by_device(self.values.device)
            return
        assert not slots.is_cuda, "a CUDA storage's static resolve needs a mapped host tier"
        at = torch.nonzero(slots >= 0).squeeze(1)  # [k] positions with a slot (host read)
        slot = slots[at]  # [k]
        payload = self.store.swap(back[at], self._packed(slot), read[at])  # [k, 2 * dim]
        if new is not None and new_values is not None:
            payload = torch.where(new[at].unsqueeze(1), self._initial(new_values[at]), payload)
        self._unpack(slot, payload)

    def _write_slots(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Host rows ``rows`` [P] (-1: none) take the payload of slots ``slots`` [P] (a bypassed
        row's staging slot), in place as :meth:`_fill_slots` moves it: no packed copy of every
        position's slot (on the H100 at dim 128, a P = 1M step over a 1M-line cache, the 10 %
        cache's, packed 1 GiB a step for the staging slots no row used)."""
        slots = torch.where(rows >= 0, slots, -1)
        if self._fills_in_place:
            from shared.hashtable.cuda import host_rows

            assert isinstance(self.store, TensorHostStore)
            host_rows.fill_slots(
                self.store.device_pointer(), rows, None, slots, None, None, 0.0,
                self._values, self._accum,
            )  # fmt: skip
            self.store.used_by_device(self.values.device)
            return
        assert not slots.is_cuda, "a CUDA storage's static resolve needs a mapped host tier"
        at = torch.nonzero(slots >= 0).squeeze(1)  # [k] (a host read: free on the CPU)
        self.store.write(rows[at], self._packed(slots[at]))

    def _static_victims(
        self, need: torch.Tensor, tick: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([P] bool: the row got a line; [P] that line, the lines' sink where none) for the
        rows ``need`` [P] marks, in fixed shapes: the i-th such row (a cumsum over the mask)
        takes the i-th line of the clock window (:meth:`~CacheLines._window`, width
        ``min(L, 2P)``) sorted by stamp, unless that line is call ``tick``'s own."""
        big, p = self.lines, need.numel()
        rank = torch.cumsum(need, 0) - 1  # [P] each one's victim
        width = min(big, 2 * p)
        window = self._window(width)  # [width]
        # each line's age key: its stamp - tick (<= 0; 0: this call's, sorting last, as KEEP
        # does in the eager window) in int32: the sort's radix passes halve (int64 keys).
        # The order is the stamps' while fewer than 2**31 calls ran (an older stamp clamped
        # ties with its neighbours: another victim, never another result)
        age = (self.stamp[window] - tick).clamp_(min=-(2**31)).to(torch.int32)  # [width]
        ranked, by_age = torch.sort(age, stable=True)
        n_victims = min(width, p)
        victims = window[by_age[:n_victims]]  # [n_victims] oldest first
        at = rank.clamp(0, n_victims - 1)
        gets = need & (rank < n_victims) & (ranked[:n_victims][at] < 0)  # not this call's
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
            self._write_slots(torch.where(slots > big, rows, -1), slots)


def _ascending(keys: torch.Tensor, end: int) -> torch.Tensor:
    """[n] int64: the positions of ``keys`` [n] (each in [-1, ``end``]) in ascending order,
    sorted on 32-bit keys where ``end`` fits (half the radix passes of 64-bit ones)."""
    return torch.argsort(keys.to(torch.int32) if end < 2**31 else keys)
