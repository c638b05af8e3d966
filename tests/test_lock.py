"""requirements/lock.txt is the whole environment: every dependency pyproject.toml names is pinned
there at a version pyproject.toml admits, with hashes, and the project's venv is exactly the lock."""

import re
import sys
import tomllib
from importlib.metadata import distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"
PROJECT = "dynrec"
# Installed by the venv itself, not by the lock (scripts/env.sh never upgrades it).
NOT_LOCKED = {"pip"}


def _lock() -> dict[str, tuple[Version, int]]:
    """Canonical name -> (pinned version, number of hashes), parsed from the lock's entries."""
    pins: dict[str, tuple[Version, int]] = {}
    name = ""
    for line in LOCK.read_text().splitlines():
        entry = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if entry:
            name = canonicalize_name(entry.group(1))
            assert name not in pins, f"{LOCK.name}: {name} pinned twice"
            pins[name] = (Version(entry.group(2)), 0)
        elif line.strip().startswith("--hash=sha256:") and name:
            version, hashes = pins[name]
            pins[name] = (version, hashes + 1)
        elif line.strip() and not line.lstrip().startswith(("#", "--hash")):
            raise AssertionError(f"{LOCK.name}: not an exact pin: {line!r}")
    return pins


def _declared() -> list[tuple[str, Requirement]]:
    """(where, requirement) for everything pyproject.toml asks for."""
    p = tomllib.loads((ROOT / "pyproject.toml").read_text())
    groups = {
        "[project] dependencies": p["project"]["dependencies"],
        "[tool.dynrec] no-deps": p["tool"]["dynrec"]["no-deps"],
        "[build-system] requires": p["build-system"]["requires"],
        "dev extra": p["project"]["optional-dependencies"]["dev"],
    }
    return [(where, Requirement(text)) for where, reqs in groups.items() for text in reqs]


def test_every_entry_is_an_exact_pin_with_hashes() -> None:
    pins = _lock()
    assert len(pins) > 50, "the lock looks truncated"
    unhashed = sorted(name for name, (_, hashes) in pins.items() if hashes == 0)
    assert not unhashed, f"{LOCK.name}: entries without hashes {unhashed}: run bash scripts/lock.sh"


def test_every_dependency_pyproject_names_is_locked_at_an_admitted_version() -> None:
    pins = _lock()
    missing, excluded = [], []
    for where, req in _declared():
        name = canonicalize_name(req.name)
        if name not in pins:
            missing.append(f"{req} ({where})")
        elif not req.specifier.contains(pins[name][0], prereleases=True):
            excluded.append(f"{req} ({where}) but the lock pins {pins[name][0]}")
    fix = "run `bash scripts/lock.sh` and commit requirements/lock.txt"
    assert not missing, f"pyproject.toml names packages the lock lacks: {missing}; {fix}"
    assert not excluded, f"the lock pins versions pyproject.toml excludes: {excluded}; {fix}"


def test_the_lock_pins_the_torch_cpu_build() -> None:
    """A plain `torch` pin would take the multi-GB CUDA build from PyPI on Linux."""
    version = _lock()["torch"][0]
    assert version.local == "cpu", f"the lock pins torch {version}; expected a +cpu build"


@pytest.mark.skipif(
    Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(),
    reason="checks the project's own .venv (made by scripts/env.sh); this is another environment",
)
def test_the_venv_is_exactly_the_lock() -> None:
    installed = {
        canonicalize_name(d.metadata["Name"]): Version(d.version)
        for d in distributions()
        if canonicalize_name(d.metadata["Name"]) not in NOT_LOCKED | {PROJECT}
    }
    locked = {name: version for name, (version, _) in _lock().items()}
    extra = sorted(f"{n}=={v}" for n, v in installed.items() if locked.get(n) != v)
    absent = sorted(f"{n}=={v}" for n, v in locked.items() if installed.get(n) != v)
    assert not extra and not absent, (
        f"the venv differs from {LOCK.name}: installed but not locked {extra}, locked but not "
        f"installed {absent}; delete .venv and run bash scripts/env.sh"
    )
