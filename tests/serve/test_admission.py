"""serve.admission: the bound is exact, refusals are immediate, leaving frees a place."""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from serve.admission import Admission, OverloadedError


def test_admits_up_to_the_limit_then_refuses_until_one_leaves() -> None:
    adm = Admission(3)
    with ExitStack() as held:
        for _ in range(3):
            held.enter_context(adm.admit())
        assert adm.pending == 3
        with pytest.raises(OverloadedError, match="3 requests in flight"), adm.admit():
            pass
        assert adm.pending == 3  # the refused one took no place
    assert adm.pending == 0
    with adm.admit():
        assert adm.pending == 1


def test_a_failing_request_leaves_too() -> None:
    adm = Admission(1)
    with pytest.raises(RuntimeError), adm.admit():
        raise RuntimeError("boom")
    assert adm.pending == 0


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        Admission(0)
