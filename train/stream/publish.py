"""Publishing a streamed model: a full bundle every K deltas, deltas in between.

Layout of the publish root (``--publish-root R``; servers follow it with ``python -m serve
--model-dir R/full --watch-deltas R/deltas``, :mod:`serve.delta_watch`)::

    R/full/step-<N>/                 full bundles (train.export), version "step-<N>"
    R/deltas/step-<N>/step-<M>/      deltas of checkpoint step M against bundle step-<N>

A delta holds the rows changed since its base bundle, the base keys the trainer no longer holds
(evicted: the tombstones) and the dense program when its weights changed; its manifest carries
the event time of the newest trained row (:mod:`shared.delta`). Deltas are relative to their
base, not to the delta before (the apply path of the server is base + delta): a server that
starts, restarts or missed a delta needs the base and the newest delta only, and a delta grows
with the rows changed since the base; a new full bundle every ``full_every`` deltas bounds that.
Every publish is of a committed checkpoint (:mod:`train.stream.trainer` checkpoints first), so
what is served never holds rows that a restart after a crash trains again. Both writers are
atomic (temporary directory, one rename), and the trainer's state of publishing is read back
from the root, so a restarted trainer goes on where it stopped.

Off the training loop: the loop only takes the checkpoint's snapshot (the device -> host copies
of one step's state, :func:`train.checkpoint.snapshot`); a thread writes the checkpoint and a
process of its own (spawned once, kept) exports the bundle or delta from it: restoring the
model, diffing the tables against the base and ``torch.export`` of the dense part hold the GIL
for seconds, which in a thread would stall the loop. One publish at a time: the next is due
only once the one before is in place. Example::

    publisher = Publisher(config_path, PublishOptions(root=Path("pub"), every_s=10))
    if publisher.due(step, time.monotonic()):
        publisher.submit(checkpoint_future, step)   # returns at once
    record = publisher.collect()   # {"what": "full"|"delta", ...} once it is in place, or None
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train.data.loader import die_with_parent
from train.export import export_bundle
from train.export_cache import ExportCache
from train.tools.delta import export_delta

log = logging.getLogger(__name__)

_STEP_NAME = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class PublishOptions:
    """When and where to publish (:mod:`train.stream.publish`)."""

    root: Path
    every_s: float | None = None  # publish when this many seconds passed since the last one
    every_steps: int | None = None  # ... or this many steps
    full_every: int = 10  # a full bundle after this many deltas on the same base

    def __post_init__(self) -> None:
        if self.every_s is None and self.every_steps is None:
            raise ValueError(
                "--publish-root needs --publish-every-s SECONDS or --publish-every-steps N"
            )
        if self.every_s is not None and self.every_s <= 0:
            raise ValueError(f"--publish-every-s must be > 0, got {self.every_s}")
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"--publish-every-steps must be >= 1, got {self.every_steps}")
        if self.full_every < 0:
            raise ValueError(f"--full-every must be >= 0 (0: every publish full), got "
                             f"{self.full_every}")  # fmt: skip


def _steps(folder: Path) -> list[int]:
    """Steps of the complete ``step-<N>`` entries of ``folder`` (manifest written), ascending."""
    if not folder.is_dir():
        return []
    found = (_STEP_NAME.match(p.name) for p in folder.iterdir())
    return sorted(int(m.group(1)) for m in found if m and (folder / m.group(0) / "manifest.json")
                  .is_file())  # fmt: skip


class Publisher:
    """Writes the publishes of one stream (module doc) and says when the next is due."""

    def __init__(self, config_path: Path, options: PublishOptions) -> None:
        self.config_path, self.options = config_path, options
        self.full_root, self.delta_root = options.root / "full", options.root / "deltas"
        self._last_time = time.monotonic()
        done = _steps(self.full_root)
        self._base: int | None = done[-1] if done else None
        self._deltas = len(self._delta_steps())
        self._last_step = max([*done, *self._delta_steps()], default=-1)
        self._threads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")
        # the exports: a process spawned once (no CUDA, no fork of a CUDA process), kept warm
        self._process = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            # killed with the trainer: an export left running would write a publish that the
            # restarted trainer writes again
            initializer=die_with_parent,
            initargs=(os.getpid(),),
        )
        self._process.submit(_warm)
        self._pending: Future[dict[str, Any]] | None = None

    def _delta_steps(self) -> list[int]:
        return [] if self._base is None else _steps(self.delta_root / f"step-{self._base}")

    @property
    def last_step(self) -> int:
        """The step of the newest publish submitted (-1: none yet)."""
        return self._last_step

    @property
    def busy(self) -> bool:
        """A publish is being written."""
        return self._pending is not None and not self._pending.done()

    def due(self, step: int, now: float) -> bool:
        """Whether a publish is due at ``step`` (``now``: time.monotonic()); never while one
        is being written."""
        if step <= self._last_step or self._pending is not None:
            return False  # nothing trained since, or the last one not collected yet
        o = self.options
        by_time = o.every_s is not None and now - self._last_time >= o.every_s
        by_steps = o.every_steps is not None and step - max(self._last_step, 0) >= o.every_steps
        return by_time or by_steps

    def submit(self, checkpoint: Future[Path] | Path, step: int) -> None:
        """Publish the checkpoint of ``step`` (written by ``checkpoint``'s future, or already
        there) in the background: a full bundle when there is no base yet or it has
        ``full_every`` deltas, else a delta against the base. :meth:`collect` gives its record."""
        if self._pending is not None:
            raise RuntimeError("a publish is pending: collect() it before the next submit()")
        full = self._base is None or self._deltas >= self.options.full_every
        base = step if full else self._base
        assert base is not None
        self._base, self._deltas = base, 0 if full else self._deltas + 1
        self._last_step, self._last_time = step, time.monotonic()
        self._pending = self._threads.submit(self._run, checkpoint, full, base, step)

    def _run(
        self, checkpoint: Future[Path] | Path, full: bool, base: int, step: int
    ) -> dict[str, Any]:
        t0 = time.perf_counter()
        path = checkpoint.result() if isinstance(checkpoint, Future) else checkpoint
        t1 = time.perf_counter()
        job = (str(self.config_path), full, str(self.full_root), str(self.delta_root), base)
        record = self._process.submit(export, *job, str(path), step).result()
        record["checkpoint_seconds"] = t1 - t0  # waiting for the checkpoint's files
        record["publish_seconds"] = time.perf_counter() - t0  # snapshot to files in place
        log.info("published %s %s in %.2f s", record["what"], record["version"],
                 record["publish_seconds"])  # fmt: skip
        return record

    def collect(self, *, wait: bool = False) -> dict[str, Any] | None:
        """The record of the publish submitted last, once it is in place (``wait``: wait for
        it); None when none is pending or it is still being written. Raises its error."""
        pending = self._pending
        if pending is None or (not wait and not pending.done()):
            return None
        self._pending = None
        return pending.result()

    def close(self) -> None:
        """Wait for the pending publish (its error is dropped: collect() first to see it), then
        end the thread and the export process."""
        self._threads.shutdown(wait=True)
        self._process.shutdown(wait=True)


def _warm() -> None:
    """Nothing: the import of this module (torch, the exporters) in the spawned process."""


# the export process's: the base bundle and the traced dense program, kept between publishes
_CACHE = ExportCache()


def export(
    config_path: str, full: bool, full_root: str, delta_root: str, base: int, checkpoint: str,
    step: int,
) -> dict[str, Any]:  # fmt: skip
    """Write the publish of ``checkpoint`` (run in the export process): the full bundle
    ``full_root/step-<step>``, or the delta ``delta_root/step-<base>/step-<step>``."""
    t0 = time.perf_counter()
    version = f"step-{step}"
    if full:
        out = export_bundle(
            Path(config_path),
            out_dir=Path(full_root) / version,
            checkpoint=Path(checkpoint),
            cache=_CACHE,
        )
        record: dict[str, Any] = {"what": "full", "version": version, "path": str(out)}
    else:
        name = f"step-{base}"
        report = export_delta(
            Path(config_path),
            base=Path(full_root) / name,
            out=Path(delta_root) / name / version,
            checkpoint=Path(checkpoint),
            delta_id=version,
            cache=_CACHE,
        )
        record = {
            "what": "delta",
            "version": f"{name}+{version}",
            "path": report["path"],
            "bytes": report["bytes"],
            "tables": report["tables"],
        }
    record["export_seconds"] = time.perf_counter() - t0
    return record
