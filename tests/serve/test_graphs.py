"""CUDA graph replay of a batch (serve.graphs) gives the eager scores; run on the GPU machine:
``pytest -m gpu tests/serve/test_graphs.py``."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pytest
import torch

from protos import predict_pb2_grpc
from serve.batcher import BatcherConfig
from serve.graphs import Bucket, scores
from serve.host_batch import HostBatch
from serve.limits import Limits
from serve.model import LoadedModel, synthetic_batch
from serve.offline import score_rows, score_table
from serve.server import PredictionServer, ServerConfig
from shared.batch import Batch
from shared.features import FeatureSet
from shared.fg import table_to_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BUCKETS = (Bucket(4, 4, 1), Bucket(64, 64, 8), Bucket(1024, 1024, 64), Bucket(8192, 8192, 512))
ATOL = 1e-6


@pytest.fixture(scope="module")
def graphed(din_bundles: tuple[Path, Path]) -> LoadedModel:
    model = LoadedModel.load(din_bundles[1], device="cuda", graph_buckets=BUCKETS)
    assert model.graphs is not None
    return model


@pytest.fixture(scope="module")
def eager(din_bundles: tuple[Path, Path]) -> LoadedModel:
    model = LoadedModel.load(din_bundles[1], device="cuda")
    assert model.graphs is None
    return model


def _no_labels(batch: Batch) -> Batch:
    return Batch(batch.user, batch.item, batch.sequence, batch.user_index)


def _bucket_of(model: LoadedModel, batch: Batch) -> Bucket | None:
    assert model.graphs is not None
    return model.graphs.bucket_for(batch)


def test_every_bucket_is_captured(graphed: LoadedModel) -> None:
    stats = graphed.graph_stats()
    assert stats is not None
    assert stats.failures == {}
    assert stats.captures == len(BUCKETS)
    assert graphed.graphs is not None and graphed.graphs.buckets == sorted(BUCKETS)


# (users, candidates, sequence lengths) → the bucket it must replay in
CASES = [
    pytest.param(1, 1, (0,), Bucket(4, 4, 1), id="B=1,empty"),
    pytest.param(1, 1, (4,), Bucket(4, 4, 1), id="B=1,full"),
    pytest.param(1, 8, (8,), Bucket(64, 64, 8), id="U=1,B=8"),
    pytest.param(5, 20, (0, 3, 1, 9, 2), Bucket(1024, 1024, 64), id="U=5,B=20"),
    pytest.param(1, 64, (16,), Bucket(1024, 1024, 64), id="U=1,B=64,N=1024"),
    pytest.param(40, 500, (0, 5, 17, 1, 20), Bucket(8192, 8192, 512), id="largest"),
]


@pytest.mark.parametrize(("users", "candidates", "lengths", "bucket"), CASES)
def test_replay_equals_eager(
    graphed: LoadedModel,
    eager: LoadedModel,
    fs: FeatureSet,
    users: int,
    candidates: int,
    lengths: tuple[int, ...],
    bucket: Bucket,
) -> None:
    batch = synthetic_batch(fs, users, candidates, lengths)
    assert _bucket_of(graphed, batch) == bucket
    stats = graphed.graph_stats()
    assert stats is not None
    before = stats.replays
    got = graphed.predict(batch)
    assert stats.replays == before + 1
    assert got.shape == (candidates,) and got.device.type == "cpu"
    want = eager.predict(batch)
    assert float((got - want).abs().max()) <= ATOL


def test_replay_of_request_rows_equals_eager_and_counts_the_same(
    graphed: LoadedModel, eager: LoadedModel, table: pa.Table
) -> None:
    """Real rows (missing values, empty sequences, hits and misses), untiled and tiled; the
    table statistics count the real ids only."""
    batch = _no_labels(table_to_batch(graphed.fs, table))
    assert _bucket_of(graphed, batch) is not None
    graphed.tables.reset_stats()
    eager.tables.reset_stats()
    timings: dict[str, float] = {}
    got = graphed.predict(batch, timings=timings)
    assert set(timings) == {"h2d", "compute", "sync"}
    want = eager.predict(batch)
    assert float((got - want).abs().max()) <= ATOL
    assert graphed.table_stats() == eager.table_stats()
    assert sum(s.hits + s.misses for s in graphed.table_stats()) > 0
    tiled_g = score_table(graphed, table, tiled=True)
    tiled_e = score_table(eager, table, tiled=True)
    np.testing.assert_allclose(tiled_g, tiled_e, rtol=0, atol=ATOL)


def test_host_batches_back_to_back_equal_eager(
    graphed: LoadedModel, eager: LoadedModel, fs: FeatureSet
) -> None:
    """Handed-off requests merged on the host (serve.host_batch) replay in every bucket, back to
    back in a mixed order (a bucket's slots are padded again only where the last batch wrote),
    with the scores of the same batch run eagerly; one that fits no bucket runs eagerly."""
    shapes = [(1, 1, (0,)), (1, 8, (8,)), (5, 20, (0, 3, 1, 9, 2)), (40, 500, (0, 5, 17, 1, 20))]
    shapes += [(1, 1, (4,)), (2, 9000, (3, 0)), (1, 64, (16,)), (1, 3, (2,))]
    stats = graphed.graph_stats()
    assert stats is not None
    replays = stats.replays
    for users, candidates, lengths in [*shapes, *reversed(shapes), *shapes]:
        parts = [synthetic_batch(fs, users, candidates, lengths)]
        if candidates < 20:  # two requests merged
            parts.append(synthetic_batch(fs, 1, candidates, lengths[:1]))
        host = HostBatch.concat([HostBatch.of(p) for p in parts])
        batch = host.to_batch()
        got = graphed.predict(host)
        assert got.shape == (host.batch_size,)
        assert float((got - eager.predict(batch)).abs().max()) <= ATOL, (users, candidates)
    assert stats.replays - replays == 3 * (len(shapes) - 1)  # 9000 candidates: eagerly


def test_batches_started_back_to_back_equal_eager(
    graphed: LoadedModel, eager: LoadedModel, fs: FeatureSet, table: pa.Table
) -> None:
    """Batches started without waiting for the ones before (LoadedModel.start, as the batcher
    does, here more than two at once), through the same bucket and different ones (whose
    graphs share one memory pool), real rows and synthetic ones, one that runs eagerly among
    them: each batch gets its own eager scores."""
    rows = [table, table.slice(0, 7), table.slice(7, 20), table.slice(3, 1)]
    real = [_no_labels(table_to_batch(graphed.fs, t)) for t in rows]
    shapes = [(5, 20, (0, 3, 1, 9, 2)), (1, 64, (16,)), (40, 500, (0, 5, 17, 1, 20))]
    shapes += [(10, 300, (0, 1, 2, 3, 4)), (1, 1, (0,)), (1, 8, (8,)), (2, 9000, (3, 0))]
    synthetic = [synthetic_batch(fs, u, c, lens) for u, c, lens in shapes]
    batches = [real[0], *synthetic[:2], real[1], *synthetic[2:5], real[2], *synthetic[5:]]
    batches += [real[3], real[0], synthetic[0]]
    buckets = [_bucket_of(graphed, b) for b in batches]
    graphed_buckets = [b for b in buckets if b is not None]
    assert len(set(graphed_buckets)) >= 3 and len(set(graphed_buckets)) < len(graphed_buckets)
    assert None in buckets  # 9000 candidates: eagerly, between started batches
    stats = graphed.graph_stats()
    assert stats is not None
    replays = stats.replays
    pendings = [graphed.start(b) for b in batches]  # no waiting in between
    got = [p.result() for p in pendings]
    assert stats.replays - replays == len(graphed_buckets)
    for batch, scores_, bucket in zip(batches, got, buckets, strict=True):
        assert scores_.shape == (batch.batch_size,) and scores_.device.type == "cpu"
        assert float((scores_ - eager.predict(batch)).abs().max()) <= ATOL, bucket


def test_shape_outside_the_buckets_runs_eagerly(
    graphed: LoadedModel, eager: LoadedModel, fs: FeatureSet
) -> None:
    batch = synthetic_batch(fs, 2, 9000, (3, 0))  # more candidates than the largest bucket
    assert _bucket_of(graphed, batch) is None
    stats = graphed.graph_stats()
    assert stats is not None
    eager_before, replays = stats.eager.get("no bucket fits", 0), stats.replays
    got = graphed.predict(batch)
    assert stats.eager["no bucket fits"] == eager_before + 1 and stats.replays == replays
    assert float((got - eager.predict(batch)).abs().max()) <= ATOL
    many_pairs = synthetic_batch(fs, 1, 100, (100,))  # 10,000 pairs > 8192
    assert _bucket_of(graphed, many_pairs) is None
    assert float((graphed.predict(many_pairs) - eager.predict(many_pairs)).abs().max()) <= ATOL


def test_a_bucket_replays_batches_of_every_size_in_it(
    graphed: LoadedModel, eager: LoadedModel, fs: FeatureSet
) -> None:
    """One graph, batches of decreasing size: nothing of a larger batch leaks into a smaller."""
    for candidates in (500, 300, 100, 300):
        batch = synthetic_batch(fs, 10, candidates, (0, 1, 2, 3, 4))
        assert _bucket_of(graphed, batch) == Bucket(8192, 8192, 512)
        got, want = graphed.predict(batch), eager.predict(batch)
        assert float((got - want).abs().max()) <= ATOL


def test_lookups_and_pair_program_do_not_sync(eager: LoadedModel, fs: FeatureSet) -> None:
    """What the graphs hold runs without a host sync (and so can be captured)."""
    batch = synthetic_batch(fs, 3, 12, (0, 5, 2))
    on_device, pairs = eager._inputs_to_device(batch)
    assert pairs is not None
    with torch.inference_mode():
        scores(eager, on_device, pairs)  # plans and allocator blocks made
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = scores(eager, on_device, pairs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (12,) and out.is_cuda


def test_format_2_bundle_on_cuda_runs_eagerly(din_bundles: tuple[Path, Path], fs) -> None:
    """A program without the pair inputs cannot be captured: no graphs, the same scores."""
    old = LoadedModel.load(din_bundles[0], device="cuda", graph_buckets=BUCKETS)
    new = LoadedModel.load(din_bundles[1], device="cuda", graph_buckets=BUCKETS)
    assert old.graphs is None and new.graphs is not None
    batch = synthetic_batch(fs, 3, 30, (4, 0, 9))
    assert float((old.predict(batch) - new.predict(batch)).abs().max()) <= ATOL


def test_server_with_graphs_answers_like_the_offline_scorer(
    din_bundles: tuple[Path, Path], table: pa.Table, requests: list
) -> None:
    f3 = din_bundles[1]
    flat = score_rows(f3, table, tiled=False)
    config = ServerConfig(
        bundle=f3,
        device="cuda",
        batching=BatcherConfig(max_batch_rows=64),
        limits=Limits(max_candidates=64),
    )
    srv = PredictionServer(config).start()
    try:
        assert srv.wait_ready(300), srv.load_error
        model = srv.manager.current
        assert model is not None and model.graphs is not None
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = predict_pb2_grpc.PredictionServiceStub(channel)
            got = np.concatenate([stub.Predict(r, timeout=30).probabilities for r in requests])
        stats = model.graph_stats()
        assert stats is not None and stats.replays > 0 and stats.failures == {}
    finally:
        srv.stop(grace=0)
    np.testing.assert_allclose(got, flat, rtol=1e-5, atol=1e-6)


def test_a_retired_model_is_freed_without_a_collection(din_bundles: tuple[Path, Path]) -> None:
    """A model and its graphs refer to each other; retiring it (serve.versions, after a swap)
    breaks that, so the last reference frees it (and its graphs) at once, not at a garbage
    collection in the middle of some request."""
    import gc
    import weakref

    model = LoadedModel.load(din_bundles[1], device="cuda", graph_buckets=BUCKETS[:2])
    assert model.graphs is not None
    refs = weakref.ref(model), weakref.ref(model.graphs)
    gc.disable()
    try:
        model.retire()
        del model
        assert refs[0]() is None and refs[1]() is None
    finally:
        gc.enable()


def test_two_models_graphs_replayed_at_once_keep_their_scores(
    din_bundles: tuple[Path, Path],
) -> None:
    """The served version's graphs replay on its stream while the next version's check and
    warm-up replay on the load stream: each model's graphs are captured on a capture stream of
    its own (shared.cuda_capture.capture_streams), so their GEMMs do not share the cuBLAS
    workspace torch keys by (thread, stream) (pytorch#193402), and every replay of the one
    gives its scores while the other's replay beside it. Two loads of the format 3 bundle (a
    format 2 bundle's program reads its pair count back: it has no graphs), replaying buckets
    of other sizes, so that their GEMMs' partial sums differ."""
    a = LoadedModel.load(din_bundles[1], device="cuda", graph_buckets=BUCKETS)
    b = LoadedModel.load(din_bundles[1], device="cuda", graph_buckets=BUCKETS)
    assert a.graphs is not None and b.graphs is not None
    assert int(a.graphs._stream.cuda_stream) != int(b.graphs._stream.cuda_stream)
    # the largest bucket (the most GEMMs) beside the next one
    ga, gb = a.graphs.graphs[-1], b.graphs.graphs[-2]
    assert ga.out is not None
    ga.launch()
    torch.cuda.synchronize()
    want = ga.out.clone()
    served, loading = torch.cuda.Stream(), torch.cuda.Stream()
    got = []
    with torch.inference_mode():
        for _ in range(50):
            with torch.cuda.stream(loading):
                gb.launch()
            with torch.cuda.stream(served):
                ga.launch()
                got.append(ga.out.clone())
    torch.cuda.synchronize()
    for out in got:
        torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
