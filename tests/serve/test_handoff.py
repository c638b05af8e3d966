"""The shared-memory channel (serve.handoff) in one process: both ends over a real pipe, a real
batcher and model, no gRPC (tests/serve/test_frontend.py runs it between processes)."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import multiprocessing as mp
import socket
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from protos import predict_pb2
from serve.batcher import Batcher, BatcherConfig
from serve.handoff import (
    HandoffClient,
    HandoffServer,
    ModelRegistry,
    SharedReader,
)
from serve.host_batch import HostBatch
from serve.limits import Limits
from serve.model import LoadedModel
from serve.rpc import RpcError
from serve.servicer import status_of
from serve.slots import HandoffConfig, SlotArena
from serve.validation import request_inputs
from shared.batch import Batch
from shared.features import FeatureSet
from shared.fg_request import request_columns_to_batch

WAIT_S = 30.0


def _batch(fs: FeatureSet, request: predict_pb2.PredictRequest) -> Batch:
    return request_columns_to_batch(fs, **vars(request_inputs(request, fs, Limits())))


class _Recorder:
    """A predictor that takes host batches and records what it was given."""

    takes_host_batches = True

    def __init__(self, model: LoadedModel, token: int) -> None:
        self.model, self.token, self.bundle = model, token, model.bundle
        self.given: list[object] = []

    def predict(self, batch: Any) -> torch.Tensor:
        self.given.append(batch)
        return self.model.predict(batch)


def test_handed_off_batches_reach_the_model_as_host_batches(
    model: LoadedModel, fs: FeatureSet, requests
) -> None:
    recorder = _Recorder(model, 0)
    config = HandoffConfig(slots=4, slot_bytes=64 << 10, inflight=1)
    batching = BatcherConfig(max_batch_rows=64, max_wait_us=5000)
    with _open_channel(recorder, config, batching) as ch:
        client, _server, _batcher, token = ch
        handle = _Model(model, token)
        _assert_answers(client, handle, model, [_batch(fs, r) for r in requests])
    assert recorder.given and all(isinstance(b, HostBatch) for b in recorder.given)


class _Model:
    """A loaded model under a token (what the registry and the batcher need)."""

    def __init__(self, model: LoadedModel, token: int) -> None:
        self.model = model
        self.token = token


@pytest.fixture(scope="module")
def model(bundle_v1: Path) -> LoadedModel:
    return LoadedModel.load(bundle_v1, device="cpu", verify_checksums=False)


@contextlib.contextmanager
def _open_channel(
    model: Any, config: HandoffConfig, batching: BatcherConfig
) -> Iterator[tuple[HandoffClient, HandoffServer, Batcher, int]]:
    """A client and a server over one real pipe and arena, a real batcher, ``model`` served."""
    arena = SlotArena.create(config)
    batcher = Batcher(batching)
    models = ModelRegistry(lambda: model)
    token = models.register(model)
    mine, theirs = mp.Pipe(duplex=True)
    server = HandoffServer(mine, arena, batcher, models, status_of, "test")
    client = HandoffClient(theirs, SlotArena.attach(arena.name, config))
    server.start()
    client.start()
    try:
        yield client, server, batcher, token
    finally:
        client.close()
        server.close()
        batcher.close()
        arena.close()


@pytest.fixture
def channel(model: LoadedModel) -> Iterator[tuple[HandoffClient, HandoffServer, Batcher, int]]:
    config = HandoffConfig(slots=2, slot_bytes=64 << 10, inflight=8)  # more than slots
    with _open_channel(model, config, BatcherConfig(max_batch_rows=64, max_wait_us=1000)) as ch:
        yield ch


def _assert_answers(client, handle, model: LoadedModel, batches) -> None:
    """Submit every batch at once; each answer equals the model's own scores."""
    futures = [client.submit(handle, b) for b in batches]
    for b, f in zip(batches, futures, strict=True):
        want = model.predict(b).numpy()
        np.testing.assert_allclose(f.result(WAIT_S), want, rtol=1e-6, atol=1e-7)


def test_answers_equal_the_model_through_slots_and_the_pipe(
    channel, model: LoadedModel, fs: FeatureSet, requests
) -> None:
    client, _server, _batcher, token = channel
    handle = _Model(model, token)
    batches = [_batch(fs, r) for r in requests]
    # 12 at once over 2 slots: most go through the pipe instead (never refused)
    _assert_answers(client, handle, model, batches)
    assert client.payload_sends > 0
    sent = client.payload_sends
    for b in batches[:3]:  # one at a time: a slot each time
        client.submit(handle, b).result(WAIT_S)
    assert client.payload_sends == sent


def test_failures_come_back_with_their_status(channel, fs: FeatureSet, requests) -> None:
    client, _server, batcher, token = channel
    batch = _batch(fs, requests[0])

    # an expired deadline: the device process's batcher drops it, DEADLINE_EXCEEDED
    with pytest.raises(RpcError) as info:
        client.submit(_Model(None, token), batch, deadline=0.0).result(WAIT_S)  # type: ignore[arg-type]
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert info.value.details.startswith("deadline exceeded: deadline passed after")
    # a token no model has: UNAVAILABLE, retry
    with pytest.raises(RpcError) as info:
        client.submit(_Model(None, 999), batch).result(WAIT_S)  # type: ignore[arg-type]
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    # the batcher closed: UNAVAILABLE with the single-process text
    batcher.close()
    with pytest.raises(RpcError) as info:
        client.submit(_Model(None, token), batch).result(WAIT_S)  # type: ignore[arg-type]
    assert (info.value.code, info.value.details) == (
        grpc.StatusCode.UNAVAILABLE,
        "the server is shutting down",
    )


def test_a_closed_pipe_fails_the_waiting_requests(fs: FeatureSet, requests) -> None:
    config = HandoffConfig(slots=1, slot_bytes=64 << 10)
    arena = SlotArena.create(config)
    gone, theirs = mp.Pipe(duplex=True)  # nobody reads ``gone``: the device process hangs
    client = HandoffClient(theirs, arena)
    client.start()
    try:
        waiting = client.submit(_Model(None, 1), _batch(fs, requests[0]))  # type: ignore[arg-type]
        gone.close()  # ... and dies
        with pytest.raises(RpcError) as info:
            waiting.result(WAIT_S)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert client.closed.wait(WAIT_S)
    finally:
        client.close()
        arena.close()


def test_the_registry_holds_only_the_current_model() -> None:
    class M:
        def __init__(self, digest: str) -> None:
            self.bundle = type("B", (), {"config_digest": digest})()

    current: list[Any] = [M("a")]
    models = ModelRegistry(lambda: current[0])
    old = models.register(current[0])
    assert models.get(old) is current[0]
    current[0] = M("a")  # a new version of the same feature config
    new = models.register(current[0])
    gc.collect()
    assert models.get(old) is current[0]  # the old one is gone: the same features serve
    current[0] = M("b")  # another feature config
    models.register(current[0])
    gc.collect()
    with pytest.raises(RpcError) as info:
        models.get(new)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_requests_queued_past_the_inflight_bound_go_as_one_group(
    model: LoadedModel, fs: FeatureSet, requests
) -> None:
    """Past HandoffConfig.inflight the client groups what queued: fewer messages, the same
    answers, each request its own slice; a cancelled queued request is left out."""
    config = HandoffConfig(slots=4, slot_bytes=256 << 10, inflight=1)
    batching = BatcherConfig(max_batch_rows=4096, max_wait_us=1000)
    with _open_channel(model, config, batching) as (client, _server, _batcher, token):
        handle = _Model(model, token)
        batches = [_batch(fs, r) for r in requests]
        futures = [client.submit(handle, b) for b in batches]
        dropped = client.submit(handle, batches[0])
        dropped.cancel()
        for b, f in zip(batches, futures, strict=True):
            want = model.predict(b).numpy()
            np.testing.assert_allclose(f.result(WAIT_S), want, rtol=1e-6, atol=1e-7)
        assert dropped.cancelled()
        assert client.requests_sent == len(batches)
        assert client.groups_sent < len(batches)  # the first went alone, the rest grouped


def test_the_bench_reports_its_fields(tmp_path: Path) -> None:
    from bench import bench_handoff

    out = tmp_path / "handoff.json"
    argv = ["--out", str(out), "--frontends", "1", "--concurrency", "2", "--candidates", "20"]
    argv += ["--duration-s", "0.5", "--warmup-s", "0.3", "--repeats", "2"]
    assert bench_handoff.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["errors"] == 0 and report["frontends"] == 1 and len(report["windows"]) == 2
    for key in (
        "requests",
        "requests_per_s",
        "candidates_per_s",
        "main_cpu_s",
        "main_cpu_us_per_request",
        "main_cpu_busy",
        "batches",
        "requests_per_batch",
    ):
        assert key in report["median"], key
    assert report["median"]["requests"] > 0
    assert report["requests_per_handoff"] >= 1.0


def test_one_shared_reader_serves_every_frontend_and_outlives_a_closed_pipe(
    model: LoadedModel, fs: FeatureSet, requests
) -> None:
    """The device process reads N frontends' pipes with one thread (SharedReader): one
    frontend's pipe breaking ends that endpoint only (on_closed), the others are still
    answered; a call that blocks does not stall the reader; the thread ends with the last
    endpoint."""
    config = HandoffConfig(slots=2, slot_bytes=64 << 10, inflight=2)
    batcher = Batcher(BatcherConfig(max_batch_rows=64, max_wait_us=1000))
    models = ModelRegistry(lambda: model)
    handle = _Model(model, models.register(model))
    reader = SharedReader(name="test-shared-reader")
    before = set(threading.enumerate())
    arenas: list[SlotArena] = []
    servers: list[HandoffServer] = []
    clients: list[HandoffClient] = []
    ended: list[int] = []  # the endpoints whose on_closed ran
    release = threading.Event()
    try:
        for i in range(3):
            arena = SlotArena.create(config)
            arenas.append(arena)
            mine, theirs = mp.Pipe(duplex=True)
            server = HandoffServer(
                mine, arena, batcher, models, status_of, f"shared-{i}", reader=reader
            )
            server.on_closed = functools.partial(ended.append, i)  # type: ignore[method-assign]
            server.call_handlers["slow"] = lambda: release.wait(WAIT_S) and "slow answer"
            server.start()
            servers.append(server)
            client = HandoffClient(theirs, SlotArena.attach(arena.name, config), name=f"c{i}")
            client.start()
            clients.append(client)
        started = set(threading.enumerate()) - before
        device_threads = [t for t in started if not t.name.startswith("c")]
        assert [t.name for t in device_threads] == ["test-shared-reader"]  # one for three
        assert reader.threads() == 1
        batches = [_batch(fs, r) for r in requests[:4]]
        for client in clients:
            _assert_answers(client, handle, model, batches)

        # a call blocks in its handler: the reader goes on serving every frontend meanwhile
        with futures.ThreadPoolExecutor(1) as pool:
            slow = pool.submit(clients[1].call, "slow", WAIT_S)
            for client in clients:
                _assert_answers(client, handle, model, batches)
            assert not slow.done()
            release.set()
            assert slow.result(WAIT_S) == "slow answer"

        # frontend 0 dies (shutdown: its own reader thread would keep a closed socket open)
        with socket.fromfd(clients[0].conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.shutdown(socket.SHUT_RDWR)
        clients[0].close()  # only its endpoint ends
        assert servers[0].closed.wait(WAIT_S)
        assert ended == [0]
        for client in clients[1:]:
            _assert_answers(client, handle, model, batches)
        assert not any(s.closed.is_set() for s in servers[1:])
        assert reader.threads() == 1

        servers[1].close()  # closed by the device process: ends it, frontend 1 sees it
        assert servers[1].closed.wait(WAIT_S) and clients[1].closed.wait(WAIT_S)
        assert sorted(ended) == [0, 1]
        _assert_answers(clients[2], handle, model, batches)
    finally:
        for client in clients:
            client.close()
        for server in servers:
            server.close()
        batcher.close()
        for arena in arenas:
            arena.close()
    thread = next(t for t in started if t.name == "test-shared-reader")
    thread.join(WAIT_S)
    assert not thread.is_alive() and reader.threads() == 0  # no thread left behind
    assert sorted(ended) == [0, 1, 2]
