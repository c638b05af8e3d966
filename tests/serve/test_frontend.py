"""``--frontends N`` (serve.frontend) against the single-process server, over real gRPC on
127.0.0.1 with real frontend processes: the same answers, codes and messages; overload across
frontends; a frontend killed and restarted; a hot swap reaching the frontends; no orphans when
the device process dies. No timing is asserted (WAIT_S only bounds how long a state may take)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import predict_pb2, predict_pb2_grpc
from serve.admin import AdminConfig
from serve.limits import Limits
from serve.server import PredictionServer, ServerConfig
from serve.servicer import SERVICE_NAME
from shared.features import FeatureSet

from .conftest import candidate_variants, to_columnar
from .hostile import PREDICT_METHOD
from .test_overload import GatedModel
from .test_server import BATCHING, LIMITS, _bad_cases, _columnar_bad_cases

WAIT_S = 60.0
NO_CONTEXT = cast(grpc.ServicerContext, None)  # HealthServicer.Check does not use it
ROOT = Path(__file__).resolve().parents[2]


def _config(**kw: object) -> ServerConfig:
    base: dict[str, object] = dict(device="cpu", limits=LIMITS, batching=BATCHING)
    base.update(kw)
    return ServerConfig(**base)  # type: ignore[arg-type]


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {WAIT_S:.0f} s: {what}")
        time.sleep(0.05)


def _health(port: int, service: str = "") -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


@pytest.fixture(scope="module")
def single(bundle_v1: Path) -> Iterator[PredictionServer]:
    srv = PredictionServer(_config(bundle=bundle_v1)).start()
    assert srv.wait_ready(WAIT_S), srv.load_error
    yield srv
    srv.stop(grace=0)


@pytest.fixture(scope="module")
def model_dir(bundle_v1: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("frontend-models")
    shutil.copytree(bundle_v1, root / "1")
    return root


@pytest.fixture(scope="module")
def multi(model_dir: Path) -> Iterator[PredictionServer]:
    srv = PredictionServer(
        _config(
            model_dir=model_dir,
            poll_interval_s=0.3,
            frontends=2,
            metrics_port=0,
            admin=AdminConfig(address="127.0.0.1:0"),
        )
    ).start()
    try:
        assert srv.wait_ready(WAIT_S), srv.load_error
        yield srv
    finally:
        srv.stop(grace=0)
        assert srv.frontends is not None
        assert srv.frontends.alive() == 0


@pytest.fixture(scope="module")
def stubs(single, multi) -> Iterator[tuple[predict_pb2_grpc.PredictionServiceStub, ...]]:
    with (
        grpc.insecure_channel(f"127.0.0.1:{single.port}") as one,
        grpc.insecure_channel(f"127.0.0.1:{multi.port}") as many,
    ):
        yield (
            predict_pb2_grpc.PredictionServiceStub(one),
            predict_pb2_grpc.PredictionServiceStub(many),
        )


def _outcome(call: Callable[..., object], request: object) -> tuple[object, ...]:
    try:
        resp = call(request, timeout=10)
    except grpc.RpcError as err:
        return ("error", err.code(), err.details())
    if isinstance(resp, bytes):
        resp = predict_pb2.PredictResponse.FromString(resp)
    assert isinstance(resp, predict_pb2.PredictResponse)
    return ("ok", resp.model_version, resp.request_id, tuple(np.round(resp.probabilities, 6)))


def test_answers_equal_the_single_process_server(stubs, fs: FeatureSet, requests) -> None:
    one, many = stubs
    cases = list(requests) + list(candidate_variants(requests).values())
    for req in cases + [to_columnar(fs, r) for r in cases]:
        want = _outcome(one.Predict, req)
        assert want[0] == "ok"
        assert _outcome(many.Predict, req) == want


def test_bad_requests_get_the_same_code_and_message(
    stubs, single, multi, fs: FeatureSet, requests
) -> None:
    one, many = stubs
    bad = []
    for mutate, _field in _bad_cases().values():
        req = predict_pb2.PredictRequest()
        req.CopyFrom(requests[1])
        mutate(req)
        bad.append(req)
    good = to_columnar(fs, candidate_variants(requests)["unknown ids"])
    for mutate, _field, _words in _columnar_bad_cases().values():
        req = predict_pb2.PredictRequest()
        req.CopyFrom(good)
        mutate(req)
        bad.append(req)
    big = predict_pb2.PredictRequest()
    big.CopyFrom(requests[0])
    big.request_id = "x" * (70 << 10)  # past max_request_bytes: RESOURCE_EXHAUSTED
    bad.append(big)
    for req in bad:
        want = _outcome(one.Predict, req)
        assert want[0] == "error"
        assert _outcome(many.Predict, req) == want
    # undecodable bytes, and a deadline already over
    for junk in (b"\xff\xff\xff", requests[0].SerializeToString()[:-3]):
        answers = []
        for port in (single.port, multi.port):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                raw: Any = channel.unary_unary(PREDICT_METHOD, request_serializer=None)
                answers.append(_outcome(raw, junk))
        assert answers[0] == answers[1] and answers[0][0] == "error"
    for stub in (one, many):
        with pytest.raises(grpc.RpcError) as info:
            stub.Predict(requests[0], timeout=1e-4)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_metadata_health_and_metrics(stubs, single, multi) -> None:
    mds = [s.GetModelMetadata(predict_pb2.ModelMetadataRequest(), timeout=10) for s in stubs]
    for md in mds:
        md.ClearField("loaded_at_unix")
        md.ClearField("startup_seconds")
        md.ClearField("tables")  # hit counts differ with the traffic each saw
    assert mds[0] == mds[1]
    for service in ("", SERVICE_NAME):
        assert _health(multi.port, service) == health_pb2.HealthCheckResponse.SERVING
    assert _health(multi.admin_port) == health_pb2.HealthCheckResponse.SERVING
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{multi.metrics_port}/metrics", timeout=10)
        .read()
        .decode()
    )
    requests = re.search(r'^dynrec_serving_requests_total\{method="Predict"\} (\S+)$', text, re.M)
    assert requests is not None and float(requests.group(1)) > 0  # the frontends' counts
    for name in (
        "dynrec_serving_batch_rows_count",  # the device process's
        'dynrec_serving_stage_seconds_count{clock="cpu",stage="fg"}',  # the frontends'
        'dynrec_serving_errors_total{code="INVALID_ARGUMENT",method="Predict"}',
        "dynrec_serving_frontends_alive 2.0",
    ):
        assert name in text, name
    assert text.count("# TYPE dynrec_serving_requests_total counter") == 1


def test_a_killed_frontend_is_restarted(multi, stubs, requests) -> None:
    pool = multi.frontends
    before = pool.pids()
    os.kill(before[0], signal.SIGKILL)
    _until(lambda: pool.pids()[0] not in (None, before[0]) and pool.ready() == 2, "restarted")
    assert pool.pids()[1] == before[1]
    for _ in range(4):  # new connections land on either frontend
        with grpc.insecure_channel(f"127.0.0.1:{multi.port}") as channel:
            stub = predict_pb2_grpc.PredictionServiceStub(channel)
            assert stub.Predict(requests[0], timeout=10).probabilities


def test_a_new_version_reaches_the_frontends(
    multi, model_dir: Path, bundle_v2: Path, requests
) -> None:
    shutil.copytree(bundle_v2, model_dir / "2")
    with grpc.insecure_channel(f"127.0.0.1:{multi.port}") as channel:
        stub = predict_pb2_grpc.PredictionServiceStub(channel)
        _until(lambda: stub.Predict(requests[0], timeout=10).model_version == "2", "version 2")
        md = stub.GetModelMetadata(predict_pb2.ModelMetadataRequest(), timeout=10)
        assert md.model_version == "2"


# --------------------------------------------------------------------------- overload, no frontend


def test_overload_across_frontends_and_not_serving_without_one(bundle_v1: Path, requests) -> None:
    n = 3
    gate = threading.Event()
    gate.set()
    srv = PredictionServer(
        _config(
            bundle=bundle_v1,
            limits=Limits(max_candidates=8, max_pending=n),
            frontends=2,
            restart_frontends=False,
        )
    )
    load = srv.manager._loader
    srv.manager._loader = lambda path: GatedModel(load(path), gate)
    srv.start()
    try:
        assert srv.wait_ready(WAIT_S), srv.load_error
        pool = srv.frontends
        assert pool is not None
        gate.clear()
        channels = [grpc.insecure_channel(f"127.0.0.1:{srv.port}") for _ in range(n)]
        held = [
            predict_pb2_grpc.PredictionServiceStub(c).Predict.future(r, timeout=WAIT_S)
            for c, r in zip(channels, requests[:n], strict=True)
        ]
        _until(lambda: pool.pending() == n, f"{n} admitted")
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = predict_pb2_grpc.PredictionServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.Predict(requests[n], timeout=WAIT_S)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.details() == (
            f"server overloaded: {n} requests in flight (limit {n}, serve --max-queue); "
            "retry with backoff or another replica"
        )
        gate.set()
        for f in held:
            assert f.result(timeout=WAIT_S).probabilities
        for c in channels:
            c.close()
        _until(lambda: pool.pending() == 0, "the admitted requests left")
        # every frontend gone (restarts off): the server says NOT_SERVING
        for pid in pool.pids():
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
        _until(lambda: pool.alive() == 0, "frontends gone")
        _until(
            lambda: (
                srv.health.Check(health_pb2.HealthCheckRequest(service=""), NO_CONTEXT).status
                == health_pb2.HealthCheckResponse.NOT_SERVING
            ),
            "NOT_SERVING",
        )
    finally:
        gate.set()
        srv.stop(grace=0)


# --------------------------------------------------------------------------- the CLI


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_frontends_exit_when_the_device_process_dies(bundle_v1: Path, requests) -> None:
    cmd = [sys.executable, "-m", "serve", "--bundle", str(bundle_v1), "--port", "0"]
    cmd += ["--device", "cpu", "--frontends", "1", "--no-verify-checksums"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        m = re.match(r"SERVING on 127\.0\.0\.1:(\d+) .*frontend pids \[(\d+)\]", line)
        assert m, line
        port, frontend = int(m.group(1)), int(m.group(2))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = predict_pb2_grpc.PredictionServiceStub(channel)
            assert stub.Predict(requests[0], timeout=10).probabilities
        proc.kill()  # SIGKILL: no cleanup in the device process
        proc.wait(WAIT_S)
        _until(lambda: not _alive(frontend), "the frontend exited")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_new_version_of_the_same_features_keeps_the_warm_feature_set(fs) -> None:
    """The FeatureSet object a frontend's plans and string caches are built for survives a
    swap to a version of equal features (a copy, as unpickled); other features replace it."""
    import copy
    import dataclasses

    from serve.frontend import FrontendModel

    first = FrontendModel.announced(("model", 1, "1", fs, "d"), None)
    same = copy.deepcopy(fs)
    assert same is not fs and same == fs
    second = FrontendModel.announced(("model", 2, "2", same, "d"), first)
    assert second.fs is fs and (second.token, second.version) == (2, "2")
    fewer = dataclasses.replace(fs, label_fields=())
    third = FrontendModel.announced(("model", 3, "3", fewer, "e"), second)
    assert third.fs is fewer
