"""Fine-tune starts: the weights of a checkpoint without its optimizer state or progress.

``python -m train train ... --fine_tune_checkpoint PATH`` (tzrec's flag) starts training at step 0
from the weights at ``PATH``: a checkpoint (``<model_dir>/checkpoints/step_N``), a model dir (its
newest checkpoint), or an initial checkpoint that holds only dynamic tables (``python -m
train.tools init-ckpt``, from a config's ``dynamicemb.init_table``), or a converted one
(``python -m train.tools convert``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from shared.hashtable.checkpoint import module_dir, saved_tables
from train.checkpoint import DYNAMIC_MODULE, latest_checkpoint
from train.model.multi_tower_din import MultiTowerDIN

log = logging.getLogger(__name__)


def resolve_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it holds a checkpoint (``dense.pt`` or ``dynamicemb/``), else the
    newest complete checkpoint of the model dir ``path``."""
    path = Path(path)
    if (path / "dense.pt").is_file() or (path / "dynamicemb").is_dir():
        return path
    newest = latest_checkpoint(path)
    if newest is None:
        raise FileNotFoundError(
            f"{path} is neither a checkpoint (no dense.pt, no dynamicemb/) nor a model dir with "
            "complete checkpoints; pass a checkpoints/step_N dir or an init-ckpt output dir"
        )
    return newest


def load_weights(
    path: str | Path, model: MultiTowerDIN, *, rank: int = 0, world_size: int = 1
) -> dict[str, Any]:
    """Copy the weights of the checkpoint at ``path`` into ``model`` (see the module docstring).

    Dense layers and num_buckets tables come from ``dense.pt`` when present (an init checkpoint
    has none: they keep their fresh initialization); each dynamic table of the checkpoint
    replaces the model's (rows, Adagrad sums, scores, admission counters), re-sharded to
    ``rank`` of ``world_size`` by key owner; dynamic tables the checkpoint lacks stay empty.
    Returns what was loaded, e.g. ``{"checkpoint": ..., "dense": False, "tables":
    ["user_id_emb"], "missing": ["brand_emb", ...]}``.
    """
    ckpt = resolve_checkpoint(path)
    dense = (ckpt / "dense.pt").is_file()
    if dense:
        state = torch.load(ckpt / "dense.pt", map_location="cpu", weights_only=False)
        try:
            model.dense.load_state_dict(state["dense"])
            model.sparse.dense.load_state_dict(state["dense_tables"])
        except (KeyError, RuntimeError) as err:
            raise ValueError(
                f"{ckpt / 'dense.pt'} does not fit this model's dense layers or num_buckets "
                f"tables ({err}); was it written with another config? A num_buckets checkpoint "
                "is converted with `python -m train.tools convert`"
            ) from None
    names = [t.name for t in model.fs.dynamic_tables]
    directory = module_dir(ckpt, DYNAMIC_MODULE)
    saved = saved_tables(directory) if directory.is_dir() else []
    unknown = [t for t in saved if t not in names]
    if unknown:
        raise ValueError(
            f"{directory} holds tables {unknown} that this config has no dynamic table for "
            f"(dynamic tables: {', '.join(names)}); wrong config?"
        )
    if saved:
        model.sparse.dynamic.load(
            ckpt, module_name=DYNAMIC_MODULE, rank=rank, world_size=world_size, strict=False
        )
    if not dense and not saved:
        raise ValueError(f"{ckpt}: nothing to load (no dense.pt and no dynamic tables)")
    info = {
        "checkpoint": str(ckpt),
        "dense": dense,
        "tables": saved,
        "missing": [t for t in names if t not in saved],
    }
    log.info("fine-tune start from %s", info)
    return info
