"""Names, constants and small helpers of the bundle format, shared by its writer and reader."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

BUNDLE_FORMAT = "dynrec-bundle"
MANIFEST = "manifest.json"
FG_JSON = "fg.json"
DENSE_PROGRAM = "dense.pt2"
DEFAULT_MAX_SHARD_BYTES = 4 << 30

VERSION_RE = re.compile(r"^[A-Za-z0-9._:+-]{1,128}$")
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


class BundleError(ValueError):
    """A bundle that cannot be written or read; the message names the file/table and the fix."""


def check_unique(table: str, keys: torch.Tensor, where: str) -> None:
    """Refuse a hashmap table holding a key twice (numpy sort: fast, no torch warm-up)."""
    if keys.numel() < 2:
        return
    s = np.sort(keys.numpy())
    dup = s[1:] == s[:-1]
    if dup.any():
        raise BundleError(
            f"{where}: table {table!r}: duplicate keys in a hashmap table ({int(dup.sum())} "
            f"repeats, e.g. {int(s[1:][dup][0])}); each key must appear once across all parts: "
            "deduplicate before export"
        )


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_json(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BundleError(f"{path}: unreadable JSON ({err}); re-export the bundle") from None
    if not isinstance(obj, dict):
        raise BundleError(
            f"{path}: expected a JSON object, got {type(obj).__name__}; re-export the bundle"
        )
    return obj


def write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
