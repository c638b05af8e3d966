"""A batch's layout in a shared-memory slot (serve.slots): written, read back as a KJT batch and
as numpy views, and refused when it does not fit."""

from __future__ import annotations

import numpy as np
import torch

from protos import predict_pb2
from serve.host_batch import HostBatch
from serve.limits import Limits
from serve.slots import batch_bytes, read_batch, read_host_batch, write_batch
from serve.validation import request_inputs
from shared.batch import Batch
from shared.features import FeatureSet
from shared.fg_request import request_columns_to_batch


def _batch(fs: FeatureSet, request: predict_pb2.PredictRequest) -> Batch:
    return request_columns_to_batch(fs, **vars(request_inputs(request, fs, Limits())))


def _same(a: Batch, b: Batch) -> None:
    for x, y in ((a.user, b.user), (a.item, b.item), (a.sequence, b.sequence)):
        assert x.keys() == y.keys() and x.stride() == y.stride()
        assert x.length_per_key() == y.length_per_key()
        assert torch.equal(x.values(), y.values()) and torch.equal(x.lengths(), y.lengths())
    assert torch.equal(a.user_index, b.user_index)


def test_a_batch_round_trips_through_a_buffer(fs: FeatureSet, requests) -> None:
    for req in requests:
        batch = _batch(fs, req)
        buf = np.zeros(batch_bytes(batch), dtype=np.uint8)
        ref = write_batch(batch, buf)
        assert ref is not None
        _same(read_batch(ref, buf), batch)
        assert write_batch(batch, buf[:-1]) is None  # does not fit: None, nothing raised


def test_a_batch_reads_back_as_a_host_batch(fs: FeatureSet, requests) -> None:
    """Numpy views of the slot (no copy), the tensors of read_batch; bfloat16 (no numpy dtype)
    falls back to read_batch."""
    from tests.serve.test_host_batch import assert_same_batch

    for req in requests:
        batch = _batch(fs, req)
        buf = np.zeros(batch_bytes(batch), dtype=np.uint8)
        ref = write_batch(batch, buf)
        assert ref is not None
        host = read_host_batch(ref, buf)
        assert isinstance(host, HostBatch) and np.shares_memory(host.item.values, buf)
        assert_same_batch(host.to_batch(), read_batch(ref, buf))
    user, item, seq, index = ref
    weights = ("torch.bfloat16", item[3][1], item[3][2])
    assert read_host_batch((user, (*item[:5], weights), seq, index), buf) is None
