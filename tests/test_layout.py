"""Package boundaries: serve/ never imports train/; shared/ imports neither."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(package: str) -> set[tuple[str, str]]:
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {(str(path.relative_to(ROOT)), a.name.split(".")[0]) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add((str(path.relative_to(ROOT)), node.module.split(".")[0]))
    return found


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("serve", {"train"}),
        ("shared", {"train", "serve", "loadtest"}),
        ("protos", {"train", "serve"}),
    ],
)
def test_package_boundaries(package: str, forbidden: set[str]) -> None:
    bad = sorted((f, m) for f, m in _imports(package) if m in forbidden)
    assert not bad, f"{package}/ must not import {forbidden}: {bad}"
