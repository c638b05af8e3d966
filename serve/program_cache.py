"""Reuse the loaded dense program when a new version has the same graph and only new weights.

Deserializing ``dense.pt2`` (``torch.export.load``) is a few hundred milliseconds of pure Python
that holds the GIL, so during a hot swap it slows the requests served meanwhile. A retrained
model usually keeps its architecture: the archive then differs from the loaded one only in its
weight files. This cache keeps, per device, the last program loaded and a digest of its archive
without the weight payloads (graph, signature, weight/constant metadata); when a new archive has
the same digest, it copies the module (``copy.deepcopy``, a fraction of the cost) and fills in
the new weights read straight from the archive. Anything unexpected (pickled weights, a size
mismatch, an unknown layout) falls back to the full load, so the cache can only save time.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# archive entries that differ between two saves of the same program and do not affect it
_VOLATILE = (".data/serialization_id", "data/sample_inputs/")
_WEIGHTS_DIR = "data/weights/"
_WEIGHTS_CONFIG = "data/weights/model_weights_config.json"

# full load: (module, whether it takes keyword inputs)
Loader = Callable[[Path, torch.device], tuple[torch.nn.Module, bool]]


@dataclass
class _Entry:
    digest: str
    module: torch.nn.Module
    keyword: bool


def _strip(name: str) -> str:
    """Entry name without the archive's top folder (``dense/models/model.json`` → ``models/...``)."""
    return name.split("/", 1)[1] if "/" in name else name


def archive_digest(zf: zipfile.ZipFile) -> str:
    """sha256 over every entry except weight payloads and volatile ones (names and bytes)."""
    h = hashlib.sha256()
    for info in sorted(zf.infolist(), key=lambda i: _strip(i.filename)):
        name = _strip(info.filename)
        is_payload = name.startswith(_WEIGHTS_DIR) and name != _WEIGHTS_CONFIG
        if is_payload or name.startswith(_VOLATILE):
            continue
        h.update(name.encode() + b"\0" + zf.read(info.filename) + b"\0")
    return h.hexdigest()


def _new_weights(zf: zipfile.ZipFile, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The archive's weights as CPU tensors shaped like ``module``'s, or None if not plain."""
    prefix = {_strip(i.filename): i.filename for i in zf.infolist()}
    if _WEIGHTS_CONFIG not in prefix:
        return None
    config = json.loads(zf.read(prefix[_WEIGHTS_CONFIG]))["config"]
    state = module.state_dict(keep_vars=True)
    out: dict[str, torch.Tensor] = {}
    for fqn, entry in config.items():
        target = state.get(fqn)
        path = prefix.get(_WEIGHTS_DIR + str(entry.get("path_name")))
        if entry.get("use_pickle") or target is None or path is None or not target.is_contiguous():
            return None
        data = zf.read(path)
        if len(data) != target.numel() * target.element_size():
            return None
        out[fqn] = torch.frombuffer(bytearray(data), dtype=target.dtype).view(target.shape)
    return out if set(out) == set(config) else None


def program_digest(path: Path) -> str:
    """:func:`archive_digest` of the ``dense.pt2`` at ``path``: equal for two archives of the same
    graph, whatever their weights."""
    with zipfile.ZipFile(path) as zf:
        return archive_digest(zf)


def same_graph_weights(
    path: Path, module: torch.nn.Module, digest: str | None
) -> dict[str, torch.Tensor] | None:
    """The weights of the archive at ``path`` as CPU tensors shaped like ``module``'s, when the
    archive holds the graph ``digest`` names (:func:`archive_digest`); None for another graph
    or weights that are not plain (pickled, of another size, another layout)."""
    with zipfile.ZipFile(path) as zf:
        return _new_weights(zf, module) if archive_digest(zf) == digest else None


def refill(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` (:func:`same_graph_weights`) into ``module``'s own tensors, in place."""
    with torch.no_grad():
        for fqn, value in module.state_dict(keep_vars=True).items():
            if fqn in weights:
                value.copy_(weights[fqn])


class ProgramCache:
    """``load(path, device, full_load)`` → (module, keyword inputs, digest); reuses the last module
    loaded for ``device`` when the new archive has the same digest."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self.reused = 0  # loads served by the fast path (for tests and logs)

    def load(
        self, path: Path, device: torch.device, full_load: Loader
    ) -> tuple[torch.nn.Module, bool, str]:
        """(module, keyword inputs, the archive's digest: :func:`program_digest`)."""
        with zipfile.ZipFile(path) as zf:
            digest = archive_digest(zf)
            with self._lock:
                entry = self._entries.get(str(device))
            if entry is not None and entry.digest == digest:
                weights = _new_weights(zf, entry.module)
                if weights is not None:
                    module = copy.deepcopy(entry.module)
                    refill(module, weights)
                    self.reused += 1
                    return module, entry.keyword, digest
        module, keyword = full_load(path, device)
        with self._lock:
            self._entries[str(device)] = _Entry(digest, module, keyword)
        return module, keyword, digest
