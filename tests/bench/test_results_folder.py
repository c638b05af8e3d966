"""bench/results/ holds results only: the JSON a benchmark writes, its logs and tables, and the
figures' README/HISTORY. Sweep configs, prototypes and scripts belong in bench/sweeps/ or bench/."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
RESULT_SUFFIXES = {".json", ".log", ".txt", ".md", ".png", ".csv"}


def test_results_folder_holds_results_only() -> None:
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert files, f"{RESULTS} is empty"
    others = sorted(str(p.relative_to(RESULTS)) for p in files if p.suffix not in RESULT_SUFFIXES)
    assert not others, (
        f"bench/results/ holds results only; move these to bench/sweeps/ (configs, prototypes) "
        f"or bench/ (scripts): {others}"
    )
