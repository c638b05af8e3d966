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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _internal_imports(package: str) -> dict[str, set[str]]:
    """Module → the modules of ``package`` it imports, every import counted (top level, inside
    functions, under ``if TYPE_CHECKING``); ``from pkg import sub`` counts as ``pkg.sub`` when
    ``sub`` is a module. Implicit imports of parent packages are not edges."""
    paths = {_module_name(p): p for p in (ROOT / package.replace(".", "/")).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for mod, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module
                    for a in node.names
                ]
            graph[mod] |= {n for n in names if n in paths and n != mod}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_hashtable_import_graph_has_no_cycles() -> None:
    graph = _internal_imports("shared.hashtable")
    assert "shared.hashtable.table" in graph and "shared.hashtable.cuda.backend" in graph
    cycle = _cycle(graph)
    assert cycle is None, "import cycle in shared/hashtable: " + " -> ".join(cycle or [])


def test_train_data_import_graph_has_no_cycles() -> None:
    """The loader's modules (train/data/loader.py and the parts it was split into) import
    downwards only: plan <- messages <- streams, in_order <- loader; workers <- loader."""
    graph = _internal_imports("train.data")
    assert "train.data.loader" in graph and "train.data.plan" in graph
    cycle = _cycle(graph)
    assert cycle is None, "import cycle in train/data: " + " -> ".join(cycle or [])


def test_hashtable_table_does_not_import_the_cuda_kernels() -> None:
    """table.py reaches the kernels only through its backend (shared/hashtable/backend.py)."""
    graph = _internal_imports("shared.hashtable")
    cuda = sorted(
        m for m in graph["shared.hashtable.table"] if m.startswith("shared.hashtable.cuda")
    )
    assert not cuda, f"shared/hashtable/table.py imports {cuda}"


def test_cycle_finder_sees_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
