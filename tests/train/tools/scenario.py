"""Session fixtures shared by the tools tests and the serving delta tests (registered in
``tests/conftest.py``): small trained runs of the seed config and of a num_buckets baseline."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import BASELINE_CONFIG, SEED_CONFIG, write_config

# the baseline's big tables shrunk (fast tests) and small enough for ids to collide
SMALL_BUCKETS = {
    "num_buckets: 1141730": "num_buckets: 97",
    "num_buckets: 846812": "num_buckets: 89",
    "num_buckets: 461498": "num_buckets: 53",
    "num_buckets: 423438": "num_buckets: 61",
    "num_buckets: 255877": "num_buckets: 47",
    "num_buckets: 12961": "num_buckets: 31",
}


@dataclass(frozen=True)
class DynRun:
    model_dir: Path
    base_checkpoint: Path  # step 4
    checkpoint: Path  # step 8 (resumed from step 4)
    base_bundle: Path  # export of step 4, version "step-4"
    full_bundle: Path  # export of step 8, version "step-8"


def train(config: Path, tiny: Path, model_dir: Path, steps: int, resume: bool = False) -> Path:
    from train.trainer import Trainer, TrainOptions

    options = TrainOptions(
        config_path=config,
        model_dir=model_dir,
        train_path=tiny / "train",
        eval_path=tiny / "eval",
        batch_size=256,
        num_workers=0,
        max_steps=steps,
        resume=resume,
        progress_bar=False,
    )
    return Trainer(options).fit().checkpoint


@pytest.fixture(scope="session")
def dyn_run(tiny_samples: Path, tmp_path_factory: pytest.TempPathFactory) -> DynRun:
    """Seed config: 4 steps → bundle v step-4 → 4 more steps → bundle step-8."""
    from train.export import export_bundle

    root = tmp_path_factory.mktemp("dyn_run")
    model_dir = root / "model"
    base_ckpt = train(SEED_CONFIG, tiny_samples, model_dir, 4)
    base = export_bundle(SEED_CONFIG, out_dir=root / "bundles" / "step-4", checkpoint=base_ckpt)
    ckpt = train(SEED_CONFIG, tiny_samples, model_dir, 8, resume=True)
    full = export_bundle(SEED_CONFIG, out_dir=root / "bundles" / "step-8", checkpoint=ckpt)
    return DynRun(model_dir, base_ckpt, ckpt, base, full)


@pytest.fixture(scope="session")
def baseline_config(tiny_samples: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("baseline_cfg")
    return write_config(
        BASELINE_CONFIG,
        root / "baseline.config",
        train=tiny_samples / "train",
        eval_=tiny_samples / "eval",
        replace=SMALL_BUCKETS,
    )


@pytest.fixture(scope="session")
def baseline_run(
    baseline_config: Path, tiny_samples: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A num_buckets checkpoint (6 steps) of the shrunk baseline config."""
    return train(baseline_config, tiny_samples, tmp_path_factory.mktemp("nb_run") / "model", 6)


@pytest.fixture(scope="session")
def dyn_ranks(dyn_run: DynRun, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """``dyn_run``'s step-8 checkpoint by world size: as one process saved it (1) and as 2 and 3
    ranks save it (``tests.train.export_checks.by_ranks``). Shared by the export, export-cache
    and checkpoint-rows tests, which only read it."""
    from tests.train.export_checks import by_ranks

    return by_ranks(dyn_run.checkpoint, tmp_path_factory.mktemp("dyn_ranks"))


@pytest.fixture(scope="session")
def dyn_rank_bundles(
    dyn_run: DynRun, dyn_ranks: dict[int, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[int, Path]:
    """The cold full export (no cache) of each of ``dyn_ranks``' checkpoints: 1 is
    ``dyn_run.full_bundle`` (the same export of the same checkpoint), 2 and 3 exported here once
    for the tests that compare them (each export traces the dense program, about half a second
    on CPU). Read only."""
    from train.export import export_bundle

    root = tmp_path_factory.mktemp("dyn_rank_bundles")
    out = {1: dyn_run.full_bundle}
    for w in (2, 3):
        out[w] = export_bundle(SEED_CONFIG, out_dir=root / f"w{w}", checkpoint=dyn_ranks[w])
    return out
