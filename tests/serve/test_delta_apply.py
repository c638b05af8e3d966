"""Delta updates on a running server over real gRPC (127.0.0.1): scores equal a full re-export.

The deltas are exported under the server's delta root and applied through its admin service
(its own port, :mod:`serve.admin`) by name relative to that root."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pyarrow.dataset as pads
import pytest

from loadtest.parity import check_parity, request_for_rows
from loadtest.requests import (
    sequence_formats_from_metadata,
    sides_from_metadata,
    value_types_from_metadata,
)
from protos import predict_pb2, predict_pb2_grpc
from serve.admin import AdminConfig
from serve.batcher import BatcherConfig
from serve.server import PredictionServer, ServerConfig
from shared.bundle import read_bundle
from tests.conftest import SEED_CONFIG
from train.tools.__main__ import main
from train.tools.delta import export_delta
from train.tools.inspection import inspect_server


def _server(bundle: Path, **kw: object) -> PredictionServer:
    config = ServerConfig(
        bundle=bundle,
        device="cpu",
        batching=BatcherConfig(max_batch_rows=256, max_wait_us=500),
        **kw,  # type: ignore[arg-type]
    )
    server = PredictionServer(config).start()
    assert server.wait_ready(60), server.load_error
    return server


@pytest.fixture(scope="module")
def delta_root(dyn_run, tmp_path_factory) -> Path:
    """The server's delta root: "step-8" (for the base bundle) and "foreign" (for another)."""
    root = tmp_path_factory.mktemp("deltas")
    export_delta(
        SEED_CONFIG, base=dyn_run.base_bundle, checkpoint=dyn_run.checkpoint, out=root / "step-8"
    )
    export_delta(
        SEED_CONFIG,
        base=dyn_run.full_bundle,
        checkpoint=dyn_run.checkpoint,
        out=root / "foreign",
        delta_id="foreign",
    )
    return root


@pytest.fixture(scope="module")
def server(dyn_run, delta_root: Path) -> Iterator[PredictionServer]:
    srv = _server(dyn_run.base_bundle, admin=AdminConfig(delta_root=delta_root))
    yield srv
    srv.stop(grace=0)


def _admin(server: PredictionServer) -> str:
    return f"127.0.0.1:{server.admin_port}"


def _predict_loop(
    host: str,
    request: predict_pb2.PredictRequest,
    stop: threading.Event,
    seen: list[str],
    errors: list[BaseException],
) -> None:
    with grpc.insecure_channel(host) as channel:
        stub = predict_pb2_grpc.PredictionServiceStub(channel)
        while not stop.is_set():
            try:
                seen.append(stub.Predict(request, timeout=10).model_version)
            except grpc.RpcError as err:  # pragma: no cover - reported below
                errors.append(err)


def test_delta_applied_live_scores_like_a_full_export(
    server: PredictionServer, dyn_run, tiny_samples: Path, capsys
) -> None:
    host, admin = f"127.0.0.1:{server.port}", _admin(server)
    eval_rows = tiny_samples / "eval"
    check_parity(host, dyn_run.base_bundle, eval_rows, num_requests=4, num_candidates=8, atol=1e-6)
    with pytest.raises(AssertionError):  # the new checkpoint scores differently
        check_parity(host, dyn_run.full_bundle, eval_rows, num_requests=4, num_candidates=8)

    # requests keep flowing while the delta is applied: none fails, versions switch once
    with grpc.insecure_channel(host) as channel:
        md = predict_pb2_grpc.PredictionServiceStub(channel).GetModelMetadata(
            predict_pb2.ModelMetadataRequest(), timeout=10
        )
    assert md.model_version == "step-4" and md.base_version == "step-4" and not md.deltas
    rows = pads.dataset(str(eval_rows), format="parquet").head(8)
    request = request_for_rows(
        rows,
        sides_from_metadata(md),
        value_types_from_metadata(md),
        "x",
        sequence_formats=sequence_formats_from_metadata(md),
    )
    stop, seen, errors = threading.Event(), [], []
    loop = threading.Thread(target=_predict_loop, args=(host, request, stop, seen, errors))
    loop.start()
    try:
        assert main(["delta-apply", "--server", admin, "--delta", "step-8", "--json"]) == 0
        deadline = time.monotonic() + 20
        while "step-4+step-8" not in seen[-1:] and time.monotonic() < deadline and not errors:
            time.sleep(0.01)  # until the loop has been answered by the new version
    finally:
        stop.set()
        loop.join(30)
    applied = json.loads(capsys.readouterr().out)
    assert applied["model_version"] == "step-4+step-8" and applied["deltas"] == ["step-8"]
    assert applied["dense_program"] is True
    assert not errors and seen, errors
    first_new = seen.index("step-4+step-8")
    assert set(seen[:first_new]) <= {"step-4"} and set(seen[first_new:]) == {"step-4+step-8"}

    # the full re-export of the same checkpoint gives the same scores
    check_parity(host, dyn_run.full_bundle, eval_rows, num_requests=6, num_candidates=8, atol=1e-6)

    # inspection reports the new tables and the delta's training summary
    report = inspect_server(admin, top_k=3)
    assert report["model_version"] == "step-4+step-8" and report["deltas"] == ["step-8"]
    full = read_bundle(dyn_run.full_bundle)
    summaries = full.manifest["extra"]["table_summaries"]
    for t in report["tables"]:
        if t["is_hashmap"]:
            assert t["size"] == full.hash_tables[t["name"]][0].numel()
            assert t["top_keys"] == summaries[t["name"]]["top_keys"][:3]
            assert t["admission_pending"] == summaries[t["name"]]["admission"]["pending"]
        else:
            assert t["size"] == full.dense_tables[t["name"]].shape[0]
    assert main(["inspect", "--server", admin]) == 0
    assert "deltas applied: step-8" in capsys.readouterr().out


def test_a_delta_for_another_base_is_refused(server: PredictionServer, delta_root: Path) -> None:
    with grpc.insecure_channel(_admin(server)) as channel:
        stub = predict_pb2_grpc.ModelAdminServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ApplyDelta(predict_pb2.ApplyDeltaRequest(path="foreign"), timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "delta 'foreign': made for base bundle 'step-8'" in info.value.details()
        for path in ("/nonexistent", str(delta_root / "step-8")):  # absolute: never read
            with pytest.raises(grpc.RpcError) as info:
                stub.ApplyDelta(predict_pb2.ApplyDeltaRequest(path=path), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "no readable delta at" in info.value.details()


def test_writes_can_be_switched_off(dyn_run, delta_root: Path) -> None:
    admin = AdminConfig(delta_root=delta_root, allow_writes=False)
    srv = _server(dyn_run.base_bundle, admin=admin)
    try:
        with grpc.insecure_channel(_admin(srv)) as channel:
            stub = predict_pb2_grpc.ModelAdminServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.ApplyDelta(predict_pb2.ApplyDeltaRequest(path="step-8"), timeout=30)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert stub.InspectTables(predict_pb2.InspectRequest(), timeout=10).tables
    finally:
        srv.stop(grace=0)
