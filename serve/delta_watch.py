"""Follow the deltas an online trainer publishes: apply the newest one of the served base.

``python -m serve --model-dir R/full --watch-deltas R/deltas`` serves the newest full bundle of
``R/full`` (:mod:`serve.versions`) and, every ``--poll-interval-s``, looks in
``R/deltas/<base version>/`` (the layout ``python -m train stream --publish-root R`` writes,
:mod:`train.stream.publish`) for delta directories newer than the one applied. Deltas are
relative to their base (:mod:`shared.delta`), so only the newest matters: it is applied with
the same code as ``ApplyDelta`` (:func:`serve.delta.apply_delta`: every field checked, in place
between batches where the tables have room) on the loader thread, while the old model serves.
The served version is then ``<base>+<delta id>``. When a new full bundle is served, its own
deltas folder is followed. A server that starts (or restarts) serves the newest base plus its
newest delta at once: the state a server that applied every delta live has.

A delta that fails (malformed, for another base, a program that does not run) is refused:
logged, counted (``dynrec_serving_delta_refusals_total``), remembered with its files' stamp
and not tried again until they change; the model serving goes on, and an older delta newer
than the one applied is tried instead. Why watch rather than push (the trainer calling
``ApplyDelta``): any number of replicas follow one root without the trainer knowing them or
holding their admin token, a restarted server catches up by itself, and a server that was
down misses nothing. The root is trusted as ``--model-dir`` is (the operator's file system);
the admin service's ``ApplyDelta`` stays for pushing a delta by hand. Example::

    watcher = DeltaWatcher(manager, Path("pub/deltas"), apply=lambda m, p: apply_delta(m, p))
    watcher.poll()                  # True: a delta was applied
    watcher.start(interval_s=0.5)   # ... and then in a thread until stop()
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from serve.delta import Applied
from serve.model import LoadedModel
from serve.versions import ModelManager, dir_stamp, list_versions

log = logging.getLogger(__name__)


class DeltaWatcher:
    """Applies the newest delta of the served base found under ``root`` (module doc).

    ``apply(model, path)`` builds the successor (:func:`serve.delta.apply_delta`);
    ``on_applied`` / ``on_refused`` are told of each outcome (metrics)."""

    def __init__(
        self,
        manager: ModelManager[LoadedModel],
        root: Path,
        *,
        apply: Callable[[LoadedModel, Path], Applied],
        on_applied: Callable[[Applied], None] | None = None,
        on_refused: Callable[[Path, Exception], None] | None = None,
    ) -> None:
        self.manager, self.root = manager, Path(root)
        self._apply, self._on_applied, self._on_refused = apply, on_applied, on_refused
        # ((id, version) of the base bundle, the delta dir applied to it)
        self._applied: tuple[tuple[int, str], str] | None = None
        self._refused: dict[str, tuple[tuple[str, int, int], ...]] = {}  # path -> stamp
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _folder(self, model: LoadedModel) -> Path | None:
        """``root/<base version>``, or None when the version is no plain directory name."""
        base = model.base_bundle.version
        if not base or base.startswith(".") or "/" in base or "\\" in base:
            return None
        return self.root / base

    def poll(self) -> bool:
        """Apply the newest delta of the served base not applied nor refused; True if one was."""
        model = self.manager.current
        folder = None if model is None else self._folder(model)
        if model is None or folder is None:
            return False
        base_id = (id(model.base_bundle), model.base_bundle.version)
        applied = self._applied[1] if self._applied and self._applied[0] == base_id else None
        for path in list_versions(folder):  # highest first
            if path.name == applied:
                return False  # the newest good one serves
            stamp = dir_stamp(path)
            if self._refused.get(str(path)) == stamp:
                continue
            if self._try(path, stamp):
                self._applied = (base_id, path.name)
                return True
        return False

    def _try(self, path: Path, stamp: tuple[tuple[str, int, int], ...]) -> bool:
        result: list[Applied] = []

        def build(current: LoadedModel) -> LoadedModel:
            result.append(self._apply(current, path))
            return result[0].model

        try:
            self.manager.replace(build)
        except Exception as err:
            self._refused[str(path)] = stamp
            log.error("refused delta %s: %s (the model serving goes on; retried once its files "
                      "change)", path, " ".join(str(err).split())[:500])  # fmt: skip
            if self._on_refused is not None:
                self._on_refused(path, err)
            return False
        self._refused.pop(str(path), None)
        if self._on_applied is not None:
            self._on_applied(result[0])
        return True

    def start(self, interval_s: float) -> None:
        """:meth:`poll` now and every ``interval_s`` in a daemon thread until :meth:`stop`."""

        def run() -> None:
            while True:
                try:
                    self.poll()
                except Exception:
                    log.exception("delta poll of %s failed; will retry", self.root)
                if self._stop.wait(interval_s):
                    return

        self._thread = threading.Thread(target=run, name="delta-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
