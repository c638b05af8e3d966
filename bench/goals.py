"""A benchmark's figure against its goal, as the benchmarks' JSON writes it."""

from __future__ import annotations

from typing import Any


def check(got: float | None, goal: float, *, at_most: bool) -> dict[str, Any]:
    """``{"goal", "got", "met"}``: ``got`` against ``goal`` (``at_most``: met at or below it,
    else at or above; ``met`` None where the figure is missing)."""
    met = None if got is None else (got <= goal if at_most else got >= goal)
    return {"goal": goal, "got": got, "met": met}
