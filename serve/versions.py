"""Model versions: load one bundle, or watch a directory of versioned bundles and hot-swap.

A watched directory holds one bundle per version, ``<model_dir>/<version>/manifest.json``
(hidden entries such as the bundle writer's ``.v3.tmp-*`` are skipped). The highest version by
natural order (``2`` < ``10``, ``step-999`` < ``step-1000``) that loads is served. A new one is
loaded and warmed up in a background thread while the old one keeps serving, then swapped in by
one reference assignment: requests already accepted keep the model they were validated against
(the batcher never mixes versions in one batch), so in-flight requests finish on the old
version.

Each version directory is compared by its *stamp*: every file's relative name, size and
modification time (a bundle has a handful of files, so this is cheap). A version is loaded only
once its stamp is the same on two consecutive polls, so a copy still being written (for example
one that lands ``manifest.json`` first) is waited for; the first poll (startup) loads at once.
While the best version is being written the current model keeps serving; nothing lower is
loaded meanwhile. A bundle that fails to load is refused (logged with its version and reason,
``model_loads_total{result="refused"}``, :attr:`ModelManager.last_refusal`) and retried only
once its directory has changed and then stopped changing.
A serving model can also be replaced by a successor built from it on the same loader priority
(:meth:`ModelManager.replace`: delta updates, :mod:`serve.delta`).

A replaced model is *retired*: held for :data:`RETIRE_AFTER_S` more (the requests validated
against it finish on it), then handed to ``on_retired`` and dropped on a timer thread of the
loader's priority. So its teardown (a CUDA model's graphs, tables and program) does not land on
whichever serving thread lets go of it last, nor on a garbage collection in the middle of a
request (a model and its graphs refer to each other: ``on_retired`` breaks such cycles).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from shared.bundle.layout import MANIFEST

log = logging.getLogger(__name__)

REASON_CHARS = 500  # Refusal.reason is cut to this many characters
RETIRE_AFTER_S = 2.0  # a replaced model is dropped this long after the swap


class Versioned(Protocol):
    """What :class:`ModelManager` needs of a model: its version, for logs and swaps."""

    @property
    def version(self) -> str: ...


M = TypeVar("M", bound=Versioned)

# (relative file name, size, mtime_ns) of every file of a version directory, sorted
_Stamp = tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class Refusal:
    """A version that failed to load: which, from where, why (one line), and when."""

    version: str  # the version directory's name
    path: Path
    reason: str  # the error's text on one line, at most REASON_CHARS characters
    at_unix: float  # time.time() of the refusal


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


def _dir_stamp(path: Path) -> _Stamp:
    """Name, size and mtime_ns of every file under ``path``, recursively, sorted.

    An entry that cannot be read (removed mid-walk, no permission) counts as ``(name, -1, -1)``,
    so a directory that stays unreadable still has a stable stamp (and is refused once).
    """
    found: list[tuple[str, int, int]] = []
    folders = [(path, "")]
    while folders:
        folder, prefix = folders.pop()
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError:
            found.append((prefix, -1, -1))
            continue
        for entry in entries:
            name = prefix + entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    folders.append((Path(entry.path), name + "/"))
                    continue
                st = entry.stat()
            except OSError:
                found.append((name, -1, -1))
                continue
            found.append((name, st.st_size, st.st_mtime_ns))
    return tuple(sorted(found))


def dir_stamp(path: Path) -> _Stamp:
    """The stamp of ``path`` (:func:`_dir_stamp`): what tells a changed directory."""
    return _dir_stamp(path)


def _one_line(err: BaseException, limit: int = REASON_CHARS) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


class ModelManager(Generic[M]):
    """Holds the current model and replaces it when a better version appears.

    ``loader(path)`` builds a model from a bundle directory (the server's wraps
    :meth:`serve.model.LoadedModel.load`; anything with a ``version`` will do, tests use stubs);
    ``on_loaded(model)`` / ``on_refused(path, error)`` are called after each load attempt,
    ``on_retired(model)`` when a replaced model is dropped (module docstring).
    :attr:`last_refusal` and :attr:`refusals` say which bundle was refused last, and why.
    """

    def __init__(
        self,
        loader: Callable[[Path], M],
        *,
        on_loaded: Callable[[M], None] | None = None,
        on_refused: Callable[[Path, Exception], None] | None = None,
        on_retired: Callable[[M], None] | None = None,
    ) -> None:
        self._loader = loader
        self._on_loaded = on_loaded
        self._on_refused = on_refused
        self._on_retired = on_retired
        # replaced models waiting for retirement: (timer, [model] until retired)
        self._retiring: list[tuple[threading.Timer, list[M]]] = []
        self._retire_lock = threading.Lock()
        self._current: M | None = None
        self._current_stamp: tuple[str, _Stamp] | None = None  # (path, stamp) it was loaded from
        self._refused: dict[str, _Stamp] = {}  # path -> its stamp when refused
        self._last_refusal: Refusal | None = None
        self._refusals = 0
        # stamps of the versions looked at by the previous poll; None: no poll yet
        self._seen: dict[str, _Stamp] | None = None
        self._load_lock = threading.Lock()  # one load at a time
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._builder: ThreadPoolExecutor | None = None  # replace(): one niced thread
        self.ready = threading.Event()  # set once a model is serving

    @property
    def current(self) -> M | None:
        return self._current

    @property
    def last_refusal(self) -> Refusal | None:
        """The most recent refused load (kept after that version loads later), or None."""
        return self._last_refusal

    @property
    def refusals(self) -> int:
        """How many load attempts were refused since start (retries count again)."""
        return self._refusals

    def load(self, path: Path) -> bool:
        """Load ``path`` and swap it in; False (old one kept) if it fails. Blocking."""
        return self._load(path, _dir_stamp(path))

    def _load(self, path: Path, stamp: _Stamp) -> bool:
        # ``stamp`` is taken before loading: files that change during the load change the stamp
        # again, so a refused bundle that was completed meanwhile is retried.
        with self._load_lock:
            try:
                model = self._loader(path)
            except Exception as err:
                refusal = Refusal(path.name, path, _one_line(err), time.time())
                self._refused[str(path)] = stamp
                self._last_refusal, self._refusals = refusal, self._refusals + 1
                log.error(
                    "refused model %s from %s: %s (retried once the directory changes)",
                    refusal.version,
                    path,
                    refusal.reason,
                )
                if self._on_refused is not None:
                    self._on_refused(path, err)
                return False
            self._refused.pop(str(path), None)
            old = self._current
            self._current, self._current_stamp = model, (str(path), stamp)  # the atomic swap
            self.ready.set()
            self._retire(old)
        log.info(
            "serving model %s from %s (previous: %s)",
            model.version,
            path,
            None if old is None else old.version,
        )
        if self._on_loaded is not None:
            self._on_loaded(model)
        return True

    def replace(self, build: Callable[[M], M]) -> M:
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
            self._retire(current)
        log.info("serving model %s (replaced %s without a restart)", model.version, current.version)
        if self._on_loaded is not None:
            self._on_loaded(model)
        return model

    def _retire(self, old: M | None) -> None:
        """Hold ``old`` for RETIRE_AFTER_S, then retire it on a timer thread (under the lock)."""
        if old is None:
            return
        held = [old]  # emptied by the retirement: a fired timer keeps no model alive

        def drop() -> None:
            _lower_priority()
            self._retire_now(held)

        self._retiring = [(t, h) for t, h in self._retiring if h]
        timer = threading.Timer(RETIRE_AFTER_S, drop)
        timer.daemon = True
        timer.name = f"model-retire-{old.version}"
        self._retiring.append((timer, held))
        timer.start()

    def _retire_now(self, held: list[M]) -> None:
        with self._retire_lock:  # at most one of the timer and stop()
            if not held:
                return
            old = held.pop()
        start = time.perf_counter()
        version = old.version
        if self._on_retired is not None:
            try:
                self._on_retired(old)
            except Exception:
                log.exception("retiring model %s failed", version)
        del old  # the last reference, unless kept as the spare: its memory is freed here
        log.info("model %s retired in %.1f ms", version, (time.perf_counter() - start) * 1e3)

    def poll(self, model_dir: Path) -> bool:
        """Serve the highest loadable version of ``model_dir``; True if it changed the model.

        Versions are tried highest first. One refused and unchanged since is skipped. One whose
        stamp differs from the previous poll's (new, or still being written) ends this poll:
        the next poll loads it if it stood still. The first poll loads without waiting.
        """
        first = self._seen is None
        previous = self._seen or {}
        seen: dict[str, _Stamp] = {}
        self._seen = seen  # only the versions looked at; the others are stamped when needed
        for path in list_versions(model_dir):
            key = str(path)
            stamp = seen[key] = _dir_stamp(path)
            if self._current_stamp == (key, stamp):
                return False  # the best candidate is the one serving
            refused = self._refused.get(key)
            if refused == stamp:
                continue  # refused, and unchanged since
            if not first and previous.get(key) != stamp:
                log.debug("model %s in %s is new or changing; next poll", path.name, path)
                return False  # wait for it rather than load a lower version meanwhile
            if refused is not None:
                log.info("retrying refused model %s from %s: its files changed", path.name, path)
            if self._load(path, stamp):
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
        for timer, held in self._retiring:  # retire now what still waits
            timer.cancel()
            self._retire_now(held)
        self._retiring.clear()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
        if self._builder is not None:
            self._builder.shutdown(wait=False)


def _lower_priority() -> None:
    """Nice the calling thread (Linux: per thread) so loading competes less with serving."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
