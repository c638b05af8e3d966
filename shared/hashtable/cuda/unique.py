"""The unique of (table id, key) pairs on CUDA (``unique.cu``; the CUDA backend's
``unique_pairs``): :func:`shared.hashtable.hashing.unique_pairs`'s tensors from its stable sorts
and three kernels.

The torch code takes some thirty ops around its sorts (rolls, compares, a cumsum, a stack for the
host read, two searchsorted, a scatter). Here, after the same ``torch.sort`` calls, one kernel
gathers the table ids in key order (fused tables only), one writes the run flags (and the
composed order), a ``torch.cumsum`` numbers the runs, one host read takes the unique count and
whether a key is negative together, and one kernel writes starts, run ends and inverse (a
subtraction makes the ends counts). The GPU tests compare every tensor with the torch code's.
"""

from __future__ import annotations

import torch

from shared.hashtable.cuda import runtime as rt
from shared.hashtable.hashing import NegativeKeyError

SOURCE: rt.Source = ("unique.cu", ())
MAX_GRID = 1 << 16  # blocks of a launch; the kernels loop over the rest
SIGNATURES = {"uq_gather_tid": "pppq", "uq_flags": "pppppppiq", "uq_runs": "pppppq"}
NEGATIVE = 1 << 62  # uq_flags' mark of a negative key, in the cumsum's last element


def supports(keys: torch.Tensor, table_ids: torch.Tensor | None) -> bool:
    """Whether :func:`unique_pairs` takes these tensors (else the torch code does): 1-D int64
    keys on CUDA, at least one, with int64 table ids of their shape on their device or none."""
    if not (keys.is_cuda and keys.dtype == torch.int64 and keys.dim() == 1 and keys.numel()):
        return False
    return table_ids is None or (
        table_ids.dtype == torch.int64
        and table_ids.shape == keys.shape
        and table_ids.device == keys.device
    )


def _launch(name: str, n: int, args: tuple[object, ...], device: torch.device) -> None:
    grid = min(rt.blocks(n), MAX_GRID)
    rt.launch(name, SIGNATURES[name], grid, rt.BLOCK, args, device=device, source=SOURCE)


def unique_pairs(
    keys: torch.Tensor, table_ids: torch.Tensor | None, *, reject_negative: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """As :func:`shared.hashtable.hashing.unique_pairs` (tensors :func:`supports` takes): the
    same ``(order, starts, counts, inverse, group)``, one host synchronisation."""
    dev, n = keys.device, keys.numel()
    keys = keys.contiguous()
    by_key = torch.sort(keys, stable=True)
    korder, ksorted = by_key.indices, by_key.values
    flags = torch.empty(n + 1, dtype=torch.int64, device=dev)  # [n] run flags, then the sign
    if table_ids is None:
        none64 = rt.dummy(dev, torch.int64)
        order = korder
        flag_args = (none64, ksorted, korder, none64, rt.dummy(dev, torch.int32), none64)
        has_tids = 0
    else:
        tid32 = torch.empty(n, dtype=torch.int32, device=dev)
        _launch("uq_gather_tid", n, (table_ids.contiguous(), korder, tid32, rt.i64(n)), dev)
        by_tid = torch.sort(tid32, stable=True)
        order = torch.empty_like(korder)
        flag_args = (keys, ksorted, korder, by_tid.indices, by_tid.values, order)
        has_tids = 1
    _launch("uq_flags", n, (*flag_args, flags, rt.i32(has_tids), rt.i64(n)), dev)
    total = torch.cumsum(flags, 0)  # [n + 1]: group, then group[n - 1] + the sign mark
    last = int(total[n])  # the one host sync
    if reject_negative and last & NEGATIVE:
        raise NegativeKeyError("negative key")
    n_unique = (last & (NEGATIVE - 1)) + 1
    group = total[:n]
    starts = torch.empty(n_unique, dtype=torch.int64, device=dev)
    counts = torch.empty(n_unique, dtype=torch.int64, device=dev)  # run ends, then counts
    inverse = torch.empty(n, dtype=torch.int64, device=dev)
    _launch("uq_runs", n, (group, order, starts, counts, inverse, rt.i64(n)), dev)
    counts.sub_(starts)
    return order, starts, counts, inverse, group
