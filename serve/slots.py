"""Batches in shared memory: one frontend's slots (:class:`SlotArena`) and the layout of a batch
in a slot (:func:`write_batch`, :func:`read_batch`, :func:`read_host_batch`), for the handoff
between frontends and the device process (:mod:`serve.handoff`).

The device process creates one arena per frontend (``multiprocessing.shared_memory``: ``slots``
slots of ``slot_bytes``, reserved with ``posix_fallocate`` at start so that a full ``/dev/shm``
is an error at startup, never a SIGBUS under load). A frontend copies a batch's tensors into a
free slot, each at a multiple of :data:`ALIGN` bytes, and sends their :data:`BatchRef` (dtype,
count and offset of each); the device process reads them back as numpy views of the slot, no
copy and no KJT built (:func:`read_host_batch`), or as a KJT batch (:func:`read_batch`)::

    arena = SlotArena.create(HandoffConfig())             # the device process
    ref = write_batch(batch, arena.slot(0))               # a frontend (None: it does not fit)
    host = read_host_batch(ref, arena.slot(0))            # the device process
"""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from serve.host_batch import HostBatch, HostKjt
from shared.batch import Batch

ALIGN = 64  # bytes: every tensor in a slot starts at a multiple of this

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

# the numpy dtype of each torch dtype a slot may hold (bfloat16 has none: read_batch reads it)
_NUMPY = {
    name: torch.empty(0, dtype=d).numpy().dtype
    for name, d in _DTYPES.items()
    if name != "torch.bfloat16"
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
    inflight: int = 2  # groups a frontend has sent and not had answered; past it, it groups

    def __post_init__(self) -> None:
        if self.inflight < 1:
            raise ValueError(f"handoff inflight must be >= 1, got {self.inflight}")
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


def read_host_batch(ref: BatchRef, buf: np.ndarray) -> HostBatch | None:
    """The batch of ``ref`` as numpy views of ``buf`` (no copy, no KJT built: see
    :mod:`serve.host_batch`), or None when a tensor has no numpy dtype (:func:`read_batch`)."""
    user, item, seq, user_index = ref
    refs = [r for k in (user, item, seq) for r in k[3:] if r is not None]
    if any(r[0] not in _NUMPY for r in [*refs, user_index]):
        return None

    def get(r: TensorRef) -> np.ndarray:
        dtype_name, numel, offset = r
        dtype = _NUMPY[dtype_name]
        return buf[offset : offset + numel * dtype.itemsize].view(dtype)

    def kjt(r: KjtRef) -> HostKjt:
        keys, stride, per_key, values, lengths, weights = r
        w = None if weights is None else get(weights)
        return HostKjt(tuple(keys), stride, tuple(per_key), get(values), get(lengths), w)

    return HostBatch(kjt(user), kjt(item), kjt(seq), get(user_index))
