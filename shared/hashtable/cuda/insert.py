"""Insert-or-assign and erase on CUDA (the CUDA backend's), giving the torch backend's table and
result.

**insert_or_assign** (kernels.cu ``ht_ins2_*``): three launches on torch's stream (four for a
table that may still grow), one host read. 1.7-2.5 G keys/s for 1M new keys on the H200 (an
earlier implementation, a block per bucket with a host sync in the middle, gave 0.79 G and is
gone: ``bench/results/bench_gpu_hashtable_insert_h200.json`` and git history).

1. ``ht_ins2_stage_w<W>`` (a thread per key): locate each key; a stored key marks its row with
   the last input index using it, a new occurrence is staged in its bucket's list.
2. ``ht_ins2_place0`` (a warp per bucket): order the bucket's new occurrences by (fingerprint,
   table id, key), the torch backend's order; the last occurrence of each pair represents it.
   Where the stage counts rule out growth (at max capacity, or when the staged occurrences
   cannot reach the load bound), the warp merges the new pairs into its bucket at once: they
   take the rows of the empty slots, the slots stay sorted, and the warp writes the new rows
   (key, table id, score, values, accumulators), which lie in the bucket's own row range.
3. ``ht_ins2_place1``, only for a table that may grow: the same merge where growth looked
   possible from the stage counts but the exact pair counts of pass 0 rule it out.
4. ``ht_ins2_write`` (``2**gshift`` threads a key, 16-byte copies): the last occurrence of each
   stored pair assigns its row.

The stats (new pairs, fullest bucket, errors) are copied to pinned memory after pass 0 and
read once, after every launch is queued: the host waits for stage and pass 0 only, while pass 1
and the row writes run. When the call cannot finish on the kernels (growth, a bucket receiving
more than twice its capacity of new occurrences, invalid keys) the kernels leave the table
untouched and :func:`insert_or_assign` returns no result: the CUDA backend then runs the torch
algorithms (which raise their error for invalid keys).

**Full buckets** (at max capacity: place pass 0 lists the buckets whose new pairs do not fit,
:func:`_hand_over`): ``ht_ins2_over`` (a block per listed bucket, the list sorted) keeps each
bucket's best entries by :mod:`shared.hashtable.buckets`' ranking (eviction by score, NO_EVICTION
refusals): the torch backend's ``insert_overflow``, bit for bit (table, rows, evicted keys in
order, refusals); ``ht_ins2_gather`` fills the rows of their occurrences and
``ht_ins2_over_list`` orders the evicted keys; one more host read (evicted, refused, added),
none for a caller taking padded evictions (``exact=False``: the counts reach the table's size and
counters when next read, ``TableLayout._defer``).
About 160 us for 8192 full buckets of 128 on the H200 (the torch algorithms: ~3 ms, ~7 host
syncs). Where a block's shared memory (:func:`_over_smem`, 93 bytes a slot) exceeds the device's
opt-in limit (bucket capacity above ~2400 on the H200), :func:`_overflow_torch` runs the torch
backend's ``insert_overflow`` instead.
Scratch buffers are kept per table (:class:`_Scratch`) and left clear by the kernels
themselves: no per-call allocation or fill beyond the two result tensors. Launches go to the
driver (``cuLaunchKernel``) from C parameter buffers kept with the scratch (``runtime.Kernel``):
a launch stores each argument in its slot, with no CuPy argument conversion.
Tables of any dim (0 included: the admission counter) and bucket capacity take this path; a
bucket capacity whose shared memory exceeds 48 KiB per warp (1024, the counter's default) opts
in to the device's limit.

**insert_selected** (:func:`insert_selected`): the same kernels inside a captured training
step (``shared.hashtable.static_insert``): the selected keys of a static-size batch by a mask
(stage and gather skip the others), at max capacity, with no host read: ``ht_ins2_over`` gets
a block for every bucket and the blocks past the device count of full buckets return at once;
the counts stay on the device (``SelectedInsert``).

**erase** (kernels.cu ``ht_erase_*``, :func:`erase`): mark (a thread per key) and apply (a warp
per bucket holding an erased key: a stable partition of its slots, the rows freed), one host
read, on the table's scratch; invalid keys raise the torch backend's error with the table
untouched. ``count=False`` (``HashTable.erase``: the caller needs no count and promises valid
keys; a storage erasing admitted keys from its admission counter) reads nothing: the stats go to
a pinned buffer of their own with an event, and the erased count reaches the table's size when
the size is next read or the scratch next used (``TableLayout._defer``; by then long copied).
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shared.features import ScoreStrategy
from shared.hashtable.cuda import runtime as rt
from shared.hashtable.cuda.find import window
from shared.hashtable.hashing import bucket_of
from shared.hashtable.layout import Counts, InsertResult, RowArrays, SelectedInsert, TableLayout

if TYPE_CHECKING:
    from shared.hashtable.torch_backend import TorchBackend

WHAT = "HashTable.insert_or_assign"
ERASE_WHAT = "HashTable.erase"
STAGE_FACTOR = 2  # staged new keys a bucket may receive, in bucket capacities (place needs 2)
PLACE_WARPS = 4  # buckets (warps) per block of ht_ins2_place*, fewer when shared memory is short
ERASE_WARPS = 4  # buckets (warps) per block of ht_erase_apply
PLACE_STATIC_SMEM = 256  # room for the static shared memory of ht_ins2_place* (48 bytes)
OPTIN_SHARED_ATTR = 97  # cudaDevAttrMaxSharedMemoryPerBlockOptin

# kernels.cu HT_ST_*: the stats of one insert
ST_STAGED_OVER, ST_NEG_KEY, ST_BAD_TID, ST_MAYBE_FULL, ST_STAGED, ST_ANY_TID = range(6)
ST_NEW, ST_MAX_FILL, ST_N_OVER, ST_OVER_NEW = range(6, 10)
ST_OV_EVICTED, ST_OV_REFUSED, ST_OV_ADDED = range(11, 14)  # of ht_ins2_over (full buckets)
ST_OV_FAST = 14  # of ht_ins2_over: buckets its fast path took (kernels.cu)
ST_LEN = 16
# kernels.cu HT_ER_*: the stats of one erase
ER_NEG_KEY, ER_BAD_TID, ER_ERASED, ER_LISTED = range(4)

# Parameter types of the kernels launched through runtime.Kernel, in order: p pointer (a tensor
# or None), q int64, i int32, f float32. Must match kernels.cu (test_cuda_keyed checks them).
SIGNATURES = {
    "ht_ins2_stage": "ppiqpppppqqqiqppppppp",
    "ht_ins2_place": "ppiqqqipppppppppppiqpppifiiipppppi",
    "ht_ins2_write": "qpppiiiipppppiqqpppi",
    "ht_ins2_gather": "ppqppp",
    "ht_ins2_over": "pqqppppipppifiipipppppppppippppqp",
    "ht_ins2_over_list": "qpppppp",
    "ht_erase_mark": "ppiqpppppqqqipppp",
    "ht_erase_apply": "qipppppppppppp",
}

# What an insert did (:func:`insert_or_assign`'s second value; the CUDA backend counts them):
# the kernels stored the call ("fast": place pass 0, "slow": place pass 1, "overflow": with full
# buckets, through ht_ins2_over), or they left it to the torch algorithms
# ("abort": the kernels found growth, a skewed batch or invalid keys; "unsupported": nothing was
# launched: no keys, 2**31 keys or more, buckets too large for shared memory).
PATHS = ("fast", "slow", "overflow", "abort", "unsupported")


# ---------------------------------------------------------------------------------------- insert


def _place_stride(S: int) -> int:
    """Shared-memory bytes per warp of ``ht_ins2_place*`` (its layout comment): 30 * S, to 16."""
    return (30 * S + 15) // 16 * 16


def _over_smem(bc: int, S: int) -> int:
    """Dynamic shared-memory bytes of an ``ht_ins2_over`` block (its layout comment): 69 * bc
    + 12 * S, to 16 (93 * bc with S = 2 * bc: 12 KiB for 128, 93 KiB for 1024)."""
    return (69 * bc + 12 * S + 15) // 16 * 16


def _over_threads(bc: int) -> int:
    """Threads of an ``ht_ins2_over`` block: about one a slot, 64 to 1024, whole warps."""
    return min(1024, max(64, (bc + 31) // 32 * 32))


def _erase_stride(bc: int) -> int:
    """Shared-memory bytes per warp of ``ht_erase_apply``: a bucket's fingerprints and rows."""
    return 16 * bc


def _family(name: str) -> str:
    """The SIGNATURES entry of a kernel name (``ht_ins2_stage_w4`` → ``ht_ins2_stage``)."""
    return re.sub(r"(_w\d+|\d)$", "", name)


class _Scratch:
    """The buffers of one table size (``nb`` buckets of ``bc``), kept between calls.

    Invariant between calls: ``scount`` is 0, ``win`` is -1 and ``stats[parity]`` is 0; the
    kernels restore it (place clears scount, ht_ins2_write clears win and the other stats
    buffer; ht_erase_apply the same for an erase). ``dirty`` marks a call interrupted between
    its launches: the next call clears all.
    """

    def __init__(self, table: TableLayout) -> None:
        dev, nb, bc = table.device, table.num_buckets, table.bucket_capacity
        self.shape = (nb, bc)
        self.S = STAGE_FACTOR * bc
        self.scount = torch.zeros(nb, dtype=torch.int32, device=dev)  # staged occurrences
        # input indices staged per bucket: plain stores and loads only, so where the table's
        # row arrays are (host memory mapped into the device for RowArrays.HOST: 8 B a slot
        # off the device); win takes atomics and stays in device memory
        self.stage = table.row_array(nb * self.S, 0, torch.int32)
        self.stage_on_host = table.row_arrays is RowArrays.HOST
        self.win = torch.full((nb * bc,), -1, dtype=torch.int32, device=dev)  # writer of a row
        self.nnew = torch.empty(nb, dtype=torch.int64, device=dev)  # new pairs (over buckets)
        self.over_list = torch.empty(nb, dtype=torch.int64, device=dev)  # buckets without room
        self.stats = torch.zeros(2, ST_LEN, dtype=torch.int64, device=dev)  # alternate per call
        self.stats_of = (self.stats[0], self.stats[1])
        self._pin = dev.type == "cuda"
        self._host: torch.Tensor | None = None
        self._erase_host: torch.Tensor | None = None
        self.rep_of = torch.empty(0, dtype=torch.int32, device=dev)  # grows with the batch
        self.empty = torch.zeros(0, dtype=torch.int64, device=dev)
        self.kernels: dict[str, rt.Kernel] = {}
        self.parity = 0
        self.dirty = False
        self.stream_ptr: int | None = None
        self.event: Any = None
        self.erase_event: Any = None

    @property
    def host(self) -> torch.Tensor:
        """The pinned copy of a call's stats (made at the first use: a scratch made inside a
        captured call, :func:`insert_selected`'s, allocates no host memory)."""
        if self._host is None:
            self._host = torch.zeros(ST_LEN, dtype=torch.int64, pin_memory=self._pin)
        return self._host

    @property
    def erase_host(self) -> torch.Tensor:
        """A deferred erase's stats (erase(count=False)), read when the table's size is needed."""
        if self._erase_host is None:
            self._erase_host = torch.zeros(ST_LEN, dtype=torch.int64, pin_memory=self._pin)
        return self._erase_host

    def clear(self) -> None:
        self.scount.zero_()
        self.win.fill_(-1)
        self.stats.zero_()
        self.parity = 0
        self.dirty = False

    def kernel(self, launch: rt.Launcher, name: str) -> rt.Kernel:
        k = self.kernels.get(name)
        if k is None:
            k = self.kernels[name] = rt.Kernel(launch.index, name, SIGNATURES[_family(name)])
        return k


_scratch: weakref.WeakKeyDictionary[TableLayout, _Scratch] = weakref.WeakKeyDictionary()
_optin: dict[int, int] = {}  # device index -> opt-in shared memory a block may use
_smem_set: dict[tuple[int, str], int] = {}  # dynamic shared memory a kernel was allowed


def scratch_bytes(table: TableLayout) -> int:
    """Device bytes of the scratch these kernels keep with ``table`` (0 before its first CUDA
    insert or erase), as long as the table lives: ``win`` 4 bytes a slot, ``stage`` 8 bytes a
    slot unless the row arrays are on the host (it is then with them: :func:`stage_host_bytes`),
    20 bytes a bucket, the stats (256 bytes) and ``rep_of``, 4 bytes a key of the largest batch.
    The planner counts all but ``rep_of``: :func:`shared.hashtable.placement.insert_scratch_bytes`
    (``TablePlacement.insert_scratch_bytes``; test_layout checks that they agree)."""
    sc = _scratch.get(table)
    if sc is None:
        return 0
    return sum(
        v.nbytes
        for v in vars(sc).values()
        if isinstance(v, torch.Tensor) and v.is_cuda and not (v is sc.stage and sc.stage_on_host)
    )


def stage_host_bytes(table: TableLayout) -> int:
    """Host bytes of the scratch these kernels keep with ``table``: its ``stage`` where the row
    arrays are on the host, else 0 (0 before its first CUDA insert or erase)."""
    sc = _scratch.get(table)
    return sc.stage.nbytes if sc is not None and sc.stage_on_host else 0


def reserve_scratch(table: TableLayout) -> None:
    """Make ``table``'s scratch now, if it has none of its size: before a capture whose
    :func:`insert_selected` would otherwise make it inside (where the host memory of a ``stage``
    for ``RowArrays.HOST`` cannot be page-locked)."""
    _table_scratch(table)


def _scratch_of(table: TableLayout, launcher: rt.Launcher) -> _Scratch:
    """The table's scratch for a call on ``launcher``'s stream, the table's pending counts
    settled first (a deferred erase reads ``erase_host``, which the next one overwrites)."""
    if table._pending:
        table._settle()
    sc = _table_scratch(table)
    if sc.stream_ptr is not None and sc.stream_ptr != launcher.stream_ptr:
        launcher.synchronize()  # the last call's kernels ran on another stream
    sc.stream_ptr = launcher.stream_ptr
    if sc.event is None:
        sc.event = launcher.event()
        sc.erase_event = launcher.event()
    if sc.dirty:
        sc.clear()
    return sc


def _table_scratch(table: TableLayout) -> _Scratch:
    """The table's kept scratch: new, or made again where the table grew (the old one freed)."""
    sc = _scratch.get(table)
    if sc is None or sc.shape != (table.num_buckets, table.bucket_capacity):
        sc = _scratch[table] = _Scratch(table)
    return sc


def _block_warps(launch: rt.Launcher, names: tuple[str, ...], stride: int, want: int) -> int:
    """Warps per block of the kernels ``names`` with ``stride`` bytes of dynamic shared memory
    a warp: up to ``want`` within the default 48 KiB, else within the device's opt-in limit,
    which the kernels are then allowed (call inside ``with launch``). 0: not one warp fits."""
    warps = min(want, (rt.MAX_SHARED - PLACE_STATIC_SMEM) // stride)
    if warps > 0:
        return warps
    limit = _optin.get(launch.index)
    if limit is None:
        try:
            limit = int(launch.cp.cuda.runtime.deviceGetAttribute(OPTIN_SHARED_ATTR, launch.index))
        except Exception:  # an old CuPy or driver: no opt-in
            limit = rt.MAX_SHARED
        limit = _optin[launch.index] = limit
    warps = min(want, (limit - PLACE_STATIC_SMEM) // stride)
    if warps <= 0:
        return 0
    need = warps * stride
    for name in names:
        key = (launch.index, name)
        if _smem_set.get(key, 0) < need:
            try:
                rt._function(launch.index, name).max_dynamic_shared_size_bytes = need
            except Exception:
                return 0
            _smem_set[key] = need
    return warps


def _dense(
    t: torch.Tensor, dev: torch.device, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """``t`` on ``dev`` as a contiguous ``dtype`` tensor of ``shape`` (no op when it is one)."""
    if t.dtype != dtype or t.device != dev:
        t = t.to(dev, dtype)
    if t.shape != shape:
        t = t.reshape(shape)
    return t.contiguous()


def _row_layout(dim: int, arrays: list[torch.Tensor]) -> tuple[bool, int]:
    """(vec4, gshift) of row copies: float4 units when ``dim % 4 == 0`` and every array is
    16-byte aligned, else floats; ``2**gshift`` threads a row, the smallest power of 2 covering
    its units, at most 32."""
    vec4 = dim % 4 == 0 and all(t.data_ptr() % 16 == 0 for t in arrays)
    units = dim // 4 if vec4 else dim
    return vec4, min(5, (max(units, 1) - 1).bit_length())


@dataclass(slots=True)  # not frozen: a frozen __init__ costs ~3 us more per insert (host-bound)
class _Batch:
    """One insert's inputs as the kernels take them, with the table's geometry and limits at the
    call (:func:`_batch_of`): what the steps of :func:`insert_or_assign` share."""

    dev: torch.device
    keys: torch.Tensor  # [n] int64, contiguous
    tids: torch.Tensor | None  # [n] int64, contiguous
    n: int
    n_blocks: int  # of the one-thread-per-key kernels (stage, gather)
    values: torch.Tensor  # [n, dim] float32
    scores: torch.Tensor  # [n] int64
    acc_in: torch.Tensor | None  # [n, dim] float32: the given accumulators, where kept
    acc_out: torch.Tensor | None  # the table's accumulators
    vec4: bool
    gshift: int
    nb: int
    bc: int
    cap: int
    dim: int
    S: int  # staged occurrences a bucket may receive
    stride: int  # shared-memory bytes per warp of ht_ins2_place*
    may_grow: bool
    new_limit: int  # the most new pairs without growth
    has_t: int
    limits: tuple[int, int]  # (may_grow, new_limit) as the kernels take them
    exact: bool = True  # False: the caller takes padded evictions (insert_or_assign's exact)


def insert_or_assign(
    table: TableLayout,
    core: TorchBackend,
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    *,
    table_ids: torch.Tensor | None,
    accumulators: torch.Tensor | None,
    pinned_rows: torch.Tensor | None,
    exact: bool = True,
) -> tuple[InsertResult | None, str]:
    """(what the torch backend's ``insert_or_assign`` returns for the same call, the path: see
    :data:`PATHS`), or (None, path) with the table untouched where the torch algorithms must do
    the call. ``core``: the backend whose ``insert_overflow`` and ``fingerprint`` serve full
    buckets where ``ht_ins2_over`` cannot (the calling CUDA backend). ``exact=False``: the
    caller takes evictions padded with -1 and num_refused -1 (``InsertResult``); full buckets
    then cost no host read (:func:`_overflow`: the counts are settled later)."""
    b = _batch_of(table, keys, values, scores, table_ids, accumulators)
    if b is None:
        return None, "unsupported"
    b.exact = exact
    launch = rt.Launcher(b.dev)
    with launch:
        warps = _block_warps(launch, ("ht_ins2_place0", "ht_ins2_place1"), b.stride, PLACE_WARPS)
        if warps == 0:
            return None, "unsupported"
        sc = _scratch_of(table, launch)
        rows, inserted = _launch_insert(table, b, launch, sc, warps)
    st = sc.host.tolist()

    path = _path_of(table, b, st)
    if path == "abort":
        return None, path
    _count_new(table, st)
    evicted_k, evicted_t, refused = sc.empty, sc.empty, 0
    if st[ST_N_OVER]:
        path = "overflow"
        evicted_k, evicted_t, refused = _hand_over(
            table, core, b, launch, sc, st, pinned_rows, rows, inserted
        )
    return InsertResult(rows, inserted.view(torch.bool), evicted_k, evicted_t, refused), path


def _batch_of(
    table: TableLayout,
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    table_ids: torch.Tensor | None,
    accumulators: torch.Tensor | None,
) -> _Batch | None:
    """The call's arguments as the kernels take them (no host sync: the keys are checked on the
    device), or None where the kernels cannot take it (no keys, 2**31 keys or more, a staging
    list too long)."""
    dev, bc, dim = table.device, table.bucket_capacity, table.dim
    keys, tids = table._prepare(keys, table_ids, WHAT, validate=False)
    n = keys.numel()
    S = STAGE_FACTOR * bc
    if n == 0 or n >= 1 << 31 or S > 32767:
        return None
    keys = keys.contiguous()
    tids = None if tids is None else tids.contiguous()
    values = _dense(values, dev, torch.float32, (n, dim))
    scores = _dense(scores, dev, torch.int64, (n,))
    acc_out = table._accum
    acc_in = None  # the torch backend ignores given accumulators when the table keeps none
    if accumulators is not None and acc_out is not None:
        acc_in = _dense(accumulators, dev, torch.float32, (n, dim))
    aligned = [values, table._values]
    aligned += [t for t in (acc_out, acc_in) if t is not None]
    vec4, gshift = _row_layout(dim, aligned)
    nb, cap = table.num_buckets, table.capacity
    may_grow = nb < table._max_buckets
    # the most new pairs without growth: size + new > lf * nb * bc <=> new > floor(...) - size;
    # only read where the table may grow (reading the size settles its pending counts: a host
    # read, which a captured call, insert_selected's, may not make)
    new_limit = math.floor(table.max_load_factor * nb * bc) - table._size if may_grow else 0
    stride = _place_stride(S)
    has_t = int(tids is not None)
    limits = (int(may_grow), new_limit)
    n_blocks = rt.blocks(n)
    return _Batch(
        dev=dev, keys=keys, tids=tids, n=n, n_blocks=n_blocks, values=values, scores=scores,
        acc_in=acc_in, acc_out=acc_out, vec4=vec4, gshift=gshift, nb=nb, bc=bc, cap=cap, dim=dim,
        S=S, stride=stride, may_grow=may_grow, new_limit=new_limit, has_t=has_t, limits=limits,
    )  # fmt: skip


def _launch_insert(
    table: TableLayout, b: _Batch, launch: rt.Launcher, sc: _Scratch, warps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queue stage, place (pass 0, the stats copy, pass 1 where the table may grow) and the row
    writes on torch's stream, then wait for the stats copy: (rows [n] int64, inserted [n]
    uint8), the call's results, the rows of the overflowing buckets' new pairs still unset."""
    if sc.rep_of.numel() < b.n:
        sc.rep_of = torch.empty(b.n, dtype=torch.int32, device=b.dev)
    stats, stats_next = sc.stats_of[sc.parity], sc.stats_of[1 - sc.parity]
    rows = torch.empty(b.n, dtype=torch.int64, device=b.dev)
    inserted = torch.empty(b.n, dtype=torch.uint8, device=b.dev)
    sc.dirty = True
    stage_args = _stage_args(table, b, sc, stats, rows, inserted)
    launch(sc.kernel(launch, f"ht_ins2_stage_w{window(table)}"), b.n_blocks, rt.BLOCK, stage_args)
    place_args = _place_args(table, b, sc, stats, rows, inserted, sc.rep_of)
    grid, block, smem = math.ceil(b.nb / warps), 32 * warps, warps * b.stride
    launch(sc.kernel(launch, "ht_ins2_place0"), grid, block, place_args, smem)
    launch.to_host(sc.host, stats, sc.event)
    if b.may_grow:  # at max capacity pass 0 always decides: no pass 1
        launch(sc.kernel(launch, "ht_ins2_place1"), grid, block, place_args, smem)
    write_args = _write_args(table, b, sc, stats, stats_next, rows, inserted)
    launch(sc.kernel(launch, "ht_ins2_write"), rt.blocks(b.n << b.gshift), rt.BLOCK, write_args)
    sc.parity ^= 1  # ht_ins2_write cleared the other buffer
    sc.dirty = False
    sc.event.synchronize()  # stage and pass 0 are done; pass 1 and the writes may still run
    return rows, inserted


def _stage_args(
    table: TableLayout,
    b: _Batch,
    sc: _Scratch,
    stats: torch.Tensor,
    rows: torch.Tensor,
    inserted: torch.Tensor,
) -> tuple[Any, ...]:
    """The arguments of ``ht_ins2_stage_w<W>`` (SIGNATURES order)."""
    return (
        b.keys,
        b.tids,
        b.has_t,
        b.n,
        table._slot_fp,
        table._slot_row,
        table._row_key,
        table._row_tid,
        table._bucket_count,
        b.nb,
        b.bc,
        b.cap,
        int(b.tids is not None or table._any_tid),
        b.S,
        rows,
        inserted,
        sc.win,
        sc.scount,
        sc.stage,
        stats,
        None,  # no mask: every key takes part
    )


def _place_args(
    table: TableLayout,
    b: _Batch,
    sc: _Scratch,
    stats: torch.Tensor,
    rows: torch.Tensor,
    inserted: torch.Tensor,
    rep_of: torch.Tensor,
) -> tuple[Any, ...]:
    """The arguments of ``ht_ins2_place0`` and ``ht_ins2_place1`` (SIGNATURES order)."""
    return (
        b.keys,
        b.tids,
        b.has_t,
        b.nb,
        b.bc,
        b.S,
        b.stride,
        sc.scount,
        sc.stage,
        table._bucket_count,
        table._slot_fp,
        table._slot_row,
        rows,
        inserted,
        rep_of,
        sc.nnew,
        sc.over_list,
        stats,
        *b.limits,
        b.values,
        b.scores,
        b.acc_in,
        int(b.acc_in is not None),
        table.initial_accumulator_value,
        b.dim,
        int(b.vec4),
        b.gshift,
        table._row_key,
        table._row_tid,
        table._row_score,
        table._values,
        b.acc_out,
        int(b.acc_out is not None),
    )


def _write_args(
    table: TableLayout,
    b: _Batch,
    sc: _Scratch,
    stats: torch.Tensor,
    stats_next: torch.Tensor,
    rows: torch.Tensor,
    inserted: torch.Tensor,
) -> tuple[Any, ...]:
    """The arguments of ``ht_ins2_write`` (SIGNATURES order)."""
    return (
        b.n,
        b.values,
        b.scores,
        b.acc_in,
        int(b.acc_in is not None),
        b.dim,
        int(b.vec4),
        b.gshift,
        rows,
        inserted,
        sc.win,
        stats,
        stats_next,
        *b.limits,
        b.bc,
        table._values,
        table._row_score,
        b.acc_out,
        int(b.acc_out is not None),
    )


def _path_of(table: TableLayout, b: _Batch, st: list[int]) -> str:
    """The path of the call from its stats ``st``: "abort" where the kernels left the table
    untouched (raising the torch backend's error for invalid keys), else "fast" or "slow"."""
    if st[ST_NEG_KEY] or st[ST_BAD_TID]:
        table._prepare(b.keys, b.tids, WHAT)  # raises the torch backend's error
        return "abort"
    if st[ST_STAGED_OVER] or (b.may_grow and (st[ST_NEW] > b.new_limit or st[ST_MAX_FILL] > b.bc)):
        return "abort"  # nothing changed: growth or a skewed batch, the torch backend's job
    fast = not b.may_grow or (not st[ST_MAYBE_FULL] and st[ST_STAGED] <= b.new_limit)
    return "fast" if fast else "slow"


def _count_new(table: TableLayout, st: list[int]) -> None:
    """The table's size and table-id flag after the kernels stored the call (stats ``st``)."""
    table._size += st[ST_NEW] - st[ST_OVER_NEW]
    if st[ST_ANY_TID]:
        table._any_tid = True  # a superset of the torch rule (new stored pairs): always safe


def _hand_over(
    table: TableLayout,
    core: TorchBackend,
    b: _Batch,
    launch: rt.Launcher,
    sc: _Scratch,
    st: list[int],
    pinned_rows: torch.Tensor | None,
    rows: torch.Tensor,
    inserted: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The ``st[ST_N_OVER]`` buckets without room (at max capacity) through the kernels
    (:func:`_overflow`), or through the torch backend's ``insert_overflow``
    (:func:`_overflow_torch`) where an ``ht_ins2_over`` block's shared memory exceeds the
    device's limit (bucket capacity above ~2400 on the H200); then ``ht_ins2_gather`` fills
    their new pairs' ``rows`` and ``inserted``: (evicted keys, evicted table ids, refused)."""
    over = torch.sort(sc.over_list[: st[ST_N_OVER]]).values
    rep_rows = torch.empty(b.n, dtype=torch.int64, device=b.dev)
    with launch:
        if _block_warps(launch, ("ht_ins2_over",), _over_smem(b.bc, b.S), 1):
            return _overflow(
                table, b, launch, sc, over, st[ST_OVER_NEW], pinned_rows, rep_rows, rows, inserted
            )
    evicted_k, evicted_t, refused = _overflow_torch(
        table,
        core,
        over,
        b.keys,
        b.tids,
        b.values,
        b.scores,
        b.acc_in,
        pinned_rows,
        sc.stage,
        sc.nnew,
        rep_rows,
    )
    with launch:
        _gather(b, launch, sc, rep_rows, rows, inserted)
    return evicted_k, evicted_t, refused


def _gather(
    b: _Batch,
    launch: rt.Launcher,
    sc: _Scratch,
    rep_rows: torch.Tensor,
    rows: torch.Tensor,
    inserted: torch.Tensor,
) -> None:
    """``ht_ins2_gather``: the occurrences of the full buckets' new pairs take their
    representative's row in ``rep_rows`` (call inside ``with launch``)."""
    launch(
        sc.kernel(launch, "ht_ins2_gather"),
        b.n_blocks,
        rt.BLOCK,
        (sc.rep_of, rep_rows, b.n, rows, inserted, None),
    )


def _pins(
    table: TableLayout, pinned_rows: torch.Tensor | None, dev: torch.device
) -> tuple[torch.Tensor | None, int]:
    """:func:`_pin_mode` of the rows ``pinned_rows`` (made a [capacity] bool mask)."""
    if table.score_strategy is ScoreStrategy.NO_EVICTION or pinned_rows is None:
        return _pin_mode(table, None)
    pinned = torch.zeros(table.capacity, dtype=torch.bool, device=dev)
    # index_fill_ takes the value as a scalar: an index_put_ of True copies it from the host,
    # a host sync (two a training step: the table's and the counter's full buckets)
    pinned.index_fill_(0, pinned_rows.to(dev), True)
    return _pin_mode(table, pinned)


def _pin_mode(table: TableLayout, pinned: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    """(pinned [capacity] bool or None, mode) for ``ht_ins2_over``: mode 0 nothing pinned, 1
    the rows of ``pinned``, 2 every stored entry (NO_EVICTION)."""
    if table.score_strategy is ScoreStrategy.NO_EVICTION:
        return None, 2
    return (None, 0) if pinned is None else (pinned.contiguous(), 1)


def _overflow(
    table: TableLayout,
    b: _Batch,
    launch: rt.Launcher,
    sc: _Scratch,
    over: torch.Tensor,
    over_new: int,
    pinned_rows: torch.Tensor | None,
    rep_rows: torch.Tensor,
    rows: torch.Tensor,
    inserted: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The full buckets ``over`` [n_o] (ascending; ``over_new`` new pairs in all) on the kernels
    (kernels.cu ``ht_ins2_over``: the torch backend's ``insert_overflow``, bit for bit), then
    ``ht_ins2_gather`` and ``ht_ins2_over_list``, and one host read (evicted, refused, added):
    (evicted keys, evicted table ids, refused). Without ``b.exact`` no read: ``over_new``
    entries each (the evicted ones, then -1) and refused -1, the counts deferred to the table
    (:func:`_overflowed_later`; ``sc.host`` is next written after ``_scratch_of`` settled them).
    Call inside ``with launch`` (the kernel's shared memory allowed)."""
    dev, n_over = b.dev, over.numel()
    pinned, pin_mode = _pins(table, pinned_rows, dev)
    ev_key = torch.empty(over_new, dtype=torch.int64, device=dev)  # at most one a new pair
    ev_tid = torch.empty(over_new, dtype=torch.int64, device=dev)
    ev_meta = torch.empty(2, n_over, dtype=torch.int64, device=dev)  # (start, count) a bucket
    stats = sc.stats_of[1 - sc.parity]  # this call's: ht_ins2_write flipped the parity
    pins = (pinned, pin_mode)
    args = _over_args(table, b, sc, over, pins, rep_rows, (ev_key, ev_tid, ev_meta), stats)
    smem = _over_smem(b.bc, b.S)
    launch(sc.kernel(launch, "ht_ins2_over"), n_over, _over_threads(b.bc), args, smem)
    _gather(b, launch, sc, rep_rows, rows, inserted)
    return _list_evicted(table, b, launch, sc, stats, over_new, ev_meta, (ev_key, ev_tid))


def _over_args(
    table: TableLayout,
    b: _Batch,
    sc: _Scratch,
    over: torch.Tensor,
    pins: tuple[torch.Tensor | None, int],
    rep_rows: torch.Tensor,
    evicted: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    stats: torch.Tensor,
) -> tuple[Any, ...]:
    """The arguments of ``ht_ins2_over`` (SIGNATURES order) for the list ``over`` [n_o]:
    ``pins`` (pinned, mode) of :func:`_pins`, ``evicted`` (ev_key, ev_tid, ev_meta [2, n_o])."""
    ev_key, ev_tid, ev_meta = evicted
    return (
        over,
        b.bc,
        b.S,
        sc.stage,
        sc.nnew,
        b.keys,
        b.tids,
        b.has_t,
        b.scores,
        b.values,
        b.acc_in,
        int(b.acc_in is not None),
        table.initial_accumulator_value,
        b.dim,
        int(b.vec4),
        *pins,
        table._sentinel,
        table._bucket_count,
        table._slot_fp,
        table._slot_row,
        table._row_key,
        table._row_tid,
        table._row_score,
        table._values,
        b.acc_out,
        int(b.acc_out is not None),
        rep_rows,
        ev_key,
        ev_tid,
        ev_meta,
        over.numel(),
        stats,
    )


def _list_evicted(
    table: TableLayout,
    b: _Batch,
    launch: rt.Launcher,
    sc: _Scratch,
    stats: torch.Tensor,
    over_new: int,
    ev_meta: torch.Tensor,
    evicted_by_bucket: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """:func:`_overflow`'s end: ``ht_ins2_over_list`` orders the evicted keys and table ids
    (``ev_meta`` [2, n_o]: each bucket's start and count in ``evicted_by_bucket``), then the
    host read of ``stats`` (or, without ``b.exact``, its deferral): _overflow's result."""
    dev, n_over = b.dev, ev_meta.shape[1]
    ev_key, ev_tid = evicted_by_bucket
    ends = torch.cumsum(ev_meta[1], 0)
    # [2, over_new]: keys, table ids; ht_ins2_over_list writes the first `evicted` entries of
    # each, the rest stays padding (-1) where the caller takes it (not b.exact)
    out = torch.empty(2, over_new, dtype=torch.int64, device=dev)
    if not b.exact:
        out.fill_(-1)
    out_key, out_tid = out[0], out[1]
    launch(
        sc.kernel(launch, "ht_ins2_over_list"),
        rt.blocks(32 * n_over),
        rt.BLOCK,
        (n_over, ev_meta, ends, ev_key, ev_tid, out_key, out_tid),
    )
    launch.to_host(sc.host, stats, sc.event)
    if not b.exact:  # padded with -1: nothing read now, the counts settled later
        table._defer(_overflowed_later(sc.host, sc.event))
        return out_key, out_tid, -1
    sc.event.synchronize()
    evicted, refused, added = sc.host[ST_OV_EVICTED : ST_OV_ADDED + 1].tolist()
    table._size += added
    table.evictions += evicted
    table.refusals += refused
    return out_key[:evicted], out_tid[:evicted], refused


# ------------------------------------------------------------- insert of a captured training step


def insert_selected(
    table: TableLayout,
    keys: torch.Tensor,
    table_ids: torch.Tensor | None,
    values: torch.Tensor,
    scores: torch.Tensor,
    mask: torch.Tensor,
    pinned: torch.Tensor | None,
) -> SelectedInsert | None:
    """Insert the keys ``keys[i]`` where ``mask[i]`` (distinct valid pairs absent from the
    table, fewer than ``2 * bucket_capacity`` selected in a bucket: the staging list) with
    ``values``, ``scores`` and fresh accumulators into ``table``, at its max capacity, with
    static shapes and no host read: the insert of a captured training step
    (:func:`shared.hashtable.static_insert.insert_absent` selects the keys). ``pinned``
    [capacity] bool: rows never evicted.

    The kernels of :func:`insert_or_assign`: stage (with the mask), place pass 0 (at max
    capacity it decides alone), ``ht_ins2_over`` with a block for every bucket (the list of
    full buckets padded with -1 past its device count: those blocks return at once) and
    ``ht_ins2_gather``; no ``ht_ins2_write`` (no selected key is stored: there is nothing to
    assign). The scratch is left as found, both stats buffers zero. None where the kernels
    cannot take the call (:func:`_batch_of`, shared memory): nothing launched."""
    if table.num_buckets != table._max_buckets:
        return None
    b = _batch_of(table, keys, values, scores, table_ids, None)
    if b is None:
        return None
    mask = mask.contiguous()  # stage and gather read it as bytes
    launch = rt.Launcher(b.dev)
    with launch:
        warps = _block_warps(launch, ("ht_ins2_place0",), b.stride, PLACE_WARPS)
        over_smem = _over_smem(b.bc, b.S)
        if warps == 0 or not _block_warps(launch, ("ht_ins2_over",), over_smem, 1):
            return None
        sc = _static_scratch(table)
        staged = _stage_and_place(table, b, launch, sc, mask, warps)
        stats, rows, inserted, rep_of, rep_rows = staged
        n, nb, dev = b.n, b.nb, b.dev
        over = torch.where(torch.arange(nb, device=dev) < stats[ST_N_OVER], sc.over_list, -1)
        ev = torch.empty(2, n, dtype=torch.int64, device=dev)  # keys, table ids: one a new pair
        ev_meta = torch.empty(2, nb, dtype=torch.int64, device=dev)
        pins = _pin_mode(table, pinned)
        evicted = (ev[0], ev[1], ev_meta)
        args = _over_args(table, b, sc, over, pins, rep_rows, evicted, stats)
        launch(sc.kernel(launch, "ht_ins2_over"), nb, _over_threads(b.bc), args, over_smem)
        launch(
            sc.kernel(launch, "ht_ins2_gather"),
            b.n_blocks,
            rt.BLOCK,
            (rep_of, rep_rows, n, rows, inserted, mask),
        )
    added = stats[ST_NEW] - stats[ST_OVER_NEW] + stats[ST_OV_ADDED]
    counts = torch.stack([added, stats[ST_OV_EVICTED], stats[ST_OV_REFUSED]])
    failed = (stats[ST_STAGED_OVER] | stats[ST_NEG_KEY] | stats[ST_BAD_TID]) != 0
    tids = torch.where(torch.arange(n, device=dev) < stats[ST_OV_EVICTED], ev[1], -1)
    sc.stats.zero_()  # queued after every read of this call's stats
    sc.dirty = False
    if table_ids is not None:
        table._any_tid = True  # a superset of the torch rule (new stored pairs): always safe
    return SelectedInsert(rows, inserted.view(torch.bool), counts, tids, failed)


def _static_scratch(table: TableLayout) -> _Scratch:
    """The table's scratch for :func:`insert_selected`: :func:`_scratch_of` without its host
    work (no pending counts settled, no stream synchronized: a captured call may do neither;
    its buffers are device-only, the pinned ones untouched)."""
    sc = _table_scratch(table)
    if sc.dirty:
        sc.clear()
    return sc


def _stage_and_place(
    table: TableLayout,
    b: _Batch,
    launch: rt.Launcher,
    sc: _Scratch,
    mask: torch.Tensor,
    warps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`insert_selected`'s stage (the keys of ``mask``) and place pass 0 on the first
    stats buffer: (stats, rows [n] int64, inserted [n] uint8, rep_of [n] int32, rep_rows [n]
    int64 all -1)."""
    n, dev = b.n, b.dev
    # the call's own (not the scratch's, which grows: a graph would keep writing to the freed
    # buffer), defined for every key: gather reads it for selected keys only
    rep_of = torch.zeros(n, dtype=torch.int32, device=dev)
    sc.stats.zero_()  # the last call's buffer too (ht_ins2_write clears it only at the next)
    stats = sc.stats_of[0]
    rows = torch.empty(n, dtype=torch.int64, device=dev)
    inserted = torch.empty(n, dtype=torch.uint8, device=dev)
    rep_rows = torch.full((n,), -1, dtype=torch.int64, device=dev)
    sc.dirty = True
    stage_args = (*_stage_args(table, b, sc, stats, rows, inserted)[:-1], mask)
    launch(sc.kernel(launch, f"ht_ins2_stage_w{window(table)}"), b.n_blocks, rt.BLOCK, stage_args)
    grid, block, smem = math.ceil(b.nb / warps), 32 * warps, warps * b.stride
    place_args = _place_args(table, b, sc, stats, rows, inserted, rep_of)
    launch(sc.kernel(launch, "ht_ins2_place0"), grid, block, place_args, smem)
    return stats, rows, inserted, rep_of, rep_rows


# ---------------------------------------------------------------------------------------- erase


def erase(
    table: TableLayout, keys: torch.Tensor, table_ids: torch.Tensor | None, *, count: bool = True
) -> tuple[bool, int | None]:
    """(True, what the torch backend's ``erase`` returns for the same call), with the same table
    afterwards; (False, None), the table untouched, where the torch algorithms must do it (2**31
    keys or more, buckets too large for shared memory).

    ``count=False`` (``HashTable.erase``'s: valid keys promised): (True, None) without a host
    sync; the stats go to the scratch's pinned ``erase_host`` with ``erase_event``, and the
    erased count reaches the size when it is next read (``table._defer``, :func:`_erased_later`).
    """
    keys, tids = table._prepare(keys, table_ids, ERASE_WHAT, validate=False)
    n = keys.numel()
    if n == 0:
        return True, 0 if count else None
    if n >= 1 << 31:
        return False, None
    keys = keys.contiguous()
    tids = None if tids is None else tids.contiguous()
    stride = _erase_stride(table.bucket_capacity)
    launch = rt.Launcher(table.device)
    with launch:
        warps = _block_warps(launch, ("ht_erase_apply",), stride, ERASE_WARPS)
        if warps == 0:
            return False, None
        sc = _scratch_of(table, launch)
        host, event = (sc.host, sc.event) if count else (sc.erase_host, sc.erase_event)
        _launch_erase(table, keys, tids, launch, sc, (warps, stride), host, event)
    if not count:
        table._defer(_erased_later(host, event))
        return True, None
    event.synchronize()  # the marks are counted; the apply may still run
    st = host.tolist()
    if st[ER_NEG_KEY] or st[ER_BAD_TID]:
        table._prepare(keys, tids, ERASE_WHAT)  # raises the torch backend's error
        return False, None
    erased = st[ER_ERASED]
    table._size -= erased
    return True, erased


def _erased_later(host: torch.Tensor, event: Any) -> Callable[[], Counts]:
    """The size change of an erase whose stats are being copied to ``host`` (then ``event``):
    what ``table._defer`` takes. Called when the size is next needed, long after the copy."""

    def count() -> Counts:
        event.synchronize()
        neg, bad, erased = host[: ER_ERASED + 1].tolist()
        # HashTable.erase(count=False)'s contract; the kernels kept the table as it was
        assert not (neg or bad), f"{ERASE_WHAT}(count=False) was given invalid keys"
        return Counts(-erased)

    return count


def _overflowed_later(host: torch.Tensor, event: Any) -> Callable[[], Counts]:
    """The changes of an ``ht_ins2_over`` call whose stats are being copied to ``host`` (then
    ``event``): (added, evicted, refused), what ``table._defer`` takes."""

    def counts() -> Counts:
        event.synchronize()
        evicted, refused, added = host[ST_OV_EVICTED : ST_OV_ADDED + 1].tolist()
        return Counts(added, evicted, refused)

    return counts


def _launch_erase(
    table: TableLayout,
    keys: torch.Tensor,
    tids: torch.Tensor | None,
    launch: rt.Launcher,
    sc: _Scratch,
    blocks: tuple[int, int],
    host: torch.Tensor,
    event: Any,
) -> None:
    """Queue ``ht_erase_mark`` (its stats then copied to pinned ``host``, ``event`` after the
    copy) and ``ht_erase_apply`` (``blocks``: its warps a block and shared memory a warp)."""
    nb, bc, n = table.num_buckets, table.bucket_capacity, keys.numel()
    warps, stride = blocks
    stats, stats_next = sc.stats_of[sc.parity], sc.stats_of[1 - sc.parity]
    sc.dirty = True
    launch(
        sc.kernel(launch, f"ht_erase_mark_w{window(table)}"),
        rt.blocks(n),
        rt.BLOCK,
        (
            keys,
            tids,
            int(tids is not None),
            n,
            table._slot_fp,
            table._slot_row,
            table._row_key,
            table._row_tid,
            table._bucket_count,
            nb,
            bc,
            table.capacity,
            int(tids is not None or table._any_tid),
            sc.win,
            sc.scount,
            sc.over_list,
            stats,
        ),
    )
    launch.to_host(host, stats, event)
    launch(
        sc.kernel(launch, "ht_erase_apply"),
        math.ceil(min(n, nb) / warps),  # at most one bucket listed per distinct key
        32 * warps,
        (
            bc,
            stride,
            sc.scount,
            sc.win,
            sc.over_list,
            stats,
            stats_next,
            table._sentinel,
            table._bucket_count,
            table._slot_fp,
            table._slot_row,
            table._row_key,
            table._row_tid,
            table._row_score,
        ),
        warps * stride,
    )
    sc.parity ^= 1  # ht_erase_apply cleared the other buffer
    sc.dirty = False


def _overflow_torch(
    table: TableLayout,
    core: TorchBackend,
    over: torch.Tensor,
    keys: torch.Tensor,
    tids: torch.Tensor | None,
    values: torch.Tensor,
    scores: torch.Tensor,
    accumulators: torch.Tensor | None,
    pinned_rows: torch.Tensor | None,
    stage: torch.Tensor,
    nnew: torch.Tensor,
    rep_rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Buckets whose new keys do not fit, where ``ht_ins2_over`` cannot take them (shared
    memory): ``core.insert_overflow`` on their new pairs (``over`` [n_o]: the buckets,
    ascending), in its order (bucket, then fingerprint); fills ``rep_rows``."""
    dev, nb = table.device, table.num_buckets
    S = stage.numel() // nb
    staged = stage.view(nb, S)[over]  # [n_o, S]: new pairs of each bucket, in order
    reps = staged[torch.arange(S, device=dev) < nnew[over][:, None]].to(torch.int64)  # [m]
    k = keys[reps]
    t = None if tids is None else tids[reps]
    fp = core.fingerprint(k, t)
    pinned = None
    if pinned_rows is not None:
        pinned = torch.zeros(table.capacity, dtype=torch.bool, device=dev)
        pinned.index_fill_(0, pinned_rows.to(dev), True)  # as _pins: no host sync
    rows = torch.full_like(reps, -1)
    ek, et, refused = core.insert_overflow(
        table,
        torch.arange(reps.numel(), device=dev),
        fp,
        bucket_of(fp, nb),
        k,
        t,
        values[reps],
        scores[reps],
        None if accumulators is None else accumulators[reps],
        pinned,
        rows,
    )
    rep_rows[reps] = rows
    return ek, et, refused
