"""Where each feature of a FeatureSet goes in a :class:`~shared.batch.Batch`, worked out once.

Both batch builders use it: :func:`shared.fg.table_to_batch` (training rows) and
:func:`shared.fg_request.request_columns_to_batch` (one serving request). :func:`per_feature_set`
keeps what is built of a FeatureSet for as long as the FeatureSet lives; :func:`kjt` and
:func:`sequence_kjt` put per-feature ids into the KeyedJaggedTensors of a Batch. Example::

    plan = feature_plan(fs)  # built at the first call for ``fs``, then the same object
    user = kjt([s.name for s in plan.user], [ids_of(s) for s in plan.user], stride=1)
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias, TypeVar

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from shared.features import FeatureKind, FeatureSet, FeatureSpec, Side

__all__ = [
    "FeaturePlan",
    "Ids",
    "feature_plan",
    "flat_kjt",
    "kjt",
    "per_feature_set",
    "sequence_kjt",
]

Ids: TypeAlias = tuple[np.ndarray, np.ndarray]  # (ids int64 [present rows], lengths [rows])


def kjt(keys: list[str], parts: list[Ids], stride: int) -> KeyedJaggedTensor:
    """KJT from per-key (values, lengths [stride]); values key-major, as torchrec expects."""
    values = np.concatenate([v for v, _ in parts]) if parts else np.zeros(0, np.int64)
    lengths = np.concatenate([ln for _, ln in parts]) if parts else np.zeros(0, np.int32)
    return flat_kjt(keys, values, lengths, [len(v) for v, _ in parts], stride)


def flat_kjt(
    keys: list[str], values: np.ndarray, lengths: np.ndarray, per_key: list[int], stride: int
) -> KeyedJaggedTensor:
    """KJT from its values and lengths already key-major (``per_key``: values of each key)."""
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)),
        lengths=torch.from_numpy(np.ascontiguousarray(lengths, dtype=np.int32)),
        stride=stride,
        length_per_key=per_key,
        offset_per_key=list(itertools.accumulate(per_key, initial=0)),
    )


@dataclass(frozen=True)
class FeaturePlan:
    """Where each feature of a FeatureSet goes in a Batch, worked out once (:func:`feature_plan`)."""

    user: tuple[FeatureSpec, ...]  # USER scalars in config order: the keys of Batch.user
    context: tuple[FeatureSpec, ...]
    items: tuple[FeatureSpec, ...]  # ITEM scalars
    item_kjt: tuple[FeatureSpec, ...]  # ITEM and CONTEXT scalars in config order: Batch.item
    sequences: tuple[tuple[FeatureSpec, ...], ...]  # sub-features of each sequence
    sequence_keys: tuple[str, ...]  # the keys of Batch.sequence (config order)
    sequence_order: tuple[int, ...]  # position in the flattened groups of each key

    @classmethod
    def of(cls, fs: FeatureSet) -> FeaturePlan:
        groups: dict[str, list[FeatureSpec]] = {}
        for spec in fs.features.values():
            if spec.kind is FeatureKind.SEQUENCE_ID:
                groups.setdefault(spec.sequence_name or spec.name, []).append(spec)
        flat = [s.name for specs in groups.values() for s in specs]
        position = {name: i for i, name in enumerate(fs.features)}
        order = sorted(range(len(flat)), key=lambda i: position[flat[i]])
        scalars = [s for s in fs.features.values() if not s.is_sequence]

        def side(*sides: Side) -> tuple[FeatureSpec, ...]:
            return tuple(s for s in scalars if s.side in sides)

        return cls(
            user=side(Side.USER),
            context=side(Side.CONTEXT),
            items=side(Side.ITEM),
            item_kjt=side(Side.ITEM, Side.CONTEXT),
            sequences=tuple(tuple(specs) for specs in groups.values()),
            sequence_keys=tuple(flat[i] for i in order),
            sequence_order=tuple(order),
        )


_T = TypeVar("_T")


def per_feature_set(build: Callable[[FeatureSet], _T]) -> Callable[[FeatureSet], _T]:
    """``build(fs)`` once per FeatureSet object (a bundle's: at its first request), for what
    every request needs of ``fs``: a FeatureSet is not changed once built.

    A FeatureSet holds dicts (not hashable), so entries are kept by ``id(fs)`` and dropped when
    their FeatureSet is collected. Example: ``feature_plan = per_feature_set(FeaturePlan.of)``.
    """
    cache: dict[int, tuple[weakref.ref[FeatureSet], _T]] = {}

    def cached(fs: FeatureSet) -> _T:
        key = id(fs)
        entry = cache.get(key)
        if entry is not None and entry[0]() is fs:
            return entry[1]
        value = build(fs)
        cache[key] = (weakref.ref(fs, lambda _: cache.pop(key, None)), value)
        return value

    return cached


feature_plan = per_feature_set(FeaturePlan.of)


def sequence_kjt(
    plan: FeaturePlan, ids_of: Callable[[tuple[FeatureSpec, ...]], list[Ids]], stride: int
) -> KeyedJaggedTensor:
    """Batch.sequence from ``ids_of(sub-features)`` of each sequence."""
    parts = [part for specs in plan.sequences for part in ids_of(specs)]
    return kjt(list(plan.sequence_keys), [parts[i] for i in plan.sequence_order], stride)
