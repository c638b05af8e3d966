"""Admission under overload (issue #16): past ``max_pending`` a Predict is refused at once.

The model is made slow on demand: the loader's model is wrapped so that ``predict`` waits for an
event the test sets (as ``test_server.py`` gates a load). With the gate closed, N admitted
Predicts hold their places; request N+1 is answered RESOURCE_EXHAUSTED while they still wait
(it was answered at all, so it did not queue behind them), health and metadata answer, and the
refusal is counted. Opening the gate lets the N finish.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import predict_pb2, predict_pb2_grpc
from serve.batcher import BatcherConfig
from serve.limits import Limits
from serve.model import LoadedModel
from serve.server import PredictionServer, ServerConfig
from serve.servicer import SERVICE_NAME
from shared.batch import Batch

from .hostile import PREDICT_METHOD

N = 3  # the admission bound
WAIT_S = 60.0  # how long the test waits for a state before it fails (no timing is asserted)


class GatedModel:
    """A loaded model whose ``predict`` waits until ``gate`` is set (everything else is the
    model's): the batcher's :class:`~serve.batcher.Predictor`, slow on demand."""

    def __init__(self, model: LoadedModel, gate: threading.Event) -> None:
        self._model = model
        self._gate = gate
        self.entered = threading.Event()  # a predict is waiting at the gate

    def __getattr__(self, name: str) -> object:
        return getattr(self._model, name)

    def predict(self, batch: Batch, timings: dict[str, float] | None = None) -> torch.Tensor:
        if not self._gate.is_set():
            self.entered.set()
            if not self._gate.wait(WAIT_S):
                raise TimeoutError("the test never opened the gate")
        return self._model.predict(batch, timings)


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {WAIT_S:.0f} s: {what}")
        time.sleep(0.01)


@pytest.fixture
def gated(bundle_v1: Path) -> Iterator[tuple[PredictionServer, threading.Event]]:
    gate = threading.Event()
    gate.set()  # open until the test closes it
    srv = PredictionServer(
        ServerConfig(
            bundle=bundle_v1,
            device="cpu",
            limits=Limits(max_candidates=8, max_pending=N),
            batching=BatcherConfig(max_batch_rows=64, max_wait_us=500),
        )
    )
    load = srv.manager._loader
    srv.manager._loader = lambda path: GatedModel(load(path), gate)
    srv.start()
    try:
        assert srv.wait_ready(60), srv.load_error
        yield srv, gate
    finally:
        gate.set()
        srv.stop(grace=0)


def _rejections(srv: PredictionServer) -> float:
    value = srv.metrics.registry.get_sample_value(
        "dynrec_serving_rejections_total", {"method": "Predict", "reason": "overloaded"}
    )
    return value or 0.0


def test_past_the_bound_is_refused_while_the_admitted_wait(gated, requests) -> None:
    srv, gate = gated
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        stub = predict_pb2_grpc.PredictionServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        want = [np.asarray(stub.Predict(r, timeout=WAIT_S).probabilities) for r in requests[:N]]
        assert _rejections(srv) == 0

        gate.clear()
        model = srv.manager.current
        assert isinstance(model, GatedModel)
        held = [stub.Predict.future(r, timeout=WAIT_S) for r in requests[:N]]
        _until(lambda: srv.admission.pending == N and model.entered.is_set(), f"{N} admitted")

        with pytest.raises(grpc.RpcError) as info:
            stub.Predict(requests[N], timeout=WAIT_S)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        assert "overloaded" in info.value.details()
        # undecodable bytes are refused the same way: admission comes before parsing
        raw = channel.unary_unary(PREDICT_METHOD, request_serializer=None)
        with pytest.raises(grpc.RpcError) as info:
            raw(b"\xff\xff\xff", timeout=WAIT_S)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()

        # health and metadata do not queue behind the admitted Predicts
        for service in ("", SERVICE_NAME):
            req = health_pb2.HealthCheckRequest(service=service)
            assert (
                health.Check(req, timeout=WAIT_S).status == health_pb2.HealthCheckResponse.SERVING
            )
        md = stub.GetModelMetadata(predict_pb2.ModelMetadataRequest(), timeout=WAIT_S)
        assert md.limits.max_pending == N and md.model_version == "1"

        assert not gate.is_set() and not any(f.done() for f in held)  # all answered meanwhile
        assert srv.admission.pending == N
        assert _rejections(srv) == 2

        gate.set()
        for f, r, w in zip(held, requests[:N], want, strict=True):
            resp = f.result(timeout=WAIT_S)
            assert resp.request_id == r.request_id
            np.testing.assert_allclose(resp.probabilities, w, rtol=1e-5, atol=1e-6)
        _until(lambda: srv.admission.pending == 0, "the admitted requests left")
        assert len(stub.Predict(requests[N], timeout=WAIT_S).probabilities) == len(
            requests[N].candidates
        )
    assert _rejections(srv) == 2
    errors = srv.metrics.registry.get_sample_value(
        "dynrec_serving_errors_total", {"method": "Predict", "code": "RESOURCE_EXHAUSTED"}
    )
    assert errors == 2
