"""Closed-loop gRPC Predict clients for the hot-swap and delta benchmarks (127.0.0.1 only), and
the server those benchmarks run: a ``--model-dir`` server and the atomic install of a version."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np

from protos import predict_pb2, predict_pb2_grpc
from serve.admin import AdminConfig
from serve.batcher import BatcherConfig
from serve.server import PredictionServer, ServerConfig


def start_model_dir_server(
    models: Path, device: str, ready_timeout_s: float, *, admin: AdminConfig | None = None
) -> PredictionServer:
    """A server watching ``models`` (polled every 0.1 s), batches of up to 1024 rows, ready;
    with ``admin``, its admin service too (``server.admin_port``)."""
    config = ServerConfig(
        model_dir=models,
        device=device,
        poll_interval_s=0.1,
        batching=BatcherConfig(max_batch_rows=1024, max_wait_us=500),
        admin=admin,
    )
    server = PredictionServer(config).start()
    if not server.wait_ready(ready_timeout_s):
        raise SystemExit(f"server did not start: {server.load_error}")
    return server


def install_version(bundle: Path, models: Path, version: str) -> None:
    """Copy ``bundle`` into ``models/<version>`` atomically (a hidden copy, then one rename), as a
    deployment would, so the server never sees a half-written version."""
    tmp = models / f".{version}.tmp"
    shutil.copytree(bundle, tmp)
    tmp.rename(models / version)


def latency_stats(lat: list[float]) -> dict[str, float]:
    """count, p50, p99 and max in ms of latencies given in seconds."""
    a = np.asarray(lat) * 1e3
    if not len(a):
        return {"count": 0}
    return {
        "count": int(len(a)),
        "p50_ms": float(np.percentile(a, 50)),
        "p99_ms": float(np.percentile(a, 99)),
        "max_ms": float(a.max()),
    }


class ClosedLoopClients:
    """``clients`` threads, each sending the next request as soon as the last one returns.

    ``log`` holds (start perf_counter, latency s, model_version) per answered request,
    ``errors`` the failed ones as "CODE: details".
    """

    def __init__(
        self,
        host: str,
        requests: Sequence[predict_pb2.PredictRequest],
        clients: int,
        *,
        timeout_s: float,
    ) -> None:
        self.host, self.requests, self.timeout_s = host, requests, timeout_s
        self.log: list[tuple[float, float, str]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(k,)) for k in range(clients)]

    def _run(self, k: int) -> None:
        with grpc.insecure_channel(self.host) as channel:
            stub = predict_pb2_grpc.PredictionServiceStub(channel)
            i = k
            while not self._stop.is_set():
                t = time.perf_counter()
                try:
                    r = stub.Predict(self.requests[i % len(self.requests)], timeout=self.timeout_s)
                    self.log.append((t, time.perf_counter() - t, r.model_version))
                except grpc.RpcError as e:
                    self.errors.append(f"{e.code().name}: {e.details()}")
                i += 1

    def start(self) -> ClosedLoopClients:
        for t in self._threads:
            t.start()
        return self

    def wait_for_version(self, version: str, timeout_s: float) -> None:
        """Until the last answers come from ``version`` (or ``timeout_s`` passes)."""
        deadline = time.monotonic() + timeout_s
        while not any(v == version for _, _, v in self.log[-10:]) and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def latencies(self, start: float, end: float = float("inf")) -> list[float]:
        return [lat for t, lat, _ in self.log if start <= t < end]

    def timeline(
        self, start: float, bin_s: float, end: float = float("inf")
    ) -> list[dict[str, object]]:
        """Requests started from ``start`` (to ``end``) in bins of ``bin_s``: per bin its start
        (s after ``start``), count, p50 and max latency (ms) and the versions that answered."""
        bins: dict[int, list[tuple[float, str]]] = {}
        for t, lat, version in self.log:
            if start <= t < end:
                bins.setdefault(int((t - start) / bin_s), []).append((lat, version))
        return [
            {
                "t_s": round(k * bin_s, 3),
                "count": len(rows),
                "p50_ms": float(np.median([lat for lat, _ in rows])) * 1e3,
                "max_ms": max(lat for lat, _ in rows) * 1e3,
                "versions": sorted({v for _, v in rows}),
            }
            for k, rows in sorted(bins.items())
        ]

    def versions(self) -> list[str]:
        return sorted({v for _, _, v in self.log})
