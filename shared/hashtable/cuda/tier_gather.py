"""The rows of a two-tier read-only table in one launch (``tier_gather.cu``): serving's cached
dynamic tables (:mod:`serve.tiers`).

Each looked-up position has a row (-1: no key); a row with an HBM line is read from the HBM
matrix of hot rows, any other straight from the host tier through its device-mapped pointer
(UVA: :meth:`shared.hashtable.host_store.TensorHostStore.device_pointer`), whose address the
kernel reads from a device cell, so that a captured graph reads whichever rows the cell names
(serve.tiers swaps a version's rows so, copy-on-write). One thread per 16
bytes of a row (``float4`` loads when the dim is a multiple of 4): vectorized row reads, not
element-wise ones, which reach only 44M rows/s from pinned memory on the H100 here (issue #52).
The launch is one kernel on torch's current stream with no host read, so a CUDA graph captures
it; the values are copied, never computed, so the rows equal an all-in-HBM gather bit for bit.
"""

from __future__ import annotations

import torch

from shared.hashtable.cuda import runtime as rt

SOURCE: rt.Source = ("tier_gather.cu", ())
SIGNATURES = {"tg_gather4": "pppppqi", "tg_gather1": "pppppqi"}
MAX_GRID = 1 << 16  # blocks of a launch; the threads loop over the rest


def gather(
    hot: torch.Tensor,
    host_at: torch.Tensor,
    rows: torch.Tensor,
    line_of_row: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``out[i] = hot[line_of_row[rows[i]]]`` where that line is >= 0, the host tier's row
    ``rows[i]`` (at the device address ``host_at[0]``, [capacity, dim] float32) where it is -1,
    zeros where ``rows[i]`` is -1. ``hot`` [H, dim] and ``out`` [N, dim] float32, ``host_at``
    [1] int64, ``rows`` [N] int64, ``line_of_row`` [capacity] int32, all contiguous on one
    CUDA device."""
    n, dim = out.shape
    if n == 0:
        return
    vec = 4 if dim % 4 == 0 else 1
    name = f"tg_gather{vec}"
    threads = n * (dim // vec)
    rt.launch(
        name,
        SIGNATURES[name],
        min(rt.blocks(threads), MAX_GRID),
        rt.BLOCK,
        [hot, host_at, rows, line_of_row, out, rt.i64(n), rt.i32(dim)],
        device=out.device,
        source=SOURCE,
    )
