"""The channel between a frontend process and the device process: batches in shared memory,
small control messages over a pipe.

A frontend (:mod:`serve.frontend`) parses, validates and runs feature generation; the device
process owns the batcher, the model and its CUDA graphs. Per frontend the device process
creates one :class:`SlotArena` (``multiprocessing.shared_memory``: ``slots`` slots of
``slot_bytes``, reserved with ``posix_fallocate`` at start so that a full ``/dev/shm`` is an
error at startup, never a SIGBUS under load) and one duplex pipe. A request goes::

    frontend                                        device process
    take a free slot, copy the batch's tensors
    into it (:func:`write_batch`)
    ("predict", rid, token, deadline, slot, ref) ─▶ tensors as views of the slot
                                                    (:func:`read_batch`), Batcher.submit
    ("cancel", rid)  (client gone, optional)     ─▶ future.cancel()
                                                 ◀─ ("done", rid, n): probabilities [n]
                                                    float32 written over the slot
                                                 ◀─ or ("failed", rid, code, details)
    read the probabilities, free the slot

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
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import grpc
import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from serve.batcher import Batcher, BatcherClosedError, Predictor
from serve.rpc import RpcError
from shared.batch import Batch

log = logging.getLogger(__name__)

ALIGN = 64  # bytes: every tensor in a slot starts at a multiple of this
SHUTTING_DOWN = "the server is shutting down"  # BatcherClosedError's text: the same answer

_DTYPES = {
    str(d): d
    for d in (
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
    )
}

# (dtype, numel, byte offset) of one 1-D tensor in a slot or payload
TensorRef = tuple[str, int, int]
# keys, stride, length_per_key, values, lengths, weights (None: unweighted)
KjtRef = tuple[tuple[str, ...], int, list[int], TensorRef, TensorRef, TensorRef | None]
# user, item, sequence, user_index
BatchRef = tuple[KjtRef, KjtRef, KjtRef, TensorRef]


@dataclass(frozen=True)
class HandoffConfig:
    """Shared memory per frontend: ``slots`` batches of up to ``slot_bytes`` each in flight
    (more, or larger, go through the pipe instead)."""

    slots: int = 32
    slot_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"handoff slots must be >= 1, got {self.slots}")
        if self.slot_bytes < 4096 or self.slot_bytes % ALIGN:
            raise ValueError(
                f"handoff slot_bytes must be >= 4096 and a multiple of {ALIGN}, "
                f"got {self.slot_bytes}"
            )

    @property
    def total_bytes(self) -> int:
        return self.slots * self.slot_bytes


class SlotArena:
    """One frontend's shared memory, :attr:`HandoffConfig.slots` slots of ``slot_bytes``."""

    def __init__(self, shm: SharedMemory, config: HandoffConfig, *, owner: bool) -> None:
        self.shm = shm
        self.config = config
        self._owner = owner
        self._bytes = np.ndarray((config.total_bytes,), dtype=np.uint8, buffer=shm.buf)

    @property
    def name(self) -> str:
        return self.shm.name

    @classmethod
    def create(cls, config: HandoffConfig) -> SlotArena:
        """A new arena (the device process: it owns and unlinks it)."""
        shm = SharedMemory(create=True, size=config.total_bytes)
        try:
            fd = getattr(shm, "_fd", -1)
            if fd >= 0 and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, config.total_bytes)  # no SIGBUS later: fail now
        except OSError as err:
            shm.close()
            shm.unlink()
            raise OSError(
                f"cannot reserve {config.total_bytes >> 20} MiB of shared memory for a frontend "
                f"({err.strerror or err}); enlarge /dev/shm (docker: --shm-size) or lower "
                "serve --handoff-slots / --handoff-slot-kib"
            ) from err
        return cls(shm, config, owner=True)

    @classmethod
    def attach(cls, name: str, config: HandoffConfig) -> SlotArena:
        """The arena ``name`` created by the device process (a frontend)."""
        return cls(SharedMemory(name=name), config, owner=False)

    def slot(self, index: int) -> np.ndarray:
        size = self.config.slot_bytes
        return self._bytes[index * size : (index + 1) * size]

    def close(self) -> None:
        """Unmap (and, as the owner, unlink). Views still held elsewhere keep the memory."""
        self._bytes = np.zeros(0, dtype=np.uint8)
        with contextlib.suppress(BufferError):  # tensors of the last batches may still view it
            self.shm.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()


# --------------------------------------------------------------------------- batch layout


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _kjt_parts(kjt: KeyedJaggedTensor) -> list[torch.Tensor | None]:
    return [kjt.values(), kjt.lengths(), kjt.weights_or_none()]


def batch_bytes(batch: Batch) -> int:
    """Bytes :func:`write_batch` needs for ``batch``."""
    parts = [t for k in (batch.user, batch.item, batch.sequence) for t in _kjt_parts(k)]
    return sum(_aligned(t.nbytes) for t in [*parts, batch.user_index] if t is not None)


def write_batch(batch: Batch, buf: np.ndarray) -> BatchRef | None:
    """Copy ``batch``'s tensors into ``buf`` (uint8); their layout, or None if it does not fit.

    Only what serving batches carry: three KJTs (values, lengths, optional weights, host-side
    ``length_per_key``) and ``user_index``; labels and oracle are not sent.
    """
    if batch_bytes(batch) > buf.nbytes:
        return None
    cursor = 0

    def put(t: torch.Tensor) -> TensorRef:
        nonlocal cursor
        t = t.detach().contiguous().view(-1)
        n = t.nbytes
        if n:
            buf[cursor : cursor + n] = t.view(torch.uint8).numpy()
        ref = (str(t.dtype), t.numel(), cursor)
        cursor += _aligned(n)
        return ref

    def kjt_ref(kjt: KeyedJaggedTensor) -> KjtRef:
        values, lengths, weights = _kjt_parts(kjt)
        assert values is not None and lengths is not None
        return (
            tuple(kjt.keys()),
            kjt.stride(),
            list(kjt.length_per_key()),
            put(values),
            put(lengths),
            None if weights is None else put(weights),
        )

    user, item, seq = kjt_ref(batch.user), kjt_ref(batch.item), kjt_ref(batch.sequence)
    return user, item, seq, put(batch.user_index)


def read_batch(ref: BatchRef, buf: np.ndarray) -> Batch:
    """The batch of ``ref``; its tensors are views of ``buf`` (no copy)."""

    def get(r: TensorRef) -> torch.Tensor:
        dtype_name, numel, offset = r
        dtype = _DTYPES[dtype_name]
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        size = numel * torch.empty(0, dtype=dtype).element_size()
        return torch.from_numpy(buf[offset : offset + size]).view(dtype)

    def kjt(r: KjtRef) -> KeyedJaggedTensor:
        keys, stride, per_key, values, lengths, weights = r
        return KeyedJaggedTensor(
            keys=list(keys),
            values=get(values),
            lengths=get(lengths),
            weights=None if weights is None else get(weights),
            stride=stride,
            length_per_key=per_key,
            offset_per_key=[0, *itertools.accumulate(per_key)],
        )

    user, item, seq, user_index = ref
    return Batch(user=kjt(user), item=kjt(item), sequence=kjt(seq), user_index=get(user_index))


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
                msg = self.conn.recv()
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
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("%s: handoff reader failed; closing the channel", self.name)
        finally:
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
    """A request's probabilities; cancelling it also asks the device process to drop it."""

    def __init__(self, client: HandoffClient, rid: int) -> None:
        super().__init__()
        self._client = client
        self._rid = rid

    def cancel(self) -> bool:
        if not self.done():
            self._client.send(("cancel", self._rid))
        return super().cancel()


class HandoffClient(_Endpoint):
    """The frontend's end, and its batcher: :meth:`submit` as :meth:`serve.batcher.Batcher.submit`
    (``model`` is anything with the ``token`` of the version it was validated against)."""

    def __init__(self, conn: Connection, arena: SlotArena, name: str = "frontend") -> None:
        super().__init__(conn, name)
        self.arena = arena
        self._free = list(range(arena.config.slots - 1, -1, -1))  # LIFO: hot slots reused
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[int, _RemoteFuture]] = {}
        self._rids = itertools.count()
        self.on_message: Callable[[tuple[Any, ...]], None] = lambda msg: None
        self.on_gone: Callable[[], None] = lambda: None
        self.call_handlers: dict[str, Callable[[], Any]] = {}
        self.payload_sends = 0  # batches sent in the pipe (no free slot, or too large)

    def depth(self) -> int:
        return 0  # the queue is the device process's

    def submit(self, model: Any, batch: Batch, *, deadline: float | None = None) -> Future[Any]:
        rid = next(self._rids)
        future = _RemoteFuture(self, rid)
        with self._lock:
            slot = self._free.pop() if self._free else -1
        ref = write_batch(batch, self.arena.slot(slot)) if slot >= 0 else None
        payload: bytes | None = None
        if ref is None:  # no free slot, or too large for one: in the message
            if slot >= 0:
                self._release(slot)
                slot = -1
            buf = np.empty(batch_bytes(batch), dtype=np.uint8)
            ref = write_batch(batch, buf)
            assert ref is not None
            payload = buf.tobytes()
            self.payload_sends += 1
        with self._lock:
            self._pending[rid] = (slot, future)
        if self.closed.is_set() or not self.send(
            ("predict", rid, model.token, deadline, slot, ref, payload)
        ):
            self._finish(rid)
            raise BatcherClosedError(SHUTTING_DOWN)
        return future

    def _release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def _finish(self, rid: int) -> _RemoteFuture | None:
        with self._lock:
            entry = self._pending.pop(rid, None)
        if entry is None:
            return None
        slot, future = entry
        if slot >= 0:
            self._release(slot)
        return future

    def handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "done":
            _, rid, n, payload = msg
            with self._lock:
                entry = self._pending.get(rid)
            if entry is None:
                return
            slot = entry[0]
            if payload is None:
                probs = self.arena.slot(slot)[: 4 * n].view(np.float32).copy()
            else:
                probs = np.frombuffer(payload, dtype=np.float32, count=n)
            future = self._finish(rid)
            if future is not None and not future.done():
                future.set_result(probs)
        elif kind == "failed":
            _, rid, code, details = msg
            future = self._finish(rid)
            if future is not None and not future.done():
                future.set_exception(RpcError(grpc.StatusCode[code], details))
        else:
            self.on_message(msg)

    def on_call(self, name: str) -> Any:
        handler = self.call_handlers.get(name)
        if handler is None:
            return super().on_call(name)
        return handler()

    def on_closed(self) -> None:
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        for _, future in pending:
            if not future.done():
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
    ) -> None:
        super().__init__(conn, name)
        self.arena = arena
        self._batcher = batcher
        self._models = models
        self._status_of = status_of
        self._inflight: dict[int, Future[np.ndarray]] = {}
        self._lock = threading.Lock()
        self.on_message: Callable[[tuple[Any, ...]], None] = lambda msg: None
        self.call_handlers: dict[str, Callable[[], Any]] = {}

    def inflight(self) -> int:
        return len(self._inflight)

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
            batch = read_batch(ref, buf)
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
