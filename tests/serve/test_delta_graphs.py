"""A delta keeps the CUDA graphs: the new model gets the served model's buckets and captures its
own graphs over its own tables before the swap (serve.delta, serve.graphs). The CPU tests check
the hand-over and the refusals; the GPU ones the replay after a delta. On the GPU machine:
``pytest -m gpu tests/serve/test_delta_graphs.py``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from serve.delta import apply_delta
from serve.graphs import Bucket, CudaGraphs
from serve.model import STAGES, LoadedModel, synthetic_batch
from shared.delta import DeltaError
from shared.dense_inputs import Signature
from tests.conftest import SEED_CONFIG
from train.tools.delta import export_delta

BUCKETS = (Bucket(64, 64, 8), Bucket(1024, 1024, 64))
ATOL = 1e-6
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def delta_dir(dyn_run, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("delta_graphs") / "step-8"
    export_delta(SEED_CONFIG, base=dyn_run.base_bundle, checkpoint=dyn_run.checkpoint, out=out)
    return out


def test_a_delta_model_gets_the_graph_buckets_and_tables_of_its_own(
    dyn_run, delta_dir: Path
) -> None:
    base = LoadedModel.load(dyn_run.base_bundle, device="cpu", graph_buckets=BUCKETS)
    applied = apply_delta(base, delta_dir, in_place=False)
    model, delta = applied.model, applied.delta
    assert delta.program_signature is model.program.signature is Signature.PAIRS
    assert model.graph_buckets == base.graph_buckets == BUCKETS
    assert model.tables is not base.tables and model.program is not base.program
    assert model.graphs is None  # on the CPU: eager, as the base
    assert set(model.startup.as_dict()) == set(STAGES) and model.startup.graphs == 0.0


def test_a_delta_whose_program_contradicts_its_version_is_refused(
    dyn_run, delta_dir: Path, tmp_path: Path
) -> None:
    """format_version 1 says 'no pair inputs': a pair program under it is a broken delta."""
    bad = tmp_path / "mislabelled"
    shutil.copytree(delta_dir, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**manifest, "format_version": 1}))
    base = LoadedModel.load(dyn_run.base_bundle, device="cpu")
    with pytest.raises(
        DeltaError, match=r"'pair_segment', 'pair_element'\], but the manifest's format_version 1"
    ):
        apply_delta(base, bad, in_place=False)


def test_graphs_do_not_replay_over_replaced_tables(dyn_run, delta_dir: Path) -> None:
    """Graphs read the tensors they were captured with: a model whose tables were swapped
    under them runs eagerly (CPU: the check before any bucket is looked at)."""
    base = LoadedModel.load(dyn_run.base_bundle, device="cpu")
    other = apply_delta(base, delta_dir, in_place=False).model
    batch = synthetic_batch(base.fs, 1, 4, (3,))
    keys = [tuple(k.keys()) for k in (batch.user, batch.item, batch.sequence)]
    graphs = CudaGraphs(base, keys)
    base.tables = other.tables
    assert graphs.predict(batch) is None
    assert graphs.stats.eager == {"tables or program replaced": 1}


@pytest.mark.gpu
@cuda
def test_graphs_replay_after_a_delta(dyn_run, delta_dir: Path) -> None:
    """The delta model captures every bucket over its new tables: its replays equal its eager
    scores, and the base's graphs (still serving until the swap) still give the base's."""
    base = LoadedModel.load(dyn_run.base_bundle, device="cuda", graph_buckets=BUCKETS)
    model = apply_delta(base, delta_dir, in_place=False).model
    stats = model.graph_stats()
    assert stats is not None and stats.captures == len(BUCKETS) and stats.failures == {}
    assert model.startup.graphs > 0 and stats.memory_reserved_bytes >= 0
    base_eager = LoadedModel.load(dyn_run.base_bundle, device="cuda")
    new_eager = apply_delta(base_eager, delta_dir, in_place=False).model
    for users, cands, lengths in ((1, 8, (5,)), (4, 60, (3, 0, 12, 7))):
        batch = synthetic_batch(model.fs, users, cands, lengths)
        batch.sequence.values().random_(0, 1000)  # dynamic tables: rows the delta may change
        got, want = model.predict(batch), new_eager.predict(batch)
        assert float((got - want).abs().max()) <= ATOL
        old, old_want = base.predict(batch), base_eager.predict(batch)
        assert float((old - old_want).abs().max()) <= ATOL
    assert stats.replays == 2 and stats.eager == {}
    base_stats = base.graph_stats()
    assert base_stats is not None and base_stats.replays == 2
