"""The next version written into a replaced one's tensors (serve.spare): the same tensors and
the scores of a full load, the misfits that load in full, which models may be spares, and on
CUDA a hot swap through gRPC that captures no graph. The GPU tests run on the GPU machine:
``pytest -m gpu tests/serve/test_spare.py``."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

import serve.versions
from bench.synthetic_bundle import write_synthetic_bundle
from serve.delta import apply_delta
from serve.graphs import Bucket
from serve.model import LoadedModel, synthetic_batch
from serve.offline import score_rows
from serve.server import PredictionServer, ServerConfig
from serve.spare import Spare, adopt
from shared.features import FeatureSet
from tests.serve.conftest import (
    KEYS_PER_TABLE,
    export_tiny_program,
    make_din_bundle,
    predict_traffic,
)

ATOL = 1e-6
BUCKETS = (Bucket(64, 64, 8), Bucket(1024, 1024, 64))
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tensors(model: LoadedModel) -> list[int]:
    """data_ptr of every tensor the lookups, the program (and CUDA graphs) read."""
    out = [p.data_ptr() for p in model.program.module.state_dict().values()]  # type: ignore[attr-defined]
    for g in model.tables._groups:
        out.append(g.weight.data_ptr())
        if g.hash is not None:
            out += [g.hash.keys.data_ptr(), g.hash.values.data_ptr(), g.hash._live.data_ptr()]
    return out


def _max_diff(got: LoadedModel, want: LoadedModel) -> float:
    torch.manual_seed(0)
    diff = 0.0
    for users, cands, lengths in ((1, 8, (5,)), (4, 60, (3, 0, 12, 7))):
        batch = synthetic_batch(got.fs, users, cands, lengths)
        for kjt in (batch.user, batch.item, batch.sequence):  # dynamic ids: half of them hit
            offsets = kjt.offset_per_key()
            for k, key in enumerate(kjt.keys()):
                if got.fs.tables[got.fs.features[key].table].is_dynamic:
                    kjt.values()[offsets[k] : offsets[k + 1]].random_(0, 2 * KEYS_PER_TABLE)
        diff = max(diff, float((got.predict(batch) - want.predict(batch)).abs().max()))
    return diff


def _spare_of(path: Path, device: str = "cpu", **kw: object) -> tuple[Spare, LoadedModel]:
    model = LoadedModel.load(path, device=device, **kw)  # type: ignore[arg-type]
    spare = Spare()
    assert spare.offer(model, serving=None)
    return spare, model


def _adopt(spare: Spare, path: Path) -> LoadedModel | None:
    return adopt(spare, path, verify_checksums=True, warmup_candidates=10)


def test_a_version_written_into_the_spare_scores_as_loaded_in_full(
    bundle_v1: Path, bundle_v2: Path
) -> None:
    spare, old = _spare_of(bundle_v1)
    before = _tensors(old)
    model = _adopt(spare, bundle_v2)
    assert model is not None and model.version == "2" and model.path == bundle_v2
    assert _tensors(model) == before and not spare.ready  # its tensors, taken
    fresh = LoadedModel.load(bundle_v2, device="cpu")
    assert _max_diff(fresh, LoadedModel.load(bundle_v1, device="cpu")) > 1e-3  # versions differ
    assert _max_diff(model, fresh) <= ATOL
    assert old.superseded and _max_diff(old, fresh) <= ATOL  # a straggler gets the new scores
    assert model.deltas == () and model.base_bundle is model.bundle
    assert model.startup.graphs == 0.0 and model.startup.total > 0


def test_another_graph_loads_in_full_and_drops_the_spare(
    fs: FeatureSet, bundle_v1: Path, tmp_path: Path
) -> None:
    """Same tables, a program of another graph (wider hidden layer): nothing is written."""
    spare, old = _spare_of(bundle_v1)
    before = _max_diff(old, LoadedModel.load(bundle_v1, device="cpu"))
    wider = export_tiny_program(fs, tmp_path / "dense.pt2", seed=3, hidden=16)  # not 8
    keys = {t.name: KEYS_PER_TABLE for t in fs.dynamic_tables}
    other = write_synthetic_bundle(
        tmp_path / "3", fs, keys=keys, program_path=wider, version="3", seed=1
    )
    assert _adopt(spare, other) is None
    assert not spare.ready and old.graphs is None and not old.superseded
    assert _max_diff(old, LoadedModel.load(bundle_v1, device="cpu")) == before == 0.0


def test_more_keys_than_the_spare_has_room_for_load_in_full(
    fs: FeatureSet, bundle_v1: Path, tmp_path: Path
) -> None:
    spare, old = _spare_of(bundle_v1)
    program = export_tiny_program(fs, tmp_path / "dense.pt2", seed=1)  # the same graph
    keys = {t.name: 40 * KEYS_PER_TABLE for t in fs.dynamic_tables}  # beyond 10 % headroom
    big = write_synthetic_bundle(tmp_path / "4", fs, keys=keys, program_path=program, version="4")
    assert _adopt(spare, big) is None and not spare.ready and not old.superseded


def test_a_bundle_that_does_not_read_keeps_the_spare(bundle_v1: Path, tmp_path: Path) -> None:
    spare, old = _spare_of(bundle_v1)
    broken = tmp_path / "5"
    shutil.copytree(bundle_v1, broken)
    (broken / "manifest.json").write_text("{")
    with pytest.raises(Exception, match="manifest"):
        _adopt(spare, broken)
    assert spare.ready and spare.take() is old


def test_models_sharing_tensors_with_the_serving_one_are_not_kept(dyn_run, tmp_path: Path) -> None:
    """A model whose tables an in-place delta's successor serves is retired, not kept; a
    spare displaced by another is retired."""
    from tests.conftest import SEED_CONFIG
    from train.tools.delta import export_delta

    export_delta(SEED_CONFIG, base=dyn_run.base_bundle, checkpoint=dyn_run.checkpoint,
                 out=tmp_path / "d")  # fmt: skip
    base = LoadedModel.load(dyn_run.base_bundle, device="cpu")
    applied = apply_delta(base, tmp_path / "d")
    spare = Spare()
    assert not spare.offer(base, serving=applied.model)  # shares its tables
    first = LoadedModel.load(dyn_run.base_bundle, device="cpu")
    second = LoadedModel.load(dyn_run.full_bundle, device="cpu")
    assert spare.offer(first, serving=None) and spare.offer(second, serving=first)
    assert spare.take() is second and first.graphs is None
    spare.clear()
    assert not spare.ready


def test_a_model_with_deltas_applied_is_a_spare_for_the_next_full_version(
    dyn_run, tmp_path: Path
) -> None:
    """What ``train stream`` publishes: a base, deltas written into it in place (its program's
    weights too), then a full version. The last delta's model, once replaced, is the spare the
    full version is written into (here step-4 again, whose rows and weights the delta to
    step-8 changed): it scores as loaded in full."""
    from tests.conftest import SEED_CONFIG
    from train.tools.delta import export_delta

    export_delta(SEED_CONFIG, base=dyn_run.base_bundle, checkpoint=dyn_run.checkpoint,
                 out=tmp_path / "d")  # fmt: skip
    applied = apply_delta(LoadedModel.load(dyn_run.base_bundle, device="cpu"), tmp_path / "d")
    spare = Spare()
    assert applied.model.deltas and spare.offer(applied.model, serving=None)
    step4 = LoadedModel.load(dyn_run.base_bundle, device="cpu")
    assert _max_diff(applied.model, step4) > 1e-4
    model = _adopt(spare, dyn_run.base_bundle)
    assert model is not None and model.deltas == () and model.base_program is model.program
    assert _max_diff(model, step4) <= ATOL


def test_the_trained_versions_fit_each_other(dyn_run) -> None:
    """Two exports of one run (4 and 8 steps: new keys, new weights) share the graph."""
    spare, _ = _spare_of(dyn_run.base_bundle)
    model = _adopt(spare, dyn_run.full_bundle)
    assert model is not None
    assert _max_diff(model, LoadedModel.load(dyn_run.full_bundle, device="cpu")) <= ATOL


@pytest.mark.gpu
@cuda
def test_graphs_replay_over_a_version_written_into_the_spare(dyn_run) -> None:
    """CUDA: the spare's graphs serve the next version: no capture, replays = eager."""
    spare, old = _spare_of(dyn_run.base_bundle, "cuda", graph_buckets=BUCKETS)
    graphs = old.graphs
    assert graphs is not None and graphs.stats.captures == len(BUCKETS)
    model = _adopt(spare, dyn_run.full_bundle)
    assert model is not None and model.graphs is graphs and graphs.model is model
    assert graphs.stats.captures == len(BUCKETS) and old.graphs is None
    replays = graphs.stats.replays
    eager = LoadedModel.load(dyn_run.full_bundle, device="cuda")  # no graphs
    assert _max_diff(model, eager) <= ATOL
    assert graphs.stats.replays == replays + 2 and graphs.stats.eager == {}


@pytest.mark.gpu
@cuda
def test_a_hot_swap_on_cuda_writes_into_the_spare(
    dyn_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watched directory on CUDA: startup builds the spare, the swap to the next version
    writes into it (its graphs, no capture), and the replaced version becomes the spare."""
    monkeypatch.setattr(serve.versions, "RETIRE_AFTER_S", 0.2)
    models = tmp_path / "models"
    models.mkdir()
    shutil.copytree(dyn_run.base_bundle, models / "1")
    config = ServerConfig(model_dir=models, device="cuda", poll_interval_s=0.1)
    server = PredictionServer(config).start()
    try:
        assert server.wait_ready(120)
        first = server.manager.current
        assert first is not None and server.spare.ready
        spare = server.spare._model
        assert spare is not None and spare is not first and spare.graphs is not None
        graphs, tensors = spare.graphs, _tensors(spare)
        shutil.copytree(dyn_run.full_bundle, models / ".2.tmp")
        (models / ".2.tmp").rename(models / "2")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and server.manager.current is first:
            time.sleep(0.05)
        second = server.manager.current
        assert second is not None and second.path == models / "2" and second.graphs is graphs
        assert _tensors(second) == tensors
        eager = LoadedModel.load(dyn_run.full_bundle, device="cuda")
        assert _max_diff(second, eager) <= ATOL
        while time.monotonic() < deadline and server.spare._model is not first:
            time.sleep(0.05)
        assert server.spare._model is first  # retired into the spare
        paths = server.metrics.load_paths
        assert paths.labels("full")._value.get() == 1 and paths.labels("spare")._value.get() == 1
    finally:
        server.stop()
    assert not server.spare.ready


@pytest.mark.gpu
@cuda
def test_a_swap_under_traffic_on_cuda_loses_no_request(
    fs: FeatureSet,
    table: pa.Table,
    groups: list,
    requests: list,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As deployed: CUDA graphs, the spare and frontends. Clients send requests while the next
    version is installed; every request is answered OK, by one version or the other, with that
    version's offline scores, and the swap wrote into the spare (no capture)."""
    caplog.set_level(logging.INFO, logger="serve")  # loads, swaps, retirements: in a failure
    monkeypatch.setattr(serve.versions, "RETIRE_AFTER_S", 0.2)
    bundles = [
        make_din_bundle(tmp_path, fs, v, pairs=True, seed=s) for v, s in (("1", 0), ("2", 1))
    ]
    bounds = np.cumsum([0] + [len(g) for g in groups])
    expected = {}
    for bundle in bundles:
        flat = score_rows(bundle, table, tiled=False)
        expected[bundle.name] = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert not np.allclose(expected["1"][0], expected["2"][0], atol=1e-3)  # versions differ
    models = tmp_path / "models"
    models.mkdir()
    shutil.copytree(bundles[0], models / "1")
    config = ServerConfig(model_dir=models, device="cuda", poll_interval_s=0.1, frontends=2)
    server = PredictionServer(config).start()
    try:
        assert server.wait_ready(120), server.load_error
        with predict_traffic(server.port, requests) as traffic:
            time.sleep(0.5)
            shutil.copytree(bundles[1], models / ".2.tmp")
            (models / ".2.tmp").rename(models / "2")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not any(
                v == "2" for _, v, _ in traffic.results[-20:]
            ):
                time.sleep(0.05)
            time.sleep(0.5)  # traffic on the new version too
        spare_loads = server.metrics.load_paths.labels("spare")._value.get()
    finally:
        server.stop()
    assert not traffic.errors, traffic.errors[:3]
    versions = [v for _, v, _ in traffic.results]
    assert versions[0] == "1" and versions[-1] == "2"
    # every answer has its version's offline scores; a wrong one is reported as (answer number,
    # request, version said, the version whose scores it has: None = neither, the largest
    # difference to the said version's), beside the number of the first answer of version 2
    # (on the H200 on 2026-12-07 three answers of version 1 just before the first of version 2
    # had neither's scores, in both runs of the whole GPU suite and in neither of two runs of
    # this test alone; the likely cause, both versions' graphs captured on one stream and so
    # writing one cuBLAS workspace while the spare's check replayed beside the served version,
    # is mended since: shared.cuda_capture.capture_streams. The difference tells a race, whole
    # scores off, from a tolerance, 1e-5s)
    wrong = []
    for n, (i, v, probs) in enumerate(traffic.results):
        if not np.allclose(probs, expected[v][i], rtol=1e-5, atol=1e-5):
            has = [o for o in expected if np.allclose(probs, expected[o][i], atol=1e-5)]
            diff = float(np.abs(np.asarray(probs) - expected[v][i]).max())
            wrong.append((n, i, v, has[0] if has else None, f"{diff:.2e}"))
    assert not wrong, (
        f"{len(wrong)} of {len(versions)} answers, the first of version 2 is number "
        f"{versions.index('2')}: {wrong[:10]}"
    )
    assert spare_loads == 1  # the swap wrote into the spare
