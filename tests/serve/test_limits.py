"""serve.limits: the limits' checks, the sequence cap, and what is echoed to clients."""

from __future__ import annotations

import pytest

from serve.limits import Limits, shown, truncate


def test_sequence_cap_is_the_config_unless_the_flag_is_lower() -> None:
    assert Limits().sequence_cap(50) == 50
    assert Limits(max_sequence_length=20).sequence_cap(50) == 20
    assert Limits(max_sequence_length=80).sequence_cap(50) == 50
    assert Limits(max_sequence_length=7).sequence_cap(None) == 7
    with pytest.raises(ValueError, match="sequence_length"):
        Limits().sequence_cap(None)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"max_candidates": 0}, "max_candidates"),
        ({"max_pending": 0}, "max_pending"),
        ({"max_string_bytes": 0}, "max_string_bytes"),
        ({"max_detail_bytes": 10}, "max_detail_bytes"),
        ({"max_sequence_length": -1}, "max_sequence_length"),
    ],
)
def test_bad_limits_name_the_field(kw: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Limits(**kw)


def test_transport_limit_leaves_room_to_see_oversize_requests() -> None:
    lim = Limits(max_request_bytes=1000)
    assert lim.transport_bytes > 2 * lim.max_request_bytes


def test_truncate_keeps_short_text_and_cuts_long_text_to_the_byte_limit() -> None:
    assert truncate("short", 100) == "short"
    long = "é" * 1000  # 2 bytes each: the cut must not split a character
    cut = truncate(long, 100)
    assert len(cut.encode()) <= 100 and cut.endswith("[2000 bytes, cut]")
    cut.encode("utf-8")  # valid UTF-8


def test_shown_cuts_long_values() -> None:
    assert shown(7) == "7"
    text = shown("x" * 10_000)
    assert len(text) <= 48 and "10002 chars" in text
