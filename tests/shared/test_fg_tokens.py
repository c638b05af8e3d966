"""The vectorized kernels against plain references: sequence tokens (one Python split and
``int`` per row) and price buckets (``np.searchsorted``), on random and edge-case inputs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest

from shared.features import FeatureSet
from shared.fg import _decimal_boundaries, bucket_ids
from shared.fg_text import TokenError, split_int_tokens, string_buffers

INT64_MAX = 2**63 - 1


def reference_tokens(rows: list[str], one_empty: list[bool]) -> tuple[list[int], list[int]]:
    """(tokens per row, ids) by Python: "" holds no token (one empty one where ``one_empty``),
    an empty token is id 0; raises ValueError where a token is not a decimal id in int64."""
    lengths, ids = [], []
    for row, empty in zip(rows, one_empty, strict=True):
        tokens = row.split("|") if row else ([""] if empty else [])
        for t in tokens:
            if t and (not t.isascii() or not t.isdigit() or len(t) > 19 or int(t) > INT64_MAX):
                raise ValueError(t)
            ids.append(int(t) if t else 0)
        lengths.append(len(tokens))
    return lengths, ids


def _random_rows(rng: np.random.Generator) -> list[str]:
    pieces = ["", "0", "7", "007", "123", "99999999", "123456789", "9223372036854775807"]
    rows = []
    for _ in range(int(rng.integers(0, 14))):
        if rng.random() < 0.2:
            rows.append("")
        else:
            tokens = [
                str(int(rng.integers(0, 10 ** int(rng.integers(1, 19)))))
                if rng.random() < 0.6
                else str(rng.choice(pieces))
                for _ in range(int(rng.integers(1, 6)))
            ]
            rows.append("|".join(tokens))
    if rng.random() < 0.1:  # a bad token somewhere
        bad = ["12a", "-5", "+5", " 5", "9223372036854775808", "00000000000000000001", "x"]
        rows.insert(int(rng.integers(0, len(rows) + 1)), f"1|{rng.choice(bad)}")
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_split_int_tokens_equals_a_python_split(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(300):
        rows = _random_rows(rng)
        arr = pa.array(["5|6", *rows], pa.large_string() if rng.random() < 0.3 else pa.string())
        arr = arr.slice(1)  # offsets and data not at 0
        empty = (np.diff(string_buffers(arr)[0]) == 0) & (rng.random(len(arr)) < 0.5)
        try:
            want = reference_tokens(rows, empty.tolist())
        except ValueError:
            with pytest.raises(TokenError):
                split_int_tokens(arr, ord("|"), empty)
            continue
        got = split_int_tokens(arr, ord("|"), empty)
        assert got.lengths.dtype == np.int64 and got.lengths.tolist() == want[0], rows
        assert got.ints.dtype == np.int64 and got.ints.tolist() == want[1], rows
        assert got.missing.tolist() == [i == 0 and t == "" for i, t in _flat(rows, empty)]


def _flat(rows: list[str], one_empty: np.ndarray) -> list[tuple[int, str]]:
    out = []
    for row, empty in zip(rows, one_empty.tolist(), strict=True):
        for t in row.split("|") if row else ([""] if empty else []):
            out.append((int(t) if t else 0, t))
    return out


def test_bad_tokens_are_named_with_their_row() -> None:
    arr = pa.array(["1|2", "", "3|4|5x|6"])
    with pytest.raises(TokenError, match=r"'5x' in row 2 \(not a non-negative integer\)"):
        split_int_tokens(arr, ord("|"), np.zeros(3, bool))
    with pytest.raises(TokenError, match=r"'9223372036854775808' in row 0 \(outside int64\)"):
        split_int_tokens(pa.array(["9223372036854775808"]), ord("|"), np.zeros(1, bool))


def test_bucket_ids_equal_searchsorted(fs: FeatureSet) -> None:
    price = fs.features["price"]
    rng = np.random.default_rng(0)
    cases = [
        price.boundaries,
        (0.0,),
        (0.0, 0.0, 1.0),
        (1.0, 1.0, 2.0, 1e10),
        (5.0,),
        tuple(np.sort(rng.random(500) * 1000).tolist()),
        (-1.0, 2.0),  # negative: the plain search
        (),
    ]
    for boundaries in cases:
        spec = dataclasses.replace(price, boundaries=boundaries)
        b = _decimal_boundaries(spec.boundaries)
        edges = np.abs(b)
        x = np.concatenate(
            [
                rng.exponential(200, 3000),
                edges,
                np.nextafter(edges, 0),
                np.nextafter(edges, np.inf),
                [0.0, -0.0, 5e-324, 1e300, np.finfo(float).max],
            ]
        )
        rng.shuffle(x)
        got = bucket_ids(spec, x)
        assert got is not None and got.dtype == np.int64
        want = np.searchsorted(b, x, side="right")
        assert np.array_equal(got, want), boundaries
    assert bucket_ids(price, np.array([1.0, np.nan])) is None
    assert bucket_ids(price, np.array([-1.0])) is None
