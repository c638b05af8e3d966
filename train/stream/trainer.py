"""Online training: follow a growing source, commit the position with each checkpoint, publish.

:class:`StreamTrainer` trains on the rows of :class:`~train.stream.source.PartitionSource` in
order, through the batch trainer's machinery: the loader's worker processes read and turn the
rows into batches (:class:`~train.data.loader.InOrderLoader`, planned ahead by
:class:`~train.stream.source.StreamReader`), the prefetch thread copies them to the device
(:func:`train.data.prefetch.prefetch_to_device`), and each is one step of
:func:`train.trainer.train_step` (the same model, optimizers and sparse Adagrad, CUDA graphs on
CUDA as in :class:`train.trainer.Trainer`). There is no epoch: the step count only grows, so
STEP scores of the dynamic tables age (and TIMESTAMP scores follow the clock), and a full
bucket evicts its lowest score: the tables stay within ``max_capacity`` however long the stream
runs (LFU counts do not decay).

Exactly once. A checkpoint (:mod:`train.checkpoint`, written atomically: temp dir + rename)
holds the source position (``Progress.source_partition``/``source_row``) of the rows trained
into it: the end of the last batch's span, known exactly since the batches come in the order
they were planned. A restart loads the newest checkpoint and reads on from its position, so
after a kill -9 the rows trained since that checkpoint are trained again from the same state,
and the result holds every row once. The optional row log (``row_log``: a JSON line per step
and partition, ``{"step", "partition", "start", "end"}``) is cut back to the checkpoint's step
at a restart, so it lists what the committed state was trained on.

Checkpoints come every ``checkpoint_every`` steps and with each publish
(:mod:`train.stream.publish`), so what is published is always committed. The loop only takes
their snapshot (device -> host copies); a thread writes the files, and the publish is
exported by a process of its own, while training goes on. With no new complete partition the
loop polls every ``poll_s``; SIGTERM (or SIGINT) ends the step under way, then the loop
checkpoints, publishes what is pending and returns. Every ``log_every_s`` a ``stream`` record
(metrics.jsonl and the log) gives rows/s, the lag behind the source (rows not yet trained;
seconds from the newest trained row's event time to now), the last publish and the seconds
the loop stalled for snapshots.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from shared.batch import Batch
from shared.config import load_config
from shared.features import build_feature_set
from train.checkpoint import (
    Progress,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_stale_temp_checkpoints,
    snapshot,
    write_checkpoint,
)
from train.data.loader import MESSAGE_ROWS, InOrderLoader
from train.data.prefetch import prefetch_to_device
from train.dense_ema import DenseEMA
from train.metrics_log import MetricsLog
from train.model.graphed import DenseArchGraphs
from train.model.multi_tower_din import MultiTowerDIN
from train.stream.publish import Publisher, PublishOptions
from train.stream.row_log import RowLog
from train.stream.source import PartitionSource, Position, Span, StreamReader
from train.trainer import (
    build_optimizers,
    cuda_graphs_for,
    learning_rate_schedules,
    set_learning_rates,
    train_step,
)

log = logging.getLogger(__name__)
KEEP_CHECKPOINTS = 3  # the newest kept (and the one a publish is exporting)


@dataclass(frozen=True)
class StreamOptions:
    """Options of ``python -m train stream`` (the model itself comes from the config)."""

    config_path: Path
    source: Path
    model_dir: Path
    device: str = "cpu"
    batch_size: int | None = None  # default: data_config.batch_size
    num_workers: int | None = None  # loader worker processes; default: data_config.num_workers
    message_rows: int = MESSAGE_ROWS  # rows a worker reads and sends at once
    checkpoint_every: int | None = None  # steps; default: train_config.save_checkpoints_steps
    poll_s: float = 1.0  # wait between looks at the source when it has nothing new
    idle_exit_s: float | None = None  # stop after this long without new rows (None: never)
    log_every_s: float = 10.0
    publish: PublishOptions | None = None
    row_log: Path | None = None
    seed: int = 0
    cuda_graphs: bool = True  # on CUDA: the dense step and the tables' static step as graphs


@dataclass
class StreamResult:
    progress: Progress
    checkpoint: Path | None
    publishes: int
    stall_seconds: dict[str, float] = field(default_factory=dict)


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
        tc, dc = self.config.train_config, self.config.data_config
        self.batch_size = options.batch_size or dc.batch_size
        self.num_workers = dc.num_workers if options.num_workers is None else options.num_workers
        self.checkpoint_every = options.checkpoint_every or tc.save_checkpoints_steps or None
        self.source = PartitionSource(options.source)
        self.schedules = learning_rate_schedules(tc)
        # the loader's workers start now, before the model (and CUDA) exists, as the batch
        # trainer's: they fork from a process without CUDA
        self.loader = InOrderLoader(
            self.fs,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            pin_memory=self.device.type == "cuda",
            message_rows=options.message_rows,
        )
        self.model = MultiTowerDIN.from_config(
            self.config, self.fs, device=self.device, seed=options.seed
        )
        self.optimizers = build_optimizers(self.model, tc)
        self.dense_ema = DenseEMA.of_config(self.model.dense, tc)
        use_graphs = options.cuda_graphs and self.device.type == "cuda"
        self.graphs: DenseArchGraphs | None = cuda_graphs_for(self.model) if use_graphs else None
        self.metrics = MetricsLog(options.model_dir / "metrics.jsonl")
        self.publisher = (
            Publisher(options.config_path, options.publish) if options.publish else None
        )
        self.stop = _Stop()
        self.publishes = 0
        self._committed = -1  # step of the newest checkpoint taken (-1: none)
        self._writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._written: Future[Path] | None = None  # the newest checkpoint's write
        self._exporting: set[int] = set()  # steps whose checkpoint a publish is reading
        self._publishing: tuple[int, int, float] = (0, 0, 0.0)  # step, event time, snapshot s
        # seconds the loop spent on snapshots (checkpoints, publishes) and waiting for writes
        self.stalls = {"snapshot": 0.0, "write_wait": 0.0}

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

    def _reader(self, progress: Progress) -> StreamReader:
        position = Position(progress.source_partition, progress.source_row)
        return StreamReader(self.source, self.loader, position)

    def run(self) -> StreamResult:
        """Train until SIGTERM/SIGINT, :attr:`stop`, or ``idle_exit_s`` without new rows."""
        self.stop.install()
        progress = self._start()
        rows = RowLog(self.options.row_log, progress.step) if self.options.row_log else None
        reader = self._reader(progress)
        batches = prefetch_to_device(reader.batches(), self.device)
        try:
            meter = self._loop(progress, reader, batches, rows)
            checkpoint = self._commit(progress, rows)
            self._publish_now(progress)
        finally:
            reader.close()  # first: the loader's workers end, so the feeder's source ends
            batches.close()  # then the feeder thread, which may wait for the loader, is joined
            if self.publisher is not None:
                self.publisher.close()
            self._writes.shutdown(wait=True)
            if rows is not None:
                rows.close()
        self._log(progress, meter, force=True)
        return StreamResult(progress, checkpoint, self.publishes, dict(self.stalls))

    def _loop(
        self,
        progress: Progress,
        reader: StreamReader,
        batches: Iterator[Batch],
        rows: RowLog | None,
    ) -> _Meter:
        """Plan, step, checkpoint, publish and log until stopped (``batches``: the reader's, on
        the device); returns the rate meter."""
        self.model.train()
        meter = _Meter(progress.samples)
        idle_since = time.monotonic()
        while not self.stop.event.is_set():
            if not reader.plan():
                self._maybe_publish(progress, rows)
                self._log(progress, meter)
                if self._idle_too_long(idle_since):
                    break
                self.stop.event.wait(self.options.poll_s)
                continue
            idle_since = time.monotonic()
            batch = next(batches)
            span = reader.take()
            self._step(batch, span, progress)
            if rows is not None:
                rows.add(progress.step, span)
            self._after_step(progress, rows, meter)
        return meter

    def _idle_too_long(self, since: float) -> bool:
        limit = self.options.idle_exit_s
        if limit is not None and time.monotonic() - since >= limit:
            log.info("no new rows for %.1f s (--idle-exit-s): stopping", limit)
            return True
        return False

    def _step(self, batch: Batch, span: Span, progress: Progress) -> None:
        """One optimizer step on ``batch`` (the rows of ``span``); ``progress`` moves past it."""
        set_learning_rates(self.model, self.optimizers, self.schedules, progress.step, 0)
        precision = self.config.train_config.mixed_precision
        train_step(self.model, self.optimizers, batch, progress.step, precision, graphs=self.graphs)
        if self.dense_ema is not None:
            self.dense_ema.update()
        progress.step += 1
        progress.samples += span.rows
        progress.source_partition, progress.source_row = span.end.partition, span.end.row
        progress.event_time = max(progress.event_time, span.event_time)

    def _after_step(self, progress: Progress, rows: RowLog | None, meter: _Meter) -> None:
        """Checkpoint and publish on their cadences, log on its."""
        every = self.checkpoint_every
        if every and progress.step % every == 0:
            self._commit_in_background(progress, rows)
        self._maybe_publish(progress, rows)
        self._log(progress, meter)

    def _commit_in_background(self, progress: Progress, rows: RowLog | None) -> Future[Path]:
        """Checkpoint ``progress``: the snapshot now, the files by the writer thread (after the
        write before it). The row log is flushed first, so it never lags a checkpoint."""
        if self._written is not None and progress.step == self._committed:
            return self._written
        if rows is not None:
            rows.flush()
        t0 = time.perf_counter()
        state = snapshot(self.model, self.optimizers, progress, self.dense_ema)
        self.stalls["snapshot"] += time.perf_counter() - t0
        self._committed = progress.step
        self._written = self._writes.submit(self._write, state)
        return self._written

    def _write(self, state: Any) -> Path:
        path = write_checkpoint(self.options.model_dir, state, keep=0)
        for old in list_checkpoints(self.options.model_dir)[:-KEEP_CHECKPOINTS]:
            if int(old.name.split("_")[-1]) not in self._exporting:
                shutil.rmtree(old, ignore_errors=True)
        return path

    def _commit(self, progress: Progress, rows: RowLog | None = None) -> Path | None:
        """Checkpoint ``progress`` and wait for its files (nothing new when it is committed)."""
        if progress.step == self._committed and self._written is None:
            return latest_checkpoint(self.options.model_dir)
        written = self._commit_in_background(progress, rows)
        t0 = time.perf_counter()
        path = written.result()
        self.stalls["write_wait"] += time.perf_counter() - t0
        return path

    def _maybe_publish(self, progress: Progress, rows: RowLog | None) -> None:
        """Collect a finished publish; submit the next when it is due."""
        pub = self.publisher
        if pub is None:
            return
        self._collect(pub.collect())
        if pub.due(progress.step, time.monotonic()):
            self._submit(pub, progress, rows)

    def _submit(self, pub: Publisher, progress: Progress, rows: RowLog | None) -> None:
        before = self.stalls["snapshot"]
        written = self._commit_in_background(progress, rows)
        self._exporting.add(progress.step)
        pub.submit(written, progress.step)
        stall = self.stalls["snapshot"] - before  # the loop's pause for this publish
        self._publishing = (progress.step, progress.event_time, stall)

    def _collect(self, record: dict[str, Any] | None) -> None:
        if record is None:
            return
        step, event_time, stall = self._publishing
        self._exporting.discard(step)
        self.publishes += 1
        published = {"kind": "publish", "step": step, "at_unix": time.time()}
        self._record({**published, "event_time": event_time, "stall_seconds": stall, **record})

    def _publish_now(self, progress: Progress) -> None:
        """At the end: the pending publish, then one of the last step if it is not published."""
        pub = self.publisher
        if pub is None:
            return
        self._collect(pub.collect(wait=True))
        if progress.step > pub.last_step:
            self._submit(pub, progress, None)
            self._collect(pub.collect(wait=True))

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
            "at_unix": time.time(),
            "step": progress.step,
            "samples": progress.samples,
            "rows_per_s": meter.rate(progress.samples, now),
            "lag_rows": self.source.pending_rows(pos),
            "lag_seconds": time.time() - progress.event_time if progress.event_time else None,
            "position": asdict(pos),
            "publishes": self.publishes,
            "stall_seconds": dict(self.stalls),
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
