"""Model versions: load one bundle, or watch a directory of versioned bundles and hot-swap.

A watched directory holds one bundle per version, ``<model_dir>/<version>/manifest.json``
(hidden entries such as the bundle writer's ``.v3.tmp-*`` are skipped). The highest version by
natural order (``2`` < ``10``, ``step-999`` < ``step-1000``) that loads is served. A new one is
loaded and warmed up in a background thread while the old one keeps serving, then swapped in by
one reference assignment: requests already accepted keep the model they were validated against
(the batcher never mixes versions in one batch), so in-flight requests finish on the old
version. A bundle that fails to load is refused (logged, ``model_loads_total{result="refused"}``)
and remembered by its manifest's mtime, so it is retried only when rewritten.
A serving model can also be replaced by a successor built from it on the same loader priority
(:meth:`ModelManager.replace`: delta updates, :mod:`serve.delta`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from serve.model import LoadedModel
from shared.bundle.layout import MANIFEST

log = logging.getLogger(__name__)

Loader = Callable[[Path], LoadedModel]


def version_key(name: str) -> tuple[object, ...]:
    """Natural sort key: digit runs compare as numbers."""
    return tuple(
        (0, int(part), "") if part.isdigit() else (1, 0, part)
        for part in re.split(r"(\d+)", name)
        if part
    )


def list_versions(model_dir: Path) -> list[Path]:
    """Complete bundles under ``model_dir`` (those with a manifest), highest version first."""
    if not model_dir.is_dir():
        return []
    found = [
        p
        for p in model_dir.iterdir()
        if not p.name.startswith(".") and p.is_dir() and (p / MANIFEST).is_file()
    ]
    return sorted(found, key=lambda p: version_key(p.name), reverse=True)


def _stamp(path: Path) -> tuple[str, int]:
    try:
        return str(path), (path / MANIFEST).stat().st_mtime_ns
    except OSError:
        return str(path), -1


class ModelManager:
    """Holds the current :class:`LoadedModel` and replaces it when a better version appears.

    ``on_loaded(model)`` / ``on_refused(path, error)`` are called after each load attempt.
    """

    def __init__(
        self,
        loader: Loader,
        *,
        on_loaded: Callable[[LoadedModel], None] | None = None,
        on_refused: Callable[[Path, Exception], None] | None = None,
    ) -> None:
        self._loader = loader
        self._on_loaded = on_loaded
        self._on_refused = on_refused
        self._current: LoadedModel | None = None
        self._current_stamp: tuple[str, int] | None = None
        self._refused: set[tuple[str, int]] = set()
        self._load_lock = threading.Lock()  # one load at a time
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._builder: ThreadPoolExecutor | None = None  # replace(): one niced thread
        self.ready = threading.Event()  # set once a model is serving

    @property
    def current(self) -> LoadedModel | None:
        return self._current

    def load(self, path: Path) -> bool:
        """Load ``path`` and swap it in; False (old one kept) if it fails. Blocking."""
        stamp = _stamp(path)
        with self._load_lock:
            try:
                model = self._loader(path)
            except Exception as err:
                self._refused.add(stamp)
                log.error("refused model bundle %s: %s", path, err)
                if self._on_refused is not None:
                    self._on_refused(path, err)
                return False
            old = self._current
            self._current, self._current_stamp = model, stamp  # the atomic swap
            self.ready.set()
        log.info(
            "serving model %s from %s (previous: %s)",
            model.version,
            path,
            None if old is None else old.version,
        )
        if self._on_loaded is not None:
            self._on_loaded(model)
        return True

    def replace(self, build: Callable[[LoadedModel], LoadedModel]) -> LoadedModel:
        """Build a successor of the serving model and swap it in (e.g. base + a delta,
        :mod:`serve.delta`); blocking, errors propagate and the old model keeps serving.

        ``build(current)`` runs on a loader thread of lower priority (as the watcher), one load
        or replace at a time. The watcher keeps the base bundle's stamp, so it does not reload
        the base over the successor; a newer bundle version still replaces both.
        """
        with self._load_lock:
            current = self._current
            if current is None:
                raise RuntimeError("no model is serving yet; retry when SERVING")
            if self._builder is None:
                self._builder = ThreadPoolExecutor(
                    1, thread_name_prefix="model-build", initializer=_lower_priority
                )
            model = self._builder.submit(build, current).result()
            self._current = model  # the atomic swap
        log.info("serving model %s (replaced %s in place)", model.version, current.version)
        if self._on_loaded is not None:
            self._on_loaded(model)
        return model

    def poll(self, model_dir: Path) -> bool:
        """Serve the highest loadable version of ``model_dir``; True if it changed the model."""
        for path in list_versions(model_dir):
            stamp = _stamp(path)
            if stamp == self._current_stamp:
                return False  # the best candidate is the one serving
            if stamp in self._refused:
                continue
            if self.load(path):
                return True
        return False

    def watch(self, model_dir: Path, interval_s: float = 2.0) -> None:
        """Poll ``model_dir`` every ``interval_s`` in a daemon thread until :meth:`stop`."""

        def run() -> None:
            _lower_priority()
            while not self._stop.wait(interval_s):
                try:
                    self.poll(model_dir)
                except Exception:
                    log.exception("model directory poll failed; will retry")

        self._watcher = threading.Thread(target=run, name="model-watcher", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
        if self._builder is not None:
            self._builder.shutdown(wait=False)


def _lower_priority() -> None:
    """Nice the calling thread (Linux: per thread) so loading competes less with serving."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
