"""Embedding lookups of MultiTowerDIN: ids of a :class:`Batch` → pooled and jagged embeddings.

Mixed embeddings, as the config says: tables with ``dynamicemb {}`` live in the shared hash-table
core (:class:`DynamicEmbeddingCollection`, fused sparse Adagrad in its backward); the others are
:class:`~train.model.fused_tables.DenseTables` (small tables fused per dim into one matrix with a
dense gradient, large ones with row-sparse gradients; updated by ``torch.optim.Adagrad``).
Every lookup of a table in one step goes through one call, so a sequence feature and its top-level
feature (``click_50_seq__adgroup_id`` and ``adgroup_id``) update the same rows, with the gradients
of duplicate ids summed before the optimizer step.

A dynamic table may train at its own multiple of the sparse rate
(``train_config.sparse_optimizer.table_learning_rates``, :func:`table_lr_scales`), as
TorchRec's per-table optimizer settings allow: the tables' rows see very different numbers of
rows in an epoch, and one rate does not suit them all (docs/guide/training.md, #22)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from protos import pipeline_pb2
from shared.batch import Batch
from shared.config import ConfigError
from shared.dense_inputs import (
    FeaturePart,
    feature_parts,
    parts_by_table,
    pool_and_flag_features,
)
from shared.features import FeatureSet
from shared.hashtable.embedding import DynamicEmbeddingCollection
from shared.hashtable.layout import RowArrays
from train.model.fused_tables import DenseTables
from train.model.id_dropout import IdDropout

# Tables up to this many elements get dense gradients; larger ones row-sparse gradients.
DENSE_GRAD_MAX_ELEMENTS = {"cpu": 1 << 20, "cuda": 1 << 24}


def uses_sparse_grad(rows: int, dim: int, device: torch.device | str) -> bool:
    """Whether a num_buckets table should get row-sparse gradients.

    Both give the same Adagrad update: a row that no lookup touched gets a zero gradient, and
    Adagrad leaves it as it is (sum += 0, value -= lr * 0 / std). Sparse gradients cost a sort
    (torch's coalesce) of the looked-up ids per step, which on CUDA is slow for small tables hit
    thousands of times per batch (~10 ms a step for the seed config's 9 small tables on the
    H200); dense ones cost a pass over the whole table, which is what large tables avoid.
    """
    kind = torch.device(device).type
    return rows * dim > DENSE_GRAD_MAX_ELEMENTS.get(kind, DENSE_GRAD_MAX_ELEMENTS["cpu"])


LR_FIELD = "train_config.sparse_optimizer.table_learning_rates"


def table_lr_scales(fs: FeatureSet, config: pipeline_pb2.SparseOptimizer) -> dict[str, float]:
    """Table name -> its sparse rate as a multiple of the optimizer's, from
    ``config.table_learning_rates``; ConfigError naming the field for a feature that is not
    there or not dynamic, a scale not > 0, or a table named twice."""
    scales: dict[str, float] = {}
    for k, entry in enumerate(config.table_learning_rates):
        field = f"{LR_FIELD}[{k}]"
        name = entry.feature_name
        feature = fs.features.get(name)
        if feature is None:
            raise ConfigError(
                "<config>", None, f"{field}.feature_name",
                f"{name!r} is not a feature of this config (those are {sorted(fs.features)})",
            )  # fmt: skip
        table = fs.tables[feature.table]
        if not table.is_dynamic:
            raise ConfigError(
                "<config>", None, f"{field}.feature_name",
                f"{name!r} has a num_buckets table ({table.name}); only dynamic (dynamicemb) "
                "tables take a rate of their own",
            )  # fmt: skip
        if not (math.isfinite(entry.lr_scale) and entry.lr_scale > 0):
            raise ConfigError(
                "<config>", None, f"{field}.lr_scale", f"{entry.lr_scale}: give a scale > 0"
            )
        if table.name in scales:
            raise ConfigError(
                "<config>", None, f"{field}.feature_name",
                f"{name!r} uses table {table.name}, whose rate an earlier entry sets; name "
                "each table once",
            )  # fmt: skip
        scales[table.name] = entry.lr_scale
    return scales


class Embedded(NamedTuple):
    """A batch's looked-up embeddings, as :func:`~shared.dense_inputs.assemble_dense_inputs`
    takes them."""

    pooled: dict[str, torch.Tensor]  # [rows, dim] per pooled feature
    sequences: dict[str, torch.Tensor]  # [T, dim] per sequence feature
    cold: dict[str, torch.Tensor]  # [rows] bool per dynamic feature (asked for), else empty


class SparseArch(nn.Module):
    """Looks up every feature of a batch.

    ``forward`` returns :class:`Embedded`: ``pooled[name]`` is [rows, dim] (sum or mean per bag;
    an empty bag gives zeros; rows = U for user-side features, B for item/context ones),
    ``sequences[name]`` is [T, dim], jagged with the batch's sequence lengths, and with
    ``cold=True`` ``cold[name]`` says, for every dynamic feature, which rows (elements) have no
    row in its table (:func:`~shared.dense_inputs.pool_and_flag_features`). With ``id_dropout``, in training
    mode, some of those flags (and rows) are of warm keys treated as cold
    (:mod:`train.model.id_dropout`; the only place it is applied).
    """

    def __init__(
        self,
        fs: FeatureSet,
        *,
        sparse_lr: float,
        sparse_eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
        device: torch.device | str = "cpu",
        seed: int = 0,
        id_dropout: IdDropout | None = None,
        lr_scales: dict[str, float] | None = None,
        cache_load_factors: dict[str, float] | None = None,
        row_arrays: dict[str, RowArrays] | None = None,
    ) -> None:
        super().__init__()
        self.fs = fs
        self.id_dropout = id_dropout
        dense = fs.dense_tables
        users: dict[str, list[str]] = {t.name: [] for t in dense}
        for f in fs.features.values():
            if f.table in users:
                users[f.table].append(f.name)
        used = [t for t in dense if users[t.name]]
        self.dense = DenseTables(
            used,
            sparse_grad={
                t.name for t in used if uses_sparse_grad(int(t.num_rows or 0), t.dim, device)
            },
            device=device,
        )
        _init_tables(self.dense, seed)
        self.dynamic = DynamicEmbeddingCollection(
            fs.dynamic_tables,
            fs.fusion_groups,
            lr=sparse_lr,
            eps=sparse_eps,
            initial_accumulator_value=initial_accumulator_value,
            device=device,
            seed=seed,
            id_mode=fs.id_mode.value,
            lr_scales=lr_scales,
            cache_load_factors=cache_load_factors,
            row_arrays=row_arrays,
        )

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters of the dense (num_buckets) tables, for the sparse Adagrad optimizer: one
        per fused dim, one per row-sparse table. Pass the optimizer to
        :func:`~train.model.fused_tables.keep_per_table_state` so that its saved state stays
        per table."""
        return self.dense.parameters()

    def dense_table_weights(self) -> dict[str, torch.Tensor]:
        """Table name → weight [rows, dim] of every dense (num_buckets) table, in table order (a
        fused table's is a view of its rows): what exports and deltas read."""
        return self.dense.weights()

    def forward(self, batch: Batch, *, cold: bool = False) -> Embedded:
        # 1. every (feature, ids) of the batch, looked up once per table
        parts = feature_parts(batch)
        rows, hits = self._lookup(parts, hits=cold)
        if cold and self.training and self.id_dropout is not None:
            # after the lookup: its step is this step's (DynamicEmbeddingCollection.step)
            rows, hits = self.id_dropout.apply(self.fs, parts, rows, hits, self.dynamic.step)
        # 2. pool scalar features per bag, keep sequences jagged; the cold flags of the parts
        # with hits, counted with the pooling's bag index
        return Embedded(*pool_and_flag_features(self.fs, parts, rows, hits))

    def prefetch(self, batch: Batch) -> None:
        """Bring the rows of ``batch``'s stored dynamic keys into the device tier of the CACHING
        storages (:meth:`DynamicEmbeddingCollection.prefetch`: no insert, no score change), so
        that the batch's own lookup hits. The trainer calls it for batch i+1 once step i is
        issued, when :attr:`tiered`. On CUDA with static steps it runs on a side stream from
        the end of step i's lookups on, beside the rest of step i
        (:meth:`DynamicEmbeddingCollection.prefetch_stream`)."""
        assert isinstance(self.dynamic, DynamicEmbeddingCollection)
        with self.dynamic.prefetch_stream():
            parts = feature_parts(batch)
            keys: dict[str, torch.Tensor] = {}
            for table, idx in parts_by_table(self.fs, parts).items():
                if self.fs.tables[table].is_dynamic:
                    got = [parts[i][2] for i in idx]
                    keys[table] = torch.cat(got) if len(got) > 1 else got[0]
            self.dynamic.prefetch(keys)

    @property
    def tiered(self) -> bool:
        """Whether a dynamic storage of this process is CACHING (and not sharded: the sharded
        lookup's owners would prefetch, which is not built)."""
        return isinstance(self.dynamic, DynamicEmbeddingCollection) and self.dynamic.tiered

    def _lookup(
        self, parts: list[FeaturePart], *, hits: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """One lookup call per table; returns [n_i, dim] rows per part, in order, and with
        ``hits`` [n_i] bool per dynamic part (the key has a row), else None. The dynamic parts
        go to the collection as they are (``lookup_parts``: a table's parts are one lookup of
        their concatenation, made by its storage)."""
        out: list[torch.Tensor | None] = [None] * len(parts)
        found_rows: list[torch.Tensor | None] = [None] * len(parts)
        dynamic: list[int] = []  # positions in parts of the dynamic tables' lookups
        fixed: list[int] = []  # of the dense tables' lookups
        for i, (_which, name, _ids, _lengths) in enumerate(parts):
            is_dynamic = self.fs.tables[self.fs.features[name].table].is_dynamic
            (dynamic if is_dynamic else fixed).append(i)
        found_fixed = self.dense(
            [(parts[i][1], self.fs.features[parts[i][1]].table, parts[i][2]) for i in fixed]
        )
        for i, rows in zip(fixed, found_fixed, strict=True):
            out[i] = rows  # [n_i, dim]
        if dynamic:
            # a DynamicEmbeddingCollection, or train.distributed's sharded one (same lookup)
            pieces = [(self.fs.features[parts[i][1]].table, parts[i][2]) for i in dynamic]
            found, stored = self.dynamic.lookup_parts(pieces, hits=hits)
            for i, rows in zip(dynamic, found, strict=True):
                out[i] = rows  # [n_i, dim]
            for i, flags in zip(dynamic, stored, strict=False):  # empty without hits
                found_rows[i] = flags  # [n_i] bool
        assert all(o is not None for o in out)
        return out, found_rows  # type: ignore[return-value]


def _init_tables(tables: DenseTables, seed: int) -> None:
    """tzrec's default init, uniform ±sqrt(1/dim), drawn per table in table order from a
    generator seeded with ``seed``, as when every table was an ``nn.Embedding`` of a torchrec
    ``EmbeddingCollection``. That collection also initialised each table twice from the global
    generator before we overwrote it (``nn.Embedding``'s ``normal_``, then its uniform
    ``init_fn``); the dense layers built after this module draw from the global generator, so
    the same draws are made here, in the same order, to keep every seeded result as it was."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in tables.weights().values():  # [rows, dim], a view for a fused table
            bound = (1.0 / weight.shape[1]) ** 0.5
            nn.init.normal_(weight)
            nn.init.uniform_(weight, -bound, bound)
            w = torch.empty(weight.shape).uniform_(-bound, bound, generator=generator)
            weight.copy_(w.to(weight.device))
