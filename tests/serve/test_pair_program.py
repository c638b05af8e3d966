"""Serving dense programs with and without the pair inputs: bundle format 3 programs get the
pairs computed on the host and moved in the batch's one copy; format 1 and 2 programs (no pair
inputs, told by their input names) run as before; both give the same scores."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from serve.model import LoadedModel, load_program, move_to_device, synthetic_batch
from serve.offline import score_table
from serve.program_cache import ProgramCache
from shared.bundle import BundleError, read_manifest
from shared.dense_inputs import INPUT_NAMES, PAIR_INPUT_NAMES
from shared.features import FeatureSet


def test_format_follows_the_program(din_bundles: tuple[Path, Path], bundle_v1: Path) -> None:
    f2, f3 = din_bundles
    assert read_manifest(f2)["format_version"] == 2
    assert read_manifest(f3)["format_version"] == 3
    assert read_manifest(bundle_v1)["format_version"] == 2  # TinyDense: the six inputs


def test_program_signature_is_told_by_its_inputs(din_bundles: tuple[Path, Path]) -> None:
    f2, f3 = din_bundles
    old = load_program(f2 / "dense.pt2", torch.device("cpu"), cache=None)
    new = load_program(f3 / "dense.pt2", torch.device("cpu"), cache=None)
    assert (old.takes_pairs, old.input_names) == (False, INPUT_NAMES)
    assert (new.takes_pairs, new.input_names) == (True, PAIR_INPUT_NAMES)


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_format_2_and_3_bundles_score_alike(
    din_bundles: tuple[Path, Path], table: pa.Table, tiled: bool
) -> None:
    """The same model with and without the pair inputs: the same scores (empty sequences,
    one user with many candidates, and untiled rows among them)."""
    old, new = (LoadedModel.load(b, device="cpu", warmup_rounds=1) for b in din_bundles)
    assert (old.program.takes_pairs, new.program.takes_pairs) == (False, True)
    want, got = score_table(old, table, tiled=tiled), score_table(new, table, tiled=tiled)
    assert got.shape == (table.num_rows,)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert np.unique(np.round(got, 4)).size > 4  # the scores differ between candidates


@pytest.mark.parametrize(
    ("users", "candidates", "lengths"),
    [(1, 1, (0,)), (1, 9, (7,)), (3, 5, (0, 4, 1)), (4, 4, (0, 0, 0, 0))],
    ids=["B=1,empty", "U=1", "U!=B", "all-empty"],
)
def test_synthetic_batches_score_alike(
    din_bundles: tuple[Path, Path],
    fs: FeatureSet,
    users: int,
    candidates: int,
    lengths: tuple[int, ...],
) -> None:
    old, new = (LoadedModel.load(b, device="cpu", warmup_rounds=0) for b in din_bundles)
    batch = synthetic_batch(fs, users, candidates, lengths)
    want = old.predict(batch)
    timings: dict[str, float] = {}
    got = new.predict(batch, timings=timings)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert set(timings) == {"h2d", "compute", "sync"}
    # a batch already on the device: the pairs are computed there (with the host sync)
    torch.testing.assert_close(new.logits(new.to_device(batch)).sigmoid(), want, atol=1e-6, rtol=0)


def test_pairs_travel_in_the_batch_copy(fs: FeatureSet) -> None:
    batch = synthetic_batch(fs, 2, 3, (2, 1))
    extra = [torch.arange(4), torch.arange(4) * 2]
    moved, got = move_to_device(batch, torch.device("cpu"), extra=extra, packed=True)
    assert [t.tolist() for t in got] == [t.tolist() for t in extra]
    assert torch.equal(moved.user_index, batch.user_index)


def test_unknown_program_inputs_are_refused(tmp_path: Path) -> None:
    class Odd(torch.nn.Module):
        def forward(self, user_deep: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
            return user_deep.sum(1) + extra.sum()

    path = tmp_path / "dense.pt2"
    x = {"user_deep": torch.ones(2, 3), "extra": torch.ones(2)}
    torch.export.save(torch.export.export(Odd(), (), kwargs=x), path)
    with pytest.raises(BundleError, match="are none of"):
        load_program(path, torch.device("cpu"), cache=None)


def test_a_cached_program_keeps_its_signature(din_bundles: tuple[Path, Path]) -> None:
    """The program cache's copy of a module (a new version, same graph) still takes the pairs."""
    cache = ProgramCache()
    path = din_bundles[1] / "dense.pt2"
    first = load_program(path, torch.device("cpu"), cache=cache)
    again = load_program(path, torch.device("cpu"), cache=cache)
    assert cache.reused == 1
    assert first.takes_pairs and again.takes_pairs and again.module is not first.module
