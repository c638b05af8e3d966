"""The per-FeatureSet plan: built once per FeatureSet object."""

from __future__ import annotations

from shared.features import FeatureSet, feature_set_from_text
from shared.fg_plan import per_feature_set
from tests.shared.fg_rows import SEED_TEXT


def test_per_feature_set_builds_once_per_feature_set_object() -> None:
    built: list[FeatureSet] = []

    def build(fs: FeatureSet) -> int:
        built.append(fs)
        return len(built)

    cached = per_feature_set(build)
    a, b = feature_set_from_text(SEED_TEXT, "a"), feature_set_from_text(SEED_TEXT, "b")
    assert a == b and a is not b
    assert [cached(a), cached(a), cached(b), cached(a)] == [1, 1, 2, 1]
