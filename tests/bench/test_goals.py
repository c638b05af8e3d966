"""bench.goals: a figure against its goal, in both directions, and a missing figure."""

from __future__ import annotations

from bench.goals import check


def test_at_least_and_at_most_goals_and_a_missing_figure() -> None:
    assert check(1.2, 1.3, at_most=False) == {"goal": 1.3, "got": 1.2, "met": False}
    assert check(1.3, 1.3, at_most=False)["met"] is True
    assert check(0.0, 0.001, at_most=True)["met"] is True
    assert check(0.002, 0.001, at_most=True)["met"] is False
    assert check(None, 0.85, at_most=False) == {"goal": 0.85, "got": None, "met": None}
