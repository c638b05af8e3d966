"""The committed *_pb2 files must be what protos/build.py generates from the .proto sources."""

import tempfile
from pathlib import Path

import pytest

PROTOS = Path(__file__).resolve().parents[2] / "protos"


def test_generated_code_is_fresh() -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is needed to regenerate")
    from protos.build import generate

    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_bytes() for p in generate(Path(tmp))}
    committed = {p.name: p.read_bytes() for p in PROTOS.glob("*_pb2*.py*")}
    assert sorted(fresh) == sorted(committed), "run `python -m protos.build`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated files {stale}: run `python -m protos.build`"
