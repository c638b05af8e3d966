"""Download, on the CPU machine, the wheels the GPU machine lacks, at the versions of
requirements/lock.txt, so both machines run the same dependencies.

The GPU machine (device tool) has Python 3.12, a CUDA torch 2.11 with its own dependencies, cupy,
numpy, pyarrow, safetensors and pytest, and no package index. It gets everything else the runtime
and the tests need: the closure in the lock of pyproject's [project] dependencies, torchrec and the
test-only packages below, without what the image provides, each verified against the lock's hashes.
Only torchrec and fbgemm-gpu-cpu differ from the lock: their releases are bound to torch's, and the
GPU machine has torch 2.11.

    python scripts/gpu_wheels.py [--dest .whl] [EXTRA==VERSION ...]

Then, in the GPU run: carry [".whl"] and start the command with
    python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl \\
      && export PYTHONPATH=$PWD:$PWD/.site
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"
# Provided by the GPU machine's image (torch 2.11.0+cu130 and what it needs, cupy-cuda13x).
PROVIDED = {"torch", "numpy", "pyarrow", "safetensors", "pytest", "cupy-cuda12x", "cupy-cuda13x"}
# Bound to the torch release: the lock's are for torch 2.13, these match the GPU machine's 2.11.
TORCH_BOUND = {"torchrec": "1.6.1", "fbgemm-gpu-cpu": "1.6.0"}
# Dev packages the tests and benchmarks use on the GPU machine (TLS certs, generated tests, the OIP
# client, pytest's timeout option, py-spy stacks); linters, type checkers and docs tools stay here.
GPU_DEV = ["pytest-timeout", "hypothesis", "cryptography", "tritonclient[grpc,http]", "py-spy"]
# Plots (load-test and training curves) are drawn on the CPU machine from the JSON: matplotlib and
# its stack (27 MB) would not fit the device tool's 64 MiB carry beside the rest.
NOT_ON_GPU = {"matplotlib"}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
PLATFORMS += ["manylinux_2_24_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]


def read_lock(text: str) -> tuple[dict[str, str], dict[str, list[str]], dict[str, set[str]]]:
    """Parse uv's line-annotated lock: name -> version, name -> hashes, name -> its dependents."""
    versions: dict[str, str] = {}
    hashes: dict[str, list[str]] = {}
    via: dict[str, set[str]] = {}
    name = ""
    for line in text.splitlines():
        entry = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if entry:
            name = canonicalize_name(entry.group(1))
            versions[name], hashes[name], via[name] = entry.group(2), [], set()
        elif m := re.match(r"\s+--hash=(sha256:[0-9a-f]+)", line):
            hashes[name].append(m.group(1))
        elif m := re.match(r"\s+# via (.+)", line):
            for parent in m.group(1).split(","):
                via[name].add(canonicalize_name(parent.strip().split(" ")[0]))
    return versions, hashes, via


def closure(roots: list[str], via: dict[str, set[str]], versions: dict[str, str]) -> list[str]:
    """Roots plus everything they need in the lock, not descending into what the GPU provides."""
    children: dict[str, set[str]] = {n: set() for n in versions}
    for child, parents in via.items():
        for parent in parents & children.keys():
            children[parent].add(child)
    todo = [canonicalize_name(Requirement(r).name) for r in roots]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name in PROVIDED | NOT_ON_GPU:
            continue
        if name not in versions:
            raise SystemExit(f"{name} is not in {LOCK}: run bash scripts/lock.sh")
        seen.add(name)
        todo.extend(children[name])
    return sorted(seen)


def download(requirements: list[str], dest: Path, *, hashed: bool) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write("\n".join(requirements) + "\n")
        f.flush()
        # --prefer-binary, not --only-binary: a few pure-Python packages (iopath) are sdists only.
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--prefer-binary"]
        cmd += ["--python-version", "3.12", "--implementation", "cp", "-d", str(dest), "-r", f.name]
        cmd += [arg for p in PLATFORMS for arg in ("--platform", p)]
        cmd += ["--require-hashes"] if hashed else []
        subprocess.run(cmd, check=True)  # a failed download fails the script


def build_sdists(dest: Path) -> None:
    """The GPU machine installs wheels only: build the pure-Python sdists into wheels here."""
    for sdist in sorted(dest.glob("*.tar.gz")):
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), str(sdist)]
        subprocess.run(cmd, check=True)
        sdist.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl", help="wheel folder (.whl)")
    parser.add_argument("extra", nargs="*", help="more packages as NAME==VERSION (no deps)")
    args = parser.parse_args(argv)
    versions, hashes, via = read_lock(LOCK.read_text())
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    roots = pyproject["project"]["dependencies"] + pyproject["tool"]["dynrec"]["no-deps"]
    names = closure(roots + GPU_DEV, via, versions)
    locked = [
        f"{n}=={versions[n]} " + " ".join(f"--hash={h}" for h in hashes[n])
        for n in names
        if n not in TORCH_BOUND
    ]
    unlocked = [f"{n}=={v}" for n, v in TORCH_BOUND.items()] + list(args.extra)
    args.dest.mkdir(parents=True, exist_ok=True)
    download(locked, args.dest, hashed=True)
    download(unlocked, args.dest, hashed=False)
    build_sdists(args.dest)
    print(f"{len(locked)} locked + {len(unlocked)} GPU-specific wheels in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
