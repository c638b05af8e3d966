"""``HashTable.insert_or_assign`` on CUDA, giving the torch core's table and result.

1. ``ht_insert_stage`` (a thread per key): locate each key; stored keys mark their row with the
   last input index using it, new keys are staged in their bucket's list.
2. ``ht_insert_plan`` (a block per bucket): deduplicate the staged pairs (the last occurrence
   wins) and order them by (fingerprint, table id, key), the torch core's order. One host sync
   reads what the call needs (new pairs, fullest bucket, errors).
3. If the table would grow, or a bucket received more than twice its capacity of new keys,
   nothing has changed yet and the call returns None: the torch core does it all.
4. ``ht_insert_assign`` writes the stored keys' values and scores; ``ht_insert_merge`` (a block
   per bucket) gives the new keys of the buckets with room their empty slots' rows and merges
   them into the sorted slots; buckets without room (at maximum capacity) go through the torch
   core's ``_insert_overflow`` (eviction by score, NO_EVICTION refusals), unchanged.
5. ``ht_insert_rows`` gathers each input's row and ``inserted`` flag.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shared.hashtable.cuda import runtime as rt
from shared.hashtable.cuda.find import table_args, table_tensors, window
from shared.hashtable.hashing import bucket_of, fingerprint

if TYPE_CHECKING:
    from shared.hashtable.table import HashTable, InsertResult

WHAT = "HashTable.insert_or_assign"
PLAN_BLOCK = 128
STAGE_FACTOR = 2  # staged new keys a bucket may receive, in bucket capacities


def insert_or_assign(
    table: HashTable,
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    *,
    table_ids: torch.Tensor | None,
    accumulators: torch.Tensor | None,
    pinned_rows: torch.Tensor | None,
) -> InsertResult | None:
    """What ``HashTable.insert_or_assign`` returns for the same call, or None (table untouched)
    where the torch core must do it: growth, skewed batches, very large buckets, no keys."""
    from shared.hashtable.table import InsertResult

    dev, bc = table.device, table.bucket_capacity
    keys, tids = table._prepare(keys, table_ids, WHAT, validate=False)
    n = keys.numel()
    if n == 0 or n >= 1 << 31:
        return None
    S = STAGE_FACTOR * bc
    plan_smem, merge_smem = S * 32, bc * 36
    if max(plan_smem, merge_smem) > rt.MAX_SHARED:
        return None
    keys = keys.contiguous()
    values = values.to(dev, torch.float32).reshape(n, table.dim).contiguous()
    scores = scores.to(dev, torch.int64).reshape(n).contiguous()
    if accumulators is not None:
        accumulators = accumulators.to(dev, torch.float32).reshape(n, table.dim).contiguous()
    nb, cap = table.num_buckets, table.capacity
    dummy64, dummy32 = rt.dummy(dev, torch.int64), rt.dummy(dev, torch.float32)
    key_args = (keys, dummy64 if tids is None else tids.contiguous(), rt.i32(tids is not None))
    cached = table_tensors(table)

    counters = torch.zeros(2 * nb + 8, dtype=torch.int64, device=dev)
    scount, nnew, stats = counters[:nb], counters[nb : 2 * nb], counters[2 * nb :]
    row_found = torch.empty(n, dtype=torch.int64, device=dev)
    win = torch.full((cap,), -1, dtype=torch.int32, device=dev)
    stage = torch.empty(nb * S, dtype=torch.int32, device=dev)
    rep_of = torch.empty(n, dtype=torch.int32, device=dev)
    rt.launch(
        f"ht_insert_stage<{window(table)}>",
        rt.blocks(n),
        rt.BLOCK,
        (
            *key_args,
            rt.i64(n),
            *table_args(table),
            rt.i32(tids is not None or table._any_tid),
            rt.i64(S),
            row_found,
            win,
            scount,
            stage,
            stats,
        ),
        device=dev,
        cached=cached,
    )
    rt.launch(
        "ht_insert_plan",
        nb,
        PLAN_BLOCK,
        (*key_args, rt.i64(S), scount, stage, table._bucket_count, rt.i64(bc), rep_of, nnew, stats),
        device=dev,
        shared_mem=plan_smem,
        cached=cached,
    )
    staged_over, neg_key, bad_tid, new_tid, total_new, max_fill, n_over, over_new = (
        stats.tolist()  # the one host sync of the call
    )
    if neg_key or bad_tid:
        table._prepare(keys, tids, WHAT)  # raises the torch core's error
    grows = table.num_buckets < table._max_buckets and (
        table._size + total_new > table.max_load_factor * nb * bc or max_fill > bc
    )
    if grows or staged_over:
        return None

    has_acc = accumulators is not None and table._accum is not None
    rt.launch(
        "ht_insert_assign",
        rt.blocks(n),
        rt.BLOCK,
        (
            row_found,
            win,
            rt.i64(n),
            values,
            scores,
            accumulators if has_acc else dummy32,
            rt.i32(has_acc),
            rt.i32(table.dim),
            table._values,
            table._row_score,
            table._accum if has_acc else dummy32,
        ),
        device=dev,
        cached=cached,
    )
    rep_rows = torch.full((n,), -1, dtype=torch.int64, device=dev)
    # buckets without room, decided before the merge changes the counts of the others
    over = (
        torch.nonzero((nnew > 0) & (table._bucket_count + nnew > bc)).squeeze(1) if n_over else None
    )
    if total_new > over_new:
        rt.launch(
            "ht_insert_merge",
            nb,
            PLAN_BLOCK,
            (
                *key_args,
                values,
                scores,
                dummy32 if accumulators is None else accumulators,
                rt.i32(accumulators is not None),
                rt.f32(table.initial_accumulator_value),
                rt.i32(table.dim),
                rt.i64(bc),
                rt.i64(S),
                stage,
                nnew,
                table._bucket_count,
                table._slot_fp,
                table._slot_row,
                table._row_key,
                table._row_tid,
                table._row_score,
                table._values,
                dummy32 if table._accum is None else table._accum,
                rt.i32(table._accum is not None),
                rep_rows,
            ),
            device=dev,
            shared_mem=merge_smem,
            cached=cached,
        )
        table._size += total_new - over_new
    if new_tid:
        table._any_tid = True
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    evicted_k, evicted_t, refused = empty, empty, 0
    if over is not None:
        evicted_k, evicted_t, refused = _overflow(
            table,
            over,
            keys,
            tids,
            values,
            scores,
            accumulators,
            pinned_rows,
            stage,
            nnew,
            rep_rows,
        )

    rows = torch.empty(n, dtype=torch.int64, device=dev)
    inserted = torch.empty(n, dtype=torch.uint8, device=dev)
    rt.launch(
        "ht_insert_rows",
        rt.blocks(n),
        rt.BLOCK,
        (row_found, rep_of, rep_rows, rt.i64(n), rows, inserted),
        device=dev,
    )
    return InsertResult(rows, inserted.view(torch.bool), evicted_k, evicted_t, refused)


def _overflow(
    table: HashTable,
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
    """Buckets whose new keys do not fit: the torch core's ``_insert_overflow`` on their new
    pairs (``over`` [n_o]: the buckets, ascending), in its order (bucket, then fingerprint);
    fills ``rep_rows``."""
    dev, nb = table.device, table.num_buckets
    S = stage.numel() // nb
    staged = stage.view(nb, S)[over]  # [n_o, S]: new pairs of each bucket, in order
    reps = staged[torch.arange(S, device=dev) < nnew[over][:, None]].to(torch.int64)  # [m]
    k = keys[reps]
    t = None if tids is None else tids[reps]
    fp = fingerprint(k, t)
    pinned = None
    if pinned_rows is not None:
        pinned = torch.zeros(table.capacity, dtype=torch.bool, device=dev)
        pinned[pinned_rows.to(dev)] = True
    rows = torch.full_like(reps, -1)
    ek, et, refused = table._insert_overflow(
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
