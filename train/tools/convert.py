"""``convert``: a trained num_buckets checkpoint → a checkpoint of the dynamic (seed) config.

Seed 000 §4.4 / §8: teams adopt dynamic tables from a model trained with ``num_buckets`` (a
``zch_to_dynamicemb_convert`` step). For every table that is dynamic in the target config and a
fixed matrix in the source config, the keys are the ids a data set actually holds (``--samples``:
the table's top-level feature column and the click-sequence columns sharing its table, read
batch by batch and vectorized through the same feature generation as training), and each key gets
the source row its id was looked up with, ``row = old_matrix[id mod num_buckets]`` (or the hash
bucket with ``hash_bucket_size``), together with that row's Adagrad sum. Scores follow the
target's strategy: LFU the id's count in the data set, STEP / NO_EVICTION the source step,
TIMESTAMP the conversion time. Tables that are fixed matrices in both configs, the dense layers
(``DenseArch``; shapes are verified) and their optimizer states are copied; the result is a normal
checkpoint (``<out>/checkpoints/step_<N>``, dynamic tables in dynamicemb's layout) that ``train``,
``evaluate`` and ``export`` use as is.

Ids of the eval data missing from ``--samples`` are not converted: the source model looks them up
in a collision row, the converted one gives them the eval initializer (zeros), which is where
the two models' AUCs can differ (:func:`convert_checkpoint` reports both).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.dataset as pads
import torch

from shared.config import load_config
from shared.features import FeatureSet, FeatureSpec, ScoreStrategy, build_feature_set
from shared.fg import scalar_ids, sequence_ids
from shared.hashtable.checkpoint import read_table
from shared.hashtable.storage import TableState
from train.checkpoint import Progress, save_checkpoint
from train.export import evaluate_checkpoint
from train.model.multi_tower_din import MultiTowerDIN
from train.trainer import build_optimizers

_PREFIX = "embeddings."  # EmbeddingCollection state_dict keys: embeddings.<table>.weight


@dataclass
class SeenIds:
    """The distinct dynamic keys of one table in a data set and the source row of each."""

    keys: np.ndarray  # [K] int64, sorted
    source_rows: np.ndarray  # [K] int64: row of the source matrix the id was looked up in
    counts: np.ndarray  # [K] int64: occurrences in the data set


@dataclass
class ConvertResult:
    checkpoint: Path
    tables: dict[str, dict[str, Any]]  # per converted table: keys, stored, source_rows, ...
    copied: list[str]  # fixed tables copied as they are
    eval: dict[str, dict[str, Any]] = field(default_factory=dict)  # original / converted


# --------------------------------------------------------------------------- ids of a data set


def _table_features(fs: FeatureSet, table: str) -> list[FeatureSpec]:
    return [f for f in fs.features.values() if f.table == table]


def seen_ids(
    samples: Path,
    table: str,
    target: FeatureSet,
    source: FeatureSet,
    *,
    batch_rows: int = 1 << 16,
) -> SeenIds:
    """Keys of ``table`` (target transform) and their source rows (source transform), over
    every feature of the table (top level and click sequences), in batches of rows."""
    feats = _table_features(target, table)
    columns = [f.name for f in feats]
    dataset = pads.dataset(str(samples), format="parquet")
    missing = [c for c in columns if c not in dataset.schema.names]
    if missing:
        raise ValueError(
            f"{samples}: no column(s) {missing} for table {table!r}; pass the samples the "
            "models were trained on (python -m train.data ...)"
        )
    keys_parts: list[np.ndarray] = []
    rows_parts: list[np.ndarray] = []
    count_parts: list[np.ndarray] = []
    for rb in dataset.to_batches(columns=columns, batch_size=batch_rows):
        k_all, r_all = [], []
        for f in feats:
            src = source.features[f.name]
            col = rb.column(f.name)
            if f.is_sequence:
                ((k, _),) = sequence_ids([f], [col], truncate=True)
                ((r, _),) = sequence_ids([src], [col], truncate=True)
            else:
                k, _ = scalar_ids(f, col)
                r, _ = scalar_ids(src, col)
            k_all.append(k)
            r_all.append(r)
        keys = np.concatenate(k_all)
        rows = np.concatenate(r_all)
        uniq, first, counts = np.unique(keys, return_index=True, return_counts=True)
        keys_parts.append(uniq)
        rows_parts.append(rows[first])
        count_parts.append(counts)
        _check_function(table, keys, rows, uniq, rows[first])
    if not keys_parts:
        empty = np.zeros(0, np.int64)
        return SeenIds(empty, empty, empty)
    keys = np.concatenate(keys_parts)
    rows = np.concatenate(rows_parts)
    uniq, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    counts = np.bincount(inverse, weights=np.concatenate(count_parts)).astype(np.int64)
    _check_function(table, keys, rows, uniq, rows[first])
    return SeenIds(uniq, rows[first], counts)


def _check_function(
    table: str, keys: np.ndarray, rows: np.ndarray, uniq: np.ndarray, uniq_rows: np.ndarray
) -> None:
    """Each key must map to one source row (the transforms disagree otherwise)."""
    back = uniq_rows[np.searchsorted(uniq, keys)]
    if not np.array_equal(back, rows):
        i = int(np.flatnonzero(back != rows)[0])
        raise ValueError(
            f"table {table!r}: key {int(keys[i])} maps to source rows {int(back[i])} and "
            f"{int(rows[i])}; the two configs transform this feature's raw values inconsistently"
        )


# --------------------------------------------------------------------------- checks


def _check_dense_arch(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> None:
    problems = [f"{k}: only in the target config" for k in target if k not in source]
    problems += [f"{k}: only in the source config" for k in source if k not in target]
    problems += [
        f"{k}: source {list(source[k].shape)} vs target {list(target[k].shape)}"
        for k in target
        if k in source and source[k].shape != target[k].shape
    ]
    if problems:
        raise ValueError(
            "the dense layers (DenseArch) of the two configs differ, so the checkpoint cannot be "
            "converted; the model_config (towers, din_towers, final, feature groups and "
            "embedding dims) must be the same:\n  " + "\n  ".join(problems[:20])
        )


def _score(strategy: ScoreStrategy, counts: np.ndarray, step: int) -> torch.Tensor:
    if strategy is ScoreStrategy.LFU:
        return torch.from_numpy(counts.astype(np.int64))
    now = time.time_ns() // 1000 if strategy is ScoreStrategy.TIMESTAMP else step
    return torch.full((counts.size,), now, dtype=torch.int64)


# --------------------------------------------------------------------------- conversion


def convert_checkpoint(
    *,
    source_config: Path,
    source_checkpoint: Path,
    target_config: Path,
    samples: Path,
    out_dir: Path,
    eval_path: Path | None = None,
    evaluate: bool = True,
) -> ConvertResult:
    """Write the converted checkpoint under ``out_dir/checkpoints/`` (see the module docstring);
    with ``evaluate``, also the eval metrics of the source and the converted checkpoint."""
    src_cfg, tgt_cfg = load_config(source_config), load_config(target_config)
    src_fs, tgt_fs = build_feature_set(src_cfg), build_feature_set(tgt_cfg)
    source = torch.load(
        Path(source_checkpoint) / "dense.pt", map_location="cpu", weights_only=False
    )
    progress = Progress(**source["progress"])
    model = MultiTowerDIN.from_config(tgt_cfg, tgt_fs)
    _check_dense_arch(source["dense"], model.dense.state_dict())
    model.dense.load_state_dict(source["dense"])

    src_tables: dict[str, torch.Tensor] = source["dense_tables"]
    src_order = [k[len(_PREFIX) : -len(".weight")] for k in src_tables]  # Adagrad param order
    src_sums = source["optimizers"]["sparse"]["state"]
    copied = _copy_fixed_tables(model, tgt_fs, src_tables)
    tables: dict[str, dict[str, Any]] = {}
    for spec in tgt_fs.dynamic_tables:
        assert spec.dynamic is not None
        src_spec = src_fs.tables.get(spec.name)
        if src_spec is None:
            raise ValueError(
                f"dynamic table {spec.name!r} of {target_config} has no table of that name in "
                f"{source_config} (tables: {', '.join(src_fs.tables)})"
            )
        if src_spec.is_dynamic:  # dynamic in both: take the source checkpoint's rows as they are
            state, _ = read_table(source_checkpoint, spec.name, spec=src_spec)
            model.sparse.dynamic.load_table_state(spec.name, state)
            tables[spec.name] = {"keys": int(state.keys.numel()), "from": "dynamic"}
            continue
        seen = seen_ids(samples, spec.name, tgt_fs, src_fs)
        weight = src_tables[f"{_PREFIX}{spec.name}.weight"]
        rows = torch.from_numpy(seen.source_rows)
        if src_spec.dim != spec.dim:
            raise ValueError(f"table {spec.name!r}: dim {src_spec.dim} → {spec.dim} differ")
        accum = src_sums[src_order.index(spec.name)]["sum"]
        state = TableState(
            keys=torch.from_numpy(seen.keys),
            values=weight[rows].float(),
            scores=_score(spec.dynamic.score_strategy, seen.counts, progress.step),
            accumulators=accum.to_dense()[rows].float() if accum.is_sparse else accum[rows],
        )
        model.sparse.dynamic.load_table_state(spec.name, state)
        tables[spec.name] = {
            "from": f"num_buckets {src_spec.num_rows}",
            "keys": int(seen.keys.size),
            "source_rows_used": int(np.unique(seen.source_rows).size),
            "max_capacity": spec.dynamic.max_capacity,
        }
    stats = model.sparse.dynamic.stats()
    for name, info in tables.items():  # keys that found no room (max_capacity) are dropped
        info["stored"] = int(stats[name]["size"])
        info["dropped"] = info["keys"] - info["stored"]
    optimizers = build_optimizers(model, tgt_cfg.train_config)
    _copy_optimizer_states(optimizers, source["optimizers"], model, src_order)
    ckpt = save_checkpoint(Path(out_dir), model, optimizers, progress)
    result = ConvertResult(ckpt, tables, copied)
    if evaluate:
        result.eval = {
            "original": evaluate_checkpoint(
                source_config, checkpoint=source_checkpoint, train_path=samples, eval_path=eval_path
            ).to_dict(),
            "converted": evaluate_checkpoint(
                target_config, checkpoint=ckpt, train_path=samples, eval_path=eval_path
            ).to_dict(),
        }
    return result


def _copy_fixed_tables(
    model: MultiTowerDIN, fs: FeatureSet, src_tables: dict[str, torch.Tensor]
) -> list[str]:
    target = model.sparse.dense.state_dict()
    out = {}
    for key, value in target.items():
        if key not in src_tables or src_tables[key].shape != value.shape:
            got = None if key not in src_tables else list(src_tables[key].shape)
            raise ValueError(
                f"num_buckets table {key[len(_PREFIX) : -len('.weight')]!r}: the target needs "
                f"{list(value.shape)}, the source checkpoint has {got}; keep its num_buckets and "
                "embedding_dim equal in both configs"
            )
        out[key] = src_tables[key]
    model.sparse.dense.load_state_dict(out)
    return [k[len(_PREFIX) : -len(".weight")] for k in out]


def _copy_optimizer_states(
    optimizers: dict[str, torch.optim.Optimizer],
    source: dict[str, Any],
    model: MultiTowerDIN,
    src_order: list[str],
) -> None:
    """Adam: the whole state (same parameters). Adagrad of the fixed tables: each table's state
    moved from its source position to its target position. Hyperparameters: the target's."""
    dense = optimizers["dense"].state_dict()
    dense["state"] = source["dense"]["state"]
    optimizers["dense"].load_state_dict(dense)
    sparse = optimizers["sparse"].state_dict()
    tgt_order = [k[len(_PREFIX) : -len(".weight")] for k in model.sparse.dense.state_dict()]
    sparse["state"] = {
        i: source["sparse"]["state"][src_order.index(name)] for i, name in enumerate(tgt_order)
    }
    optimizers["sparse"].load_state_dict(sparse)
