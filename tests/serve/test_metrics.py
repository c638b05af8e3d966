"""The server's metrics of the current model's CUDA graphs (serve.metrics): what a scrape shows.
On the CPU the graphs are a :class:`serve.graphs.CudaGraphs` without captures (its counters
work the same); their replays need CUDA (tests/serve/test_graphs.py)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from serve.graphs import CudaGraphs
from serve.metrics import ServingMetrics
from serve.model import LoadedModel, synthetic_batch


def test_graph_stats_are_scraped_from_the_current_model(din_bundles: tuple[Path, Path]) -> None:
    model = LoadedModel.load(din_bundles[1], device="cpu", warmup_rounds=0)
    metrics = ServingMetrics(lambda: model)
    text = generate_latest(metrics.registry).decode()
    assert "dynrec_serving_graph_" not in text  # no graphs: no graph metrics
    batch = synthetic_batch(model.fs, 1, 4, (3,))
    model.graphs = CudaGraphs(
        model, [tuple(k.keys()) for k in (batch.user, batch.item, batch.sequence)]
    )
    assert model.predict(batch).shape == (4,)  # no bucket: eager, counted
    text = generate_latest(metrics.registry).decode()
    assert 'dynrec_serving_graph_eager_batches_total{reason="no bucket fits"} 1.0' in text
    assert "dynrec_serving_graph_replays_total 0.0" in text
    assert "dynrec_serving_graph_captures 0.0" in text
    assert 'dynrec_serving_graph_memory_bytes{kind="reserved"} 0.0' in text
