"""Bucket-level decisions of :class:`~shared.hashtable.table.HashTable` as pure tensor functions.

Who stays in a bucket that cannot hold everyone: entries are ranked, per bucket, by

1. pinned first (keys the current batch uses; under NO_EVICTION every stored key),
2. higher score,
3. newcomer before a stored key with the same score (so a table full of equal scores still
   takes new keys: recency breaks ties),
4. lower fingerprint (an arbitrary but device-independent order),

and the first ``bucket_capacity`` stay. Every step is a stable sort, gather or cumsum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_runs(
    sorted_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For non-decreasing ``sorted_ids`` [n]: (distinct ids [g], run lengths [g], run index of
    each element [n], rank of each element inside its run [n])."""
    ids, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    group = torch.repeat_interleave(torch.arange(ids.numel(), device=ids.device), counts)
    rank = (
        torch.arange(sorted_ids.numel(), device=ids.device)
        - (torch.cumsum(counts, 0) - counts)[group]
    )
    return ids, counts, group, rank


def lex_sort_dim1(keys: list[tuple[torch.Tensor, bool]]) -> torch.Tensor:
    """Permutation along dim 1 sorting by several keys, most significant first ((tensor, desc))."""
    perm: torch.Tensor | None = None
    for t, desc in reversed(keys):
        t = t.to(torch.int8) if t.dtype == torch.bool else t
        cur = t if perm is None else t.gather(1, perm)
        p = torch.sort(cur, dim=1, descending=desc, stable=True).indices
        perm = p if perm is None else perm.gather(1, p)
    assert perm is not None
    return perm


def keep_best(
    order: torch.Tensor,
    bucket: torch.Tensor,
    scores: torch.Tensor,
    pinned: torch.Tensor | None,
    capacity: int,
) -> torch.Tensor:
    """Entries ``order`` (sorted by fingerprint) → bool mask over all entries of those that stay
    when each bucket keeps its best ``capacity`` by (pinned, score, fingerprint)."""
    o = order[torch.sort(scores[order], descending=True, stable=True).indices]
    if pinned is not None:
        o = o[torch.sort(pinned[o].to(torch.int8), descending=True, stable=True).indices]
    o = o[torch.sort(bucket[o], stable=True).indices]
    _, _, _, rank = group_runs(bucket[o])
    keep = torch.ones_like(bucket, dtype=torch.bool)
    keep[o[rank >= capacity]] = False
    return keep


@dataclass
class Merge:
    """The new content of full buckets (see :func:`merge_full_buckets`)."""

    slot_fp: torch.Tensor  # [n_o, b] fingerprints, sorted, sentinels last
    slot_row: torch.Tensor  # [n_o, b] rows in the same order
    size: torch.Tensor  # [n_o] entries per bucket
    new_pos: torch.Tensor  # [k] newcomer positions (values of n_ref) that were stored
    new_rows: torch.Tensor  # [k] their rows
    evicted_rows: torch.Tensor  # [e] rows of stored entries that leave
    refused: int  # newcomers that do not fit


@dataclass
class Ranked:
    """:func:`rank_buckets`' result, before any host read: the candidates of each bucket (its
    stored entries, then its newcomers) in rank order, [n_o, b + m] each, and the new slots."""

    slot_fp: torch.Tensor  # [n_o, b] fingerprints, sorted, sentinels last
    slot_row: torch.Tensor  # [n_o, b] rows in the same order
    size: torch.Tensor  # [n_o] entries per bucket
    ref: torch.Tensor  # [n_o, b + m] a stored candidate's row, a newcomer's position
    kept_new: torch.Tensor  # [n_o, b + m] bool: a newcomer that is stored
    assigned: torch.Tensor  # [n_o, b + m] the row a kept newcomer takes
    evicted: torch.Tensor  # [n_o, b + m] bool: a stored entry that leaves
    refused: torch.Tensor  # [n_o, b + m] bool: a newcomer that does not fit


def rank_buckets(
    e_fp: torch.Tensor,
    e_row: torch.Tensor,
    e_valid: torch.Tensor,
    e_score: torch.Tensor,
    e_pin: torch.Tensor,
    n_ref: torch.Tensor,
    n_fp: torch.Tensor,
    n_score: torch.Tensor,
    sentinel: torch.Tensor,
) -> Ranked:
    """Merge the stored entries of ``n_o`` buckets (``e_*`` [n_o, b]: slot fingerprints, rows,
    occupied, scores, pinned) with newcomers (``n_ref`` [n_o, m]: a position per newcomer, -1
    for padding; ``n_fp``/``n_score`` indexed by position) and keep the best ``b`` per bucket.

    Newcomers take the rows of the bucket's empty slots and evicted entries, in slot order.
    Static shapes, no host read: what :func:`merge_full_buckets` reads out. A captured insert
    (``shared.hashtable.static_insert``) ranks with :func:`rank_buckets_packed` (one sort).
    """
    n_valid = n_ref >= 0
    n_safe = n_ref.clamp(min=0)
    c_fp = torch.cat([e_fp, n_fp[n_safe]], 1)  # [n_o, b + m] candidates
    c_score = torch.cat([e_score, n_score[n_safe]], 1)
    c_valid = torch.cat([e_valid, n_valid], 1)
    c_pin = torch.cat([e_pin & e_valid, torch.zeros_like(n_valid)], 1)
    c_new = torch.cat([torch.zeros_like(e_valid), n_valid], 1)
    c_ref = torch.cat([e_row, n_safe], 1)  # stored: row; newcomer: position
    perm = lex_sort_dim1(
        [(c_valid, True), (c_pin, True), (c_score, True), (c_new, True), (c_fp, False)]
    )
    s_valid, s_new = c_valid.gather(1, perm), c_new.gather(1, perm)
    s_fp, s_ref = c_fp.gather(1, perm), c_ref.gather(1, perm)
    return _merged(perm, s_valid, s_new, s_fp, s_ref, e_row, sentinel)


def _merged(
    perm: torch.Tensor,
    s_valid: torch.Tensor,
    s_new: torch.Tensor,
    s_fp: torch.Tensor,
    s_ref: torch.Tensor,
    e_row: torch.Tensor,
    sentinel: torch.Tensor,
) -> Ranked:
    """The merge of candidates in rank order (``perm`` [n_o, b + m] sorts them; ``s_*``: their
    occupied and newcomer flags, fingerprints, refs in that order): the first ``b`` stay."""
    n_o, b = e_row.shape
    dev = e_row.device
    col = torch.arange(s_valid.shape[1], device=dev)
    kept = s_valid & (col < b)  # a prefix of each row
    lost = s_valid & (col >= b)
    # rows that are free after the merge (empty slots, evicted entries), in slot order: a
    # stable compaction by cumsum
    kept_orig = torch.zeros_like(kept)
    kept_orig.scatter_(1, perm, kept)
    free = ~kept_orig[:, :b]
    rank = torch.where(free, torch.cumsum(free, 1) - 1, b)  # column b: a sink
    free_rows = torch.zeros(n_o, b + 1, dtype=e_row.dtype, device=dev)
    free_rows.scatter_(1, rank, e_row)
    free_rows = free_rows[:, :b]  # past the free rows: unused
    kept_new = kept & s_new
    new_rank = torch.cumsum(kept_new.to(torch.int64), 1) - 1
    size = kept.sum(1, keepdim=True)
    n_new = kept_new.sum(1, keepdim=True)
    assigned = free_rows.gather(1, new_rank.clamp(min=0, max=b - 1))  # [n_o, b + m]
    filler = free_rows.gather(1, (col[:b] - size + n_new).clamp(min=0, max=b - 1))
    out_row = torch.where(kept_new, assigned, s_ref)[:, :b]
    out_row = torch.where(kept[:, :b], out_row, filler)  # empty slots keep the unused rows
    out_fp = torch.where(kept[:, :b], s_fp[:, :b], sentinel[:, None])
    fps, order = torch.sort(out_fp, dim=1, stable=True)
    return Ranked(
        slot_fp=fps,
        slot_row=out_row.gather(1, order),
        size=size.squeeze(1),
        ref=s_ref,
        kept_new=kept_new,
        assigned=assigned,
        evicted=lost & ~s_new,
        refused=lost & s_new,
    )


def merge_full_buckets(
    e_fp: torch.Tensor,
    e_row: torch.Tensor,
    e_valid: torch.Tensor,
    e_score: torch.Tensor,
    e_pin: torch.Tensor,
    n_ref: torch.Tensor,
    n_fp: torch.Tensor,
    n_score: torch.Tensor,
    sentinel: torch.Tensor,
) -> Merge:
    """:func:`rank_buckets`, its newcomers and evictions read out (host syncs)."""
    r = rank_buckets(e_fp, e_row, e_valid, e_score, e_pin, n_ref, n_fp, n_score, sentinel)
    return Merge(
        slot_fp=r.slot_fp,
        slot_row=r.slot_row,
        size=r.size,
        new_pos=r.ref[r.kept_new],
        new_rows=r.assigned[r.kept_new],
        evicted_rows=r.ref[r.evicted],
        refused=int(r.refused.sum()),
    )


SCORE_LIMIT = 1 << 60  # rank_buckets_packed: scores must lie in [0, SCORE_LIMIT)


def rank_buckets_packed(
    e_fp: torch.Tensor,
    e_row: torch.Tensor,
    e_valid: torch.Tensor,
    e_score: torch.Tensor,
    e_pin: torch.Tensor,
    n_ref: torch.Tensor,
    n_fp: torch.Tensor,
    n_score: torch.Tensor,
    sentinel: torch.Tensor,
) -> tuple[Ranked, torch.Tensor]:
    """:func:`rank_buckets` in one sort instead of five, for newcomer columns in fingerprint
    order (the stored slots are) and scores in ``[0, SCORE_LIMIT)``: (pinned, score, newcomer)
    pack into one int64 below the occupied bit, and a stable descending sort of the fingerprint-
    ordered candidates ranks them by the module's rule. Returns (the ranking, [] bool: a valid candidate's score was out of range, so the
    ranking is not the rule's; the caller reports it)."""
    n_valid = n_ref >= 0
    n_safe = n_ref.clamp(min=0)
    n_sc = n_score[n_safe]
    # the packed keys (occupied, pinned, score, newcomer), stored then newcomers: [n_o, b + m]
    e_key = (e_score.clamp(0, SCORE_LIMIT - 1) << 1) | (e_pin & e_valid).to(torch.int64) << 61
    e_key = torch.where(e_valid, e_key | (1 << 62), e_key)
    n_key = torch.where(n_valid, (n_sc.clamp(0, SCORE_LIMIT - 1) << 1) | 1 | (1 << 62), 0)
    out_of_range = (e_valid & ((e_score < 0) | (e_score >= SCORE_LIMIT))).any() | (
        n_valid & ((n_sc < 0) | (n_sc >= SCORE_LIMIT))
    ).any()
    keys, perm = torch.sort(torch.cat([e_key, n_key], 1), dim=1, descending=True, stable=True)
    s_valid, s_new = (keys >> 62).bool(), (keys & 1).bool()
    s_fp = torch.cat([e_fp, n_fp[n_safe]], 1).gather(1, perm)
    s_ref = torch.cat([e_row, n_safe], 1).gather(1, perm)  # stored: row; newcomer: position
    return _merged(perm, s_valid, s_new, s_fp, s_ref, e_row, sentinel), out_of_range
