"""Row gathers and scatters of a host matrix by the device, through UVA (``host_rows.cu``): the
host tier of a CACHING training storage
(:class:`~shared.hashtable.host_store.TensorHostStore` made with ``mapped``).

The host tier's rows are page-locked and mapped into the device's address space
(``cudaHostRegisterMapped``), so a kernel reads and writes them at
:meth:`~shared.hashtable.host_store.TensorHostStore.device_pointer` directly: no row ids copied
to the host (a device → host sync), no single-threaded CPU ``index_select`` / ``index_copy_``
of the packed rows, no second copy between the pinned buffer and the device. One thread per
16 bytes of a row (``float4`` accesses when the width is a multiple of 4): vectorized row
transfers, not the element-wise reads that reach only 44M rows/s from pinned memory on the
H100 here (issue #52). Each call is one launch on torch's current stream with no host read,
so it orders with torch's work on that stream. Values are copied, never computed: the rows
equal ``index_select`` / ``index_copy_`` on the host bit for bit.

Writes land in host memory when the kernel has run: a CPU-side read of the same rows must come
after a synchronisation (the store does it before any CPU access of its rows).
"""

from __future__ import annotations

import torch

from shared.hashtable.cuda import runtime as rt

SOURCE: rt.Source = ("host_rows.cu", ())
SIGNATURES = {
    "hr_gather4": "pppqi",
    "hr_gather1": "pppqi",
    "hr_scatter4": "ppppqi",
    "hr_scatter1": "ppppqi",
    "hr_swap4": "pppppqi",
    "hr_swap1": "pppppqi",
    "hr_fill4": "pppppppfppqi",
    "hr_fill1": "pppppppfppqi",
}
MAX_GRID = 1 << 16  # blocks of a launch; the threads loop over the rest


def gather(host_pointer: int, rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = host[rows[i]]`` (zeros where ``rows[i]`` < 0) for the ``[capacity, width]``
    float32 host rows at ``host_pointer``. ``rows`` [n] int64 and ``out`` [n, width] float32,
    contiguous on one CUDA device; ``rows`` (>= 0) must be below the host matrix's capacity."""
    _check(rows, out, "out")
    n, width = out.shape
    if n == 0:
        return
    args = [rt.Address(host_pointer), rows, out, rt.i64(n), rt.i32(width)]
    _launch("hr_gather", rows, width, args)


def scatter_int64(host_pointer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
    """:func:`scatter` of int64 ``values`` [n] or [n, k] (rows of k numbers) to host rows of
    int64: each copied as a pair of float32, its bits kept (nothing is computed on them)."""
    numbers = values.reshape(rows.numel(), -1).contiguous()
    scatter(host_pointer, rows, numbers.view(torch.float32))


def scatter(
    host_pointer: int,
    rows: torch.Tensor,
    payload: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> None:
    """``host[rows[i]] = payload[i]`` where ``rows[i]`` >= 0 and ``mask[i]`` (all, without a
    mask): a masked write-back needs no host read of which rows to write. ``rows`` [n] int64
    (distinct where written), ``payload`` [n, width] float32 and ``mask`` [n] bool, contiguous
    on one CUDA device."""
    _check(rows, payload, "payload")
    n, width = payload.shape
    if mask is not None and (
        mask.dtype != torch.bool or mask.shape != rows.shape or mask.device != rows.device
    ):
        raise ValueError(
            f"host_rows.scatter: mask must be bool [{n}] on {rows.device}, got {mask.dtype} "
            f"{list(mask.shape)} on {mask.device}"
        )
    if n == 0:
        return
    if mask is not None:
        mask = mask.contiguous()
    args = [rt.Address(host_pointer), rows, payload, mask, rt.i64(n), rt.i32(width)]
    _launch("hr_scatter", rows, width, args)


def swap(
    host_pointer: int,
    write_rows: torch.Tensor,
    out: torch.Tensor,
    read_rows: torch.Tensor,
    into: torch.Tensor,
) -> None:
    """``host[write_rows[i]] = out[i]`` where ``write_rows[i]`` >= 0, and ``into[i] =
    host[read_rows[i]]`` (zeros where < 0), in one pass: the writes (posted) and the reads
    cross PCIe at the same time instead of one launch after the other. The rows read must not
    be among the rows written (distinct rows written). ``write_rows`` and ``read_rows`` [n]
    int64, ``out`` and ``into`` [n, width] float32, contiguous on one CUDA device."""
    _check(write_rows, out, "out")
    _check(read_rows, into, "into")
    n, width = out.shape
    if into.shape != out.shape or read_rows.device != write_rows.device:
        raise ValueError(
            f"host_rows.swap: out and into must be alike on one device, got {list(out.shape)} "
            f"on {out.device} and {list(into.shape)} on {into.device}"
        )
    if n == 0:
        return
    args = [rt.Address(host_pointer), write_rows, out, read_rows, into, rt.i64(n), rt.i32(width)]
    _launch("hr_swap", write_rows, width, args)


def fill_slots(
    host_pointer: int,
    back: torch.Tensor | None,
    read: torch.Tensor | None,
    slots: torch.Tensor,
    fresh: torch.Tensor | None,
    init: torch.Tensor | None,
    initial: float,
    values: torch.Tensor,
    accum: torch.Tensor,
    *,
    order: torch.Tensor | None = None,
) -> None:
    """A cache's device slots take their payload in place, in one launch: for each ``i`` with
    ``slots[i]`` >= 0, ``host[back[i]] = (values | accum)[slots[i]]`` where ``back[i]`` >= 0 (the
    slot's old payload written back), then ``values[slots[i]] = init[i]`` and ``accum[slots[i]]
    = initial`` where ``fresh[i]``, else ``(values | accum)[slots[i]] = host[read[i]]`` where
    ``read[i]`` >= 0. ``back`` None writes nothing back, ``read`` None reads nothing, ``fresh``
    None (and ``init``) makes nothing new: with ``read`` and ``fresh`` None the slots are only
    written back. The host rows are ``[capacity, 2 * dim]`` (values, then accumulators).
    ``order`` [n] int64 (a permutation of the positions; None: in turn) is the order the
    threads take the positions in: with the rows read and written both ascending along it
    (the static cache pairs them so), neighbouring threads touch neighbouring host pages.

    Equal to :meth:`~shared.hashtable.host_store.HostStore.swap` of the slots' packed payload
    followed by a scatter of the rows read (or ``init``) into the slots, without the staging
    tensors of every position's payload or the scatter of the positions without a slot to a
    sink row (the static resolve's fixed shapes have ``P`` positions, most of them without a
    slot). ``back``, ``read`` and ``slots`` [n] int64 (distinct slots >= 0; rows read not among
    rows written), ``fresh`` [n] bool, ``init`` [n, dim], ``values`` and ``accum`` [*, dim]
    float32, contiguous on one CUDA device."""
    n, dim = slots.numel(), values.shape[-1]
    if (fresh is None) != (init is None):
        raise ValueError("host_rows.fill_slots: pass fresh and init together (or neither)")
    for rows in (t for t in (back, read, slots, order) if t is not None):
        if init is not None and rows is not order:
            _check(rows, init, "init")
        elif not (_ids(rows) and rows.shape == slots.shape and rows.device == slots.device):
            raise ValueError(
                f"host_rows.fill_slots: row ids must be contiguous int64 [{n}] on a CUDA "
                f"device, got {rows.dtype} {list(rows.shape)} on {rows.device}"
            )
    ok = (
        (fresh is None or (fresh.dtype == torch.bool and fresh.shape == slots.shape))
        and all(
            t.device == slots.device and t.is_contiguous() and t.dtype == torch.float32
            for t in (values, accum)
        )
        and values.dim() == accum.dim() == 2
        and values.shape[1] == accum.shape[1] == dim
        and (fresh is None or fresh.device == slots.device)
    )
    if not ok:
        raise ValueError(
            f"host_rows.fill_slots: fresh must be bool [{n}] and values, accum contiguous float32 "
            f"[*, {dim}] on {slots.device}, got fresh {None if fresh is None else fresh.dtype} "
            f"{None if fresh is None else list(fresh.shape)}, values {values.dtype} "
            f"{list(values.shape)}, accum {accum.dtype} {list(accum.shape)}"
        )
    if n == 0 or dim == 0:
        return
    vec = 4 if dim % 4 == 0 else 1  # each half of a host row float4-aligned
    name = f"hr_fill{vec}"
    args = [rt.Address(host_pointer), order, back, read, slots,
            None if fresh is None else fresh.contiguous(), init, rt.f32(initial), values,
            accum, rt.i64(n), rt.i32(dim)]  # fmt: skip
    rt.launch(
        name,
        SIGNATURES[name],
        min(rt.blocks(n * (2 * dim // vec)), MAX_GRID),
        rt.BLOCK,
        args,
        device=slots.device,
        source=SOURCE,
    )


def _check(rows: torch.Tensor, matrix: torch.Tensor, what: str) -> None:
    """The launch's layout: int64 rows [n] and a float32 [n, width] matrix, contiguous on one
    CUDA device (checked on the host: no sync)."""
    ok = (
        _ids(rows)
        and matrix.dtype == torch.float32
        and matrix.dim() == 2
        and matrix.is_contiguous()
        and matrix.shape[0] == rows.numel()
        and matrix.device == rows.device
    )
    if not ok:
        raise ValueError(
            f"host_rows: rows must be contiguous int64 [n] on a CUDA device and {what} "
            f"contiguous float32 [n, width] beside them, got rows {rows.dtype} "
            f"{list(rows.shape)} on {rows.device}, {what} {matrix.dtype} {list(matrix.shape)} "
            f"on {matrix.device}"
        )


def _ids(rows: torch.Tensor) -> bool:
    """Whether ``rows`` are row ids a launch takes: contiguous int64 [n] on a CUDA device."""
    return rows.is_cuda and rows.dtype == torch.int64 and rows.dim() == 1 and rows.is_contiguous()


def _launch(family: str, rows: torch.Tensor, width: int, args: list[object]) -> None:
    """One launch of ``family``'s float4 kernel (width a multiple of 4) or scalar one: a thread
    per 16 bytes (or per float) of each row of ``rows``."""
    vec = 4 if width % 4 == 0 else 1
    name = f"{family}{vec}"
    threads = rows.numel() * (width // vec)
    rt.launch(
        name,
        SIGNATURES[name],
        min(rt.blocks(threads), MAX_GRID),
        rt.BLOCK,
        args,
        device=rows.device,
        source=SOURCE,
    )
