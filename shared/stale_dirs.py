"""Remove the temp dirs that killed runs left behind (a checkpoint's ``.step_N.*``, a bundle's
``.<name>.tmp-*``), and nothing else.

A writer makes its temp dir beside the destination and renames it when complete; a process
killed in between leaves the temp dir forever. At its start a writer calls
:func:`remove_stale_dirs` with its own temp-name pattern: a matching directory whose newest
mtime (the dir and everything in it) is older than this process is from an earlier process, and
goes. A temp dir of a run still writing is newer (its files change), so it stays.

    remove_stale_dirs(root / "checkpoints", re.compile(r"^\\.step_\\d+\\.[a-z0-9_]+$"))
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)

# when this process started (as far as it matters): every temp dir it writes is created after its
# writers imported this module, so anything last modified before is another process's
PROCESS_START = time.time()


def _newest_mtime(path: Path) -> float:
    newest = path.stat().st_mtime
    for parent, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            try:
                newest = max(newest, os.lstat(os.path.join(parent, name)).st_mtime)
            except FileNotFoundError:  # removed meanwhile
                continue
    return newest


def remove_stale_dirs(
    root: Path, pattern: re.Pattern[str], *, before: float = PROCESS_START
) -> list[Path]:
    """Remove the directories directly in ``root`` whose name matches ``pattern`` and whose
    newest mtime is older than ``before`` (default: this process's start); log one line naming
    them and return them. Files, links, other names and newer dirs are never touched."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed: list[Path] = []
    for path in sorted(root.iterdir()):
        if not pattern.match(path.name) or path.is_symlink() or not path.is_dir():
            continue
        try:
            if _newest_mtime(path) >= before:
                continue
        except FileNotFoundError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        log.info(
            "removed %d stale temp dir(s) of killed runs in %s: %s",
            len(removed),
            root,
            ", ".join(p.name for p in removed),
        )
    return removed
