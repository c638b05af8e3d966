"""Byte-level kernels of feature generation: the stable string hash and the decimal token parser.

They work on the raw buffers of Arrow string arrays with numpy, vectorized over strings/tokens:
:func:`hash64` loops over byte positions (of distinct values; the rest of a few long strings is
hashed one string at a time, in numpy passes for the longest), :func:`std_hash` (TorchEasyRec's
string hash) likewise over 8-byte block positions, :func:`split_int_tokens` splits delimited id
lists and parses every token at once with SWAR arithmetic (eight digits per uint64).
They raise :class:`TokenError` with a message; :mod:`shared.fg` adds the column name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

INT64_MAX = np.iinfo(np.int64).max


class TokenError(ValueError):
    """A malformed token; the message quotes it and its row."""


def string_buffers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(int64 offsets relative to the first row, uint8 bytes) of a string/large_string array,
    zero-copy apart from the offsets. Null slots must have been filled (their bytes count)."""
    width = np.int64 if pa.types.is_large_string(arr.type) else np.int32
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=width)[arr.offset : arr.offset + len(arr) + 1]
    if bufs[2] is None or len(arr) == 0:
        return np.zeros(len(arr) + 1, np.int64), np.zeros(0, np.uint8)
    data = np.frombuffer(bufs[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    return (offsets - offsets[0]).astype(np.int64), data


# --------------------------------------------------------------------------- hashing

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_MASK64 = (1 << 64) - 1
_SHORT = 64  # bytes hashed by the position loop for every string
_WIDE = 32  # beyond _SHORT, the position loop goes on while this many strings are still longer
_PY_TAIL = 1024  # a string's rest shorter than this: a Python byte loop; longer: _fnv1a_linear
_BLOCK = 1 << 16  # bytes per pass of _fnv1a_linear (bounds its memory)


def hash64(strings: pa.Array) -> np.ndarray:
    """Stable 64-bit hash of each string's UTF-8 bytes: FNV-1a, then the SplitMix64 finalizer.

    The finalizer spreads FNV's weak low bits before ``% size`` (and keeps the dataset's two
    pids, ``430548_1007`` and ``430539_1007``, in different buckets of the config's 20). Part of
    the train/serve contract: never change it without a new bundle format. Call it on distinct
    values. Nulls hash like "". Example: ``hash64(pa.array(["430548_1007"]))``.

    Vectorized over strings: the loop runs over byte positions (strings sorted by length, so
    position ``j`` touches only the strings longer than ``j``), for the first ``_SHORT`` bytes and
    then as long as at least ``_WIDE`` strings are left. The few longer strings are finished one
    at a time (:func:`_fnv1a_tail`), so one long string costs about 35 ns per byte (1 MB: 35 ms)
    instead of a numpy loop iteration per byte (1 MB: 6-9 s).
    """
    strings = pc.fill_null(strings.cast(pa.large_string()), "")
    offsets, data = string_buffers(strings)
    lens = np.diff(offsets)
    order = np.argsort(-lens, kind="stable")
    starts, neg_lens = offsets[:-1][order], -lens[order]  # ascending, for searchsorted
    n = len(lens)
    longest = -int(neg_lens[0]) if n else 0
    wide = -int(neg_lens[_WIDE - 1]) if n >= _WIDE else 0  # _WIDE strings are this long
    stop = min(longest, max(_SHORT, wide))
    h = np.full(n, _FNV_OFFSET, dtype=np.uint64)
    active = np.searchsorted(neg_lens, -np.arange(stop), side="left")  # strings longer than j
    for j, k in enumerate(active.tolist()):
        h[:k] ^= data[starts[:k] + j]
        h[:k] *= _FNV_PRIME
    for i in range(int(np.searchsorted(neg_lens, -stop, side="left"))):  # longer than stop
        h[i] = _fnv1a_tail(int(h[i]), data[starts[i] + stop : starts[i] - neg_lens[i]])
    h ^= h >> np.uint64(30)  # SplitMix64 finalizer
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(27)
    h *= np.uint64(0x94D049BB133111EB)
    h ^= h >> np.uint64(31)
    out = np.empty_like(h)
    out[order] = h
    return out


def _fnv1a_tail(h: int, data: np.ndarray) -> int:
    """The FNV-1a state ``h`` advanced over the bytes ``data`` (the rest of one long string)."""
    if len(data) >= _PY_TAIL:
        return _fnv1a_linear(h, data)
    prime = int(_FNV_PRIME)
    for b in data.tobytes():
        h = ((h ^ b) * prime) & _MASK64
    return h


def _fnv1a_linear(h: int, data: np.ndarray) -> int:
    """:func:`_fnv1a_tail` in numpy passes over the bytes, without a loop over them.

    ``h ^ b == h + d`` with ``d = (s ^ b) - s``, ``s = h & 0xFF`` (the xor only touches the low
    byte), so after bytes ``b_0 .. b_{n-1}`` the state is ``h * P**n + sum(d_i * P**(n - i))``
    (mod 2**64): linear, once the low byte ``s_i`` before each byte is known, and the low byte
    evolves on its own (:func:`_low_bytes`). Blocks of ``_BLOCK`` bytes bound the memory.
    """
    powers = _prime_powers()
    for at in range(0, len(data), _BLOCK):
        b = data[at : at + _BLOCK]
        s = _low_bytes(h & 0xFF, b)
        d = (s ^ b).astype(np.uint64) - s  # wraps: d mod 2**64
        p = powers[len(b) - 1 :: -1]  # P**n .. P**1
        h = (h * int(p[0]) + int((d * p).sum(dtype=np.uint64))) & _MASK64
    return h


def _low_bytes(s0: int, b: np.ndarray) -> np.ndarray:
    """The low byte of the FNV-1a state before each byte of ``b`` (uint8), the first being ``s0``.

    It follows ``s' = ((s ^ b) * 0xB3) & 0xFF`` (0xB3: the prime's low byte), whose bit ``j``
    depends on bits ``<= j`` only. With ``x = s ^ b`` and ``c = 0xB3`` odd, bit ``j`` of ``x * c``
    is ``x_j ^`` bit ``j`` of ``(x mod 2**j) * c``; so bit ``j`` of ``s'`` is bit ``j`` of ``s``
    xor ``e = b_j ^ bit_j(((s ^ b) mod 2**j) * c)``, known once the lower bits are: bit ``j``
    along the string is a prefix xor of ``e``. Eight passes, one per bit.
    """
    s = np.zeros(len(b), np.uint8)
    e = np.empty_like(s)
    for j in range(8):
        np.bitwise_xor(s, b, out=e)
        e &= np.uint8((1 << j) - 1)
        e *= np.uint8(0xB3)  # wraps mod 256: bits 0..7 of the product
        e ^= b
        e >>= np.uint8(j)
        e &= np.uint8(1)
        bit = np.empty_like(s)
        bit[0] = (s0 >> j) & 1
        np.bitwise_xor(np.bitwise_xor.accumulate(e[:-1]), bit[0], out=bit[1:])
        s |= bit << np.uint8(j)
    return s


@functools.cache
def _prime_powers() -> np.ndarray:
    """``P**1 .. P**_BLOCK`` mod 2**64 (uint64; the products wrap)."""
    p = np.full(_BLOCK, _FNV_PRIME, np.uint64)
    return np.multiply.accumulate(p, out=p)


# libstdc++'s std::hash<std::string> for 64-bit size_t: _Hash_bytes (libstdc++-v3/libsupc++/
# hash_bytes.cc, a MurmurHash2-64A variant) with _Hash_impl's seed (include/bits/functional_hash.h)
_STD_MUL = np.uint64(0xC6A4A7935BD1E995)
_STD_SEED = np.uint64(0xC70F6907)
_U47 = np.uint64(47)


def std_hash(strings: pa.Array) -> np.ndarray:
    """libstdc++'s ``std::hash<std::string>`` of each string's UTF-8 bytes (uint64).

    The hash TorchEasyRec's feature generation (pyfg) buckets ``hash_bucket_size`` strings and
    keys dynamic tables with (``std::hash(s) % size``); ``std_hash(pa.array(["abc"])) % 100`` is
    33 as in tzrec's own tests. ``_Hash_bytes(p, len, 0xc70f6907)``: ``h = seed ^ len * M``; per
    8-byte little-endian block ``w``: ``h = (h ^ mix(w * M) * M) * M``, ``mix(v) = v ^ v >> 47``;
    the last ``len % 8`` bytes as one little-endian integer ``t``: ``h = (h ^ t) * M``; finally
    ``mix(mix(h) * M)``. Call it on distinct values. Nulls hash like "".

    Vectorized as :func:`hash64`: the loop runs over block positions (strings sorted by length),
    for the first ``_SHORT`` bytes and then as long as ``_WIDE`` strings are left; the blocks of the
    few longer strings are mixed in numpy and chained one string at a time (:func:`_std_chain`).
    """
    strings = pc.fill_null(strings.cast(pa.large_string()), "")
    offsets, data = string_buffers(strings)
    lens = np.diff(offsets)
    order = np.argsort(-lens, kind="stable")
    starts, lens = offsets[:-1][order], lens[order]
    neg_blocks = -(lens // 8)  # ascending
    n = len(lens)
    words = byte_words(data)
    longest = -int(neg_blocks[0]) if n else 0
    wide = -int(neg_blocks[_WIDE - 1]) if n >= _WIDE else 0  # _WIDE strings have this many
    stop = min(longest, max(_SHORT // 8, wide))
    h = _STD_SEED ^ (lens.astype(np.uint64) * _STD_MUL)
    active = np.searchsorted(neg_blocks, -np.arange(stop), side="left")  # strings with block j
    for j, k in enumerate(active.tolist()):
        h[:k] ^= _std_mix_blocks(words[starts[:k] + 8 * j])
        h[:k] *= _STD_MUL
    for i in range(int(np.searchsorted(neg_blocks, -stop, side="left"))):  # more blocks than stop
        h[i] = _std_chain(
            int(h[i]), _std_mix_blocks(words[starts[i] + 8 * stop : starts[i] + lens[i] - 7 : 8])
        )
    rest = lens % 8
    t = np.flatnonzero(rest)
    tail_bits = (rest[t] * 8).astype(np.uint64)
    h[t] ^= words[starts[t] + lens[t] - rest[t]] & ((np.uint64(1) << tail_bits) - np.uint64(1))
    h[t] *= _STD_MUL
    h ^= h >> _U47
    h *= _STD_MUL
    h ^= h >> _U47
    out = np.empty_like(h)
    out[order] = h
    return out


def _std_mix_blocks(w: np.ndarray) -> np.ndarray:
    """``mix(w * M) * M`` of 8-byte blocks ``w`` (uint64; the products wrap)."""
    d = w * _STD_MUL
    d ^= d >> _U47
    d *= _STD_MUL
    return d


def _std_chain(h: int, mixed: np.ndarray) -> int:
    """The _Hash_bytes state ``h`` advanced over the mixed blocks of one long string."""
    mul = int(_STD_MUL)
    for d in mixed.tolist():
        h = ((h ^ d) * mul) & _MASK64
    return h


def hash_strings(
    strings: pa.Array, hasher: Callable[[pa.Array], np.ndarray] = hash64
) -> np.ndarray:
    """``hasher`` (:func:`hash64` or :func:`std_hash`) per row, computed on the distinct values
    only (dictionary-encoded)."""
    enc = pc.dictionary_encode(strings)
    return hasher(enc.dictionary)[np.asarray(enc.indices)]


# --------------------------------------------------------------------------- decimal tokens

_ASCII0 = 0x3030303030303030


def _parse_upto8(words: np.ndarray, pos: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Decimal value of the ``n[i]`` (1..8) ASCII digits at byte ``pos[i]`` (digits checked before).

    SWAR (Lemire's eight-digit parse): '0' is subtracted from every byte, the token's bytes are
    shifted to the top of a uint64 (dropping the bytes after the token: a borrow only moves up
    into them), and three multiplications combine the digits. In place, on one array.
    """
    u = np.uint64
    sh = (8 - n).astype(u)
    sh <<= u(3)
    w = words[pos]
    w -= u(_ASCII0)
    w <<= sh  # top n bytes: digit values; low bytes: 0
    w *= u(2561)  # adjacent digit pairs
    w >>= u(8)
    mask = u(0x000000FF000000FF)
    low = w & mask
    low *= u(100 + (1000000 << 32))
    w >>= u(16)
    w &= mask
    w *= u(1 + (10000 << 32))
    w += low
    w >>= u(32)
    return w


def byte_words(data: np.ndarray) -> np.ndarray:
    """uint64 view whose element ``i`` is the 8 (unaligned, little-endian) bytes from byte ``i`` of
    ``data`` (a zero-padded copy: bytes past the end read as 0), for ``i`` in ``0 .. len(data)``."""
    pad = np.zeros((len(data) + 16) // 8 * 8, np.uint8)
    pad[: len(data)] = data
    return np.lib.stride_tricks.as_strided(
        pad.view(np.uint64), shape=(len(data) + 1,), strides=(1,)
    )


def _parse_digits(
    data: np.ndarray, starts: np.ndarray, lens: np.ndarray, longest: int = 19
) -> np.ndarray:
    """Parse decimal tokens (1..19 digits, already checked) at ``data[starts : starts + lens]``;
    ``longest``: at least ``lens.max()``."""
    words = byte_words(data)
    if longest <= 8:
        return _parse_upto8(words, starts, lens)
    short = lens <= 8
    if short.all():
        return _parse_upto8(words, starts, lens)
    values = np.zeros(len(starts), np.uint64)
    values[short] = _parse_upto8(words, starts[short], lens[short])
    for n in np.unique(lens[~short]):  # ids above 99,999,999: rare, one pass per length
        sel = np.flatnonzero(lens == n)
        head = int(n) % 8 or 8
        v = _parse_upto8(words, starts[sel], np.full(len(sel), head))
        for off in range(head, int(n), 8):
            v = v * np.uint64(10**8) + _parse_upto8(words, starts[sel] + off, np.full(len(sel), 8))
        values[sel] = v
    return values


@dataclass
class Tokens:
    """The parsed tokens of one sequence sub-feature column (before truncation)."""

    lengths: np.ndarray  # int64 [rows]
    ints: np.ndarray  # int64 [tokens], 0 where missing
    missing: np.ndarray  # bool [tokens]


def split_int_tokens(arr: pa.Array, delim: int, one_empty: np.ndarray) -> Tokens:
    """Split a string column on the single byte ``delim`` and parse integer tokens.

    Rows of length 0 have no token, except where ``one_empty`` says they hold one empty token.
    A token starts at its row or after a delimiter and ends at a delimiter or at its row's end;
    along the tokens (row by row) both positions only grow, so each is the sorted union of the
    two kinds (a stable sort of two sorted runs: one merge).
    """
    offsets, data = string_buffers(arr)
    is_delim = data == delim
    dpos = np.flatnonzero(is_delim)
    has = offsets[1:] != offsets[:-1]  # rows with at least one token
    has |= one_empty
    ntok = np.diff(np.searchsorted(dpos, offsets))  # delimiters per row
    ntok += has
    starts = np.concatenate([offsets[:-1][has], dpos + 1])
    starts.sort(kind="stable")
    ends = np.concatenate([dpos, offsets[1:][has]])
    ends.sort(kind="stable")
    tlen = ends - starts
    missing = tlen == 0
    nondigit = (data - np.uint8(48)) > 9  # uint8 wraps: True for every byte outside '0'..'9'
    if np.count_nonzero(nondigit) != len(dpos) or 0x30 <= delim <= 0x39:
        nondigit &= ~is_delim
        if nondigit.any():
            at = int(np.argmax(nondigit))
            bad = (starts <= at) & (ends > at)
            _bad_token(arr, ntok, data, starts, ends, bad, "not a non-negative integer")
    longest = int(tlen.max()) if len(tlen) else 0
    if longest > 19:
        _bad_token(arr, ntok, data, starts, ends, tlen > 19, "outside int64")
    any_missing = bool(missing.any())
    ints = _parse_digits(data, starts, np.maximum(tlen, 1) if any_missing else tlen, longest)
    if longest == 19 and (ints > np.uint64(INT64_MAX)).any():  # 18 digits are below 2**63
        _bad_token(arr, ntok, data, starts, ends, ints > np.uint64(INT64_MAX), "outside int64")
    ints = ints.view(np.int64)
    if any_missing:
        ints[missing] = 0
    return Tokens(ntok.astype(np.int64), ints, missing)


def _bad_token(
    arr: pa.Array,
    ntok: np.ndarray,
    data: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    bad: np.ndarray,
    why: str,
) -> None:
    i = int(np.flatnonzero(bad)[0])
    row = int(np.searchsorted(np.cumsum(ntok), i, side="right"))
    token = bytes(data[starts[i] : ends[i]]).decode("utf-8", "replace")
    raise TokenError(f"malformed sequence token {token!r} in row {row} ({why}): {arr[row]}")
