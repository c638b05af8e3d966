"""A find on CUDA (the CUDA backend's ``find``): one thread per key (kernels.cu ``ht_find``).

A call allocates ``rows``/``found`` and launches ``ht_find`` through ``runtime.Launcher``
(``cuLaunchKernel`` from a parameter buffer, the tensors as data pointers): no DLPack export per
call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from shared.hashtable.cuda import runtime as rt

if TYPE_CHECKING:
    from shared.hashtable.layout import TableLayout


# ``ht_find``'s parameter types for runtime.Kernel (checked against kernels.cu by the tests)
SIGNATURES = {"ht_find": "ppiqpppppqqqipp"}


def window(table: TableLayout, requested: int | None = None) -> int:
    """Slots a probe reads at once: ``requested`` (default :data:`runtime.DEFAULT_WINDOW`), or
    0 (binary search) where 16-byte loads are not possible (odd or tiny capacity, unaligned)."""
    w = rt.DEFAULT_WINDOW if requested is None else requested
    if w not in rt.FIND_WINDOWS:
        raise ValueError(f"find window {w} is not one of the compiled {rt.FIND_WINDOWS}")
    cap = table.capacity
    if w and (cap % 2 or cap < w or table._slot_fp.data_ptr() % 16):
        return 0
    return w


def _find_args(
    table: TableLayout,
    keys: torch.Tensor,
    table_ids: torch.Tensor | None,
    rows: torch.Tensor,
    found: torch.Tensor,
) -> tuple[object, ...]:
    """``ht_find``'s arguments (``keys``/``table_ids`` contiguous)."""
    dev = table.device
    return (
        keys,
        rt.dummy(dev, torch.int64) if table_ids is None else table_ids,
        table_ids is not None,
        keys.numel(),
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
    )


def find(
    table: TableLayout,
    keys: torch.Tensor,
    table_ids: torch.Tensor | None,
    *,
    probe_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [N] int64, -1 where missing; found [N] bool), equal to the torch backend's.

    ``keys``/``table_ids`` are validated int64 tensors on the table's device (``_prepare``).
    """
    dev, n = table.device, keys.numel()
    rows = torch.empty(n, dtype=torch.int64, device=dev)
    found = torch.empty(n, dtype=torch.bool, device=dev)  # the kernel writes bool
    if n == 0:
        return rows, found
    # the contiguous copies (if any) stay referenced here until the launch is queued
    k = keys.contiguous()
    tids = None if table_ids is None else table_ids.contiguous()
    launch = rt.Launcher(dev)
    with launch:
        kernel = launch.kernel(f"ht_find<{window(table, probe_window)}>", SIGNATURES["ht_find"])
        launch(kernel, rt.blocks(n), rt.BLOCK, _find_args(table, k, tids, rows, found))
    return rows, found


def prepared_find(
    table: TableLayout, keys: torch.Tensor, *, probe_window: int | None = None
) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """(launch, rows, found): the find kernel on fixed arguments (``runtime.prepared``); each
    call of ``launch`` refills ``rows``/``found`` (benchmarks time the kernel alone with it)."""
    dev, n = table.device, keys.numel()
    rows = torch.empty(n, dtype=torch.int64, device=dev)
    found = torch.empty(n, dtype=torch.bool, device=dev)
    run = rt.prepared(
        f"ht_find<{window(table, probe_window)}>",
        SIGNATURES["ht_find"],
        rt.blocks(n),
        rt.BLOCK,
        _find_args(table, keys.contiguous(), None, rows, found),
        device=dev,
    )
    return run, rows, found
