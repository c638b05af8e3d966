"""MultiTowerDIN = embedding lookups (:class:`SparseArch`) + the exportable :class:`DenseArch`."""

from __future__ import annotations

import logging

import torch
from torch import nn

from protos import pipeline_pb2
from shared.batch import Batch
from shared.dense_inputs import assemble_dense_inputs
from shared.features import FeatureSet
from shared.hashtable.layout import RowArrays
from shared.hashtable.placement import GIB, TablePlacement, describe, plan_placement
from train.model.dense_arch import DenseArch
from train.model.id_dropout import IdDropout
from train.model.sparse_arch import Embedded, SparseArch, table_lr_scales

log = logging.getLogger(__name__)


class MultiTowerDIN(nn.Module):
    """``forward(batch) -> logits [B]``. ``dense`` is what gets exported for serving."""

    def __init__(
        self,
        fs: FeatureSet,
        model_config: pipeline_pb2.ModelConfig,
        *,
        sparse_lr: float,
        sparse_eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
        device: torch.device | str = "cpu",
        seed: int = 0,
        sparse_lr_scales: dict[str, float] | None = None,
        cache_load_factors: dict[str, float] | None = None,
        row_arrays: dict[str, RowArrays] | None = None,
    ) -> None:
        super().__init__()
        self.fs = fs
        torch.manual_seed(seed)
        mtd = model_config.multi_tower_din
        backoff = mtd.cold_backoff if mtd.HasField("cold_backoff") else None
        self.sparse = SparseArch(
            fs,
            sparse_lr=sparse_lr,
            sparse_eps=sparse_eps,
            initial_accumulator_value=initial_accumulator_value,
            device=device,
            seed=seed,
            id_dropout=None if backoff is None else IdDropout.from_config(fs, backoff, seed=seed),
            lr_scales=sparse_lr_scales,
            cache_load_factors=cache_load_factors,
            row_arrays=row_arrays,
        )
        self.dense = DenseArch.from_config(fs, model_config).to(device)

    @classmethod
    def from_config(
        cls,
        config: pipeline_pb2.EasyRecConfig,
        fs: FeatureSet,
        *,
        device: torch.device | str = "cpu",
        seed: int = 0,
        hbm_budget_gib: float | None = None,
    ) -> MultiTowerDIN:
        """The model of ``config`` with its sparse optimizer settings, once the dynamic tables'
        placement is planned (one log line per table); CACHING tables get their planned factor
        and row arrays' place. ``hbm_budget_gib``: the tables' device budget, over the config's
        ``train_config.table_hbm_budget_gib``."""
        plans = plan_tables(config, fs, hbm_budget_gib)
        ada = sparse_adagrad(config.train_config)
        return cls(
            fs,
            config.model_config,
            sparse_lr=ada.lr,
            sparse_eps=ada.eps,
            initial_accumulator_value=ada.initial_accumulator_value,
            device=device,
            seed=seed,
            sparse_lr_scales=table_lr_scales(fs, config.train_config.sparse_optimizer),
            cache_load_factors={p.table: p.cache_load_factor for p in plans},
            row_arrays={p.table: p.row_arrays for p in plans},
        )

    def dense_inputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The dense part's keyword inputs for ``batch``: looked up, then assembled."""
        return self.assemble(batch, self.sparse(batch, cold=self.dense.takes_cold))

    def assemble(self, batch: Batch, embedded: Embedded) -> dict[str, torch.Tensor]:
        """The dense inputs from :attr:`sparse`'s embeddings of ``batch``, with the cold masks
        when the dense part backs off cold ids."""
        pooled, sequences, cold = embedded
        return assemble_dense_inputs(
            self.fs, batch, pooled, sequences, cold=cold if self.dense.takes_cold else None
        )

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.dense(**self.dense_inputs(batch))  # [B]


def plan_tables(
    config: pipeline_pb2.EasyRecConfig, fs: FeatureSet, hbm_budget_gib: float | None
) -> list[TablePlacement]:
    """Log the dynamic tables' placement (shared.hashtable.placement), refuse a budget they
    cannot fit, and return each table's plan: its cache_load_factor (1.0: HBM_ONLY) and where
    its row arrays live, which the storages honour."""
    tc = config.train_config
    if hbm_budget_gib is None and tc.HasField("table_hbm_budget_gib"):
        hbm_budget_gib = tc.table_hbm_budget_gib
    budget = None if hbm_budget_gib is None else int(hbm_budget_gib * GIB)
    plans = plan_placement(fs.dynamic_tables, hbm_budget=budget)
    for line in describe(plans):
        log.info("table plan: %s", line)
    return plans


def sparse_adagrad(config: pipeline_pb2.TrainConfig) -> pipeline_pb2.AdagradOptimizer:
    """The sparse optimizer settings; only Adagrad is implemented (as tzrec's default)."""
    sparse_cfg = config.sparse_optimizer
    if sparse_cfg.WhichOneof("optimizer") not in (None, "adagrad_optimizer"):
        raise ValueError("train_config.sparse_optimizer: only adagrad_optimizer is implemented")
    return sparse_cfg.adagrad_optimizer
