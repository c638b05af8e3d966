"""Integer hashing and small deterministic tensor ops shared by the hash-table modules.

Everything here is pure int64/float torch arithmetic that gives bit-identical results on CPU and
CUDA: int64 multiplication wraps modulo 2**64 on both, there are no float atomics, and every
scatter writes each index at most once. Unsigned 64-bit operations are written with signed int64
tensors: a logical right shift is an arithmetic shift followed by a mask.
"""

from __future__ import annotations

import hashlib

import torch

MASK64 = (1 << 64) - 1
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, the splitmix64 increment
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB


def to_signed(x: int) -> int:
    """An unsigned 64-bit Python int as the int64 with the same bits."""
    x &= MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def mix64_int(x: int) -> int:
    """splitmix64's finalizer on a Python int (unsigned result). Same bits as :func:`mix64`."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * _C1) & MASK64
    x = ((x ^ (x >> 27)) * _C2) & MASK64
    return x ^ (x >> 31)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 ``x`` by ``0 < s < 64`` bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer, a bijection on 64-bit words (int64 in, int64 out). mix64(0) == 0."""
    x = (x ^ _srl(x, 30)) * to_signed(_C1)
    x = (x ^ _srl(x, 27)) * to_signed(_C2)
    return x ^ _srl(x, 31)


def name_salt(name: str) -> int:
    """A stable 64-bit salt for a table name (blake2b; no dependence on Python's hash seed)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def fingerprint(keys: torch.Tensor, table_ids: torch.Tensor | None) -> torch.Tensor:
    """The sort value of a (table id, key) pair: mix64(key ^ mix64(table_id * GOLDEN)) with the
    sign bit flipped (signed int64 order = unsigned order) and the lowest bit cleared.

    Fingerprints are even so that the odd bucket sentinels (:func:`bucket_sentinels`) never
    equal one. Table id 0 has salt 0; two keys share a fingerprint only if their mixes differ
    in the lowest bit alone (or, for fused tables, by chance): lookups compare the full pair.
    On CUDA one kernel computes the same bits (``cuda/keyed.cu``, the CUDA backend's
    ``fingerprint``).
    """
    x = keys
    if table_ids is not None:
        x = x ^ mix64(table_ids.to(torch.int64) * to_signed(GOLDEN))
    return (mix64(x) ^ INT64_MIN) & -2


def bucket_of(fp: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """floor(u * num_buckets / 2**64) for the unsigned value u of fingerprint ``fp``.

    Monotone in ``fp``, so buckets are contiguous fingerprint ranges and the slot array, kept
    sorted inside each bucket, is one sorted sequence. Exact in int64 for num_buckets < 2**31.
    """
    if num_buckets == 1:
        return torch.zeros_like(fp)
    hi = (fp >> 32) + (1 << 31)  # high 32 bits of u (fp has the sign bit flipped)
    lo = fp & 0xFFFFFFFF
    return (hi * num_buckets + ((lo * num_buckets) >> 32)) >> 32


def bucket_sentinels(num_buckets: int, device: torch.device) -> torch.Tensor:
    """[num_buckets] int64, odd: the value stored in the empty slots of each bucket.

    Bucket b holds u in [ceil(b * 2**64 / nb), ceil((b + 1) * 2**64 / nb)) (computed as
    b * q + ceil(b * r / nb) with 2**64 = q * nb + r, in wrapping int64 arithmetic). The sentinel
    is the bucket's last value with the lowest bit set: above every (even) fingerprint of the
    bucket and not above any fingerprint of the next one, so sorted buckets with their empties
    at the end form one globally sorted slot array.
    """
    q, r = divmod(1 << 64, num_buckets)
    b1 = torch.arange(1, num_buckets + 1, dtype=torch.int64, device=device)
    lo_next = b1 * to_signed(q) + (b1 * r + num_buckets - 1) // num_buckets
    return (lo_next - 1 + INT64_MIN) | 1  # last u of the bucket, in the signed domain, made odd


_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_key_tensor(keys: torch.Tensor, what: str) -> torch.Tensor:
    """Validate that ``keys`` is a 1-D integer tensor (no op, no host sync); returns it as is,
    in its own dtype (:func:`check_keys` also converts to int64 and checks the sign)."""
    if keys.dim() != 1:
        raise ValueError(f"{what}: keys must be 1-D, got shape {tuple(keys.shape)}")
    if keys.dtype not in _INT_DTYPES:
        raise TypeError(f"{what}: keys must be an integer tensor (int64), got {keys.dtype}")
    return keys


def check_keys(keys: torch.Tensor, what: str, *, check_sign: bool = True) -> torch.Tensor:
    """Validate a 1-D tensor of non-negative int64 keys; returns it as int64.

    ``check_sign=False`` skips the (host-synchronising) test for negative keys.
    """
    keys = check_key_tensor(keys, what).to(torch.int64)
    if check_sign and keys.numel() and bool((keys < 0).any()):
        bad = int(torch.nonzero(keys < 0)[0, 0])
        raise ValueError(
            f"{what}: key {int(keys[bad])} at position {bad} is negative. Keys must be "
            "non-negative int64 (negative values are reserved: -1 marks an empty slot); "
            "feature generation maps raw ids into [0, 2**63)"
        )
    return keys


class NegativeKeyError(ValueError):
    """A lookup got a negative key (:func:`unique_pairs` with ``reject_negative``); the caller,
    which knows the tables, re-checks its parts with :func:`check_keys` to name the key."""


def compact_positions(mask: torch.Tensor, n_true: int) -> torch.Tensor:
    """[n_true] int64: the ascending positions where the 1-D bool ``mask`` is true, for a
    caller that already read their number (``nonzero`` would read it again: a host sync)."""
    n = mask.numel()
    if n_true == n:
        return torch.arange(n, device=mask.device)
    # the j-th true entry (j = 1..n_true) is where the running count of trues first reaches j:
    # one cumsum and one searchsorted (the fewest ops; every step is deterministic)
    seen = torch.cumsum(mask, 0)
    return torch.searchsorted(seen, torch.arange(1, n_true + 1, device=mask.device))


def sort_pairs(
    keys: torch.Tensor, table_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, group, keys sorted by key alone): the stable sort of (table id, key) pairs and
    the 0-based run index of each sorted position (the part of :func:`unique_pairs` with no host
    read; the static step's unique takes it too)."""
    by_key = torch.sort(keys, stable=True)
    order = by_key.indices
    k = by_key.values
    if table_ids is not None:  # ids fit int32 (the tables store them so): half the passes
        by_tid = torch.sort(table_ids[order].to(torch.int32), stable=True)
        order = order[by_tid.indices]
        k = keys[order]
        # change[i]: pair i differs from pair i - 1 (roll wraps around: position 0 set below)
        change = (k != k.roll(1)) | (by_tid.values != by_tid.values.roll(1))
    else:
        change = k != k.roll(1)
    # position 0 starts the first run: not counted, so the cumsum is the 0-based unique index
    change[:1].fill_(False)
    group = torch.cumsum(change, 0)
    return order, group, by_key.values


def unique_pairs(
    keys: torch.Tensor, table_ids: torch.Tensor | None, *, reject_negative: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic unique of (table id, key) pairs by stable sorting.

    Returns ``(order, starts, counts, inverse, group)``: ``order`` sorts the input by (table id,
    key) keeping input order among equal pairs; ``starts``/``counts`` delimit each unique pair's
    run in that order (``order[starts]`` is its first occurrence, ``order[starts + counts - 1]``
    its last); ``inverse`` [N] maps each input position to its unique index; ``group`` [N] is the
    unique index of each sorted position.

    One host synchronisation (the number of unique pairs). ``reject_negative`` reads, in the
    same synchronisation, whether any key is negative and raises :class:`NegativeKeyError`.
    """
    n = keys.numel()
    order, group, by_key = sort_pairs(keys, table_ids)
    if reject_negative and n:
        # by_key[0] is the smallest key: negative if any is
        last, smallest = torch.stack([group[-1], by_key[0]]).tolist()
        if smallest < 0:
            raise NegativeKeyError("negative key")
        n_unique = last + 1
    else:
        n_unique = int(group[-1]) + 1 if n else 0  # the one host sync
    # group is non-decreasing: each unique index's run is one searchsorted range
    ids = torch.arange(n_unique, device=keys.device)
    starts = torch.searchsorted(group, ids)
    counts = torch.searchsorted(group, ids, right=True) - starts
    inverse = torch.empty_like(order)
    inverse[order] = group
    return order, starts, counts, inverse, group


def segment_sum_sorted(
    x: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    group: torch.Tensor,
    max_count: int | None = None,
) -> torch.Tensor:
    """Sum the rows of ``x`` [M, D] within runs (``x`` already sorted by run) → [U, D].

    A pairwise tree in ceil(log2(max run)) rounds where each addition has fixed operands, so
    the float result is the same on every device and every run (unlike index_add_ on CUDA).
    ``max_count``: the longest run, if the caller read it already (else one host sync).
    """
    if x.shape[0] == 0:
        return x.new_zeros((0, *x.shape[1:]))
    if max_count is None:
        max_count = int(counts.max())  # the one host sync: the number of rounds
    if max_count == 1:
        return x[starts]
    rank = torch.arange(x.shape[0], device=x.device) - starts[group]
    left = counts[group] - rank  # elements from this one to the end of its run
    step = 1
    while step < max_count:
        # row i (rank a multiple of 2*step) adds row i + step when that is in its run; masked
        # rounds instead of gathering the rows: no host sync per round
        add = ((rank % (2 * step)) == 0) & (left > step)
        x = torch.where(add.unsqueeze(1), x + torch.roll(x, -step, 0), x)
        step *= 2
    return x[starts]


def split_mask(mask: torch.Tensor, n_true: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions where ``mask`` is true, positions where it is false), each ascending, with
    one host synchronisation (the number of true entries; none if ``n_true`` is given)
    instead of two ``nonzero`` calls."""
    # a stable descending sort keeps each side in ascending position order
    order = torch.sort(mask.to(torch.uint8), descending=True, stable=True).indices
    if n_true is None:
        n_true = int(mask.sum())
    return order[:n_true], order[n_true:]


def count_sorted(sorted_ids: torch.Tensor, n: int) -> torch.Tensor:
    """[n] int64: how often each of 0..n-1 occurs in non-decreasing ``sorted_ids``.

    A searchsorted instead of ``torch.bincount``, which has no deterministic CUDA kernel (it
    raises under ``torch.use_deterministic_algorithms``).
    """
    edges = torch.arange(n + 1, dtype=sorted_ids.dtype, device=sorted_ids.device)
    pos = torch.searchsorted(sorted_ids, edges)
    return pos[1:] - pos[:-1]


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """[n] int64: how often each of 0..n-1 occurs in ``ids`` (deterministic bincount)."""
    return count_sorted(torch.sort(ids.to(torch.int64)).values, n)
