"""Online training: follow a growing source, commit the position with each checkpoint, publish.

:class:`StreamTrainer` reads :class:`~train.stream.source.PartitionSource` chunks of
``batch_size`` rows in order, turns them into batches with the same feature generation as
batch training (:func:`shared.fg.table_to_batch`) and trains one step each
(:func:`train.trainer.train_step`: the same model, optimizers and sparse Adagrad). There is no
epoch: the step count only grows, so STEP scores of the dynamic tables age (and TIMESTAMP
scores follow the clock), and a full bucket evicts its lowest score: the tables stay within
``max_capacity`` however long the stream runs (LFU counts do not decay).

Exactly once. A checkpoint (:mod:`train.checkpoint`, written atomically: temp dir + rename)
holds the source position (``Progress.source_partition``/``source_row``) of the rows trained
into it. A restart loads the newest checkpoint and reads on from its position, so after a
kill -9 the rows trained since that checkpoint are trained again from the same state, and the
result holds every row once. The optional row log (``row_log``: one JSON line per step,
``{"step", "partition", "start", "end"}``) is cut back to the checkpoint's step at a restart,
so it lists what the committed state was trained on.

Checkpoints come every ``checkpoint_every`` steps and before each publish
(:mod:`train.stream.publish`), so what is published is always committed. With no new complete
partition the loop polls every ``poll_s``; SIGTERM (or SIGINT) ends the step under way, then
the loop checkpoints, publishes what is pending and returns. Every ``log_every_s`` a ``stream``
record (metrics.jsonl and the log) gives rows/s, the lag behind the source (rows not yet
trained; seconds from the newest trained row's event time to now) and the last publish.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from shared.config import load_config
from shared.features import build_feature_set
from shared.fg import table_to_batch
from train.checkpoint import (
    Progress,
    latest_checkpoint,
    load_checkpoint,
    remove_stale_temp_checkpoints,
    save_checkpoint,
)
from train.dense_ema import DenseEMA
from train.metrics_log import MetricsLog
from train.model.multi_tower_din import MultiTowerDIN
from train.stream.publish import Publisher, PublishOptions
from train.stream.row_log import RowLog
from train.stream.source import EVENT_TIME_COLUMN, Chunk, PartitionSource, Position
from train.trainer import build_optimizers, learning_rate_schedules, set_learning_rates, train_step

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamOptions:
    """Options of ``python -m train stream`` (the model itself comes from the config)."""

    config_path: Path
    source: Path
    model_dir: Path
    device: str = "cpu"
    batch_size: int | None = None  # default: data_config.batch_size
    checkpoint_every: int | None = None  # steps; default: train_config.save_checkpoints_steps
    poll_s: float = 1.0  # wait between looks at the source when it has nothing new
    idle_exit_s: float | None = None  # stop after this long without new rows (None: never)
    log_every_s: float = 10.0
    publish: PublishOptions | None = None
    row_log: Path | None = None
    seed: int = 0


@dataclass
class StreamResult:
    progress: Progress
    checkpoint: Path | None
    publishes: int


class _Stop:
    """Set by SIGTERM/SIGINT (installed only from the main thread) or by :meth:`set`."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping after this step", signum)
        self.event.set()


class StreamTrainer:
    """Trains on a growing source until stopped (module doc). Example::

    result = StreamTrainer(StreamOptions(config_path=cfg, source=Path("in"),
                                         model_dir=Path("runs/online"))).run()
    """

    def __init__(self, options: StreamOptions) -> None:
        self.options = options
        self.config = load_config(options.config_path)
        self.fs = build_feature_set(self.config)
        self.device = torch.device(options.device)
        tc = self.config.train_config
        self.batch_size = options.batch_size or self.config.data_config.batch_size
        self.checkpoint_every = options.checkpoint_every or tc.save_checkpoints_steps or None
        self.source = PartitionSource(
            options.source, columns=[*self.fs.columns(), EVENT_TIME_COLUMN]
        )
        self.schedules = learning_rate_schedules(tc)
        self.model = MultiTowerDIN.from_config(
            self.config, self.fs, device=self.device, seed=options.seed
        )
        self.optimizers = build_optimizers(self.model, tc)
        self.dense_ema = DenseEMA.of_config(self.model.dense, tc)
        self.metrics = MetricsLog(options.model_dir / "metrics.jsonl")
        self.publisher = (
            Publisher(options.config_path, options.publish) if options.publish else None
        )
        self.stop = _Stop()
        self.publishes = 0
        self._committed = -1  # step of the newest checkpoint (-1: none)

    def _start(self) -> Progress:
        """The newest checkpoint's progress (and weights), or a fresh start."""
        remove_stale_temp_checkpoints(self.options.model_dir)
        ckpt = latest_checkpoint(self.options.model_dir)
        if ckpt is None:
            log.info(
                "no checkpoint in %s: streaming from the first partition", self.options.model_dir
            )
            return Progress(global_batch_size=self.batch_size)
        progress = load_checkpoint(ckpt, self.model, self.optimizers, dense_ema=self.dense_ema)
        self._committed = progress.step
        where = (progress.source_partition, progress.source_row)
        log.info("resumed from %s: step %d, partition %r row %d", ckpt, progress.step, *where)
        return progress

    def run(self) -> StreamResult:
        """Train until SIGTERM/SIGINT, :attr:`stop`, or ``idle_exit_s`` without new rows."""
        self.stop.install()
        progress = self._start()
        rows = RowLog(self.options.row_log, progress.step) if self.options.row_log else None
        self.model.train()
        meter = _Meter(progress.samples)
        idle_since = time.monotonic()
        while not self.stop.event.is_set():
            pos = Position(progress.source_partition, progress.source_row)
            chunk = self.source.next_chunk(pos, self.batch_size)
            if chunk is None:
                self._maybe_publish(progress)
                self._log(progress, meter)
                if self._idle_too_long(idle_since):
                    break
                self.stop.event.wait(self.options.poll_s)
                continue
            idle_since = time.monotonic()
            self._step(chunk, progress)
            if rows is not None:
                rows.add(progress.step, chunk)
            self._after_step(progress, rows, meter)
        checkpoint = self._commit(progress, rows)
        self._maybe_publish(progress, force=True)
        self._log(progress, meter, force=True)
        return StreamResult(progress, checkpoint, self.publishes)

    def _idle_too_long(self, since: float) -> bool:
        limit = self.options.idle_exit_s
        if limit is not None and time.monotonic() - since >= limit:
            log.info("no new rows for %.1f s (--idle-exit-s): stopping", limit)
            return True
        return False

    def _step(self, chunk: Chunk, progress: Progress) -> None:
        """One optimizer step on ``chunk``; ``progress`` moves past its rows."""
        batch = table_to_batch(self.fs, chunk.table).to(self.device, non_blocking=True)
        set_learning_rates(self.model, self.optimizers, self.schedules, progress.step, 0)
        precision = self.config.train_config.mixed_precision
        train_step(self.model, self.optimizers, batch, progress.step, precision)
        if self.dense_ema is not None:
            self.dense_ema.update()
        progress.step += 1
        progress.samples += chunk.table.num_rows
        progress.source_partition, progress.source_row = chunk.end.partition, chunk.end.row
        progress.event_time = max(progress.event_time, chunk.event_time)

    def _after_step(self, progress: Progress, rows: RowLog | None, meter: _Meter) -> None:
        """Checkpoint and publish on their cadences, log on its."""
        every = self.checkpoint_every
        if every and progress.step % every == 0:
            self._commit(progress, rows)
        self._maybe_publish(progress, rows=rows)
        self._log(progress, meter)

    def _commit(self, progress: Progress, rows: RowLog | None = None) -> Path | None:
        """Checkpoint ``progress`` (row log flushed first; nothing when it is committed)."""
        if progress.step == self._committed:
            return latest_checkpoint(self.options.model_dir)
        if rows is not None:
            rows.flush()
        ema = self.dense_ema
        path = save_checkpoint(
            self.options.model_dir, self.model, self.optimizers, progress, dense_ema=ema
        )
        self._committed = progress.step
        return path

    def _maybe_publish(
        self, progress: Progress, *, rows: RowLog | None = None, force: bool = False
    ) -> None:
        pub = self.publisher
        if pub is None or progress.step <= pub.last_step:
            return
        if not force and not pub.due(progress.step, time.monotonic()):
            return
        checkpoint = self._commit(progress, rows)
        assert checkpoint is not None
        record = pub.publish(checkpoint, progress.step)
        self.publishes += 1
        published = {"kind": "publish", "step": progress.step, "at_unix": time.time()}
        self._record({**published, "event_time": progress.event_time, **record})

    def _record(self, record: dict[str, Any]) -> None:
        """Append to metrics.jsonl (none kept in memory: the stream has no end)."""
        self.metrics.write(record)
        self.metrics.records.clear()

    def _log(self, progress: Progress, meter: _Meter, force: bool = False) -> None:
        """A ``stream`` record every ``log_every_s`` (module doc)."""
        now = time.monotonic()
        if not force and now - meter.since < self.options.log_every_s:
            return
        pos = Position(progress.source_partition, progress.source_row)
        record: dict[str, Any] = {
            "kind": "stream",
            "step": progress.step,
            "samples": progress.samples,
            "rows_per_s": meter.rate(progress.samples, now),
            "lag_rows": self.source.pending_rows(pos),
            "lag_seconds": time.time() - progress.event_time if progress.event_time else None,
            "position": asdict(pos),
            "publishes": self.publishes,
        }
        self._record(record)
        log.info("stream: %s", json.dumps(record))
        meter.restart(progress.samples, now)


@dataclass
class _Meter:
    """Rows since the last ``stream`` record, and since when."""

    samples: int
    since: float = 0.0

    def __post_init__(self) -> None:
        self.since = time.monotonic()

    def rate(self, samples: int, now: float) -> float:
        return (samples - self.samples) / max(now - self.since, 1e-9)

    def restart(self, samples: int, now: float) -> None:
        self.samples, self.since = samples, now
