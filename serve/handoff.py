"""The channel between a frontend process and the device process: batches in shared memory,
small control messages over a pipe.

A frontend (:mod:`serve.frontend`) parses, validates and runs feature generation; the device
process owns the batcher, the model and its CUDA graphs. Per frontend the device process
creates one :class:`~serve.slots.SlotArena` (shared memory: ``slots`` slots of ``slot_bytes``;
the layout of a batch in a slot is :mod:`serve.slots`') and one duplex pipe. A request goes::

    frontend                                        device process
    take a free slot, copy the batch's tensors
    into it (:func:`write_batch`)
    ("predict", rid, token, deadline, slot, ref) ─▶ numpy views of the slot, no KJT built
                                                    (:func:`read_host_batch`), Batcher.submit
    ("cancel", rid)  (client gone, optional)     ─▶ future.cancel()
                                                 ◀─ ("done", rid, n): probabilities [n]
                                                    float32 written over the slot
                                                 ◀─ or ("failed", rid, code, details)
    read the probabilities, free the slot

A "predict" may carry a *group*: while :attr:`HandoffConfig.inflight` groups of a frontend wait
for their answers, its further requests queue in the frontend, and the next send concatenates
every queued request of one model version (up to the batcher's ``max_batch_rows`` and one slot)
into one batch, one message, one submit: the device process pays its per-message cost (receive,
unpickle, reading the batch, submit, the batcher's concat, the answer) once per group, and
the frontend splits the answer back (see :class:`HandoffClient`). ``rid`` names the group; a
"cancel" is sent once every request of a group is cancelled.

The device process reads a batch as a :class:`~serve.host_batch.HostBatch` (its arrays are
views of the slot): the batcher merges those with numpy and a CUDA graph pads them straight into
its inputs; KJTs are built once per batch, and only where it runs eagerly.

A slot belongs to the device process from the "predict" message until its answer (every
request is answered exactly once, also when cancelled or expired), so a frontend never writes
a slot the device process may still read. A batch larger than a slot, or one sent while every
slot is taken, travels in the message itself (``payload``): slower, never refused. ``deadline``
is a ``time.monotonic()`` time, which is the same clock in every process of a Linux host.
``token`` names the model version the frontend validated against (:class:`ModelRegistry`).

Both ends also make small calls of each other (``("call", qid, name)`` → ``("reply", qid,
ok, value)``: the device process asks a frontend for its metrics, a frontend asks for
``GetModelMetadata``), and the device process pushes ``("model", ...)`` (the version to
validate against) and ``("stop", grace)``. A broken pipe ends both: the device process fails
nothing (the frontend is gone) and a frontend fails its waiting requests UNAVAILABLE and exits.

The device process reads every frontend's pipe with one thread (:class:`SharedReader`), not a
reader thread per frontend: fewer threads to take the GIL from the batcher's.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import selectors
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, cast

import grpc
import numpy as np

from serve.batcher import Batcher, BatcherClosedError, Predictor, concat_batches
from serve.rpc import RpcError
from serve.slots import (
    BatchRef,
    SlotArena,
    batch_bytes,
    read_batch,
    read_host_batch,
    write_batch,
)
from shared.batch import Batch

log = logging.getLogger(__name__)

SHUTTING_DOWN = "the server is shutting down"  # BatcherClosedError's text: the same answer


# --------------------------------------------------------------------------- both ends


class _Endpoint:
    """One end of the pipe: sends under a lock, a reader thread, calls with answers."""

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self.name = name
        self._send_lock = threading.Lock()
        self._calls: dict[int, Future[Any]] = {}
        self._qids = itertools.count()
        self._reader: threading.Thread | None = None
        self.closed = threading.Event()  # the pipe broke or was closed

    def send(self, msg: tuple[Any, ...]) -> bool:
        """False when the other end is gone."""
        try:
            with self._send_lock:
                self.conn.send(msg)
            return True
        except (OSError, ValueError, EOFError):
            return False

    def start(self) -> None:
        self._reader = threading.Thread(target=self._read, name=f"{self.name}-reader", daemon=True)
        self._reader.start()

    def call(self, name: str, timeout: float | None) -> Any:
        """Ask the other end; its value, or RpcError (UNAVAILABLE when it does not answer)."""
        qid = next(self._qids)
        future: Future[Any] = Future()
        self._calls[qid] = future
        try:
            if not self.send(("call", qid, name)):
                raise RpcError(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
            try:
                return future.result(timeout)
            except TimeoutError:
                raise RpcError(
                    grpc.StatusCode.UNAVAILABLE, f"{name}: no answer from the serving process"
                ) from None
        finally:
            self._calls.pop(qid, None)

    def _answer_call(self, qid: int, name: str) -> None:
        try:
            value = self.on_call(name)
            reply: tuple[Any, ...] = ("reply", qid, True, value)
        except RpcError as err:
            reply = ("reply", qid, False, (err.code.name, err.details))
        except Exception as err:
            reply = ("reply", qid, False, internal_error(err, f"call {name}"))
        self.send(reply)

    def on_call(self, name: str) -> Any:
        raise RpcError(grpc.StatusCode.UNIMPLEMENTED, f"no call {name!r}")

    def _read(self) -> None:
        try:
            while True:
                self._dispatch(self.conn.recv())
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("%s: handoff reader failed; closing the channel", self.name)
        finally:
            self._end_reading()

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        """One received message: a call (answered by a thread of its own, never the reader's),
        a reply to one of ours, or :meth:`handle`'s."""
        kind = msg[0]
        if kind == "call":
            threading.Thread(
                target=self._answer_call, args=msg[1:], name=f"{self.name}-call"
            ).start()
        elif kind == "reply":
            _, qid, ok, value = msg
            future = self._calls.get(qid)
            if future is not None and not future.done():
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(RpcError(grpc.StatusCode[value[0]], value[1]))
        else:
            self.handle(msg)

    def _end_reading(self) -> None:
        """Once, by the reader, when the pipe is gone: waiting calls fail, :meth:`on_closed`."""
        self.closed.set()
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(RpcError(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN))
        self.on_closed()

    def handle(self, msg: tuple[Any, ...]) -> None:
        raise NotImplementedError

    def on_closed(self) -> None:
        """Called once by the reader thread when the pipe is gone."""

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()


def internal_error(err: BaseException, where: str) -> tuple[str, str]:
    """INTERNAL (code, details) as :mod:`serve.rpc` words it, logged under a request id."""
    request_id = uuid.uuid4().hex[:12]
    log.error("internal error in %s (request id %s)", where, request_id, exc_info=err)
    return (
        "INTERNAL",
        f"internal error (request id {request_id}, {type(err).__name__}); the server log "
        "has the traceback under this id",
    )


# --------------------------------------------------------------------------- frontend end


class _RemoteFuture(Future[np.ndarray]):
    """A request's probabilities; cancelling it also asks the device process to drop it (its
    group, once every request of the group is cancelled)."""

    def __init__(self, client: HandoffClient, batch: Batch, deadline: float | None) -> None:
        super().__init__()
        self._client = client
        self.batch: Batch | None = batch  # until sent
        self.rows = batch.batch_size
        self.deadline = deadline
        self.enqueued = time.monotonic()
        self.group: _Group | None = None

    def cancel(self) -> bool:
        done = self.done()
        cancelled = super().cancel()
        if not done and cancelled:
            self._client._cancelled(self)
        return cancelled


@dataclass
class _Group:
    """Requests of one model version sent as one batch (one message, one slot)."""

    gid: int
    slot: int
    members: list[_RemoteFuture]


class HandoffClient(_Endpoint):
    """The frontend's end, and its batcher: :meth:`submit` as :meth:`serve.batcher.Batcher.submit`
    (``model`` is anything with the ``token`` of the version it was validated against).

    Requests are sent at once while fewer than :attr:`HandoffConfig.inflight` groups wait for
    their answers; past that they queue here, and the next send takes every queued request of
    the same version (up to ``max_group_rows`` rows and one slot) as one group: one
    concatenated batch, one message, one submit in the device process, one answer split back.
    So the device process's cost per request falls as the load rises, and a lone request is
    never held back. The group runs under the latest deadline of its requests; a request whose
    deadline has passed when its group is formed fails here as the batcher would fail it.
    """

    def __init__(
        self,
        conn: Connection,
        arena: SlotArena,
        name: str = "frontend",
        *,
        max_group_rows: int | None = None,
    ) -> None:
        super().__init__(conn, name)
        self.arena = arena
        self.max_group_rows = max_group_rows
        self._free = list(range(arena.config.slots - 1, -1, -1))  # LIFO: hot slots reused
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: dict[int, _Group] = {}  # sent, not answered
        self._queue: collections.deque[tuple[Any, _RemoteFuture]] = collections.deque()
        self._sending = False  # a thread is forming and sending groups
        self._rids = itertools.count()
        self.on_message: Callable[[tuple[Any, ...]], None] = lambda msg: None
        self.on_gone: Callable[[], None] = lambda: None
        self.call_handlers: dict[str, Callable[[], Any]] = {}
        self.payload_sends = 0  # batches sent in the pipe (no free slot, or too large)
        self.groups_sent = 0
        self.requests_sent = 0
        self._sender: threading.Thread | None = None

    def depth(self) -> int:
        return 0  # the queue is the device process's

    def start(self) -> None:
        super().start()
        self._sender = threading.Thread(target=self._send_loop, name=f"{self.name}-sender")
        self._sender.daemon = True
        self._sender.start()

    def submit(self, model: Any, batch: Batch, *, deadline: float | None = None) -> Future[Any]:
        future = _RemoteFuture(self, batch, deadline)
        with self._lock:
            if self.closed.is_set():
                raise BatcherClosedError(SHUTTING_DOWN)
            self._queue.append((model.token, future))
            if self._sending or len(self._pending) >= self.arena.config.inflight:
                return future  # the sending thread, or the next answer, takes it
            self._sending = True
        self._pump()
        return future

    def _send_loop(self) -> None:
        """Sends what queued while the in-flight groups were at their bound."""
        while not self.closed.is_set():
            with self._wake:
                while not self._can_send():
                    if self.closed.is_set():
                        return
                    self._wake.wait(0.5)
                self._sending = True
            self._pump()

    def _can_send(self) -> bool:  # under the lock
        return (
            not self._sending
            and bool(self._queue)
            and len(self._pending) < self.arena.config.inflight
        )

    def _take(self) -> tuple[Any, list[_RemoteFuture]] | None:
        """Under the lock: the next group's token and requests (None: nothing to send)."""
        cfg = self.arena.config
        queue = self._queue
        while queue and queue[0][1].done():  # cancelled while queued
            queue.popleft()
        if not queue or len(self._pending) >= cfg.inflight:
            return None
        token, first = queue.popleft()
        members = [first]
        rows = first.rows
        size = batch_bytes(first.batch) if first.batch is not None else 0
        limit = self.max_group_rows
        while queue and size < cfg.slot_bytes:
            nxt_token, nxt = queue[0]
            if nxt.done():
                queue.popleft()
                continue
            if nxt_token != token or (limit is not None and rows + nxt.rows > limit):
                break
            assert nxt.batch is not None
            nbytes = batch_bytes(nxt.batch)
            if size + nbytes > cfg.slot_bytes:
                break
            queue.popleft()
            members.append(nxt)
            rows += nxt.rows
            size += nbytes
        return token, members

    def _pump(self) -> None:
        """Form and send groups until nothing is queued or the in-flight bound is reached (the
        calling thread holds the sending role; it gives it back here)."""
        while True:
            with self._lock:
                taken = None if self.closed.is_set() else self._take()
                if taken is None:
                    self._sending = False
                    if self._can_send():
                        self._wake.notify()
                    return
                token, members = taken
                slot = self._free.pop() if self._free else -1
                group = _Group(next(self._rids), slot, members)
                self._pending[group.gid] = group
            try:
                self._send_group(token, group)
            except Exception as err:  # a bug: INTERNAL for the group, the sender goes on
                code, details = internal_error(err, f"Predict (handoff by {self.name})")
                self._fail_group(group.gid, RpcError(grpc.StatusCode[code], details))

    def _send_group(self, token: Any, group: _Group) -> None:
        now = time.monotonic()
        live: list[_RemoteFuture] = []
        for f in group.members:
            if f.deadline is not None and now > f.deadline:
                with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
                    f.set_exception(  # the batcher's answer (serve.servicer.status_of's words)
                        RpcError(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"deadline exceeded: deadline passed after {now - f.enqueued:.4f}s "
                            "in the queue",
                        )
                    )
            elif not f.done():
                live.append(f)
        group.members = live
        if not live:
            self._finish(group.gid)
            return
        deadline = (
            None
            if any(f.deadline is None for f in live)
            else max(cast(float, f.deadline) for f in live)
        )
        parts = [cast(Batch, f.batch) for f in live]
        for f in live:
            f.group = group
            f.batch = None
        batch = concat_batches(parts)
        slot = group.slot
        ref = write_batch(batch, self.arena.slot(slot)) if slot >= 0 else None
        payload: bytes | None = None
        if ref is None:  # no free slot, or too large for one: in the message
            if slot >= 0:
                with self._lock:
                    self._free.append(slot)
                group.slot = slot = -1
            buf = np.empty(batch_bytes(batch), dtype=np.uint8)
            ref = write_batch(batch, buf)
            assert ref is not None
            payload = buf.tobytes()
            self.payload_sends += 1
        self.groups_sent += 1
        self.requests_sent += len(live)
        if self.closed.is_set() or not self.send(
            ("predict", group.gid, token, deadline, slot, ref, payload)
        ):
            self._fail_group(group.gid, RpcError(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN))
            return
        if all(f.done() for f in live):  # every one cancelled while it was sent
            self.send(("cancel", group.gid))

    def _cancelled(self, future: _RemoteFuture) -> None:
        group = future.group
        if group is not None and all(f.done() for f in group.members):
            with self._lock:
                sent = group.gid in self._pending
            if sent:
                self.send(("cancel", group.gid))

    def _finish(self, gid: int) -> _Group | None:
        with self._lock:
            group = self._pending.pop(gid, None)
            if group is None:
                return None
            if group.slot >= 0:
                self._free.append(group.slot)
            if self._can_send():
                self._wake.notify()
        return group

    def _fail_group(self, gid: int, err: BaseException) -> None:
        group = self._finish(gid)
        if group is not None:
            for f in group.members:
                if not f.done():
                    with contextlib.suppress(InvalidStateError):
                        f.set_exception(err)

    def handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "done":
            _, gid, n, payload = msg
            with self._lock:
                entry = self._pending.get(gid)
            if entry is None:
                return
            if payload is None:
                probs = self.arena.slot(entry.slot)[: 4 * n].view(np.float32).copy()
            else:
                probs = np.frombuffer(payload, dtype=np.float32, count=n)
            group = self._finish(gid)
            if group is None:
                return
            offset = 0
            for f in group.members:
                part = probs[offset : offset + f.rows]
                offset += f.rows
                if not f.done():
                    with contextlib.suppress(InvalidStateError):
                        f.set_result(part)
        elif kind == "failed":
            _, gid, code, details = msg
            self._fail_group(gid, RpcError(grpc.StatusCode[code], details))
        else:
            self.on_message(msg)

    def on_call(self, name: str) -> Any:
        handler = self.call_handlers.get(name)
        if handler is None:
            return super().on_call(name)
        return handler()

    def on_closed(self) -> None:
        with self._wake:
            waiting = [f for g in self._pending.values() for f in g.members]
            waiting += [f for _, f in self._queue]
            self._pending.clear()
            self._queue.clear()
            self._wake.notify_all()
        for future in waiting:
            if not future.done():
                with contextlib.suppress(InvalidStateError):
                    future.set_exception(RpcError(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN))
        self.on_gone()


# --------------------------------------------------------------------------- device end


class ModelRegistry:
    """Tokens of the model versions announced to frontends → the models.

    Only the current model is held (by the server); older ones are weak references, alive as
    long as requests hold them, so that a replaced version's tables are freed as in the
    single-process server. A request validated against a version already freed runs on the
    current one when it has the same feature config (``config_digest``), else it is
    UNAVAILABLE (retry): its batch was built for another feature set.
    """

    def __init__(self, current: Callable[[], Predictor | None]) -> None:
        self._current = current
        self._lock = threading.Lock()
        self._models: dict[int, weakref.ref[Any]] = {}
        self._digests: dict[int, str] = {}
        self._tokens = itertools.count(1)

    def register(self, model: Any) -> int:
        with self._lock:
            token = next(self._tokens)
            self._models[token] = weakref.ref(model)
            self._digests[token] = model.bundle.config_digest
            return token

    def get(self, token: int) -> Any:
        with self._lock:
            ref = self._models.get(token)
            model = None if ref is None else ref()
            if model is None:
                self._models.pop(token, None)
                digest = self._digests.get(token)
        if model is not None:
            return model
        current: Any = self._current()
        if current is not None and digest is not None and current.bundle.config_digest == digest:
            return current
        raise RpcError(
            grpc.StatusCode.UNAVAILABLE,
            "the model version this request was validated against was replaced by one with "
            "another feature config; retry",
        )


class SharedReader:
    """One thread that reads the pipes of many :class:`HandoffServer` s (the device process:
    one per frontend), instead of a reader thread each: fewer threads to take the GIL from the
    batcher's.

    The thread waits on every registered pipe at once (``epoll``, level-triggered), receives one
    message from each ready pipe and handles it as an endpoint's own reader would
    (:meth:`_Endpoint._dispatch`: a call still gets a thread of its own). A pipe that breaks ends
    its endpoint only (:meth:`_Endpoint.on_closed`), the others are read on. The thread starts
    with the first endpoint and ends when the last one is gone (closed or broken).
    """

    def __init__(self, name: str = "handoff-reader") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._endpoints: dict[int, _Endpoint] = {}  # fd → endpoint, while read
        self._ending: list[_Endpoint] = []  # closed by close(): their end to run
        self._selector: selectors.BaseSelector | None = None
        self._wake: tuple[int, int] = (-1, -1)  # a pipe: close() wakes the thread
        self._thread: threading.Thread | None = None

    def threads(self) -> int:
        """1 while any endpoint is read, else 0."""
        with self._lock:
            return int(self._thread is not None)

    def add(self, endpoint: _Endpoint) -> None:
        """Read ``endpoint``'s pipe from now on (its :meth:`_Endpoint.start`)."""
        fd = endpoint.conn.fileno()
        with self._lock:
            if self._thread is None:
                self._selector = selectors.DefaultSelector()
                self._wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
                self._selector.register(self._wake[0], selectors.EVENT_READ, None)
                self._thread = threading.Thread(
                    target=self._run, args=(self._selector, self._wake), name=self.name
                )
                self._thread.daemon = True
                self._thread.start()
            assert self._selector is not None
            # epoll: a pipe added while the thread waits is waited on at once
            self._selector.register(fd, selectors.EVENT_READ, endpoint)
            self._endpoints[fd] = endpoint

    def remove(self, endpoint: _Endpoint) -> None:
        """Stop reading ``endpoint``'s pipe before it is closed (its end runs on the thread)."""
        with self._lock:
            if not self._drop(endpoint):
                return
            self._ending.append(endpoint)
            with contextlib.suppress(OSError):
                os.write(self._wake[1], b"x")

    def _drop(self, endpoint: _Endpoint) -> bool:  # under the lock; False: not read
        for fd, other in self._endpoints.items():
            if other is endpoint:
                del self._endpoints[fd]
                assert self._selector is not None
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self._selector.unregister(fd)
                return True
        return False

    def _end(self, endpoint: _Endpoint) -> None:
        try:
            endpoint._end_reading()
        except Exception:
            log.exception("%s: closing the channel failed", endpoint.name)

    def _run(self, selector: selectors.BaseSelector, wake: tuple[int, int]) -> None:
        while True:
            with self._lock:
                ending, self._ending = self._ending, []
                if not ending and not self._endpoints:  # nothing left to read: the thread ends
                    self._thread = self._selector = None
                    self._wake = (-1, -1)
                    selector.close()
                    os.close(wake[0])
                    os.close(wake[1])
                    return
            for endpoint in ending:
                self._end(endpoint)
            if ending:
                continue
            for key, _ in selector.select():
                endpoint = key.data
                if endpoint is None:  # woken by remove()
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake[0], 4096)
                    continue
                if self._endpoints.get(key.fd) is not endpoint:
                    continue  # removed since the wait ended
                try:
                    endpoint._dispatch(endpoint.conn.recv())
                    continue
                except (EOFError, OSError):
                    pass
                except Exception:
                    log.exception("%s: handoff reader failed; closing the channel", endpoint.name)
                with self._lock:
                    gone = self._drop(endpoint)
                if gone:
                    self._end(endpoint)


_DEVICE_READER = SharedReader()  # every HandoffServer of this process, unless given another


class HandoffServer(_Endpoint):
    """The device process's end for one frontend: batches into ``batcher``, answers back."""

    def __init__(
        self,
        conn: Connection,
        arena: SlotArena,
        batcher: Batcher,
        models: ModelRegistry,
        status_of: Callable[[BaseException], RpcError | None],
        name: str,
        *,
        reader: SharedReader | None = None,
    ) -> None:
        super().__init__(conn, name)
        self.arena = arena
        self._shared = _DEVICE_READER if reader is None else reader
        self._batcher = batcher
        self._models = models
        self._status_of = status_of
        self._inflight: dict[int, Future[np.ndarray]] = {}
        self._lock = threading.Lock()
        self.on_message: Callable[[tuple[Any, ...]], None] = lambda msg: None
        self.call_handlers: dict[str, Callable[[], Any]] = {}

    def inflight(self) -> int:
        return len(self._inflight)

    def start(self) -> None:
        """Its pipe is read by the process's one :class:`SharedReader` (no thread of its own)."""
        self._shared.add(self)

    def close(self) -> None:
        self._shared.remove(self)
        super().close()

    def handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "predict":
            self._predict(*msg[1:])
        elif kind == "cancel":
            with self._lock:
                future = self._inflight.get(msg[1])
            if future is not None:
                future.cancel()  # done callback answers CANCELLED if it had not started
        else:
            self.on_message(msg)

    def _predict(
        self,
        rid: int,
        token: int,
        deadline: float | None,
        slot: int,
        ref: BatchRef,
        payload: bytes | None,
    ) -> None:
        try:
            model = self._models.get(token)
            buf = (
                self.arena.slot(slot)
                if payload is None
                else np.frombuffer(bytearray(payload), dtype=np.uint8)
            )
            host = read_host_batch(ref, buf)
            batch = read_batch(ref, buf) if host is None else host
            future = self._batcher.submit(model, batch, deadline=deadline)
        except Exception as err:
            self._fail(rid, err)
            return
        with self._lock:
            self._inflight[rid] = future
        future.add_done_callback(lambda f: self._done(rid, slot, f))

    def _fail(self, rid: int, err: BaseException) -> None:
        status = err if isinstance(err, RpcError) else self._status_of(err)
        if status is None:
            code, details = internal_error(err, f"Predict (handed off by {self.name})")
        else:
            code, details = status.code.name, status.details
        self.send(("failed", rid, code, details))

    def _done(self, rid: int, slot: int, future: Future[np.ndarray]) -> None:
        with self._lock:
            self._inflight.pop(rid, None)
        if future.cancelled():
            self.send(("failed", rid, "CANCELLED", "cancelled by the client"))
            return
        err = future.exception()
        if err is not None:
            self._fail(rid, err)
            return
        probs = np.ascontiguousarray(future.result(), dtype=np.float32)
        n = int(probs.shape[0])
        if slot >= 0 and not self.closed.is_set() and 4 * n <= self.arena.config.slot_bytes:
            self.arena.slot(slot)[: 4 * n] = probs.view(np.uint8)
            self.send(("done", rid, n, None))
        else:
            self.send(("done", rid, n, probs.tobytes()))

    def on_call(self, name: str) -> Any:
        handler = self.call_handlers.get(name)
        if handler is None:
            return super().on_call(name)
        return handler()
