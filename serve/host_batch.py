"""A serving batch as numpy arrays on the host: what the device process reads out of a handoff
slot, merges and pads into a CUDA graph's host slots without building torchrec KJTs.

Building a :class:`~torchrec.sparse.jagged_tensor.KeyedJaggedTensor` costs ~15 µs of Python
per KJT, and merging requests as KJTs (splitting and re-joining each one with torch) cost
~0.3 ms of the device process's CPU per handed-off request, all of it under the GIL. A
:class:`HostBatch` holds the same tensors as numpy arrays (views of the slot where read from
one, :func:`serve.slots.read_host_batch`) with the host-side ids per key, so

- :meth:`HostBatch.concat` merges requests with one ``np.concatenate`` per KJT part (values
  key-major, as a KJT stores them: each key's ids of every request in turn; ``user_index``
  offset by the users before). It is the one merge: :func:`serve.batcher.concat_batches` (KJT
  batches) goes through it too;
- :meth:`serve.graphs.BucketGraph.fill` pads it straight into a bucket's host slots;
- :meth:`HostBatch.to_batch` builds the KJT :class:`~shared.batch.Batch` once, for the eager path
  and for predictors that take only batches: the tensors are those ``concat_batches`` of the
  KJT batches gives (it builds them this way), so every score is the same.

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

    def blocks(self) -> np.ndarray | None:
        """The ids as [K, n] (a view) when every key has the same n ids (one id per row, or a
        sequence's T per feature: the usual request), else None."""
        k, per_key = len(self.per_key), self.per_key
        if not k or per_key.count(per_key[0]) != k:
            return None
        return self.values[: k * per_key[0]].reshape(k, per_key[0])  # [K, n]

    def by_key(self) -> list[np.ndarray]:
        """The ids of each key ([n_k] views, key order); plain slices, where ``np.split`` costs
        ~5 µs of Python."""
        spans = itertools.pairwise(itertools.accumulate(self.per_key, initial=0))
        return [self.values[a:b] for a, b in spans]

    @staticmethod
    def concat(parts: Sequence[HostKjt]) -> HostKjt:
        """``parts`` (same keys) stacked along the batch; weights are dropped (a merged KJT is
        unweighted: no serving batch has any), a part alone is returned as it is.

        One ``np.concatenate`` per array. The batcher merges ~3 requests of up to ~10 keys, where
        each numpy call costs ~1 µs of Python: a part whose keys all have the same number of ids
        (one id per row, or a sequence's T per feature: the usual request) is a [K, n] block like
        its lengths; other parts give one slice per key (fewer calls than a gather index)."""
        first = parts[0]
        keys = first.keys
        for p in parts[1:]:
            if p.keys != keys:
                raise ValueError(f"cannot concatenate batches with keys {keys} and {p.keys}")
        if len(parts) == 1:
            return first
        k = len(keys)
        stride = sum(p.stride for p in parts)
        if k == 0:
            return HostKjt((), stride, (), first.values, first.lengths, first.weights)
        lengths = np.concatenate([p.lengths.reshape(k, p.stride) for p in parts], axis=1)  # [K, ΣS]
        blocks = [b for p in parts if (b := p.blocks()) is not None]  # [K, n_i] each
        if len(blocks) == len(parts):
            merged = np.concatenate(blocks, axis=1)  # [K, Σn_i]
            values, per_key = merged.reshape(-1), (merged.shape[1],) * k  # key-major
        else:  # key-major: key 0's ids of every part, then key 1's, ...
            per_key = tuple(map(sum, zip(*(p.per_key for p in parts), strict=True)))
            by_part = [p.by_key() for p in parts]  # [n_k] per key, per part
            values = np.concatenate([v for key in zip(*by_part, strict=True) for v in key])
        # no weights (docstring)
        return HostKjt(keys, stride, per_key, values, lengths.reshape(-1))


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
        """One batch of several: users and candidates stacked, ``user_index`` offset by the
        users before (the merge :func:`serve.batcher.concat_batches` builds its batch from)."""
        if not parts:
            raise ValueError("HostBatch.concat needs at least one batch")
        if len(parts) == 1:
            return parts[0]
        users = itertools.accumulate(p.num_users for p in parts[:-1])  # users before parts[1:]
        shifted = (p.user_index + o for p, o in zip(parts[1:], users, strict=True))
        user_index = np.concatenate([parts[0].user_index, *shifted])  # [ΣB]
        return HostBatch(
            HostKjt.concat([p.user for p in parts]),
            HostKjt.concat([p.item for p in parts]),
            HostKjt.concat([p.sequence for p in parts]),
            user_index,
        )
