"""The clients of ``bench.bench_stream``'s server: a :class:`Probe` that reads
``GetModelMetadata`` every ``--probe-every-s`` (what serves, and since when: freshness), an
open-loop :class:`PacedLoad` of ``--load-candidates-per-s`` (requests of ``--candidates``, a
send schedule that a slow answer does not slow), the same load in a spawned process of its
own (:class:`LoadProcess`: it runs from phase 1 through phase 3, and the bench's own threads,
the lander's and the probe's, neither slow its clients nor share their interpreter lock), and
the requests built from the eval rows (:func:`build_requests`).

A module of its own because the clients know nothing of the phases: they send, time and log,
and the reports (``bench.stream_reports``) read the logs by time window. Times in a load's log
are ``time.monotonic()``, the same clock in every process of the machine, so the bench's
phase windows and the load process's log compare directly.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.oip_load import CHANNEL_OPTIONS
from protos import predict_pb2, predict_pb2_grpc


class Probe:
    """``GetModelMetadata`` every ``every_s``: (unix time, version, event time, age) each."""

    def __init__(self, stub: predict_pb2_grpc.PredictionServiceStub, every_s: float) -> None:
        self.stub, self.every_s = stub, every_s
        self.samples: list[tuple[float, str, float, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="probe", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                md = self.stub.GetModelMetadata(predict_pb2.ModelMetadataRequest(), timeout=10)
            except grpc.RpcError:
                continue
            self.samples.append(
                (time.time(), md.model_version, md.event_time_unix, md.freshness_seconds)
            )

    def serving(self) -> str:
        return self.samples[-1][1] if self.samples else ""


class PacedLoad:
    """Requests sent on a fixed schedule (``per_s`` a second, round-robin over ``requests``) by
    ``threads`` threads: open loop, so a slow answer does not slow the offered load. ``log``
    holds (send time, latency s, ok) per request; times are ``time.monotonic()``, the same
    clock in every process of the machine."""

    def __init__(self, host: str, requests: list[Any], per_s: float, threads: int) -> None:
        self.host, self.requests, self.per_s = host, requests, per_s
        self.log: list[tuple[float, float, bool]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k, threads), daemon=True)
                        for k in range(threads)]  # fmt: skip
        self.start = 0.0

    def run(self) -> PacedLoad:
        self.start = time.monotonic()
        for t in self.threads:
            t.start()
        return self

    def _run(self, k: int, n: int) -> None:
        # a connection of its own per thread: gRPC's global subchannel pool would carry every
        # thread's calls over one connection, which reaches one of the server's --frontends
        # (SO_REUSEPORT): on the H100 on 2026-12-07 that one frontend was the bottleneck, at
        # p50 168 ms with no trainer running (as bench_oip found, bench/oip_load.py)
        with grpc.insecure_channel(self.host, options=CHANNEL_OPTIONS) as channel:
            stub = predict_pb2_grpc.PredictionServiceStub(channel)
            i = k
            while not self.stop.is_set():
                due = self.start + i / self.per_s
                if self.stop.wait(max(due - time.monotonic(), 0.0)):
                    return
                t = time.monotonic()
                try:
                    stub.Predict(self.requests[i % len(self.requests)], timeout=10)
                    self.log.append((t, time.monotonic() - t, True))
                except grpc.RpcError:
                    self.log.append((t, time.monotonic() - t, False))
                i += n

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def seconds(self, start: float, end: float) -> list[list[float]]:
        """The answered requests' latencies (s) sent in [``start``, ``end``) (monotonic), one
        list per whole second from ``start`` (empty where none was answered)."""
        per: list[list[float]] = [[] for _ in range(max(1, int(np.ceil(end - start))))]
        for t, x, ok in self.log:
            if ok and start <= t < end:
                per[min(int(t - start), len(per) - 1)].append(x)
        return per

    def stats(self, start: float, end: float) -> dict[str, Any]:
        """The answers sent in [``start``, ``end``) (monotonic): count, errors, rate, p50 and
        p99, and ``by_second``: [answers, p99 ms] of each whole second from ``start`` (where
        in the window the slow answers were: a publish's moment or the whole phase), with
        ``start_unix``, the window's start on the wall clock the server's log uses."""
        errors = sum(1 for t, _, ok in self.log if start <= t < end and not ok)
        per_second = self.seconds(start, end)
        a = np.asarray([x for xs in per_second for x in xs]) * 1e3
        seconds = max(end - start, 1e-9)
        by_second = [
            [len(xs), round(float(np.percentile(np.asarray(xs) * 1e3, 99)), 2) if xs else 0.0]
            for xs in per_second
        ]
        return {
            "requests": len(a), "errors": errors, "seconds": seconds,
            "requests_per_s": len(a) / seconds,
            "p50_ms": float(np.percentile(a, 50)) if len(a) else None,
            "p99_ms": float(np.percentile(a, 99)) if len(a) else None,
            "start_unix": time.time() - time.monotonic() + start,
            "by_second": by_second,
        }  # fmt: skip


def _load_process(host: str, requests: list[bytes], per_s: float, threads: int,
                  asks: Any, out: Any) -> None:  # fmt: skip
    """:class:`PacedLoad` (a process of its own): for each ask on ``asks`` its log so far on
    ``out``; the ask ``"stop"`` ends the load first."""
    load = PacedLoad(host, [predict_pb2.PredictRequest.FromString(r) for r in requests], per_s,
                     threads).run()  # fmt: skip
    while True:
        ask = asks.get()
        if ask == "stop":
            load.finish()
        out.put(list(load.log))
        if ask == "stop":
            return


class LoadProcess:
    """A :class:`PacedLoad` in a spawned process: the bench's own threads (lander, probe)
    neither slow its clients nor share their interpreter lock. :meth:`so_far` returns the log
    up to now while the load goes on, :meth:`finish` stops it and returns the whole log (each
    as a :class:`PacedLoad` for its ``stats``)."""

    def __init__(self, host: str, requests: list[Any], per_s: float, threads: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.asks, self.out = context.Queue(), context.Queue()
        payload = [r.SerializeToString() for r in requests]
        self.process = context.Process(
            target=_load_process,
            args=(host, payload, per_s, threads, self.asks, self.out),
            name="load",
            daemon=True,
        )
        self.process.start()
        self.result = PacedLoad(host, requests, per_s, threads)

    def _log(self, ask: str) -> PacedLoad:
        self.asks.put(ask)
        self.result.log = self.out.get(timeout=120)
        return self.result

    def so_far(self) -> PacedLoad:
        return self._log("log")

    def finish(self) -> PacedLoad:
        result = self._log("stop")
        self.process.join(30)
        return result


def build_requests(stub: Any, eval_rows: Path, candidates: int, count: int) -> list[Any]:
    """``count`` requests of ``candidates`` eval rows each (user from the first row)."""
    import pyarrow.dataset as pads

    from loadtest.parity import request_for_rows
    from loadtest.requests import (
        sequence_formats_from_metadata,
        sides_from_metadata,
        value_types_from_metadata,
    )

    md = stub.GetModelMetadata(predict_pb2.ModelMetadataRequest(), timeout=10)
    table = pads.dataset(str(eval_rows), format="parquet").head(candidates * count)
    sides, types = sides_from_metadata(md), value_types_from_metadata(md)
    formats = sequence_formats_from_metadata(md)
    n = max(table.num_rows // candidates, 1)
    return [request_for_rows(table.slice(i * candidates, candidates), sides, types, f"r{i}",
                             sequence_formats=formats) for i in range(n)]  # fmt: skip
