"""Host → device transfer of a batch (serve.model.batch_to_device) and the predict timings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from bench.synthetic_bundle import synthetic_request
from serve.batcher import concat_batches
from serve.limits import Limits
from serve.model import LoadedModel, batch_to_device
from serve.validation import request_inputs
from shared.batch import Batch
from shared.features import FeatureSet
from shared.fg_request import request_columns_to_batch


def _batches(fs: FeatureSet) -> list[Batch]:
    rng = np.random.default_rng(0)
    shapes = [(5, 3), (7, 0), (1, 1)]  # (candidates, sequence length); one empty sequence
    return [
        request_columns_to_batch(
            fs, **vars(request_inputs(synthetic_request(fs, rng, candidates=c, sequence_length=n), fs, Limits()))
        )
        for c, n in shapes
    ]  # fmt: skip


def _assert_same(a: Batch, b: Batch) -> None:
    for x, y in ((a.user, b.user), (a.item, b.item), (a.sequence, b.sequence)):
        assert x.keys() == y.keys() and x.stride() == y.stride()
        assert x.length_per_key() == y.length_per_key()
        for t, u in ((x.values(), y.values()), (x.lengths(), y.lengths())):
            assert t.dtype == u.dtype and t.shape == u.shape
            assert torch.equal(t.cpu(), u.cpu())
    assert torch.equal(a.user_index.cpu(), b.user_index.cpu())


def test_packed_transfer_keeps_every_tensor(fs: FeatureSet) -> None:
    batch = concat_batches(_batches(fs))
    packed = batch_to_device(batch, torch.device("cpu"), packed=True)
    _assert_same(batch, packed)
    assert packed.user.values().data_ptr() != batch.user.values().data_ptr()  # really repacked


def test_predict_reports_stage_timings_and_same_scores(bundle_v1: Path, fs: FeatureSet) -> None:
    model = LoadedModel.load(bundle_v1, device="cpu")
    batch = concat_batches(_batches(fs))
    timings: dict[str, float] = {}
    timed = model.predict(batch, timings=timings)
    assert set(timings) == {"h2d", "compute", "sync"} and all(v >= 0 for v in timings.values())
    torch.testing.assert_close(timed, model.predict(batch))
