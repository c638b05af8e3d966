"""A bulk build on CUDA (the CUDA backend's ``build``, for ``HashTable.from_keys_values``): count
+ stage, then one block per bucket places its keys by (fingerprint, input index), the order of
the torch backend's stable sort (no global sort)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from shared.hashtable.cuda import runtime as rt
from shared.hashtable.hashing import check_keys
from shared.hashtable.layout import TableLayout

L = TypeVar("L", bound=TableLayout)

WHAT = "HashTable.from_keys_values"
PLACE_BLOCK = 128
# parameter types for runtime.Kernel (checked against kernels.cu by the tests)
SIGNATURES = {"ht_build_count": "ppiqqqpp", "ht_build_place": "ppipippiiqppppppppp"}


def build(
    sized: Callable[[int, int, bool], L],
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    device: torch.device,
    scores: torch.Tensor | None,
    table_ids: torch.Tensor | None,
    accumulators: torch.Tensor | None,
) -> L | None:
    """The table the torch backend builds from the same arguments (in the empty table that
    ``sized(n, dim, with_accumulator)`` makes), or None where this path does not apply (no
    keys, more than 2**31, buckets too large for shared memory, or duplicate keys: the torch
    backend then builds the table or raises its error)."""
    keys = check_keys(keys.to(device), WHAT, check_sign=False).contiguous()
    n = keys.numel()
    if values.dim() != 2 or values.shape[0] != n:
        raise ValueError(f"{WHAT}: values must be [{n}, dim], got {tuple(values.shape)}")
    if n == 0 or n >= 1 << 31:
        return None
    table = sized(n, values.shape[1], accumulators is not None)
    bc = table.bucket_capacity
    smem = bc * 16  # s_fp (8) + s_idx (4) + s_src (4) per slot
    if smem > rt.MAX_SHARED:
        return None
    tids = None if table_ids is None else table_ids.to(device, torch.int64).contiguous()
    dummy64 = rt.dummy(device, torch.int64)
    key_args = (keys, dummy64 if tids is None else tids, rt.i32(tids is not None))

    nb, count, stage, info = _count_and_stage(keys, tids, key_args, table.num_buckets, bc, device)
    if nb != table.num_buckets:
        table._allocate(nb)
    dup = _place(
        table, nb, key_args, dummy64, values, scores, accumulators, count, stage, smem, device
    )
    if int(dup):
        return None  # the torch backend names the duplicate key
    table._bucket_count = count
    table._size = n
    table._any_tid = tids is not None and bool(info[2])
    table._max_buckets = max(table._max_buckets, nb)
    table.generation = 0
    return table


def _count_and_stage(
    keys: torch.Tensor,
    tids: torch.Tensor | None,
    key_args: tuple[torch.Tensor, torch.Tensor, np.int32],
    nb: int,
    bc: int,
    device: torch.device,
) -> tuple[int, torch.Tensor, torch.Tensor, list[int]]:
    """``ht_build_count`` from ``nb`` buckets, doubling them until none overflows (the torch
    backend's may_exceed_max): (buckets, count [nb] int64, stage [nb * bc] int32: each
    bucket's input indices, info: [fullest bucket, any negative key, any table id]). One host
    sync a try; raises the torch backend's error for a negative key."""
    n = keys.numel()
    while True:
        count = torch.zeros(nb, dtype=torch.int64, device=device)
        stage = torch.empty(nb * bc, dtype=torch.int32, device=device)
        rt.launch(
            "ht_build_count",
            SIGNATURES["ht_build_count"],
            rt.blocks(n),
            rt.BLOCK,
            (*key_args, rt.i64(n), rt.i64(nb), rt.i64(bc), count, stage),
            device=device,
        )
        checks = [count.max(), (keys < 0).any()]
        if tids is not None:
            checks.append((tids != 0).any())
        info = torch.stack([c.to(torch.int64) for c in checks]).tolist()  # the one sync
        if info[1]:
            check_keys(keys, WHAT)  # raises the torch backend's error for the negative key
        if info[0] <= bc:
            return nb, count, stage, info
        nb *= 2


def _place(
    table: TableLayout,
    nb: int,
    key_args: tuple[torch.Tensor, torch.Tensor, np.int32],
    dummy64: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor | None,
    accumulators: torch.Tensor | None,
    count: torch.Tensor,
    stage: torch.Tensor,
    smem: int,
    device: torch.device,
) -> torch.Tensor:
    """``ht_build_place``, a block per bucket of ``table`` (``nb``, the counted buckets):
    the staged keys into their slots and rows; dup [1] int32, nonzero where a key repeats."""
    bc, dim = table.bucket_capacity, table.dim
    vals = values.to(device, torch.float32).contiguous()
    acc = None if accumulators is None else accumulators.to(device, torch.float32).contiguous()
    dummy32 = rt.dummy(device, torch.float32)
    dup = torch.zeros(1, dtype=torch.int32, device=device)
    rt.launch(
        "ht_build_place",
        SIGNATURES["ht_build_place"],
        nb,
        PLACE_BLOCK,
        (
            *key_args,
            dummy64 if scores is None else scores.to(device, torch.int64).contiguous(),
            rt.i32(scores is not None),
            vals,
            dummy32 if acc is None else acc,
            rt.i32(acc is not None),
            rt.i32(dim),
            rt.i64(bc),
            count,
            stage,
            table._slot_fp,
            table._row_key,
            table._row_tid,
            table._row_score,
            table._values,
            dummy32 if table._accum is None else table._accum,
            dup,
        ),
        device=device,
        shared_mem=smem,
    )
    return dup
