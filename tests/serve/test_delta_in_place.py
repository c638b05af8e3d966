"""Deltas written into the live tables between batches (serve.delta.apply_delta): the same
tensors, the scores of a full export and of the rebuild, the fallbacks, Predicts during an
apply over real gRPC. The GPU test (graph replay = eager after an in-place delta) runs on the
GPU machine: ``pytest -m gpu tests/serve/test_delta_in_place.py``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pyarrow.dataset as pads
import pytest
import torch

from loadtest.parity import request_for_rows
from loadtest.requests import (
    sequence_formats_from_metadata,
    sides_from_metadata,
    value_types_from_metadata,
)
from protos import predict_pb2, predict_pb2_grpc
from serve.admin import AdminConfig
from serve.batcher import BatcherConfig
from serve.delta import ApplyPath, apply_delta
from serve.graphs import Bucket
from serve.lookup import EmbeddingTables
from serve.model import LoadedModel, StartupTimes, load_program, synthetic_batch
from serve.server import PredictionServer, ServerConfig
from serve.tiers import TierConfig
from shared.batch import Batch
from shared.bundle import read_bundle, write_bundle
from shared.delta import diff_tables, write_delta
from tests.conftest import SEED_CONFIG
from train.tools.delta import export_delta

ATOL = 1e-6
BUCKETS = (Bucket(64, 64, 8), Bucket(1024, 1024, 64))
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

Tables = tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]


def _target(base_dir: Path, *, grow: int = 3, far_key: int | None = None) -> Tables:
    """The base tables with dense row 0 changed and, per dynamic table, 2 rows updated, 1 key
    evicted and ``grow`` + 1 keys added (``far_key``: one of them)."""
    base = read_bundle(base_dir)
    dense = {n: w.clone() for n, w in base.dense_tables.items()}
    for w in dense.values():
        w[0] += 0.25
    hashed = {}
    for name, (keys, values) in base.hash_tables.items():
        values = values.clone()
        values[1:3] += 0.5
        new = torch.arange(grow + 1, dtype=torch.int64) + int(keys.max()) + 1
        if far_key is not None:
            new[-1] = far_key
        rows = torch.full((new.numel(), values.shape[1]), 0.125)
        hashed[name] = (torch.cat([keys[1:], new]), torch.cat([values[1:], rows]))
    return dense, hashed


def _write(base_dir: Path, out: Path, name: str, tables: Tables) -> tuple[Path, Path]:
    """A delta without a dense program to ``tables``, and their full bundle (base's program)."""
    base = read_bundle(base_dir)
    dense, hashed = tables
    delta = write_delta(
        out / name,
        tables=diff_tables(base.dense_tables, base.hash_tables, dense, hashed),
        base_manifest=base.manifest,
        delta_id=name,
        target_version=f"{name}-full",
        config_digest=base.config_digest,
    )
    full = write_bundle(
        out / f"{name}-full",
        dense_tables=dense,
        hash_tables={n: [kv] for n, kv in hashed.items()},
        feature_set=base.feature_set,
        dense_program_path=base.dense_program_path,
        config_digest=base.config_digest,
        version=f"{name}-full",
    )
    return delta, full


@pytest.fixture(scope="module")
def root(dyn_run, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """step-8 (the checkpoint's delta, with its program), noop (no change), tables (rows and
    keys, no program), wide (a key beyond the shared key space), each with its full bundle."""
    out = tmp_path_factory.mktemp("in_place")
    base = dyn_run.base_bundle
    export_delta(SEED_CONFIG, base=base, checkpoint=dyn_run.checkpoint, out=out / "step-8")
    bundle = read_bundle(base)
    _write(base, out, "noop", (dict(bundle.dense_tables), dict(bundle.hash_tables)))
    _write(base, out, "tables", _target(base))
    _write(base, out, "wide", _target(base, far_key=(1 << 62) + 5))
    _write(base, out, "same-keys", _target(base, grow=0))
    return out


def _batches(model: LoadedModel) -> list[Batch]:
    out = []
    for users, cands, lengths in ((1, 8, (5,)), (4, 60, (3, 0, 12, 7))):
        batch = synthetic_batch(model.fs, users, cands, lengths)
        batch.sequence.values().random_(0, 1000)  # dynamic tables: rows the delta may change
        out.append(batch)
    return out


def _max_diff(got: LoadedModel, want: LoadedModel) -> float:
    torch.manual_seed(0)
    return max(float((got.predict(b) - want.predict(b)).abs().max()) for b in _batches(got))


def _assert_same_scores(got: LoadedModel, want: LoadedModel) -> None:
    diff = _max_diff(got, want)
    assert diff <= ATOL, diff


def _tensors(model: LoadedModel) -> list[int]:
    """data_ptr of every tensor the lookups (and CUDA graphs) read."""
    out = []
    for g in model.tables._groups:
        out.append(g.weight.data_ptr())
        if g.hash is not None:
            out += [g.hash.keys.data_ptr(), g.hash.values.data_ptr(), g.hash._live.data_ptr()]
    return out


def _no_headroom(bundle_dir: Path) -> LoadedModel:
    """A model whose tables have no free slots (EmbeddingTables headroom 0)."""
    bundle = read_bundle(bundle_dir)
    cpu = torch.device("cpu")
    tables = EmbeddingTables.from_bundle(bundle, device=cpu, headroom=0.0)
    program = load_program(bundle.dense_program_path, cpu)
    model = LoadedModel(bundle, tables, program, cpu, StartupTimes(0, 0, 0, 0, 0, 0))
    model.warmup()
    return model


def test_a_delta_is_written_into_the_live_tensors(dyn_run, root: Path) -> None:
    base = LoadedModel.load(dyn_run.base_bundle, device="cpu")
    before = _tensors(base)
    applied = apply_delta(base, root / "step-8")
    model = applied.model
    assert applied.path is ApplyPath.IN_PLACE and applied.reason == ""
    assert model.tables is base.tables and _tensors(model) == before
    assert model.version == "step-4+step-8" and model.deltas == ("step-8",)
    # the delta's program has the base's graph: its weights are written into the serving
    # program's tensors (no program loaded, no graph captured), the base's kept in a copy
    assert model.program is base.program and model.base_program is not base.program
    assert _max_diff(model, LoadedModel.load(dyn_run.base_bundle, device="cpu")) > 1e-4
    _assert_same_scores(model, LoadedModel.load(dyn_run.full_bundle, device="cpu"))
    rebuilt = apply_delta(
        LoadedModel.load(dyn_run.base_bundle, device="cpu"), root / "step-8", in_place=False
    ).model
    _assert_same_scores(model, rebuilt)
    _assert_same_scores(base, model)  # requests accepted before the swap: the new model's
    full = read_bundle(dyn_run.full_bundle)
    rows = {t.name: t.rows for t in model.table_stats()}
    assert rows == {
        **{n: k.numel() for n, (k, _) in full.hash_tables.items()},
        **{n: w.shape[0] for n, w in full.dense_tables.items()},
    }


def test_a_table_delta_keeps_the_program_and_replaces_the_previous_deltas_rows(
    dyn_run, root: Path
) -> None:
    base = LoadedModel.load(dyn_run.base_bundle, device="cpu")
    before = _tensors(base)
    tables = apply_delta(base, root / "tables")
    assert tables.path is ApplyPath.IN_PLACE and tables.model.program is base.program
    fresh = LoadedModel.load(dyn_run.base_bundle, device="cpu")
    assert _max_diff(tables.model, fresh) > 1e-4  # the delta changes the batches' scores
    _assert_same_scores(tables.model, LoadedModel.load(root / "tables-full", device="cpu"))
    # deltas are relative to the base: noop drops the keys "tables" added, restores its rows
    noop = apply_delta(tables.model, root / "noop")
    assert noop.path is ApplyPath.IN_PLACE and _tensors(noop.model) == before
    assert noop.model.deltas == ("tables", "noop") and noop.model.version == "step-4+noop"
    _assert_same_scores(noop.model, LoadedModel.load(dyn_run.base_bundle, device="cpu"))
    # and the step-8 delta (with its program) after both equals its full export
    step8 = apply_delta(noop.model, root / "step-8")
    assert step8.path is ApplyPath.IN_PLACE and step8.model.program is base.program
    _assert_same_scores(step8.model, LoadedModel.load(dyn_run.full_bundle, device="cpu"))
    # back to the base's weights with the next delta, written into the same program
    again = apply_delta(step8.model, root / "tables")
    assert again.path is ApplyPath.IN_PLACE and again.model.program is base.program
    _assert_same_scores(again.model, LoadedModel.load(root / "tables-full", device="cpu"))


def test_tables_without_room_fall_back_to_the_rebuild(
    dyn_run, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    base = _no_headroom(dyn_run.base_bundle)
    with caplog.at_level(logging.INFO, logger="serve.delta"):
        grown = apply_delta(base, root / "tables")  # 3 keys more per table: no free slot
    assert grown.path is ApplyPath.REBUILD and "room for" in grown.reason
    # the log says where the update's time went, stage by stage (the model's own figures)
    ready = [r.getMessage() for r in caplog.records if "new model ready" in r.getMessage()]
    stages = grown.model.startup.as_dict()
    assert ready == [
        "delta tables: new model ready ("
        + ", ".join(f"{k} {v:.3f} s" for k, v in stages.items())
        + ")"
    ]
    assert grown.model.tables is not base.tables
    _assert_same_scores(grown.model, LoadedModel.load(root / "tables-full", device="cpu"))
    same = apply_delta(_no_headroom(dyn_run.base_bundle), root / "same-keys")  # as many keys
    assert same.path is ApplyPath.IN_PLACE
    _assert_same_scores(same.model, LoadedModel.load(root / "same-keys-full", device="cpu"))


def test_the_servers_key_headroom_sizes_the_room_at_load_and_at_each_rebuild(
    dyn_run, root: Path
) -> None:
    """``--key-headroom`` (TierConfig.headroom): the tables' free slots for new keys. With
    none, a delta of new keys rebuilds, and the rebuilt tables keep the server's headroom
    (none again); with room for them (the default's 10 %), the same delta is written in
    place."""
    tight = TierConfig(headroom=0.0)
    base = LoadedModel.load(dyn_run.base_bundle, device="cpu", tiers=tight)
    grown = apply_delta(base, root / "tables")  # 3 keys more per table
    assert grown.path is ApplyPath.REBUILD and "room for" in grown.reason
    assert grown.model.tables.tiers == tight
    _assert_same_scores(grown.model, LoadedModel.load(root / "tables-full", device="cpu"))
    roomy = LoadedModel.load(dyn_run.base_bundle, device="cpu", tiers=TierConfig(headroom=2.0))
    assert apply_delta(roomy, root / "tables").path is ApplyPath.IN_PLACE


def test_a_key_beyond_the_shared_key_space_falls_back_to_the_rebuild(dyn_run, root: Path) -> None:
    base = LoadedModel.load(dyn_run.base_bundle, device="cpu")
    before = [t.clone() for g in base.tables._groups for t in (g.weight, g.hash.values) if g.hash]
    wide = apply_delta(base, root / "wide")
    assert wide.path is ApplyPath.REBUILD and "key space" in wide.reason
    after = [t for g in base.tables._groups for t in (g.weight, g.hash.values) if g.hash]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # nothing written
    _assert_same_scores(wide.model, LoadedModel.load(root / "wide-full", device="cpu"))
    assert apply_delta(base, root / "tables", in_place=False).model.tables is not base.tables


# --------------------------------------------------------------------------- over gRPC


@pytest.fixture
def server(dyn_run, root: Path) -> Iterator[PredictionServer]:
    config = ServerConfig(
        bundle=dyn_run.base_bundle,
        device="cpu",
        batching=BatcherConfig(max_batch_rows=256, max_wait_us=2000),
        admin=AdminConfig(delta_root=root),
    )
    srv = PredictionServer(config).start()
    assert srv.wait_ready(60), srv.load_error
    yield srv
    srv.stop(grace=0)


def _request(stub: predict_pb2_grpc.PredictionServiceStub, eval_rows: Path):
    md = stub.GetModelMetadata(predict_pb2.ModelMetadataRequest(), timeout=10)
    rows = pads.dataset(str(eval_rows), format="parquet").head(8)
    return request_for_rows(
        rows,
        sides_from_metadata(md),
        value_types_from_metadata(md),
        "x",
        sequence_formats=sequence_formats_from_metadata(md),
    )


def test_predicts_during_an_in_place_apply_get_the_old_or_the_new_scores(
    server: PredictionServer, tiny_samples: Path
) -> None:
    host, admin = f"127.0.0.1:{server.port}", f"127.0.0.1:{server.admin_port}"
    with grpc.insecure_channel(host) as channel:
        stub = predict_pb2_grpc.PredictionServiceStub(channel)
        request = _request(stub, tiny_samples / "eval")
        old = np.array(stub.Predict(request, timeout=10).probabilities)
        stop, errors = threading.Event(), []
        answers: list[tuple[str, np.ndarray]] = []

        def loop() -> None:
            while not stop.is_set():
                try:
                    r = stub.Predict(request, timeout=10)
                    answers.append((r.model_version, np.array(r.probabilities)))
                except grpc.RpcError as err:  # pragma: no cover - reported below
                    errors.append(err)

        threads = [threading.Thread(target=loop) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            with grpc.insecure_channel(admin) as admin_channel:
                admin_stub = predict_pb2_grpc.ModelAdminServiceStub(admin_channel)
                applied = admin_stub.ApplyDelta(
                    predict_pb2.ApplyDeltaRequest(path="step-8"), timeout=60
                )
            after = len(answers)
            while len(answers) < after + 20 and not errors and all(t.is_alive() for t in threads):
                stop.wait(0.01)  # until answers come from the new tables too
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        new = np.array(stub.Predict(request, timeout=10).probabilities)
    assert applied.model_version == "step-4+step-8" and not errors, errors
    assert float(np.abs(old - new).max()) > 1e-4  # the delta changes these scores
    assert any(np.allclose(p, new, atol=ATOL) for _, p in answers)
    for version, probs in answers:  # a whole request's scores are the old or the new ones
        is_old, is_new = np.allclose(probs, old, atol=ATOL), np.allclose(probs, new, atol=ATOL)
        assert is_old or is_new, (version, probs, old, new)
        assert is_new or version == "step-4"  # the new version's scores are the new ones
    applies = server.metrics.registry.get_sample_value(
        "dynrec_serving_delta_applies_total", {"path": "in_place"}
    )
    assert applies == 1


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@cuda
def test_graphs_replay_over_tables_written_in_place(dyn_run, root: Path) -> None:
    """A table delta keeps the program and the graphs: replays read the rewritten tensors and
    equal eager scores of the full export; so does a delta with a program of the same graph
    (its weights written into the program's tensors) and the next one, back to the base's
    weights: nothing is captured again."""
    base = LoadedModel.load(dyn_run.base_bundle, device="cuda", graph_buckets=BUCKETS)
    before, graphs = _tensors(base), base.graphs
    assert graphs is not None and graphs.stats.captures == len(BUCKETS)
    tables = apply_delta(base, root / "tables")
    assert tables.path is ApplyPath.IN_PLACE and tables.model.graphs is graphs
    assert _tensors(tables.model) == before
    # nothing captured: the shared graphs' earlier captures are not this apply's stage
    assert base.startup.graphs > 0 and tables.model.startup.graphs == 0.0
    replays = graphs.stats.replays
    _assert_same_scores(tables.model, LoadedModel.load(root / "tables-full", device="cuda"))
    assert graphs.stats.replays == replays + 2 and graphs.stats.eager == {}
    step8 = apply_delta(tables.model, root / "step-8")
    assert step8.path is ApplyPath.IN_PLACE and _tensors(step8.model) == before
    assert step8.model.graphs is graphs and step8.model.program is base.program
    _assert_same_scores(step8.model, LoadedModel.load(dyn_run.full_bundle, device="cuda"))
    again = apply_delta(step8.model, root / "tables")
    assert again.path is ApplyPath.IN_PLACE and again.model.graphs is graphs
    _assert_same_scores(again.model, LoadedModel.load(root / "tables-full", device="cuda"))
    assert graphs.stats.captures == len(BUCKETS) and graphs.stats.failures == {}
    assert graphs.stats.replays == replays + 6 and graphs.stats.eager == {}
