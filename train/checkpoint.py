"""Training checkpoints: dense state + optimizer state + the hash tables in the dynamicemb layout.

Layout of one checkpoint (written into a temp dir, then renamed, so a crash never leaves a
half-written checkpoint that looks complete)::

    <model_dir>/checkpoints/step_<N>/
        dense.pt          model dense weights, num_buckets tables, optimizer states, progress
        dynamicemb/<module>/<table>_keys.rank_R.world_size_W ...   (shared.hashtable.checkpoint)
        DONE              written last
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from train.model.multi_tower_din import MultiTowerDIN

DYNAMIC_MODULE = "sparse.dynamic"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class Progress:
    """Where training stands: enough to continue on the same data order."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # current epoch
    batch_in_epoch: int = 0  # batches of `epoch` already consumed
    samples: int = 0


def save_checkpoint(
    model_dir: Path,
    model: MultiTowerDIN,
    optimizers: dict[str, torch.optim.Optimizer],
    progress: Progress,
    *,
    rank: int = 0,
    world_size: int = 1,
    keep: int = 3,
) -> Path:
    """Write ``checkpoints/step_<N>`` atomically and prune all but the ``keep`` newest."""
    root = Path(model_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{progress.step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{progress.step}.", dir=root))
    try:
        state: dict[str, Any] = {
            "dense": model.dense.state_dict(),
            "dense_tables": model.sparse.dense.state_dict(),
            "optimizers": {k: o.state_dict() for k, o in optimizers.items()},
            "progress": asdict(progress),
            "rng": torch.get_rng_state(),
        }
        torch.save(state, tmp / "dense.pt")
        model.sparse.dynamic.save(tmp, module_name=DYNAMIC_MODULE, rank=rank, world_size=world_size)
        (tmp / "DONE").write_text("ok\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(model_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(model_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(model_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / "DONE").exists()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(model_dir: Path) -> Path | None:
    found = list_checkpoints(model_dir)
    return found[-1] if found else None


def load_checkpoint(
    path: Path,
    model: MultiTowerDIN,
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> Progress:
    """Restore ``model`` (and optimizers) from ``path``; returns the saved progress."""
    path = Path(path)
    if not (path / "DONE").exists():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no DONE marker); pick one listed by "
            "`list_checkpoints`"
        )
    state = torch.load(path / "dense.pt", map_location="cpu", weights_only=False)
    model.dense.load_state_dict(state["dense"])
    model.sparse.dense.load_state_dict(state["dense_tables"])
    model.sparse.dynamic.load(path, module_name=DYNAMIC_MODULE, rank=rank, world_size=world_size)
    if optimizers is not None:
        for name, opt in optimizers.items():
            opt.load_state_dict(state["optimizers"][name])
    torch.set_rng_state(state["rng"])
    return Progress(**state["progress"])
