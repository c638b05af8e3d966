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
from the root, so a restarted trainer goes on where it stopped. Example::

    publisher = Publisher(config_path, PublishOptions(root=Path("pub"), every_s=10))
    if publisher.due(step, time.monotonic()):
        record = publisher.publish(checkpoint, step)   # {"what": "full"|"delta", ...}
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train.export import export_bundle
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
        self._last_step = max([*done, *self._delta_steps()], default=-1)

    def _delta_steps(self) -> list[int]:
        return [] if self._base is None else _steps(self.delta_root / f"step-{self._base}")

    @property
    def last_step(self) -> int:
        """The step of the newest publish (-1: none yet)."""
        return self._last_step

    def due(self, step: int, now: float) -> bool:
        """Whether a publish is due at ``step`` (``now``: time.monotonic())."""
        if step <= self._last_step:
            return False  # nothing trained since
        o = self.options
        by_time = o.every_s is not None and now - self._last_time >= o.every_s
        by_steps = o.every_steps is not None and step - max(self._last_step, 0) >= o.every_steps
        return by_time or by_steps

    def publish(self, checkpoint: Path, step: int) -> dict[str, Any]:
        """Publish ``checkpoint`` (of ``step``): a full bundle when there is no base yet or it
        has ``full_every`` deltas, else a delta against the base; returns a record for the
        metrics log (kind, version, seconds, bytes)."""
        t0 = time.perf_counter()
        full = self._base is None or len(self._delta_steps()) >= self.options.full_every
        version = f"step-{step}"
        if full:
            out = export_bundle(
                self.config_path, out_dir=self.full_root / version, checkpoint=checkpoint
            )
            self._base = step
            record: dict[str, Any] = {"what": "full", "version": version, "path": str(out)}
        else:
            base = f"step-{self._base}"
            report = export_delta(
                self.config_path,
                base=self.full_root / base,
                out=self.delta_root / base / version,
                checkpoint=checkpoint,
                delta_id=version,
            )
            record = {
                "what": "delta",
                "version": f"{base}+{version}",
                "path": report["path"],
                "bytes": report["bytes"],
                "tables": report["tables"],
            }
        self._last_step, self._last_time = step, time.monotonic()
        record["publish_seconds"] = time.perf_counter() - t0
        log.info("published %s %s in %.2f s", record["what"], record["version"],
                 record["publish_seconds"])  # fmt: skip
        return record
