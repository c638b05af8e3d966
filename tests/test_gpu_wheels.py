"""scripts/gpu_wheels.py: the GPU machine's wheel list is derived from requirements/lock.txt."""

import importlib.util
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "scripts" / "gpu_wheels.py")
assert _spec is not None and _spec.loader is not None
gpu_wheels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_wheels)

LOCK = """\
grpcio==1.85.4 \\
    --hash=sha256:aa \\
    --hash=sha256:bb
    # via dynrec (pyproject.toml), grpcio-health-checking
grpcio-health-checking==1.85.1 \\
    --hash=sha256:cc
    # via dynrec (pyproject.toml)
jinja2==3.1.6 \\
    --hash=sha256:dd
    # via torch, mkdocs
mkdocs==1.6.1 \\
    --hash=sha256:ee
    # via dynrec (pyproject.toml)
torch==2.13.0+cpu \\
    --hash=sha256:ff
    # via dynrec (pyproject.toml)
"""


def test_read_lock_keeps_versions_hashes_and_dependents() -> None:
    versions, hashes, via = gpu_wheels.read_lock(LOCK)
    assert versions["grpcio"] == "1.85.4" and versions["torch"] == "2.13.0+cpu"
    assert hashes["grpcio"] == ["sha256:aa", "sha256:bb"]
    assert via["grpcio"] == {"dynrec", "grpcio-health-checking"}
    assert via["jinja2"] == {"torch", "mkdocs"}


def test_closure_follows_the_lock_and_stops_at_what_the_gpu_machine_has() -> None:
    versions, _, via = gpu_wheels.read_lock(LOCK)
    # torch is provided there: its dependency jinja2 is not shipped; mkdocs is not a root.
    assert gpu_wheels.closure(["grpcio-health-checking", "torch"], via, versions) == [
        "grpcio",
        "grpcio-health-checking",
    ]


def test_the_real_lock_ships_the_runtime_and_the_gpu_tests_needs() -> None:
    versions, _, via = gpu_wheels.read_lock((ROOT / "requirements" / "lock.txt").read_text())
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    roots = pyproject["project"]["dependencies"] + pyproject["tool"]["dynrec"]["no-deps"]
    names = set(gpu_wheels.closure(roots + gpu_wheels.GPU_DEV, via, versions))
    for needed in ("grpcio", "grpcio-health-checking", "locust", "torchrec", "tritonclient"):
        assert needed in names
    for not_shipped in ("torch", "numpy", "pyarrow", "matplotlib", "ruff", "mypy", "mkdocs"):
        assert not_shipped not in names
