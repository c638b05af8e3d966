"""The committed *_pb2 files must be what protos/build.py generates from the .proto sources,
and pyproject.toml must ask for the runtimes they were generated for."""

import re
import tempfile
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _floor(package: str) -> tuple[int, ...]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        m = re.fullmatch(rf"{re.escape(package)}>=([\d.]+)", dep)
        if m:
            return _version(m.group(1))
    raise AssertionError(f"pyproject.toml names no {package}>=VERSION")


def test_pyproject_asks_for_the_runtimes_the_generated_code_checks() -> None:
    """grpcio and protobuf refuse to import generated code newer than themselves: an install
    that meets pyproject.toml must import protos/ (a floor below these fails at import)."""
    grpc_gen = re.search(
        r"GRPC_GENERATED_VERSION = '([\d.]+)'", (PROTOS / "predict_pb2_grpc.py").read_text()
    )
    assert grpc_gen is not None
    want = _version(grpc_gen.group(1))
    for package in ("grpcio", "grpcio-tools", "grpcio-health-checking", "grpcio-reflection"):
        assert _floor(package) >= want, f"pyproject.toml: {package}>={grpc_gen.group(1)}"
    for pb2 in sorted(PROTOS.glob("*_pb2.py")):
        gen = re.search(r"Protobuf Python Version: ([\d.]+)", pb2.read_text())
        assert gen is not None, pb2.name
        assert _floor("protobuf") >= _version(gen.group(1)), (
            f"pyproject.toml: protobuf>={gen.group(1)} ({pb2.name})"
        )


def test_generated_code_is_fresh() -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is needed to regenerate")
    from protos.build import generate

    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_bytes() for p in generate(Path(tmp))}
    committed = {p.name: p.read_bytes() for p in PROTOS.glob("*_pb2*.py*")}
    assert sorted(fresh) == sorted(committed), "run `python -m protos.build`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated files {stale}: run `python -m protos.build`"
