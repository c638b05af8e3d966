"""Dynamic batching: concurrent requests are merged into one batch and run by one worker thread.

Each request is a :class:`~shared.batch.Batch` of one user and N candidates. The worker takes
the oldest request, then keeps adding requests of the same model until the batch would exceed
``max_batch_rows`` candidate rows or ``max_wait_us`` has passed since the first one arrived,
concatenates them (:func:`concat_batches`: U adds up, ``user_index`` is offset), runs the model
once and hands each request its slice of the probabilities. Requests past their deadline (or
cancelled by the client) are dropped before they cost any compute.

Example::

    batcher = Batcher(BatcherConfig(max_batch_rows=1024, max_wait_us=500))
    future = batcher.submit(model, batch, deadline=time.monotonic() + 0.1)
    probabilities = future.result()        # np.ndarray [N] float32
    batcher.close()
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, cast

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from serve.host_batch import HostBatch
from shared.batch import Batch

log = logging.getLogger(__name__)


class DeadlineExpiredError(TimeoutError):
    """The request's deadline passed while it waited in the queue (DEADLINE_EXCEEDED)."""


class BatcherClosedError(RuntimeError):
    """The batcher was shut down before the request ran (UNAVAILABLE)."""


class Predictor(Protocol):
    """What the batcher runs: a loaded model version (see :class:`serve.model.LoadedModel`).

    A predictor whose ``reports_timings`` attribute is true is called as
    ``predict(batch, timings=dict)`` and fills in per-stage seconds (:attr:`BatchStats.stages`).
    One whose ``takes_host_batches`` attribute is true is also given
    :class:`~serve.host_batch.HostBatch` es (requests handed off by frontends, merged without
    building KJTs: :func:`merge_batches`); the others always get a :class:`Batch`.
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
    run_s: float  # model time (wall), predict only
    concat_s: float = 0.0  # merging the requests into one batch (wall)
    cpu_s: float = 0.0  # CPU time of the worker thread for the batch (concat + predict)
    stages: dict[str, float] = field(default_factory=dict)  # predictor's split of run_s (wall)


class Batcher:
    """A queue + one worker thread. ``on_batch`` (optional) receives :class:`BatchStats`.

    The queue holds at most the requests the server admitted (:mod:`serve.admission` bounds
    them before they are parsed), so it needs no bound of its own.
    """

    def __init__(
        self, config: BatcherConfig, *, on_batch: Callable[[BatchStats], None] | None = None
    ) -> None:
        self.config = config
        self._on_batch = on_batch
        self._queue: collections.deque[_Pending] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="batcher", daemon=True)
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
        """Stop taking requests, finish those queued, and join the worker."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join(timeout)

    # ----------------------------------------------------------------------- worker

    def _take(self) -> list[_Pending] | None:
        """Block for the next batch: same model, ≤ max rows, within max wait of the first."""
        cfg = self.config
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            first = self._queue.popleft()
            taken, rows = [first], first.batch.batch_size
            until = first.enqueued + cfg.max_wait_us * 1e-6
            while rows < cfg.max_batch_rows:
                if not self._queue:
                    left = until - time.monotonic()
                    if left <= 0 or self._closed:
                        break
                    self._cond.wait(left)
                    continue
                nxt = self._queue[0]
                if nxt.model is not first.model or rows + nxt.batch.batch_size > cfg.max_batch_rows:
                    break  # another model version, or too big: starts the next batch
                taken.append(self._queue.popleft())
                rows += nxt.batch.batch_size
            return taken

    def _run(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                return
            try:
                self._run_batch(taken)
            except BaseException as e:  # never let the worker die: fail this batch's requests
                log.exception("batch of %d requests failed", len(taken))
                for p in taken:
                    if not p.future.done():
                        p.future.set_exception(e)

    def _run_batch(self, taken: list[_Pending]) -> None:
        now = time.monotonic()
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
        if not live:
            self._report(BatchStats(0, 0, expired, now - taken[0].enqueued, 0.0))
            return
        cpu0 = time.thread_time()
        model = live[0].model
        batch = merge_batches(
            [p.batch for p in live], host=getattr(model, "takes_host_batches", False)
        )
        start = time.monotonic()
        stages: dict[str, float] = {}
        # (a HostBatch only for a predictor that takes them: merge_batches)
        if getattr(model, "reports_timings", False):
            out = model.predict(batch, timings=stages)  # type: ignore[call-arg,arg-type]
        else:
            out = model.predict(batch)  # type: ignore[arg-type]
        probs = out.detach().cpu().numpy()  # [ΣB]
        run_s = time.monotonic() - start
        cpu_s = time.thread_time() - cpu0
        offset = 0
        for p in live:
            n = p.batch.batch_size
            p.future.set_result(probs[offset : offset + n])
            offset += n
        self._report(
            BatchStats(
                len(live),
                offset,
                expired,
                start - live[0].enqueued,
                run_s,
                concat_s=start - now,
                cpu_s=cpu_s,
                stages=stages,
            )
        )

    def _report(self, stats: BatchStats) -> None:
        if self._on_batch is not None:
            try:
                self._on_batch(stats)
            except Exception:
                log.exception("on_batch callback failed")


# --------------------------------------------------------------------------- concatenation


def _concat_kjt(kjts: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """Concatenate KJTs with the same keys along the batch (stride) dimension.

    A KJT stores its values key-major (all bags of key 0, then key 1, ...), so the result takes,
    for each key, that key's values from every input in turn.
    """
    keys = kjts[0].keys()
    for k in kjts[1:]:
        if k.keys() != keys:
            raise ValueError(f"cannot concatenate batches with keys {keys} and {k.keys()}")
    if len(kjts) == 1:
        return kjts[0]
    n_keys = len(keys)
    if n_keys == 0:
        stride = sum(k.stride() for k in kjts)
        return KeyedJaggedTensor(
            keys=[], values=kjts[0].values(), lengths=kjts[0].lengths(), stride=stride
        )
    lengths = torch.cat([k.lengths().view(n_keys, -1) for k in kjts], dim=1)  # [K, ΣS]
    per_key = [k.length_per_key() for k in kjts]  # [input][key], host ints
    per_input = [torch.split(k.values(), n) for k, n in zip(kjts, per_key, strict=True)]
    values = torch.cat([per_input[i][j] for j in range(n_keys) for i in range(len(kjts))])
    length_per_key = [sum(n[j] for n in per_key) for j in range(n_keys)]
    return KeyedJaggedTensor(
        keys=keys,
        values=values,
        lengths=lengths.reshape(-1),
        stride=int(lengths.shape[1]),
        length_per_key=length_per_key,
        offset_per_key=[0, *itertools.accumulate(length_per_key)],
    )


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """One batch of several: users and candidates are stacked, ``user_index`` offset.

    Example: a request with U=1, B=3 and one with U=1, B=2 give U=2, B=5 and
    ``user_index = [0, 0, 0, 1, 1]``. Labels and oracle are kept only if every batch has them.
    """
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    if len(batches) == 1:
        return batches[0]
    offsets = np.cumsum([0] + [b.num_users for b in batches[:-1]])
    user_index = torch.cat([b.user_index + int(o) for b, o in zip(batches, offsets, strict=True)])

    def cat_opt(name: str) -> torch.Tensor | None:
        parts = [getattr(b, name) for b in batches]
        return None if any(p is None for p in parts) else torch.cat(parts)

    return Batch(
        user=_concat_kjt([b.user for b in batches]),
        item=_concat_kjt([b.item for b in batches]),
        sequence=_concat_kjt([b.sequence for b in batches]),
        user_index=user_index,
        labels=cat_opt("labels"),
        oracle=cat_opt("oracle"),
    )


def merge_batches(parts: Sequence[Batch | HostBatch], *, host: bool) -> Batch | HostBatch:
    """The batcher's one batch of its requests: a :class:`~serve.host_batch.HostBatch` when every
    part is one and ``host`` (the predictor takes them), else :func:`concat_batches`' batch (host
    batches built into KJTs after they are merged: one KJT build, not one per request)."""
    if all(isinstance(p, HostBatch) for p in parts):
        merged = HostBatch.concat(cast(Sequence[HostBatch], parts))
        return merged if host else merged.to_batch()
    return concat_batches([p.to_batch() if isinstance(p, HostBatch) else p for p in parts])
