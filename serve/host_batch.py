"""A serving batch as numpy arrays on the host: what the device process reads out of a handoff
slot, merges and pads into a CUDA graph's host slots without building torchrec KJTs.

Building a :class:`~torchrec.sparse.jagged_tensor.KeyedJaggedTensor` costs ~15 µs of Python
per KJT, and the batcher's concatenation of KJTs (:func:`serve.batcher.concat_batches`) splits
and re-joins each one again: ~0.3 ms of the device process's CPU per handed-off request, all of
it under the GIL. A :class:`HostBatch` holds the same tensors as numpy arrays (views of the slot
where read from one, :func:`serve.handoff.read_host_batch`) with the host-side ids per key, so

- :meth:`HostBatch.concat` merges requests with one ``np.concatenate`` per KJT part (values in
  the same key-major order as :func:`serve.batcher._concat_kjt`: each key's ids of every request
  in turn; ``user_index`` offset by the users before);
- :meth:`serve.graphs.BucketGraph.fill` pads it straight into a bucket's host slots;
- :meth:`HostBatch.to_batch` builds the KJT :class:`~shared.batch.Batch` once, for the eager path
  and for predictors that take only batches: the tensors are those ``concat_batches`` of the
  KJT batches gives (same values, dtypes and order), so every score is the same.

Example::

    merged = HostBatch.concat([read_host_batch(ref, slot) for ref, slot in handed_off])
    batch = merged.to_batch()                 # the Batch concat_batches would have made
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from shared.batch import Batch


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~2 µs more
class HostKjt:
    """One KJT on the host: ``values`` key-major (all ids of key 0, then key 1, ...),
    ``lengths`` [K * stride] (key-major bags), ``per_key`` the ids of each key."""

    keys: tuple[str, ...]
    stride: int
    per_key: tuple[int, ...]
    values: np.ndarray  # [sum(per_key)]
    lengths: np.ndarray  # [len(keys) * stride]
    weights: np.ndarray | None = None  # [sum(per_key)], None: unweighted

    @classmethod
    def of(cls, kjt: KeyedJaggedTensor) -> HostKjt:
        """Views of a KJT of CPU tensors (no copy)."""
        weights = kjt.weights_or_none()
        return cls(
            tuple(kjt.keys()),
            kjt.stride(),
            tuple(kjt.length_per_key()),
            kjt.values().numpy(),
            kjt.lengths().numpy(),
            None if weights is None else weights.numpy(),
        )

    def to_kjt(self) -> KeyedJaggedTensor:
        """The KJT (its tensors share the arrays' memory)."""
        per_key = list(self.per_key)
        return KeyedJaggedTensor(
            keys=list(self.keys),
            values=torch.from_numpy(self.values),
            lengths=torch.from_numpy(self.lengths),
            weights=None if self.weights is None else torch.from_numpy(self.weights),
            stride=self.stride,
            length_per_key=per_key,
            offset_per_key=[0, *itertools.accumulate(per_key)],
        )

    @staticmethod
    def concat(parts: Sequence[HostKjt]) -> HostKjt:
        """``parts`` (same keys) stacked along the batch, as :func:`serve.batcher._concat_kjt`
        does it (weights, which it drops, included: a merged KJT is unweighted)."""
        first = parts[0]
        for p in parts[1:]:
            if p.keys != first.keys:
                raise ValueError(f"cannot concatenate batches with keys {first.keys} and {p.keys}")
        if len(parts) == 1:
            return first
        k = len(first.keys)
        stride = sum(p.stride for p in parts)
        if k == 0:
            return HostKjt((), stride, (), first.values, first.lengths, first.weights)
        lengths = np.concatenate([p.lengths.reshape(k, p.stride) for p in parts], axis=1)  # [K, ΣS]
        # (start, end) of each key's ids in each part, key-major: each key of every part in turn
        spans = [
            list(itertools.pairwise(itertools.accumulate(p.per_key, initial=0))) for p in parts
        ]
        order = [(i, *spans[i][j]) for j in range(k) for i in range(len(parts))]

        def gather(arrays: Sequence[np.ndarray]) -> np.ndarray:
            return np.concatenate([arrays[i][a:b] for i, a, b in order])

        return HostKjt(  # no weights: _concat_kjt drops them too (no serving batch has any)
            first.keys,
            stride,
            tuple(map(sum, zip(*(p.per_key for p in parts), strict=True))),
            gather([p.values for p in parts]),
            lengths.reshape(-1),
        )


@dataclass(slots=True)
class HostBatch:
    """A serving batch (no labels) on the host: the three KJTs and ``user_index`` [B] int64."""

    user: HostKjt  # stride U
    item: HostKjt  # stride B
    sequence: HostKjt  # stride U
    user_index: np.ndarray  # [B] int64 in [0, U)

    @property
    def batch_size(self) -> int:
        return int(self.user_index.shape[0])

    @property
    def num_users(self) -> int:
        return self.user.stride

    @property
    def kjts(self) -> tuple[HostKjt, HostKjt, HostKjt]:
        return self.user, self.item, self.sequence

    @classmethod
    def of(cls, batch: Batch) -> HostBatch:
        """Views of a batch of CPU tensors (labels and oracle are not kept)."""
        return cls(
            HostKjt.of(batch.user),
            HostKjt.of(batch.item),
            HostKjt.of(batch.sequence),
            batch.user_index.numpy(),
        )

    def to_batch(self) -> Batch:
        """The KJT batch (tensors sharing the arrays' memory)."""
        return Batch(
            user=self.user.to_kjt(),
            item=self.item.to_kjt(),
            sequence=self.sequence.to_kjt(),
            user_index=torch.from_numpy(self.user_index),
        )

    @staticmethod
    def concat(parts: Sequence[HostBatch]) -> HostBatch:
        """One batch of several, as :func:`serve.batcher.concat_batches` makes it."""
        if not parts:
            raise ValueError("HostBatch.concat needs at least one batch")
        if len(parts) == 1:
            return parts[0]
        users = itertools.accumulate((p.num_users for p in parts[:-1]), initial=0)
        user_index = np.concatenate([p.user_index + o for p, o in zip(parts, users, strict=True)])
        return HostBatch(
            HostKjt.concat([p.user for p in parts]),
            HostKjt.concat([p.item for p in parts]),
            HostKjt.concat([p.sequence for p in parts]),
            user_index,
        )
