"""Dynamic batching: concurrent requests are merged into one batch and run by one worker thread.

Each request is a :class:`~shared.batch.Batch` of one user and N candidates. The worker takes
the oldest request, then keeps adding requests of the same model until the batch would exceed
``max_batch_rows`` candidate rows or ``max_wait_us`` has passed since the first one arrived, or
at once when no other request could join it: given ``outstanding`` (the server's count of
requests admitted and not answered), when every one of those is already queued, taken or in a
batch in flight (a lone request on a quiet server would only pay the wait). It then
concatenates them (:func:`concat_batches`: U adds up, ``user_index`` is offset), runs the model
once and hands each request its slice of the probabilities. Requests past their deadline (or
cancelled by the client) are dropped before they cost any compute.

A predictor with a ``start`` method (:class:`serve.model.LoadedModel`) only *starts* a batch on
the worker thread: it returns :class:`PendingScores`. One already done (the CPU, eager batches)
is completed there, as :meth:`~Predictor.predict` would be; one still on the device goes to a
completion thread (FIFO), which waits for it, hands out the slices and reports the batch, while
the worker merges and starts the next batch. At most :data:`MAX_IN_FLIGHT` batches are started
and not completed (the worker waits for a slot, taking the requests that arrive meanwhile
into the batch): the device's queue stays short, and so does the latency a batch adds to those
behind it.

Example::

    batcher = Batcher(BatcherConfig(max_batch_rows=1024, max_wait_us=500))
    future = batcher.submit(model, batch, deadline=time.monotonic() + 0.1)
    probabilities = future.result()        # np.ndarray [N] float32
    batcher.close()
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, cast

import numpy as np
import torch

from serve.host_batch import HostBatch
from shared.batch import Batch

log = logging.getLogger(__name__)


class DeadlineExpiredError(TimeoutError):
    """The request's deadline passed while it waited in the queue (DEADLINE_EXCEEDED)."""


class BatcherClosedError(RuntimeError):
    """The batcher was shut down before the request ran (UNAVAILABLE)."""


# batches started (PendingScores handed out) and not yet completed: one on the device while the
# worker prepares and starts the next
MAX_IN_FLIGHT = 2


class PendingScores:
    """[B] probabilities on the host, possibly still being copied there: ``scores`` is filled
    once ``event`` (a CUDA event recorded after the copy, on the copy's stream) has completed.

    ``keep`` holds what the in-flight work reads or writes (a CUDA graph, its buffers), so that
    it outlives a model version swapped out meanwhile. Example::

        pending = model.start(batch)          # the device works; the host is free
        probs = pending.result()              # waits (GIL released): [B] float32 on the CPU
    """

    def __init__(
        self, scores: torch.Tensor, event: torch.cuda.Event | None = None, *, keep: object = None
    ) -> None:
        self._scores = scores  # [B]
        self._event = event
        self._keep = keep

    @classmethod
    def ready(cls, scores: torch.Tensor) -> PendingScores:
        """An already computed [B] tensor (no device work outstanding)."""
        return cls(scores)

    @property
    def done(self) -> bool:
        """True once :meth:`result` would not wait."""
        return self._event is None or bool(self._event.query())

    def result(self, timings: dict[str, float] | None = None) -> torch.Tensor:
        """The [B] scores, once the device has written them; the wait (seconds) is added to
        ``timings["sync"]`` if ``timings`` is given."""
        t0 = time.perf_counter()
        if self._event is not None:
            self._event.synchronize()  # releases the GIL
            self._event, self._keep = None, None
        if timings is not None:
            timings["sync"] = timings.get("sync", 0.0) + time.perf_counter() - t0
        return self._scores


class Predictor(Protocol):
    """What the batcher runs: a loaded model version (see :class:`serve.model.LoadedModel`).

    A predictor whose ``reports_timings`` attribute is true is called as
    ``predict(batch, timings=dict)`` and fills in per-stage seconds (:attr:`BatchStats.stages`).
    One whose ``takes_host_batches`` attribute is true is also given
    :class:`~serve.host_batch.HostBatch` es (requests handed off by frontends, merged without
    building KJTs: :func:`merge_batches`); the others always get a :class:`Batch`. One with a
    ``start(batch[, timings])`` method (defined by its class) returning :class:`PendingScores` is started instead
    (module docstring); ``predict`` is then for the others (offline scoring, tests).
    """

    def predict(self, batch: Batch) -> torch.Tensor: ...  # [B] probabilities


@dataclass(frozen=True)
class BatcherConfig:
    max_batch_rows: int = 1024  # candidate rows per batch (a larger single request runs alone)
    max_wait_us: int = 500  # how long the first request of a batch waits for company

    def __post_init__(self) -> None:
        if self.max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {self.max_batch_rows}")
        if self.max_wait_us < 0:
            raise ValueError(f"max_wait_us must be >= 0, got {self.max_wait_us}")


@dataclass
class _Pending:
    model: Predictor
    batch: Batch | HostBatch
    deadline: float | None  # time.monotonic() seconds
    enqueued: float
    future: Future[np.ndarray] = field(default_factory=Future)


@dataclass(frozen=True)
class BatchStats:
    """What one run of the worker did, for metrics."""

    requests: int
    rows: int
    expired: int
    queue_wait_s: float  # oldest request's wait
    run_s: float  # model time (wall), predict only (started: from start to the scores on host)
    concat_s: float = 0.0  # merging the requests into one batch (wall)
    cpu_s: float = 0.0  # CPU time of the worker thread for the batch (concat + predict/start)
    stages: dict[str, float] = field(default_factory=dict)  # predictor's split of run_s (wall)


@dataclass
class _Started:
    """A batch started on the worker thread, to be completed (here or on the completion one)."""

    pending: PendingScores
    live: list[_Pending]
    expired: int
    queue_wait_s: float
    concat_s: float
    started: float  # time.monotonic() at start
    cpu_s: float  # worker thread
    timings: dict[str, float] | None  # the predictor's stages (if it reports them)
    slot: bool  # holds one of the MAX_IN_FLIGHT slots
    users: int  # of the requests taken for it (counted in flight while it holds the slot)


def _starts(model: Predictor) -> bool:
    """Whether the batcher starts ``model``'s batches: its class defines ``start`` (a wrapper
    that hands other attributes on through ``__getattr__`` but overrides ``predict`` is run
    through its ``predict``)."""
    return callable(getattr(type(model), "start", None))


def _users(pendings: Iterable[_Pending]) -> int:
    """The requests (each one user of its batch; a frontend's group, several) of ``pendings``."""
    return sum(p.batch.num_users for p in pendings)


def _fail(live: Sequence[_Pending], err: BaseException) -> None:
    for p in live:
        if not p.future.done():
            p.future.set_exception(err)


class Batcher:
    """A queue + one worker thread (+ a completion thread for started batches: module
    docstring). ``on_batch`` (optional) receives :class:`BatchStats`.

    The queue holds at most the requests the server admitted (:mod:`serve.admission` bounds
    them before they are parsed), so it needs no bound of its own.
    """

    def __init__(
        self,
        config: BatcherConfig,
        *,
        on_batch: Callable[[BatchStats], None] | None = None,
        outstanding: Callable[[], int] | None = None,
    ) -> None:
        self.config = config
        self._on_batch = on_batch
        # requests admitted and not answered (each a user of a batch): with it a batch stops
        # waiting once none of them could still join (module docstring); None: it always waits
        self._outstanding = outstanding
        self._in_flight_users = 0  # users of the started batches not yet completed (_cond)
        self._queue: collections.deque[_Pending] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._in_flight = 0  # started batches not yet completed (under _cond)
        # started batches for the completion thread, FIFO; None (from the worker, last): stop
        self._completions: queue.Queue[_Started | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="batcher", daemon=True)
        self._completer = threading.Thread(
            target=self._run_completions, name="batcher-completion", daemon=True
        )
        self._completer.start()
        self._worker.start()

    def depth(self) -> int:
        """Requests waiting (not counting the batch being run)."""
        return len(self._queue)

    def submit(
        self, model: Predictor, batch: Batch | HostBatch, *, deadline: float | None = None
    ) -> Future[np.ndarray]:
        """Queue one request; its future gives the probabilities [B] (float32, request order).

        ``deadline`` is a ``time.monotonic()`` time; the request is dropped with
        :class:`DeadlineExpiredError` if it has not started by then. Cancelling the future before
        the worker picks it up removes it from the batch.
        """
        pending = _Pending(model, batch, deadline, time.monotonic())
        with self._cond:
            if self._closed:
                raise BatcherClosedError("the server is shutting down")
            self._queue.append(pending)
            self._cond.notify()
        return pending.future

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking requests, finish those queued (the worker runs them, then the completion
        thread completes those it was handed) and join both threads (``timeout`` in all)."""
        until = time.monotonic() + timeout
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join(timeout)
        self._completer.join(max(until - time.monotonic(), 0.0))

    # ----------------------------------------------------------------------- worker

    def _take(self) -> tuple[list[_Pending], bool] | None:
        """Block for the next batch: same model, ≤ max rows, within max wait of the first (no
        wait once no other request could join: :meth:`_nobody_else`). For a predictor that is
        started, also block for a slot (collecting meanwhile) and hold it: the batch and
        whether it holds a slot."""
        cfg = self.config
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            first = self._queue.popleft()
            taken, rows = [first], first.batch.batch_size
            slot = _starts(first.model)
            until = first.enqueued + cfg.max_wait_us * 1e-6
            blocked = False  # the next request queued starts another batch
            while True:
                if not blocked and rows < cfg.max_batch_rows and self._queue:
                    nxt = self._queue[0]
                    if (
                        nxt.model is first.model
                        and rows + nxt.batch.batch_size <= cfg.max_batch_rows
                    ):
                        taken.append(self._queue.popleft())
                        rows += nxt.batch.batch_size
                        continue
                    blocked = True  # another model version, or too big
                if slot and self._in_flight >= MAX_IN_FLIGHT:
                    self._cond.wait()  # a completion frees a slot (and notifies)
                    continue
                left = until - time.monotonic()
                done = blocked or rows >= cfg.max_batch_rows or self._closed
                if done or left <= 0 or self._nobody_else(taken):
                    break
                self._cond.wait(left)
            if slot:
                self._in_flight += 1  # released by _complete (or _free_slot)
                self._in_flight_users += _users(taken)
            return taken, slot

    def _nobody_else(self, taken: list[_Pending]) -> bool:
        """Under the lock: every outstanding request is in hand (taken, queued or in flight),
        so no other could join ``taken`` (False without ``outstanding``)."""
        if self._outstanding is None:
            return False
        held = _users(taken) + _users(self._queue) + self._in_flight_users
        return self._outstanding() <= held

    def _free_slot(self, users: int) -> None:
        with self._cond:
            self._in_flight -= 1
            self._in_flight_users -= users
            self._cond.notify_all()  # the worker may wait for a slot

    def _run(self) -> None:
        try:
            while True:
                took = self._take()
                if took is None:
                    return
                taken, slot = took
                try:
                    self._run_batch(taken, slot)
                except BaseException as e:  # never let the worker die: fail this batch's requests
                    log.exception("batch of %d requests failed", len(taken))
                    _fail(taken, e)
        finally:
            self._completions.put(None)  # after the last batch handed over: the completer stops

    def _run_completions(self) -> None:
        """The completion thread: complete started batches in the order they were started."""
        while True:
            started = self._completions.get()
            try:
                if started is None:
                    return
                self._complete(started)
            except BaseException as e:  # never let the thread die: fail this batch's requests
                assert started is not None
                log.exception("batch of %d requests failed", len(started.live))
                _fail(started.live, e)
            finally:
                self._completions.task_done()

    def _live(self, taken: list[_Pending], now: float) -> tuple[list[_Pending], int]:
        """The requests of ``taken`` still wanted (set running), and how many had expired."""
        live: list[_Pending] = []
        expired = 0
        for p in taken:
            if p.deadline is not None and now > p.deadline:
                expired += 1
                if p.future.set_running_or_notify_cancel():
                    p.future.set_exception(
                        DeadlineExpiredError(
                            f"deadline passed after {now - p.enqueued:.4f}s in the queue"
                        )
                    )
            elif p.future.set_running_or_notify_cancel():  # False: cancelled by the client
                live.append(p)
        return live, expired

    def _run_batch(self, taken: list[_Pending], slot: bool) -> None:
        """Merge and start (or run) ``taken``; ``slot``: it holds an in-flight slot (_take)."""
        now = time.monotonic()
        live, expired = self._live(taken, now)
        if not live:
            if slot:
                self._free_slot(_users(taken))
            self._report(BatchStats(0, 0, expired, now - taken[0].enqueued, 0.0))
            return
        cpu0 = time.thread_time()
        model = live[0].model
        try:
            batch = merge_batches(
                [p.batch for p in live], host=getattr(model, "takes_host_batches", False)
            )
            start = time.monotonic()
            stages: dict[str, float] | None = (
                {} if getattr(model, "reports_timings", False) else None
            )
            pending = self._start(model, batch, stages)
        except BaseException:
            if slot:
                self._free_slot(_users(taken))
            raise
        cpu_s = time.thread_time() - cpu0
        queue_wait = start - live[0].enqueued
        started = _Started(
            pending, live, expired, queue_wait, start - now, start, cpu_s, stages, slot,
            _users(taken),
        )  # fmt: skip
        # done (and nothing handed over before it, still to complete): complete it here
        if started.pending.done and self._completions.unfinished_tasks == 0:
            self._complete(started)
        else:
            self._completions.put(started)

    @staticmethod
    def _start(
        model: Predictor, batch: Batch | HostBatch, stages: dict[str, float] | None
    ) -> PendingScores:
        """Start ``batch`` on ``model`` (``start``), or run it (``predict``): done scores."""
        # (a HostBatch only for a predictor that takes them: merge_batches)
        if _starts(model):
            run = model.start  # type: ignore[attr-defined]
            return cast(PendingScores, run(batch) if stages is None else run(batch, timings=stages))
        if stages is None:
            return PendingScores.ready(model.predict(batch))  # type: ignore[arg-type]
        return PendingScores.ready(model.predict(batch, timings=stages))  # type: ignore[call-arg,arg-type]

    def _complete(self, started: _Started) -> None:
        """Wait for a started batch's scores, hand each request its slice, report the batch."""
        try:
            probs = started.pending.result(started.timings).detach().cpu().numpy()  # [ΣB]
        finally:
            if started.slot:
                self._free_slot(started.users)
        run_s = time.monotonic() - started.started
        offset = 0
        for p in started.live:
            n = p.batch.batch_size
            p.future.set_result(probs[offset : offset + n])
            offset += n
        self._report(
            BatchStats(
                len(started.live),
                offset,
                started.expired,
                started.queue_wait_s,
                run_s,
                concat_s=started.concat_s,
                cpu_s=started.cpu_s,
                stages=started.timings if started.timings is not None else {},
            )
        )

    def _report(self, stats: BatchStats) -> None:
        if self._on_batch is not None:
            try:
                self._on_batch(stats)
            except Exception:
                log.exception("on_batch callback failed")


# --------------------------------------------------------------------------- concatenation


def concat_batches(batches: Sequence[Batch | HostBatch]) -> Batch:
    """One batch of several: users and candidates are stacked, ``user_index`` offset.

    Example: a request with U=1, B=3 and one with U=1, B=2 give U=2, B=5 and
    ``user_index = [0, 0, 0, 1, 1]``. The KJTs are merged on the host
    (:meth:`~serve.host_batch.HostBatch.concat`: the one implementation) and built once; the
    batches' tensors must be on the CPU. Labels and oracle are kept only if every batch has them
    (a :class:`~serve.host_batch.HostBatch` has none); one batch alone is returned as it is.
    """
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    if len(batches) == 1:
        one = batches[0]
        return one.to_batch() if isinstance(one, HostBatch) else one
    merged = HostBatch.concat([b if isinstance(b, HostBatch) else HostBatch.of(b) for b in batches])
    batch = merged.to_batch()
    batch.labels = _cat_optional(batches, "labels")  # [ΣB] or None
    batch.oracle = _cat_optional(batches, "oracle")  # [ΣB] or None
    return batch


def _cat_optional(batches: Sequence[Batch | HostBatch], name: str) -> torch.Tensor | None:
    """The batches' ``name`` tensors (labels, oracle) stacked, or None unless all have one."""
    # a HostBatch carries neither
    tensors = [t for b in batches if (t := getattr(b, name, None)) is not None]
    return torch.cat(tensors) if len(tensors) == len(batches) else None


def merge_batches(parts: Sequence[Batch | HostBatch], *, host: bool) -> Batch | HostBatch:
    """The batcher's one batch of its requests: a :class:`~serve.host_batch.HostBatch` when every
    part is one and ``host`` (the predictor takes them), else :func:`concat_batches`' batch (host
    batches built into KJTs after they are merged: one KJT build, not one per request)."""
    if host and all(isinstance(p, HostBatch) for p in parts):
        return HostBatch.concat(cast(Sequence[HostBatch], parts))
    return concat_batches(parts)
