"""The serving path on CUDA gives the CPU scores (run on the GPU machine: ``pytest -m gpu``)."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pytest
import torch

from protos import predict_pb2_grpc
from serve.model import LoadedModel
from serve.offline import score_rows, score_table
from serve.server import PredictionServer, ServerConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("which", ["seed", "mixed dims"])
def test_cuda_scores_and_lookups_match_cpu(
    which: str, bundle_v1: Path, bundle_mixed: Path, table: pa.Table
) -> None:
    bundle = bundle_v1 if which == "seed" else bundle_mixed
    cpu = LoadedModel.load(bundle, device="cpu")
    gpu = LoadedModel.load(bundle, device="cuda")
    assert gpu.device.type == "cuda"
    want = score_table(cpu, table, tiled=False)
    np.testing.assert_allclose(score_table(gpu, table, tiled=False), want, rtol=1e-5, atol=1e-6)
    counts = [(s.name, s.hits, s.misses) for s in gpu.table_stats()]
    assert counts == [(s.name, s.hits, s.misses) for s in cpu.table_stats()]
    np.testing.assert_allclose(score_table(gpu, table, tiled=True), want, rtol=1e-5, atol=1e-6)


def test_server_on_cuda_answers_like_the_offline_scorer(
    bundle_v1: Path, table, groups, requests
) -> None:
    flat = score_rows(bundle_v1, table, tiled=False)
    srv = PredictionServer(ServerConfig(bundle=bundle_v1, device="cuda")).start()
    try:
        assert srv.wait_ready(120), srv.load_error
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = predict_pb2_grpc.PredictionServiceStub(channel)
            got = np.concatenate([stub.Predict(r, timeout=30).probabilities for r in requests])
    finally:
        srv.stop(grace=0)
    np.testing.assert_allclose(got, flat, rtol=1e-5, atol=1e-6)


def test_packed_transfer_to_cuda_keeps_every_tensor(bundle_v1: Path, table: pa.Table) -> None:
    from serve.model import batch_to_device
    from shared.fg import table_to_batch

    batch = table_to_batch(LoadedModel.load(bundle_v1, device="cpu").fs, table)
    batch = type(batch)(batch.user, batch.item, batch.sequence, batch.user_index)  # no labels
    moved = batch_to_device(batch, torch.device("cuda"))
    for x, y in (
        (batch.user, moved.user),
        (batch.item, moved.item),
        (batch.sequence, moved.sequence),
    ):
        assert y.values().is_cuda and x.length_per_key() == y.length_per_key()
        assert torch.equal(x.values(), y.values().cpu()) and torch.equal(
            x.lengths(), y.lengths().cpu()
        )
        assert x.lengths().dtype == y.lengths().dtype
    assert torch.equal(batch.user_index, moved.user_index.cpu())


@pytest.mark.parametrize("which", ["seed", "mixed dims"])
def test_lookups_read_nothing_back_to_the_host(
    which: str, bundle_v1: Path, bundle_mixed: Path, table: pa.Table
) -> None:
    """One batch's lookups and input assembly on CUDA without a synchronizing call."""
    from shared.fg import table_to_batch

    model = LoadedModel.load(bundle_v1 if which == "seed" else bundle_mixed, device="cuda")
    batch = table_to_batch(model.fs, table)
    batch = type(batch)(batch.user, batch.item, batch.sequence, batch.user_index)  # no labels
    on_device = model.to_device(batch)
    with torch.inference_mode():
        model.tables.embed(on_device)  # this key order's plan made (host tensors copied over)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            inputs = model.tables.embed(on_device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert all(t.is_cuda for t in inputs.values())
