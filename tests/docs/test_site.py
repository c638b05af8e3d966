"""The docs site (mkdocs.yml, docs/) builds with ``mkdocs build --strict``: every page in the nav
exists, and every link and anchor resolves. Offline, about a second."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    # NO_MKDOCS_2_WARNING: Material's notice about its end of life, printed on every build
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (
        f"`python {' '.join(command[1:])}` failed (exit {proc.returncode}); its warnings name "
        f"the page and the broken link or missing file:\n{proc.stdout}{proc.stderr}"
    )
