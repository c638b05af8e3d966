"""The load test end to end: a gRPC server in this process, locust in a subprocess, the report.

``prediction_server`` is a small in-test servicer that checks the request layout (and plants
failures); ``real_server`` is the serving runtime, for both protocols (Predict and the Open
Inference Protocol's ModelInfer) with the same requests.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest

from bench.synthetic_bundle import seed_feature_set
from loadtest.latency import read_raw_latencies
from loadtest.oip import oip_pool
from loadtest.pool import read_pool
from loadtest.run import main, run_load_test
from protos import predict_pb2, predict_pb2_grpc
from serve.limits import Limits
from serve.server import PredictionServer
from tests.serve.conftest import make_bundle, running_server

from .conftest import CONTEXT, ITEM, SEQUENCE, USER, model_metadata


class _LayoutCheckingServicer(predict_pb2_grpc.PredictionServiceServicer):
    """Answers like a model server and rejects requests whose layout breaks the metadata."""

    def __init__(self) -> None:
        self.metadata = model_metadata()
        self.received = 0
        self.fail_every = 0  # > 0: every n-th call fails (to test failure reporting)
        self._lock = threading.Lock()

    def GetModelMetadata(self, request, context):  # noqa: N802 (gRPC method name)
        return self.metadata

    def Predict(self, request, context):  # noqa: N802
        with self._lock:
            self.received += 1
            n = self.received
        if self.fail_every and n % self.fail_every == 0:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "planted failure")
        problem = _layout_problem(request)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if request.HasField("candidate_columns"):
            ids = np.array(request.candidate_columns.columns["adgroup_id"].int64s.values)
        else:
            ids = np.array([c.values["adgroup_id"].int64_value for c in request.candidates])
        probs = 1.0 / (1.0 + np.exp(-((ids % 7) - 3.0)))
        return predict_pb2.PredictResponse(
            probabilities=probs.tolist(), model_version="test-1", request_id=request.request_id
        )


def _layout_problem(req: predict_pb2.PredictRequest) -> str | None:
    if set(req.user.values) != set(USER):
        return f"user features {sorted(req.user.values)}"
    if set(req.context.values) != set(CONTEXT):
        return f"context features {sorted(req.context.values)}"
    if set(req.sequences) != set(SEQUENCE):
        return f"sequences {sorted(req.sequences)}"
    if len({len(s.ids) for s in req.sequences.values()}) != 1:
        return "sequence lengths differ"
    if req.HasField("candidate_columns"):
        cc = req.candidate_columns
        if req.candidates or set(cc.columns) != set(ITEM):
            return "candidate columns"
        for col in cc.columns.values():
            kind = col.WhichOneof("kind")
            if kind is None or len(getattr(col, kind).values) != cc.num_candidates:
                return "candidate column length"
        return None
    if not req.candidates or any(set(c.values) != set(ITEM) for c in req.candidates):
        return "candidate features"
    return None


@pytest.fixture
def prediction_server() -> Iterator[tuple[str, _LayoutCheckingServicer]]:
    """(address, servicer) of a PredictionService on 127.0.0.1, an ephemeral port."""
    servicer = _LayoutCheckingServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    predict_pb2_grpc.add_PredictionServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(grace=None)


@pytest.mark.parametrize("columnar", [True, False], ids=["columnar", "rows"])
def test_load_test_reports_exact_percentiles(
    prediction_server: tuple[str, _LayoutCheckingServicer],
    sample_dir: Path,
    tmp_path: Path,
    columnar: bool,
) -> None:
    address, servicer = prediction_server
    out = tmp_path / "loadtest"
    summary = run_load_test(
        address,
        sample_dir,
        out,
        users=2,
        spawn_rate=10,
        duration_s=1,  # every check holds for any count of calls > 0
        num_candidates=20,
        num_requests=50,
        columnar=columnar,
    )

    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["request_format"] == summary["request_pool"]["format"]
    assert summary["request_format"] == ("columnar" if columnar else "rows")
    assert summary["failures"] == 0, summary["locust"]["failures"]
    lat = summary["latency_ms"]
    assert all(lat[k] > 0 for k in ("p50", "p95", "p99", "p99.9"))
    assert lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["p99.9"] <= lat["max"]

    raw = read_raw_latencies(out / "raw")
    assert summary["requests"] == len(raw) > 0  # how many fit in 1 s depends on the machine
    assert raw.ok.all()
    locust_row = summary["locust"]["stats"]["Predict"]
    assert locust_row["Request Count"] == len(raw)
    assert locust_row["Failure Count"] == 0
    # the server saw every recorded call, plus at most one in flight per user at shutdown
    assert len(raw) <= servicer.received <= len(raw) + 2
    assert summary["qps"] > 0
    assert summary["candidates_per_s"] == pytest.approx(summary["qps"] * 20)
    # the rate is the calls over the measured window (how long it is depends on the machine)
    assert summary["qps"] == pytest.approx(len(raw) / summary["window_s"])
    assert summary["request_pool"]["sequences"] == {
        "click_50_seq": {"delimiter": "|", "max_length": 100}
    }
    assert sum(r["requests"] for r in summary["timeline"]) == len(raw)
    assert (out / "latency.png").stat().st_size > 10_000
    assert (out / "locust_stats.csv").exists()


def test_failures_are_counted_and_named(
    prediction_server: tuple[str, _LayoutCheckingServicer],
    sample_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    address, servicer = prediction_server
    servicer.fail_every = 4
    summary = run_load_test(
        address,
        sample_dir,
        tmp_path / "lt",
        users=1,
        spawn_rate=10,
        duration_s=1,
        num_candidates=5,
        num_requests=10,
    )
    assert summary["locust"]["exit_code"] == 1  # locust's "the run had failures"
    assert summary["failures"] == pytest.approx(summary["requests"] / 4, abs=1)
    assert summary["locust"]["stats"]["Predict"]["Failure Count"] == summary["failures"]
    (failure,) = summary["locust"]["failures"]
    assert failure["Error"] == "RpcFailure('RESOURCE_EXHAUSTED: planted failure')"
    assert failure["Occurrences"] == summary["failures"]
    assert summary["latency_ms"]["p50"] > 0  # percentiles are of the successful calls
    # stderr is not a terminal: plain progress lines (how many depends on the machine), the
    # last one written when locust exited
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("loadtest: ")]
    assert lines, "no progress line on stderr"
    assert "/1 s (" in lines[-1] and " requests, " in lines[-1] and " failures, in " in lines[-1]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictionServer]:
    """The serving runtime on CPU (a small synthetic bundle of the seed config), both protocols
    on its port."""
    root = tmp_path_factory.mktemp("served")
    with running_server(make_bundle(root, seed_feature_set(), "1", seed=1), Limits()) as srv:
        yield srv


def test_the_same_requests_over_both_protocols(
    real_server: PredictionServer, sample_dir: Path, tmp_path: Path
) -> None:
    """--protocol oip drives ModelInfer with the requests --protocol predict sends (same seed),
    against the real server: no failures (each answer holds every candidate's probability),
    the locust row and the server's counters under the protocol's method."""
    address = f"127.0.0.1:{real_server.port}"
    registry = real_server.metrics.registry

    def served(method: str) -> float:
        sample = registry.get_sample_value("dynrec_serving_requests_total", {"method": method})
        return sample or 0.0

    for protocol, method in [("predict", "Predict"), ("oip", "ModelInfer")]:
        before = served(method)
        out = tmp_path / protocol
        summary = run_load_test(
            address,
            sample_dir,
            out,
            users=2,
            spawn_rate=10,
            duration_s=1,
            num_candidates=5,
            num_requests=20,
            protocol=protocol,
        )
        assert summary["protocol"] == summary["request_pool"]["protocol"] == protocol
        assert summary["failures"] == 0, summary["locust"]["failures"]
        assert summary["locust"]["stats"][method]["Request Count"] == summary["requests"] > 0
        # every recorded call reached the server, plus at most one in flight per user
        assert summary["requests"] <= served(method) - before <= summary["requests"] + 2
    predict_pool = read_pool(tmp_path / "predict" / "requests.pool")
    oip = read_pool(tmp_path / "oip" / "requests.pool")
    assert oip.info["model_name"] == "dynrec" and len(oip) == len(predict_pool)
    assert oip.payloads == oip_pool(predict_pool, "dynrec").payloads  # the same requests


def test_an_unknown_protocol_is_refused(sample_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--protocol 'rest'"):
        run_load_test("127.0.0.1:1", sample_dir, tmp_path, protocol="rest")


def test_model_name_only_with_the_oip_protocol(
    sample_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--host", "127.0.0.1:1", "--samples", str(sample_dir), "--out", str(tmp_path)]
    assert main([*argv, "--model-name", "ctr"]) == 2  # Predict has no model name to honour
    assert "pass it with --protocol oip" in capsys.readouterr().err
