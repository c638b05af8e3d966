"""Fixtures shared across packages: configs and one tiny synthetic dataset per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.config import load_config
from shared.features import FeatureSet, build_feature_set

# trained runs shared by tests/train/tools and tests/serve (delta updates)
pytest_plugins = ["tests.train.tools.scenario"]

ROOT = Path(__file__).resolve().parents[1]
SEED_CONFIG = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config"
BASELINE_CONFIG = ROOT / "configs" / "multi_tower_din_taobao.config"
# parametrize("device", DEVICES): each test on the CPU and, marked gpu, on CUDA (skipped without)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


@pytest.fixture(scope="session")
def seed_fs() -> FeatureSet:
    return build_feature_set(load_config(SEED_CONFIG))


@pytest.fixture(scope="session")
def tiny_samples(tmp_path_factory: pytest.TempPathFactory, seed_fs: FeatureSet) -> Path:
    """``<dir>/train`` and ``<dir>/eval`` Parquet samples of the `tiny` synthetic dataset."""
    from train.data.synthetic import generate
    from train.data.taobao import build_samples

    root = tmp_path_factory.mktemp("tiny")
    generate("tiny", root, seed=0)
    build_samples(root / "raw", root / "samples", seed_fs)
    return root / "samples"


def write_config(
    base: Path, out: Path, *, train: Path, eval_: Path, replace: dict[str, str] | None = None
) -> Path:
    """A copy of ``base`` with local input paths (and text replacements) for a test run."""
    text = base.read_text()
    text = text.replace(
        'train_input_path: "data/small/samples/train"', f'train_input_path: "{train}"'
    )
    text = text.replace('eval_input_path: "data/small/samples/eval"', f'eval_input_path: "{eval_}"')
    for old, new in (replace or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    out.write_text(text)
    return out
