"""``HashTable.find`` on CUDA: one thread per key (kernels.cu ``ht_find``).

A call allocates ``rows``/``found`` and launches ``ht_find`` through ``runtime.Launcher``
(``cuLaunchKernel`` from a parameter buffer, the tensors as data pointers): no DLPack export per
call. ``runtime.DIRECT_LAUNCH`` False (or no current CUDA context): CuPy's RawKernel call on
DLPack views, as :func:`prepared_find` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from shared.hashtable.cuda import runtime as rt

if TYPE_CHECKING:
    from shared.hashtable.table import HashTable


# ``ht_find``'s parameter types for runtime.Kernel (checked against kernels.cu by the tests)
SIGNATURES = {"ht_find": "ppiqpppppqqqipp"}


def window(table: HashTable, requested: int | None = None) -> int:
    """Slots a probe reads at once: ``requested`` (default :data:`runtime.DEFAULT_WINDOW`), or
    0 (binary search) where 16-byte loads are not possible (odd or tiny capacity, unaligned)."""
    w = rt.DEFAULT_WINDOW if requested is None else requested
    if w not in rt.FIND_WINDOWS:
        raise ValueError(f"find window {w} is not one of the compiled {rt.FIND_WINDOWS}")
    cap = table.capacity
    if w and (cap % 2 or cap < w or table._slot_fp.data_ptr() % 16):
        return 0
    return w


def table_args(table: HashTable) -> tuple[object, ...]:
    """The table part of ``ht_find`` / ``ht_insert_stage``'s arguments."""
    return (
        table._slot_fp,
        table._slot_row,
        table._row_key,
        table._row_tid,
        table._bucket_count,
        rt.i64(table.num_buckets),
        rt.i64(table.bucket_capacity),
        rt.i64(table.capacity),
    )


def table_tensors(table: HashTable) -> tuple[torch.Tensor, ...]:
    """The table's long-lived arrays (their CuPy views are cached)."""
    t = (table._slot_fp, table._slot_row, table._row_key, table._row_tid, table._bucket_count)
    return (*t, table._values) if table._accum is None else (*t, table._values, table._accum)


def _find_args(
    table: HashTable, keys: torch.Tensor, table_ids: torch.Tensor | None, probe_window: int | None
) -> tuple[str, tuple[object, ...], torch.Tensor, torch.Tensor]:
    dev, n = table.device, keys.numel()
    rows = torch.empty(n, dtype=torch.int64, device=dev)
    found = torch.empty(n, dtype=torch.uint8, device=dev)
    tids = rt.dummy(dev, torch.int64) if table_ids is None else table_ids.contiguous()
    check_tid = table_ids is not None or table._any_tid
    args = (
        keys.contiguous(),
        tids,
        rt.i32(table_ids is not None),
        rt.i64(n),
        *table_args(table),
        rt.i32(check_tid),
        rows,
        found,
    )
    return f"ht_find<{window(table, probe_window)}>", args, rows, found


def find(
    table: HashTable,
    keys: torch.Tensor,
    table_ids: torch.Tensor | None,
    *,
    probe_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [N] int64, -1 where missing; found [N] bool), equal to the torch core's.

    ``keys``/``table_ids`` are validated int64 tensors on the table's device (``_prepare``).
    """
    n = keys.numel()
    if n and rt.DIRECT_LAUNCH:
        launch = rt.Launcher(table.device)
        with launch:
            if launch.direct:
                return _find_direct(launch, table, keys, table_ids, probe_window)
    name, args, rows, found = _find_args(table, keys, table_ids, probe_window)
    if n:
        rt.launch(
            name,
            rt.blocks(keys.numel()),
            rt.BLOCK,
            args,
            device=table.device,
            cached=table_tensors(table),
        )
    return rows, found.view(torch.bool)


def _find_direct(
    launch: rt.Launcher,
    table: HashTable,
    keys: torch.Tensor,
    table_ids: torch.Tensor | None,
    probe_window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`find` through ``launch`` (inside its ``with``; ``keys`` not empty)."""
    dev, n = table.device, keys.numel()
    rows = torch.empty(n, dtype=torch.int64, device=dev)
    found = torch.empty(n, dtype=torch.bool, device=dev)  # the kernel writes bool
    # the contiguous copies (if any) stay referenced here until the launch is queued
    k = keys.contiguous()
    tids = rt.dummy(dev, torch.int64) if table_ids is None else table_ids.contiguous()
    kernel = launch.kernel(f"ht_find<{window(table, probe_window)}>", SIGNATURES["ht_find"])
    launch(
        kernel,
        rt.blocks(n),
        rt.BLOCK,
        (
            k,
            tids,
            table_ids is not None,
            n,
            table._slot_fp,
            table._slot_row,
            table._row_key,
            table._row_tid,
            table._bucket_count,
            table.num_buckets,
            table.bucket_capacity,
            table.capacity,
            table_ids is not None or table._any_tid,
            rows,
            found,
        ),
    )
    return rows, found


def prepared_find(
    table: HashTable, keys: torch.Tensor, *, probe_window: int | None = None
) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """(launch, rows, found): the find kernel with its arguments converted once; each call of
    ``launch`` refills ``rows``/``found`` (benchmarks time the kernel alone with it)."""
    name, args, rows, found = _find_args(table, keys, None, probe_window)
    run = rt.prepared(name, rt.blocks(keys.numel()), rt.BLOCK, args, device=table.device)
    return run, rows, found.view(torch.bool)
