"""bench.stream_load against a real server: a ``PredictionServer`` on 127.0.0.1 with two
frontend processes (``--frontends 2``: each connection reaches one of them, SO_REUSEPORT)
serving ``bench.bench_serving``'s synthetic bundle, and requests built from the tiny eval
rows. No timing is asserted: rates and latencies are only counted and shaped, and WAIT_S only
bounds how long a state may take to come. The server runs in this process (its frontends are
processes of their own, as with ``python -m serve --frontends 2``): a second torch import for a
``python -m serve`` would double the fixture's time, and this process then holds no end of a
connection to the port but the clients'.

The connection checks are the regression test of the per-thread channel option
(``grpc.use_local_subchannel_pool``): without it gRPC's global subchannel pool carries every
thread's channel over one connection, so the load reaches one frontend; these tests then see
one connection where they want one per thread.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest

from bench.bench_serving import make_bundle
from bench.oip_load import frontends_of
from bench.stream_load import LoadProcess, PacedLoad, Probe, build_requests
from protos import predict_pb2, predict_pb2_grpc
from serve.server import PredictionServer, ServerConfig

WAIT_S = 60.0
CANDIDATES = 5


def _until(check: Callable[[], Any], what: str) -> Any:
    """``check()``'s first truthy value, polled every 0.05 s for at most WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {WAIT_S:.0f} s: {what}")
        time.sleep(0.05)
    return value


def _connections(pid: int, port: int) -> list[int]:
    """Local ports of ``pid``'s ESTABLISHED TCP connections to ``port`` (the server's)."""
    return sorted(
        c.laddr.port
        for c in psutil.Process(pid).net_connections("tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictionServer]:
    bundle, _ = make_bundle(tmp_path_factory.mktemp("stream-load"), keys=3000)
    srv = PredictionServer(ServerConfig(bundle=bundle, device="cpu", frontends=2)).start()
    try:
        assert srv.wait_ready(WAIT_S), srv.load_error
        yield srv
    finally:
        srv.stop(grace=0)


def _frontend_pids(server: PredictionServer) -> list[int]:
    assert server.frontends is not None
    return [p for p in server.frontends.pids() if p is not None]


@pytest.fixture(scope="module")
def requests(server: PredictionServer, tiny_samples: Path) -> list[predict_pb2.PredictRequest]:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = predict_pb2_grpc.PredictionServiceStub(channel)
        return build_requests(stub, tiny_samples / "eval", CANDIDATES, 8)


def test_build_requests_gives_count_requests_of_candidates_rows(
    requests: list[predict_pb2.PredictRequest],
) -> None:
    assert [r.request_id for r in requests] == [f"r{i}" for i in range(8)]
    assert all(len(r.candidates) == CANDIDATES for r in requests)
    assert len({r.SerializeToString() for r in requests}) == 8  # different rows each


def test_paced_load_opens_a_connection_per_thread_and_every_request_is_answered(
    server: PredictionServer, requests: list[predict_pb2.PredictRequest]
) -> None:
    """4 threads at 40 requests/s for about 1.2 s: while it runs this process holds 4
    connections to the port, each ending in one of the frontends (which one is the kernel's
    hash: not asserted); afterwards every request was answered and stats() counts them."""
    port = server.port
    _until(lambda: not _connections(os.getpid(), port), "no connection left open")
    load = PacedLoad(f"127.0.0.1:{port}", requests, per_s=40, threads=4).run()
    try:
        _until(lambda: len(load.log) >= 8, "8 requests answered")
        ends = frontends_of(port, _frontend_pids(server))
        time.sleep(1.0)  # the load goes on: the rest of the window
    finally:
        load.finish()
    assert len(ends) == 4, f"one connection per thread, got {ends}"
    assert None not in ends  # every connection ends in a frontend of this server
    assert not any(t.is_alive() for t in load.threads)

    assert load.log and all(ok for _, _, ok in load.log)
    sent = sorted(t for t, _, _ in load.log)
    stats = load.stats(load.start, time.monotonic())
    assert stats["requests"] == len(load.log) and stats["errors"] == 0
    assert stats["seconds"] > 0 and stats["requests_per_s"] > 0
    assert 0 < stats["p50_ms"] <= stats["p99_ms"]
    half = load.stats(load.start, sent[len(sent) // 2])  # a window: only the sends inside
    assert half["requests"] == len(sent) // 2
    before = load.stats(load.start - 10, load.start)
    assert before["requests"] == 0 and before["p50_ms"] is None and before["p99_ms"] is None


def test_probe_samples_what_serves_until_stopped(server: PredictionServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        probe = Probe(predict_pb2_grpc.PredictionServiceStub(channel), every_s=0.05)
        assert probe.serving() == ""
        probe.thread.start()
        _until(lambda: len(probe.samples) >= 3, "3 probe samples")
        probe.stop.set()
        probe.thread.join(WAIT_S)
        md = probe.stub.GetModelMetadata(predict_pb2.ModelMetadataRequest(), timeout=10)
    assert not probe.thread.is_alive()
    for at, version, event_time, age in probe.samples:
        assert isinstance(at, float) and isinstance(age, float)
        assert (version, event_time) == (md.model_version, md.event_time_unix)
    assert md.model_version == "bench"  # make_bundle's version
    times = [s[0] for s in probe.samples]
    assert times == sorted(times)
    assert probe.serving() == "bench"


def test_load_process_round_trips_the_requests_and_returns_its_log(
    server: PredictionServer, requests: list[predict_pb2.PredictRequest]
) -> None:
    """The requests cross into the spawned process as bytes and are parsed there: the server
    answers every one. so_far() gives the log while the load runs (a prefix of what finish()
    returns), and the child holds one connection per thread."""
    port = server.port
    load = LoadProcess(f"127.0.0.1:{port}", requests, per_s=40, threads=2)
    try:

        def answered() -> list[tuple[float, float, bool]]:
            log = list(load.so_far().log)
            return log if len(log) >= 4 else []

        first = _until(answered, "4 requests answered in the load process")
        pid = load.process.pid
        assert pid is not None
        child = _connections(pid, port)
    finally:
        result = load.finish()
    assert len(child) == 2, f"one connection per thread in the load process, got {child}"
    assert load.process.exitcode == 0
    assert result.log[: len(first)] == first and len(result.log) >= len(first)
    assert all(ok for _, _, ok in result.log)
    stats = result.stats(min(t for t, _, _ in result.log), time.monotonic())
    assert stats["requests"] == len(result.log) and stats["errors"] == 0
