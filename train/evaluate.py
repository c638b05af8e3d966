"""Evaluation: AUC (torchmetrics), log loss, the oracle's AUC on the same rows, head/tail AUC;
optionally every row's prediction in a Parquet file (:func:`write_predictions`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import torch
from torchmetrics.functional.classification import binary_auroc

from shared.batch import Batch
from train.model.multi_tower_din import MultiTowerDIN

if TYPE_CHECKING:
    from train.distributed.env import DistEnv

T = TypeVar("T")

TAIL_THRESHOLD = 5  # a user seen fewer times than this in training is a tail user


@dataclass
class EvalResult:
    rows: int
    auc: float
    logloss: float
    oracle_auc: float | None  # AUC of the true click probability (synthetic data)
    auc_vs_oracle: float | None  # auc / oracle_auc
    head_auc: float | None  # users seen >= TAIL_THRESHOLD times in training
    tail_auc: float | None  # users seen fewer times (including never)
    tail_rows: int
    ctr: float

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


class UserCounts:
    """How often each user id occurs in the training samples (vectorized lookups)."""

    def __init__(self, keys: np.ndarray, counts: np.ndarray) -> None:
        self.keys, self.counts = keys, counts

    @classmethod
    def from_samples(cls, train_dir: Path | str, column: str = "user_id") -> UserCounts:
        ids = pads.dataset(str(train_dir), format="parquet").to_table(columns=[column])[column]
        values = ids.drop_null().to_numpy()
        keys, counts = np.unique(values, return_counts=True)
        return cls(keys, counts)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        pos = np.clip(np.searchsorted(self.keys, ids), 0, max(len(self.keys) - 1, 0))
        hit = (self.keys[pos] == ids) if len(self.keys) else np.zeros(len(ids), bool)
        return np.where(hit, self.counts[pos] if len(self.keys) else 0, 0)


def _auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    if labels.numel() == 0 or labels.min() == labels.max():
        return None  # undefined with one class
    return float(binary_auroc(scores, labels.long()))


def _user_ids(batch: Batch) -> np.ndarray:
    """Raw user id of each candidate row (-1 where missing)."""
    jt = batch.user["user_id"]
    lengths = jt.lengths().cpu()
    per_user = torch.full((batch.num_users,), -1, dtype=torch.int64)
    per_user[lengths > 0] = jt.values().cpu()
    return per_user[batch.user_index.cpu()].numpy()


def write_predictions(
    path: Path,
    user_ids: np.ndarray,
    labels: torch.Tensor,
    probs: torch.Tensor,
    tail: np.ndarray | None,
) -> None:
    """One Parquet row per evaluated row, in the eval loader's order (unshuffled: the samples'
    files in name order, each file's rows in order): ``row`` (that position), ``user_id`` (-1
    where missing), ``label``, ``probability``, and ``tail`` (the user had fewer than
    TAIL_THRESHOLD training samples; null without the training samples' counts). Written to a
    temp file and renamed, so a file at ``path`` is always complete."""
    n = len(labels)
    tail_column = pa.nulls(n, pa.bool_()) if tail is None else pa.array(tail)
    table = pa.table({
        "row": pa.array(np.arange(n, dtype=np.int64)),
        "user_id": pa.array(user_ids.astype(np.int64)),
        "label": pa.array(labels.numpy().astype(np.int8)),
        "probability": pa.array(probs.numpy().astype(np.float32)),
        "tail": tail_column,
    })  # fmt: skip
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def _global_order(per_rank: list[list[T]]) -> list[T]:
    """Batch 0 of every rank in rank order, then batch 1, ...: the order of the global batches."""
    return [x for batch in zip(*per_rank, strict=True) for x in batch]


@torch.no_grad()
def evaluate(
    model: MultiTowerDIN,
    batches: Iterable[Batch],
    *,
    device: torch.device | str = "cpu",
    user_counts: UserCounts | None = None,
    dist: DistEnv | None = None,
    predictions: Path | None = None,
) -> EvalResult:
    """Score every batch in eval mode (no table inserts, no score changes) and compute metrics.

    Distributed (``dist``): a collective; each rank scores its part of every global batch, the
    parts are gathered in (batch, rank) order, i.e. the rows in the order one process with the
    global batch sees them, and every rank returns the metrics of all rows.
    ``predictions``: also write every row's prediction there (:func:`write_predictions`; rank
    0 only).
    """
    was_training = model.training
    model.eval()
    probs, labels, oracle, users = [], [], [], []
    try:
        for batch in batches:
            if batch.labels is None:
                raise ValueError("evaluation needs labelled batches (label column missing)")
            logits = model(batch.to(device))
            probs.append(torch.sigmoid(logits.float()).cpu())
            labels.append(batch.labels.cpu())
            if batch.oracle is not None:
                oracle.append(batch.oracle.cpu())
            if user_counts is not None or predictions is not None:
                users.append(_user_ids(batch))
    finally:
        model.train(was_training)
    if dist is not None:
        ranks = dist.all_gather_object((probs, labels, oracle, users))
        probs, labels, oracle, users = (_global_order([r[k] for r in ranks]) for k in range(4))
    p = torch.cat(probs) if probs else torch.zeros(0)
    y = torch.cat(labels) if labels else torch.zeros(0)
    eps = 1e-7
    logloss = (
        float(
            -(y * torch.log(p.clamp_min(eps)) + (1 - y) * torch.log((1 - p).clamp_min(eps))).mean()
        )
        if len(y)
        else float("nan")
    )
    auc = _auc(p, y)
    oracle_auc = _auc(torch.cat(oracle), y) if oracle and len(oracle) == len(probs) else None
    head_auc = tail_auc = None
    tail_rows = 0
    user_ids = np.concatenate(users) if users else np.zeros(0, np.int64)
    tail = None
    if user_counts is not None and users:
        tail = torch.from_numpy(user_counts.lookup(user_ids) < TAIL_THRESHOLD)
        tail_rows = int(tail.sum())
        head_auc, tail_auc = _auc(p[~tail], y[~tail]), _auc(p[tail], y[tail])
    if predictions is not None and (dist is None or dist.rank == 0):
        write_predictions(predictions, user_ids, y, p, None if tail is None else tail.numpy())
    return EvalResult(
        rows=len(y),
        auc=float("nan") if auc is None else auc,
        logloss=logloss,
        oracle_auc=oracle_auc,
        auc_vs_oracle=(auc / oracle_auc) if auc is not None and oracle_auc else None,
        head_auc=head_auc,
        tail_auc=tail_auc,
        tail_rows=tail_rows,
        ctr=float(y.mean()) if len(y) else float("nan"),
    )
