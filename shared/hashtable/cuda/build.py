"""``HashTable.from_keys_values`` on CUDA: count + stage, then one block per bucket places its
keys by (fingerprint, input index), the order of the torch core's stable sort (no global sort)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shared.features import ScoreStrategy
from shared.hashtable.cuda import runtime as rt
from shared.hashtable.hashing import check_keys

if TYPE_CHECKING:
    from shared.hashtable.table import HashTable

WHAT = "HashTable.from_keys_values"
PLACE_BLOCK = 128


def from_keys_values(
    cls: type[HashTable],
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    bucket_capacity: int,
    device: torch.device,
    scores: torch.Tensor | None,
    table_ids: torch.Tensor | None,
    accumulators: torch.Tensor | None,
    max_load_factor: float,
    max_capacity: int | None,
    score_strategy: ScoreStrategy,
) -> HashTable | None:
    """The table the torch core builds from the same arguments, or None where this path does
    not apply (no keys, more than 2**31, buckets too large for shared memory, or duplicate keys:
    the torch core then builds the table or raises its error)."""
    keys = check_keys(keys.to(device), WHAT, check_sign=False).contiguous()
    n = keys.numel()
    if values.dim() != 2 or values.shape[0] != n:
        raise ValueError(f"{WHAT}: values must be [{n}, dim], got {tuple(values.shape)}")
    if n == 0 or n >= 1 << 31:
        return None
    table = cls.sized_for(
        n,
        values.shape[1],
        bucket_capacity=bucket_capacity,
        max_load_factor=max_load_factor,
        max_capacity=max_capacity,
        score_strategy=score_strategy,
        with_accumulator=accumulators is not None,
        device=device,
    )
    bc, dim = table.bucket_capacity, table.dim
    smem = bc * 16  # s_fp (8) + s_idx (4) + s_src (4) per slot
    if smem > rt.MAX_SHARED:
        return None
    tids = None if table_ids is None else table_ids.to(device, torch.int64).contiguous()
    dummy64 = rt.dummy(device, torch.int64)
    key_args = (keys, dummy64 if tids is None else tids, rt.i32(tids is not None))

    nb = table.num_buckets
    while True:  # double the buckets until none overflows (the torch core's may_exceed_max)
        count = torch.zeros(nb, dtype=torch.int64, device=device)
        stage = torch.empty(nb * bc, dtype=torch.int32, device=device)
        rt.launch(
            "ht_build_count",
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
            check_keys(keys, WHAT)  # raises the torch core's error for the negative key
        if info[0] <= bc:
            break
        nb *= 2
    if nb != table.num_buckets:
        table._allocate(nb)

    vals = values.to(device, torch.float32).contiguous()
    acc = None if accumulators is None else accumulators.to(device, torch.float32).contiguous()
    dummy32 = rt.dummy(device, torch.float32)
    dup = torch.zeros(1, dtype=torch.int32, device=device)
    rt.launch(
        "ht_build_place",
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
    if int(dup):
        return None  # the torch core names the duplicate key
    table._bucket_count = count
    table._size = n
    table._any_tid = tids is not None and bool(info[2])
    table._max_buckets = max(table._max_buckets, nb)
    table.generation = 0
    return table
