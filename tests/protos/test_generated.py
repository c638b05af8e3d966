"""The committed *_pb2 files must be what protos/build.py generates from the .proto sources,
and pyproject.toml must ask for the runtimes they were generated for.

Freshness ignores the patch release of the generator: grpcio-tools writes its own version into
``GRPC_GENERATED_VERSION``, and a lock that moves grpcio-tools from 1.85.1 to 1.85.4 changes that
line and nothing else. The line is compared normalized, and checked on its own against pyproject's
floor (the generated module refuses to import under an older grpcio)."""

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
    assert _floor("grpcio") >= want, f"pyproject.toml: grpcio>={grpc_gen.group(1)}"
    for pb2 in sorted(PROTOS.glob("*_pb2.py")):
        gen = re.search(r"Protobuf Python Version: ([\d.]+)", pb2.read_text())
        assert gen is not None, pb2.name
        assert _floor("protobuf") >= _version(gen.group(1)), (
            f"pyproject.toml: protobuf>={gen.group(1)} ({pb2.name})"
        )


_GENERATED_VERSION = re.compile(rb"^GRPC_GENERATED_VERSION = '[\d.]+'$", re.MULTILINE)


def _normalized(code: bytes) -> bytes:
    return _GENERATED_VERSION.sub(b"GRPC_GENERATED_VERSION = '<generator>'", code)


def test_normalization_hides_only_the_generator_version() -> None:
    a = b"x = 1\nGRPC_GENERATED_VERSION = '1.85.1'\ny = 2\n"
    assert _normalized(a) == _normalized(a.replace(b"1.85.1", b"1.85.4"))
    assert _normalized(a) != _normalized(a.replace(b"y = 2", b"y = 3"))


def test_generated_code_is_fresh() -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is needed to regenerate")
    from protos.build import generate

    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_bytes() for p in generate(Path(tmp))}
    committed = {p.name: p.read_bytes() for p in PROTOS.glob("*_pb2*.py*")}
    assert sorted(fresh) == sorted(committed), "run `python -m protos.build`"
    stale = [name for name in fresh if _normalized(fresh[name]) != _normalized(committed[name])]
    assert not stale, f"stale generated files {stale}: run `python -m protos.build`"
