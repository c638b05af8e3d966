"""Fine-tune starts: the weights of a checkpoint without its optimizer state or progress.

``python -m train train ... --fine_tune_checkpoint PATH`` (tzrec's flag) starts training at step 0
from the weights at ``PATH``: a checkpoint (``<model_dir>/checkpoints/step_N``), a model dir (its
newest checkpoint), an initial checkpoint that holds only dynamic tables (``python -m
train.tools init-ckpt``, from a config's ``dynamicemb.init_table``), a converted one (``python -m
train.tools convert``), or a TorchEasyRec checkpoint (``model.ckpt-N``, or the model dir holding
it), whose ``dynamicemb/`` tables load as they are (its torch-DCP dense state does not).

Which dynamic tables must be in it: every dynamic table of the config, unless the checkpoint is
an init checkpoint (its ``init_ckpt.json`` lists the tables it initializes) or ``--fine-tune-tables``
names the ones to load (the others then start empty). A table that is missing, a checkpoint that
holds none of them, or one whose tables hold no rows is an error, never a silent start from scratch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shared.hashtable.checkpoint import CheckpointError, collection_paths
from train.checkpoint import foreign_checkpoints, latest_checkpoint
from train.model.multi_tower_din import MultiTowerDIN

log = logging.getLogger(__name__)

INIT_MANIFEST = "init_ckpt.json"  # written by train.tools.init_table


def resolve_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it holds a checkpoint (``dense.pt`` or ``dynamicemb/``), else the
    newest complete checkpoint of the model dir ``path`` (ours, else TorchEasyRec's)."""
    path = Path(path)
    if (path / "dense.pt").is_file() or (path / "dynamicemb").is_dir():
        return path
    newest = latest_checkpoint(path)
    if newest is None:
        theirs = [p for p in foreign_checkpoints(path) if (p / "dynamicemb").is_dir()]
        newest = theirs[-1] if theirs else None
    if newest is None:
        raise FileNotFoundError(
            f"{path} is neither a checkpoint (no dense.pt, no dynamicemb/) nor a model dir with "
            "complete checkpoints (checkpoints/step_N with DONE, or TorchEasyRec's "
            "model.ckpt-N/dynamicemb); pass a checkpoints/step_N dir or an init-ckpt output dir"
        )
    return newest


def _init_tables(ckpt: Path) -> list[str] | None:
    """The tables an init checkpoint initializes (None: not an init checkpoint)."""
    manifest = ckpt / INIT_MANIFEST
    if not manifest.is_file():
        return None
    return sorted(json.loads(manifest.read_text())["tables"])


def load_weights(
    path: str | Path,
    model: MultiTowerDIN,
    *,
    rank: int = 0,
    world_size: int = 1,
    tables: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Copy the weights of the checkpoint at ``path`` into ``model`` (see the module docstring).

    Dense layers and num_buckets tables come from ``dense.pt`` when present (an init or
    TorchEasyRec checkpoint has none: they keep their fresh initialization); each dynamic table
    loaded replaces the model's (rows, Adagrad sums, scores, admission counters), re-sharded to
    ``rank`` of ``world_size`` by key owner. ``tables``: the dynamic tables to load (default: see
    the module docstring). Returns what was loaded, e.g. ``{"checkpoint": ..., "layout":
    "dynamicemb", "dense": False, "tables": ["user_id_emb"], "rows": {"user_id_emb": 120},
    "missing": ["brand_emb", ...], "notes": {...}, "ignored": [...]}``.
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
    wanted = list(tables) if tables is not None else _init_tables(ckpt)
    info: dict[str, Any] = {"checkpoint": str(ckpt), "dense": dense, "layout": None}
    if names:
        report = model.sparse.dynamic.load(
            ckpt, collection_paths(model.fs), rank=rank, world_size=world_size, tables=wanted
        )
        info |= {
            "layout": report.layout,
            "tables": sorted(report.tables),
            "rows": {n: t.rows for n, t in report.tables.items()},
            "missing": [n for n in names if n not in report.tables],
            "notes": {n: t.notes for n, t in report.tables.items() if t.notes},
            "ignored": report.ignored,
        }
    elif not dense:
        raise CheckpointError(
            f"{ckpt}: nothing to load (no dense.pt; the config has no dynamic tables)"
        )
    log.info("fine-tune start from %s", info)
    return info
