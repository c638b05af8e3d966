"""The padding of serve.graphs on the CPU: a batch padded into a bucket's buffers scores its real
rows as the batch itself does, and the padding ids stay out of the table statistics. (Capture
and replay need CUDA: tests/serve/test_graphs.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from serve.graphs import (
    DEFAULT_PAIR_RATIOS,
    MIN_FREE_MEMORY_FRACTION,
    Bucket,
    BucketGraph,
    CudaGraphs,
    default_buckets,
    scores,
)
from serve.host_batch import HostBatch
from serve.model import LoadedModel, synthetic_batch
from shared.batch import Batch
from shared.dense_inputs import pair_index
from shared.features import FeatureSet
from shared.fg import table_to_batch


@pytest.fixture(scope="module")
def model(din_bundles: tuple[Path, Path]) -> LoadedModel:
    return LoadedModel.load(din_bundles[1], device="cpu", warmup_rounds=0)


def _keys(batch: Batch) -> list[tuple[str, ...]]:
    return [tuple(k.keys()) for k in (batch.user, batch.item, batch.sequence)]


def _padded_scores(model: LoadedModel, batch: Batch, bucket: Bucket) -> torch.Tensor:
    graph = BucketGraph(model, bucket, _keys(batch))
    graph.fill(batch)
    with torch.inference_mode():
        out = scores(model, graph.batch, graph.device_pairs())
    assert out.shape == (bucket.candidates + 1,)
    return out[: batch.batch_size]


def _no_labels(batch: Batch) -> Batch:
    return Batch(batch.user, batch.item, batch.sequence, batch.user_index)


@pytest.mark.parametrize(
    ("users", "candidates", "lengths", "bucket"),
    [
        (1, 1, (0,), Bucket(4, 4, 1)),  # B=1, empty sequence, the smallest bucket
        (1, 1, (3,), Bucket(64, 64, 8)),  # much padding everywhere
        (1, 9, (7,), Bucket(64, 64, 16)),  # one user, many candidates: N = 63
        (3, 5, (0, 4, 1), Bucket(16, 8, 5)),  # B = capacity, T = 5
        (4, 4, (0, 0, 0, 0), Bucket(4, 4, 4)),  # only empty sequences: N = 0
    ],
)
def test_padded_batch_scores_its_rows_unchanged(
    model: LoadedModel,
    fs: FeatureSet,
    users: int,
    candidates: int,
    lengths: tuple[int, ...],
    bucket: Bucket,
) -> None:
    batch = synthetic_batch(fs, users, candidates, lengths)
    got = _padded_scores(model, batch, bucket)
    torch.testing.assert_close(got, model.predict(batch), rtol=0, atol=1e-6)


def test_padded_request_rows_and_statistics(model: LoadedModel, table: pa.Table) -> None:
    """Real rows (missing values, empty sequences, hits and misses): the same scores, and after
    discounting the padding, the same hit and miss counts as the batch run as it is."""
    batch = _no_labels(table_to_batch(model.fs, table))
    model.tables.reset_stats()
    want = model.predict(batch)
    eager = model.table_stats()
    model.tables.reset_stats()
    graph = BucketGraph(model, Bucket(2048, 2048, 64), _keys(batch))
    padding = graph.fill(batch)
    assert sum(padding.values()) > 0
    with torch.inference_mode():
        got = scores(model, graph.batch, graph.device_pairs())[: batch.batch_size]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert model.table_stats() != eager  # the padding ids were looked up ...
    model.tables.discount_padding(padding)
    assert model.table_stats() == eager  # ... and are left out


def test_a_bucket_is_reused_for_smaller_batches(model: LoadedModel, fs: FeatureSet) -> None:
    """Stale data of a larger batch in the buffers does not leak into a smaller one."""
    big, small = synthetic_batch(fs, 4, 12, (5, 0, 9, 2)), synthetic_batch(fs, 1, 2, (3,))
    bucket = Bucket(256, 64, 16)
    graph = BucketGraph(model, bucket, _keys(big))
    for batch in (big, small, big):
        graph.fill(batch)
        with torch.inference_mode():
            got = scores(model, graph.batch, graph.device_pairs())[: batch.batch_size]
        torch.testing.assert_close(got, model.predict(batch), rtol=0, atol=1e-6)


def test_bucket_fit_and_choice(model: LoadedModel, fs: FeatureSet) -> None:
    keys = _keys(synthetic_batch(fs, 1, 1, (0,)))
    graphs = CudaGraphs(model, keys)  # on the CPU: its buckets, without captures
    graphs.graphs = [BucketGraph(model, b, keys) for b in sorted(default_buckets(8, (4, 16)))]
    small = graphs._smallest_fit(1, 1, 3, 3, [[1], [1], [3]])
    assert small is not None and small.bucket == Bucket(4, 4, 1)
    one_user = graphs._smallest_fit(8, 1, 10, 80, [[1], [8], [10]])
    assert one_user is not None and one_user.bucket == Bucket(128, 128, 8)
    assert graphs._smallest_fit(9, 1, 1, 9, [[1], [9], [1]]) is None  # more candidates
    assert graphs._smallest_fit(8, 8, 200, 200, [[1], [8], [25]]) is None  # more pairs
    assert graphs._smallest_fit(2, 1, 1, 2, [[10], [1], [1]]) is None  # 10 ids of a user key
    assert graphs.bucket_for(synthetic_batch(fs, 1, 8, (10,))) == Bucket(128, 128, 8)
    assert graphs.bucket_for(synthetic_batch(fs, 1, 8, (20,))) is None  # 160 pairs


def test_captures_stop_when_the_gpu_runs_short_of_memory(
    model: LoadedModel, fs: FeatureSet
) -> None:
    """Cheapest first; once less than MIN_FREE_MEMORY_FRACTION is free, the rest are skipped
    (with why) and never captured."""
    graphs = CudaGraphs(model, _keys(synthetic_batch(fs, 1, 1, (0,))))
    buckets = sorted(default_buckets(8, (4, 16)))
    total = 100 << 30
    free = iter([total, total // 2, int(total * MIN_FREE_MEMORY_FRACTION) - 1, total])
    captured: list[Bucket] = []
    graphs.capture_while_room(buckets, captured.append, lambda: (next(free), total))
    assert captured == buckets[:2]
    assert list(graphs.stats.skipped) == [str(b) for b in buckets[2:]]
    assert "GiB free, under 25%" in graphs.stats.skipped[str(buckets[2])]
    roomy = CudaGraphs(model, graphs.keys)
    everything: list[Bucket] = []
    roomy.capture_while_room(buckets, everything.append, lambda: (total, total))
    assert everything == buckets and not roomy.stats.skipped


def test_batches_that_run_eagerly_are_counted(model: LoadedModel, table: pa.Table) -> None:
    graphs = CudaGraphs(model, [("x",), ("y",), ("z",)])
    batch = table_to_batch(model.fs, table)
    assert graphs.predict(batch) is None
    assert graphs.stats.eager == {"key order": 1}
    graphs = CudaGraphs(model, _keys(batch))
    assert graphs.predict(batch) is None  # labels
    assert graphs.predict(_no_labels(batch)) is None  # no buckets
    assert graphs.stats.eager == {"labels or weights": 1, "no bucket fits": 1}
    assert graphs.stats.as_dict()["replays"] == 0


def test_default_buckets() -> None:
    buckets = default_buckets(1000)
    assert buckets == tuple(sorted(buckets))
    assert Bucket(8, 8, 1) in buckets and Bucket(1024 * 128, 1024 * 128, 1024) in buckets
    assert max(b.candidates for b in buckets) == 1024
    assert len(buckets) == 11 * len(DEFAULT_PAIR_RATIOS)  # 1 to 1024 candidates
    assert len(default_buckets(8192)) == 42  # the server's default on CUDA (--max-batch-rows)
    assert all(b.pairs <= 1 << 20 for b in default_buckets(1 << 14))
    with pytest.raises(ValueError, match="must be >= 1"):
        Bucket(0, 1, 1)


def test_graphs_need_cuda_and_the_pairs(model: LoadedModel) -> None:
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        CudaGraphs.capture(model, [Bucket(4, 4, 1)])


def test_graph_buckets_on_the_cpu_mean_eager(din_bundles: tuple[Path, Path], fs) -> None:
    model = LoadedModel.load(din_bundles[1], device="cpu", graph_buckets=[Bucket(4, 4, 1)])
    assert model.graphs is None and model.graph_stats() is None
    assert model.predict(synthetic_batch(fs, 1, 1, (2,))).shape == (1,)


def test_serving_path_batches_fit_and_score_unchanged(
    model: LoadedModel, fs: FeatureSet, requests: list
) -> None:
    """Batches as the server makes them (requests, row and columnar, concatenated by the
    batcher) have the key order the graphs are captured for, and pad without a change."""
    from serve.batcher import concat_batches
    from serve.limits import Limits
    from serve.validation import request_inputs
    from shared.fg_request import request_columns_to_batch
    from tests.serve.conftest import to_columnar

    parts = [
        request_columns_to_batch(fs, **vars(request_inputs(r, fs, Limits())))
        for r in [*requests, *(to_columnar(fs, r) for r in requests)]
    ]
    batch = concat_batches(parts)
    keys = _keys(synthetic_batch(fs, 1, 1, (0,)))
    graphs = CudaGraphs(model, keys)
    bucket = Bucket(4096, 4096, 256)
    graphs.graphs = [BucketGraph(model, bucket, keys)]
    assert graphs.bucket_for(batch) == bucket
    got = _padded_scores(model, batch, bucket)
    torch.testing.assert_close(got, model.predict(batch), rtol=0, atol=1e-6)


def _slots(graph: BucketGraph) -> list[np.ndarray]:
    return [v.copy() for v in graph.buffers.views]


def test_a_reused_bucket_holds_what_a_fresh_one_does(model: LoadedModel, fs: FeatureSet) -> None:
    """A fill pads again only what the last fill wrote beyond its own data: after any sequence of
    batches, the slots are those a fresh bucket filled with the last batch has, bit for bit."""
    batches = [
        synthetic_batch(fs, 4, 12, (5, 0, 9, 2)),
        synthetic_batch(fs, 1, 2, (3,)),
        synthetic_batch(fs, 1, 1, (0,)),
        synthetic_batch(fs, 3, 16, (12, 1, 7)),
        synthetic_batch(fs, 2, 5, (0, 0)),
    ]
    bucket = Bucket(256, 64, 16)
    keys = _keys(batches[0])
    reused = BucketGraph(model, bucket, keys)
    rng = np.random.default_rng(0)
    for i in [*range(len(batches)), *rng.integers(0, len(batches), 12)]:
        batch = batches[i]
        padding = reused.fill(HostBatch.of(batch))
        fresh = BucketGraph(model, bucket, keys)
        assert fresh.fill(batch) == padding
        for got, want in zip(_slots(reused), _slots(fresh), strict=True):
            np.testing.assert_array_equal(got, want)
    with torch.inference_mode():
        got = scores(model, reused.batch, reused.device_pairs())[: batch.batch_size]
    torch.testing.assert_close(got, model.predict(batch), rtol=0, atol=1e-6)


def test_host_batches_fill_as_their_kjt_batches(
    model: LoadedModel, fs: FeatureSet, requests: list
) -> None:
    """Requests merged on the host (serve.host_batch) pad into the same slots as the same
    requests merged as KJTs, and prepare/bucket_for treat both alike."""
    from serve.batcher import concat_batches
    from serve.limits import Limits
    from serve.validation import request_inputs
    from shared.fg_request import request_columns_to_batch

    parts = [
        request_columns_to_batch(fs, **vars(request_inputs(r, fs, Limits()))) for r in requests
    ]
    keys = _keys(synthetic_batch(fs, 1, 1, (0,)))
    graphs = CudaGraphs(model, keys)
    graphs.graphs = [BucketGraph(model, b, keys) for b in sorted(default_buckets(64, (32, 128)))]
    for n in (1, 3, len(parts)):
        kjt_batch = concat_batches(parts[:n])
        host = HostBatch.concat([HostBatch.of(p) for p in parts[:n]])
        bucket = graphs.bucket_for(kjt_batch)
        assert bucket is not None and graphs.bucket_for(host) == bucket
        via_kjt = graphs.prepare(kjt_batch)
        assert via_kjt is not None
        want = _slots(via_kjt)
        via_host = graphs.prepare(host)
        assert via_host is via_kjt and via_host.bucket == bucket
        for got, w in zip(_slots(via_host), want, strict=True):
            np.testing.assert_array_equal(got, w)
        with torch.inference_mode():
            got_scores = scores(model, via_host.batch, via_host.device_pairs())[: host.batch_size]
        torch.testing.assert_close(got_scores, model.predict(kjt_batch), rtol=0, atol=1e-6)
        torch.testing.assert_close(model.predict(host), model.predict(kjt_batch), rtol=0, atol=0)
    assert graphs.stats.eager == {}


# (users, candidates, sequence lengths) of synthetic batches: every key one id per row
_SYNTHETIC = [(4, 12, (5, 0, 9, 2)), (1, 2, (3,)), (1, 1, (0,)), (3, 16, (12, 1, 7))]


def _defined_slots(graph: BucketGraph, batch: HostBatch) -> list[np.ndarray]:
    """The slots of ``graph`` holding ``batch`` as the module docstring of serve.graphs defines
    them, built key by key: each key's ids then PAD_ID, real bags, the padding's bag in the first
    dummy row, empty bags after it; dummy candidates of the dummy user; the real rows."""
    from serve.lookup import PAD_ID

    out = []
    for kjt, shape in zip(batch.kjts, graph.shapes, strict=True):
        k, real = len(shape.keys), kjt.stride
        ids = np.full((k, shape.per_key), PAD_ID, np.int64)  # [K, cap]
        lens = np.zeros((k, shape.rows), np.int64)  # [K, rows]
        start = 0
        for key, n in enumerate(kjt.per_key):
            ids[key, :n] = kjt.values[start : start + n]
            lens[key, :real] = kjt.lengths[key * real : (key + 1) * real]
            lens[key, real] = shape.per_key - n
            start += n
        out += [ids.reshape(-1), lens.reshape(-1)]
    b = batch.batch_size
    user_index = np.full(graph.shapes[1].rows, batch.num_users, np.int64)  # [candidates + 1]
    user_index[:b] = batch.user_index
    return [*out, user_index, np.array([b], np.int64)]


def _defined_pairs(
    graph: BucketGraph, batch: HostBatch, sequence_key: str
) -> tuple[np.ndarray, np.ndarray]:
    """The pairs of a padded batch as the module docstring of serve.graphs defines them:
    pair_index's (of ``sequence_key``'s lengths), then the last dummy candidate's with element
    0, up to the bucket's pairs."""
    u = batch.num_users
    first = batch.sequence.keys.index(sequence_key)
    seg, elem = pair_index(batch.sequence.lengths[first * u : (first + 1) * u], batch.user_index)
    pair_seg = np.full(graph.bucket.pairs, graph.bucket.candidates, np.int64)  # [pairs]
    pair_elem = np.zeros(graph.bucket.pairs, np.int64)
    pair_seg[: seg.shape[0]], pair_elem[: elem.shape[0]] = seg, elem
    return pair_seg, pair_elem


def test_fills_hold_the_defined_slots_bit_for_bit(
    model: LoadedModel, fs: FeatureSet, requests: list
) -> None:
    """Request batches (keys with different numbers of ids) and synthetic ones (one id per row),
    alone and merged on the host, filled in turn into one bucket: after every fill its slots
    are the defined padding of that batch (dtypes and every bit), whatever the fill before, and
    the pairs the graph builds from them are the defined pairs."""
    from serve.limits import Limits
    from serve.validation import request_inputs
    from shared.fg_request import request_columns_to_batch

    parts = [
        HostBatch.of(request_columns_to_batch(fs, **vars(request_inputs(r, fs, Limits()))))
        for r in requests
    ]
    parts += [HostBatch.of(synthetic_batch(fs, u, b, t)) for u, b, t in _SYNTHETIC]
    batches = [*parts, HostBatch.concat(parts), HostBatch.concat(parts[::-2])]
    assert any(len(set(k.per_key)) > 1 for p in parts for k in p.kjts)  # ragged keys too
    keys = _keys(synthetic_batch(fs, 1, 1, (0,)))
    graph = BucketGraph(model, Bucket(4096, 512, 128), keys)
    rng = np.random.default_rng(1)
    for i in [*range(len(batches)), *rng.integers(0, len(batches), 20)]:
        batch = batches[i]
        graph.fill(batch)
        want = _defined_slots(graph, batch)
        for got, w in zip(graph.buffers.views, want, strict=True):
            assert got.dtype == w.dtype == np.int64
            np.testing.assert_array_equal(got, w)
        for got_pairs, want_pairs in zip(
            graph.device_pairs(),
            _defined_pairs(graph, batch, model.tables.layout.sequence[0]),
            strict=True,
        ):
            assert got_pairs.dtype == torch.int64
            np.testing.assert_array_equal(got_pairs.numpy(), want_pairs)
