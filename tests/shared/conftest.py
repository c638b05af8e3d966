"""Fixtures of the feature-generation tests: the seed FeatureSet in both id modes."""

from __future__ import annotations

import pytest

from shared.features import FeatureSet, IdMode, feature_set_from_text
from tests.shared.fg_rows import SEED_TEXT, TZREC_TEXT


@pytest.fixture(scope="module")
def fs() -> FeatureSet:
    return feature_set_from_text(SEED_TEXT, "seed")


@pytest.fixture(scope="module")
def fs_tzrec() -> FeatureSet:
    fs = feature_set_from_text(TZREC_TEXT, "seed, TorchEasyRec ids")
    assert fs.id_mode is IdMode.TZREC
    return fs
