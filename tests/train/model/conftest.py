"""Fixtures of the model tests."""

from __future__ import annotations

from pathlib import Path

import pyarrow.dataset as ds
import pytest

from shared.batch import Batch
from shared.features import FeatureSet
from shared.fg import table_to_batch


@pytest.fixture(scope="module")
def tiny_batch(tiny_samples: Path, seed_fs: FeatureSet) -> Batch:
    """The first 64 eval rows of ``tiny`` (fresh tables: every dynamic id in them is cold)."""
    rows = ds.dataset(str(tiny_samples / "eval"), format="parquet").head(64)
    return table_to_batch(seed_fs, rows)
