"""No function outside a CLI ``main`` is over 80 lines (issue #17; scripts/function_lengths.py)."""

from scripts.function_lengths import DEFAULT_PATHS, ROOT, long_functions


def test_no_function_over_80_lines() -> None:
    found = long_functions([ROOT / d for d in DEFAULT_PATHS], limit=80)
    assert not found, (
        "functions over 80 lines (path:line name length); split them along their steps, "
        "see `python -m scripts.function_lengths`:\n" + "\n".join(found)
    )
