"""The tensors of one batch, as feature generation produces them and the model consumes them.

Rows are split by who they belong to, so that serving can send a user's part once for N
candidate ads (user tiling) and training uses the same structure with one user row per sample:

- ``user``: KJT of the USER-side id/bucketized features, stride U (one bag per user row).
- ``item``: KJT of the ITEM- and CONTEXT-side id/bucketized features, stride B (one bag per
  candidate row). Scalar features have 0 (missing → zero embedding) or 1 value per bag.
- ``sequence``: KJT of the sequence sub-features, stride U; the sub-features of one sequence have
  equal lengths (element i of ``click_50_seq__adgroup_id`` and of ``click_50_seq__brand`` is the
  same clicked ad). Values are jagged: no padding.
- ``user_index``: [B] int64, the user row of each candidate row (``arange(B)`` in training).
- ``labels``: [B] float32 (None when serving); ``oracle``: [B] float32 true click probability
  (synthetic data only, for evaluation).
- ``rows_are_users``: a host-side promise that ``user_index`` is ``arange(B)`` (U == B), set by
  training feature generation; the training step then takes the DIN's sync-free path
  (``JaggedDIN.forward(user_index=None)``) without reading the tensor back.
Keys follow the FeatureSet's feature order. Ids are already transformed (mod / hash / bucket /
raw dynamic id), so the model only looks them up.

One buffer (:func:`pack`, :func:`rebase`, :func:`byte_span`): the loader's workers copy all tensors
of a few batches into one shared-memory buffer, so that a message between processes carries one
file descriptor instead of one per tensor, the main process pins it with one copy, and
:mod:`train.data.prefetch` moves a batch to the device with one copy (its tensors are views).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

ALIGN = 64  # bytes: every tensor of a packed buffer starts at a multiple of this


@dataclass
class Batch:
    user: KeyedJaggedTensor  # stride U
    item: KeyedJaggedTensor  # stride B
    sequence: KeyedJaggedTensor  # stride U
    user_index: torch.Tensor  # [B] int64 in [0, U)
    labels: torch.Tensor | None = None  # [B] float32
    oracle: torch.Tensor | None = None  # [B] float32
    rows_are_users: bool = False  # user_index is arange(B): see the module docstring

    @property
    def batch_size(self) -> int:
        return int(self.user_index.numel())

    @property
    def num_users(self) -> int:
        return int(self.user.stride())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return replace(
            self,
            user=self.user.to(device, non_blocking=non_blocking),
            item=self.item.to(device, non_blocking=non_blocking),
            sequence=self.sequence.to(device, non_blocking=non_blocking),
            user_index=self.user_index.to(device, non_blocking=non_blocking),
            labels=move(self.labels),
            oracle=move(self.oracle),
        )

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the batch (KJT values, lengths, offsets and weights where set)."""
        out = [t for kjt in (self.user, self.item, self.sequence) for t in _kjt_tensors(kjt)]
        return out + [t for t in (self.user_index, self.labels, self.oracle) if t is not None]

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """This batch with every tensor of :meth:`tensors` replaced by ``fn(tensor)``: how a batch
        is re-homed as a whole (packed into a buffer, pinned or moved as views of one copy)."""

        def opt(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        return replace(
            self,
            user=_map_kjt(self.user, fn),
            item=_map_kjt(self.item, fn),
            sequence=_map_kjt(self.sequence, fn),
            user_index=fn(self.user_index),
            labels=opt(self.labels),
            oracle=opt(self.oracle),
        )

    def pin_memory(self) -> Batch:
        def pin(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory()

        return replace(
            self,
            user=self.user.pin_memory(),
            item=self.item.pin_memory(),
            sequence=self.sequence.pin_memory(),
            user_index=self.user_index.pin_memory(),
            labels=pin(self.labels),
            oracle=pin(self.oracle),
        )


def _kjt_tensors(kjt: KeyedJaggedTensor) -> list[torch.Tensor]:
    optional = (kjt.lengths_or_none(), kjt.offsets_or_none(), kjt.weights_or_none())
    return [kjt.values(), *(t for t in optional if t is not None)]


def _map_kjt(
    kjt: KeyedJaggedTensor, fn: Callable[[torch.Tensor], torch.Tensor]
) -> KeyedJaggedTensor:
    """``kjt`` with its tensors mapped by ``fn`` and its host metadata kept (as ``KJT.to``)."""
    if kjt.variable_stride_per_key():
        raise ValueError(
            "Batch.map_tensors: variable-stride KJTs are not supported (none of ours is)"
        )

    def opt(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else fn(t)

    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=fn(kjt.values()),
        weights=opt(kjt.weights_or_none()),
        lengths=opt(kjt.lengths_or_none()),
        offsets=opt(kjt.offsets_or_none()),
        stride=kjt.stride(),
        length_per_key=kjt.length_per_key_or_none(),
        offset_per_key=kjt.offset_per_key_or_none(),
    )


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pack(batches: Sequence[Batch], alloc: Callable[[int], torch.Tensor]) -> list[Batch]:
    """``batches`` with all their tensors copied into one uint8 buffer ``alloc(nbytes)`` (1-D,
    contiguous, storage offset 0), batch after batch, each tensor at a multiple of
    :data:`ALIGN` bytes; the returned batches' tensors are views of it. Example::

        shm = pack(batches, lambda n: torch.empty(n, dtype=torch.uint8).share_memory_())
    """
    total = sum(_aligned(t.nbytes) for b in batches for t in b.tensors())
    buffer = alloc(total)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < total:
        raise ValueError(f"pack: alloc({total}) must give a 1-D uint8 tensor of >= {total} bytes")
    cursor = 0

    def place(t: torch.Tensor) -> torch.Tensor:
        nonlocal cursor
        view = buffer[cursor : cursor + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        cursor += _aligned(t.nbytes)
        return view

    return [b.map_tensors(place) for b in batches]


def byte_span(batch: Batch) -> tuple[torch.UntypedStorage, int, int] | None:
    """(storage, first byte, end byte) that all of ``batch``'s tensors lie in, or None when they
    are in more than one storage or are not dense (a strided view). ``end - first`` is at most
    the tensors' bytes plus the alignment gaps when the batch came from :func:`pack`."""
    tensors = batch.tensors()
    storage = tensors[0].untyped_storage()
    first, end = storage.nbytes(), 0
    for t in tensors:
        if t.untyped_storage().data_ptr() != storage.data_ptr() or not t.is_contiguous():
            return None
        start = int(t.storage_offset()) * t.element_size()
        first, end = min(first, start), max(end, start + t.nbytes)
    return storage, first - first % ALIGN, max(end, first)


def rebase(batch: Batch, home: torch.Tensor, first: int) -> Batch:
    """``batch`` as views of ``home``, a 1-D uint8 tensor holding the bytes from ``first`` on of
    the storage all of ``batch``'s tensors are in (:func:`byte_span`): a tensor at byte ``b``
    there is at byte ``b - first`` of ``home`` (same dtype, shape and strides)."""
    if home.dtype != torch.uint8 or home.dim() != 1 or home.storage_offset() != 0:
        raise ValueError("rebase: home must be a whole 1-D uint8 buffer (storage offset 0)")
    storage = home.untyped_storage()

    def view(t: torch.Tensor) -> torch.Tensor:
        offset, rest = divmod(int(t.storage_offset()) * t.element_size() - first, t.element_size())
        if rest or offset < 0:
            raise ValueError(f"rebase: a {t.dtype} tensor is not aligned to byte {first}")
        out = torch.empty(0, dtype=t.dtype, device=home.device)
        return out.set_(storage, offset, t.shape, t.stride())

    return batch.map_tensors(view)
