"""Closed-loop load windows of ``bench.bench_oip``: client processes whose connections each carry
one loop of every protocol of the window, and what each process did in it.

Why every connection carries both protocols: a gRPC connection reaches one server process
(``python -m serve --frontends N`` puts N processes on one port; the kernel hands each new
connection to one of them, SO_REUSEPORT), and a frontend is one Python process, so the calls of
one connection are only as fast as that frontend. Before, half the client processes sent Predict
and half ModelInfer, and all the channels of one process shared one connection (gRPC's global
subchannel pool), so each protocol stood on the frontends its processes happened to reach.
On the H100 on 2026-12-07 (4 frontends, 4 client processes) the rounds' ratios were 0.54 or
0.99 at 16 clients and 0.60, 0.99 or 1.66 at 8, at an equal pooled p99; on CPU (2 frontends,
4 processes, 8 clients) ``ss`` showed one connection per process, and the two rounds whose
processes sat unevenly (Predict, ModelInfer, Predict on one frontend, ModelInfer alone on the
other) gave 1.23 and 1.14 where the four even ones gave 0.98-1.01. Now each connection (its
own: ``grpc.use_local_subchannel_pool``) runs one closed loop of each protocol, so every
frontend sees both protocols in equal numbers and a busy frontend or a stalled client process
slows both alike: on the same CPU run the rounds gave 0.99-1.01, also in a round where one
connection had a frontend to itself and completed 450 requests of each protocol to the others'
~284.

Each process reports its requests per protocol and the server process (index in the pids it is
given) behind each of its connections, read with psutil while the connections are open; the
processes that completed no request of some protocol are listed in the window's ``idle_procs``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

# Each channel its own connection: channels of one process with the same target and options share
# one by default, so all the loops of a process would reach one frontend.
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]


@dataclass(frozen=True)
class Protocol:
    """One kind of call: ``method`` with raw ``payloads`` (cycled), reported as ``name``."""

    name: str  # "predict" or "oip"
    method: str
    payloads: list[bytes]


@dataclass(frozen=True)
class Window:
    """``clients`` concurrent calls over ``clients / len(protocols)`` connections, each running
    one closed loop of every protocol, spread over ``procs`` client processes."""

    protocols: tuple[Protocol, ...]
    clients: int
    procs: int

    def connections_per_proc(self) -> list[int]:
        """Connections of each process (near-equal; never an empty process)."""
        assert self.clients % len(self.protocols) == 0, "bench_oip._check: even --clients"
        connections = self.clients // len(self.protocols)
        return split(connections, min(self.procs, connections))


def split(total: int, parts: int) -> list[int]:
    """``total`` as ``parts`` near-equal counts (the first ones one larger)."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def frontends_of(port: int, servers: Sequence[int]) -> list[int | None]:
    """For each connection of this process to ``port`` (by local port), the index in ``servers``
    (pids) of the process holding its other end; None where none of them does (a frontend
    restarted since its pid was read) or psutil may not read it: the accounting is evidence beside
    the figures, and a client process that raised here would leave its window without a report."""
    import psutil

    mine = sorted(
        c.laddr.port
        for c in psutil.Process().net_connections("tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )
    far: dict[int, int] = {}
    for i, pid in enumerate(servers):
        try:
            conns = psutil.Process(pid).net_connections("tcp")
        except psutil.Error:  # gone (NoSuchProcess) or not ours to read (AccessDenied)
            continue
        far.update({c.raddr.port: i for c in conns if c.raddr and c.laddr.port == port})
    return [far.get(p) for p in mine]


def _client(
    index: int,
    host: str,
    protocols: tuple[Protocol, ...],
    connections: int,
    first: int,
    start: float,
    stop: float,
    servers: list[int],
    out: Any,
) -> None:
    """A client process: ``connections`` channels, each with one closed loop per protocol, from
    ``start`` to ``stop`` (perf_counter of this host); sends its report (see :func:`window`).
    Loop ``k`` starts at payload ``first + k`` so processes do not send the same requests."""
    lat: dict[str, list[float]] = {p.name: [] for p in protocols}
    errors: dict[str, list[str]] = {p.name: [] for p in protocols}

    def loop(channel: grpc.Channel, p: Protocol, k: int) -> None:
        call: Any = channel.unary_unary(
            p.method, request_serializer=None, response_deserializer=None
        )
        i = k
        while time.perf_counter() < start:
            call(p.payloads[i % len(p.payloads)], timeout=60)  # warm-up, not counted
            i += 1
        while (t := time.perf_counter()) < stop:
            try:
                call(p.payloads[i % len(p.payloads)], timeout=60)
                lat[p.name].append(time.perf_counter() - t)
            except grpc.RpcError as err:
                errors[p.name].append(f"{err.code().name}: {(err.details() or '')[:200]}")
            i += 1

    channels = [grpc.insecure_channel(host, options=CHANNEL_OPTIONS) for _ in range(connections)]
    threads = [
        threading.Thread(target=loop, args=(ch, p, first + k))
        for k, ch in enumerate(channels)
        for p in protocols
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    frontends = frontends_of(int(host.rsplit(":", 1)[1]), servers)  # the channels still open
    for ch in channels:
        ch.close()
    out.put({
        "proc": index, "pid": os.getpid(), "connections": connections, "frontends": frontends,
        "latencies": lat, "errors": {k: v[:20] for k, v in errors.items()},
    })  # fmt: skip


def window(
    host: str, w: Window, duration: float, warmup: float, servers: list[int]
) -> dict[str, Any]:
    """One closed-loop window: every process starts and stops at the same instants.

    Returns "phases": per protocol name {"latencies" (s), "errors", "seconds",
    "requests_per_proc"}; "procs", what each process did: [{"pid", "connections", "frontends"
    (server index per connection), "requests" {name: n}}]; "connections_per_frontend" (index in
    ``servers``); "idle_procs": the processes that completed no request of some protocol."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    start = time.perf_counter() + warmup + 2.0  # spawn time
    stop = start + duration
    counts = w.connections_per_proc()
    firsts = [sum(counts[:i]) for i in range(len(counts))]
    ps = [
        ctx.Process(
            target=_client,
            args=(i, host, w.protocols, n, firsts[i], start, stop, servers, queue),
        )
        for i, n in enumerate(counts)
    ]
    for proc in ps:
        proc.start()
    reports = sorted(
        (queue.get(timeout=warmup + duration + 120) for _ in ps), key=lambda r: r["proc"]
    )
    for proc in ps:
        proc.join(30)
    phases: dict[str, Any] = {}
    for p in w.protocols:
        phases[p.name] = {
            "latencies": [x for r in reports for x in r["latencies"][p.name]],
            "errors": [e for r in reports for e in r["errors"][p.name]],
            "seconds": duration,
            "requests_per_proc": [len(r["latencies"][p.name]) for r in reports],
        }
    out: dict[str, Any] = {"phases": phases}
    out["procs"] = [
        {
            "pid": r["pid"],
            "connections": r["connections"],
            "frontends": r["frontends"],
            "requests": {p.name: len(r["latencies"][p.name]) for p in w.protocols},
        }
        for r in reports
    ]
    out["connections_per_frontend"] = tally(out["procs"], len(servers))
    out["idle_procs"] = [
        i for i, r in enumerate(out["procs"]) if min(r["requests"].values(), default=0) == 0
    ]
    return out


def tally(procs: list[dict[str, Any]], servers: int) -> list[int]:
    """Connections per server process (index) over ``procs``' reports; unknown ends not counted."""
    count = [0] * servers
    for r in procs:
        for f in r["frontends"]:
            if f is not None:
                count[f] += 1
    return count
