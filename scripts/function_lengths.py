"""List functions longer than a limit (issue #17: split long functions along their steps).

    python -m scripts.function_lengths [--max 80] [paths...]  # default: train serve shared loadtest

Length is ``end_lineno - lineno + 1`` of the ``def`` (decorators excluded; nested functions and
methods count on their own). CLI entry points named ``main`` are exempt, and so are argument
parsers (``parse_args``, ``*parser``) in a ``__main__.py``. Prints ``path:line name length`` for
each one found and exits 1 if there are any.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PATHS = ("train", "serve", "shared", "loadtest")


def _exempt(name: str, path: Path) -> bool:
    parser = name == "parse_args" or name.endswith("parser")
    return name == "main" or (path.name == "__main__.py" and parser)


def long_functions(paths: list[Path], limit: int = 80) -> list[str]:
    """``path:line name length`` of every function in ``paths`` (files or directories) over
    ``limit`` lines; ``name`` is qualified by its classes and enclosing functions."""
    found: list[tuple[Path, int, str]] = []
    for file in sorted(f for p in paths for f in ([p] if p.is_file() else p.rglob("*.py"))):
        todo: list[tuple[ast.AST, str]] = [(ast.parse(file.read_text(), str(file)), "")]
        while todo:
            node, prefix = todo.pop()
            for child in ast.iter_child_nodes(node):
                if not isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    todo.append((child, prefix))
                    continue
                todo.append((child, f"{prefix}{child.name}."))
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                too_long = length > limit and not isinstance(child, ast.ClassDef)
                if too_long and not _exempt(child.name, file):
                    found.append((file, child.lineno, f"{prefix}{child.name} {length}"))
    shown = [(f.relative_to(ROOT) if f.is_relative_to(ROOT) else f, n, t) for f, n, t in found]
    return [f"{f}:{n} {t}" for f, n, t in sorted(shown)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.function_lengths", description=__doc__)
    p.add_argument("--max", type=int, default=80, help="longest allowed function, in lines")
    p.add_argument(
        "paths",
        nargs="*",
        type=Path,
        help=f"files or directories (default: {' '.join(DEFAULT_PATHS)})",
    )
    a = p.parse_args(argv)
    found = long_functions(
        [p.resolve() for p in a.paths] or [ROOT / d for d in DEFAULT_PATHS], a.max
    )
    print("\n".join(found) or f"no function over {a.max} lines")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
