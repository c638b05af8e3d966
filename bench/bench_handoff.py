"""The device process's cost per request of ``serve --frontends N`` (serve.handoff), without a
model: how many requests one device process can take from its frontends.

Runs the real device-process side (one :class:`~serve.handoff.HandoffServer` per frontend, one
real :class:`~serve.batcher.Batcher`) against a stand-in predictor that answers zeros at once,
and ``--frontends`` real frontend processes (spawned, real shared memory and pipes), each
pumping ``--concurrency`` threads of prebuilt columnar requests of ``--candidates`` candidates
(the seed feature set's synthetic requests, validated and built into batches as the server
does) through a :class:`~serve.handoff.HandoffClient` as fast as the answers come back. After a
warm-up, ``--repeats`` windows of ``--duration-s`` each measure requests/s, candidates/s and the
device process's CPU seconds per request (``time.process_time``: every thread of it: the pipe
readers, the batcher, the answers) and the p50/p99 round trip of a request (a frontend's submit
to its answer: the handoff's latency, without a model); the report gives each window and their
medians::

    python -m bench.bench_handoff --frontends 2 --duration-s 3 --out results/handoff.json

``--predictor fill`` also does a CUDA-graph batch's host work in the device process, on the CPU:
the stand-in predictor holds :class:`~serve.graphs.CudaGraphs` with the buckets of
``--max-batch-rows`` (host buffers only, nothing captured) and pads each batch into the
smallest that fits (the pair count, bucket choice, :meth:`~serve.graphs.BucketGraph.fill`, the
padding's statistics), then answers zeros: all of the serving path's main-process CPU but the
replay (which builds the pairs on the device) and the wait for the scores.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.cli import Parser, plain, run_cli
from shared.cli import exit_code as _exit_code

EXAMPLE = """examples:
  python -m bench.bench_handoff --frontends 2 --duration-s 3 --out results/handoff.json
  python -m bench.bench_handoff --frontends 1 --concurrency 1 --duration-s 1 --out /tmp/h.json"""
_CTX = mp.get_context("spawn")


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_handoff", description=plain(__doc__), epilog=EXAMPLE)
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--frontends", type=int, default=2, help="frontend processes")
    p.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="threads per frontend, each one request at a time",
    )
    p.add_argument("--candidates", type=int, default=500, help="candidate ads per request")
    p.add_argument(
        "--sequence-length",
        type=int,
        default=5,
        help="clicks in each request's sequence (the serving bench's traffic has ~50: the "
        "sequence ids per batch grow with it, and so did the host's pair work before the graphs "
        "built the pairs)",
    )
    p.add_argument("--duration-s", type=float, default=3.0, help="seconds of one measured window")
    p.add_argument("--warmup-s", type=float, default=1.0, help="seconds before the first window")
    p.add_argument("--repeats", type=int, default=3, help="measured windows (medians reported)")
    p.add_argument(
        "--max-batch-rows", type=int, default=8192, help="the batcher's rows per batch (CUDA's)"
    )
    p.add_argument("--max-wait-us", type=int, default=500, help="the batcher's max wait")
    p.add_argument("--slots", type=int, default=32, help="handoff slots per frontend")
    p.add_argument("--slot-kib", type=int, default=1024, help="handoff slot size in KiB")
    p.add_argument(
        "--predictor",
        choices=("zero", "fill"),
        default="zero",
        help="zero: answers at once; fill: pads each batch into a CUDA graph bucket's host "
        "slots first (on the CPU), as the GPU server does before a replay",
    )
    p.add_argument(
        "--inflight",
        type=int,
        default=2,
        help="groups a frontend has in flight before it groups requests (HandoffConfig.inflight);"
        " 0: never group, one message per request as before grouping",
    )
    return p


class _ZeroModel:
    """A stand-in predictor: zeros at once (the model costs nothing)."""

    version = "bench"

    def __init__(self) -> None:
        self.bundle = type("Bundle", (), {"config_digest": "0" * 64})()

    def predict(self, batch: Any) -> torch.Tensor:
        return torch.zeros(batch.batch_size)


class _FillModel(_ZeroModel):
    """Zeros after the host side of a CUDA graph replay (see the module docstring)."""

    takes_host_batches = True  # serve.batcher: handed-off batches as HostBatches

    def __init__(self, max_rows: int) -> None:
        from types import SimpleNamespace

        from bench.synthetic_bundle import seed_feature_set
        from serve.graphs import BucketGraph, CudaGraphs, default_buckets
        from serve.model import synthetic_batch
        from shared.dense_inputs import dense_layout

        super().__init__()
        fs = seed_feature_set()
        tables = SimpleNamespace(layout=dense_layout(fs), discount_padding=lambda padding: None)
        self.device = torch.device("cpu")
        self.fs, self.tables, self.program = fs, tables, object()
        probe = synthetic_batch(fs, 1, 1, (0,))
        keys = [tuple(k.keys()) for k in (probe.user, probe.item, probe.sequence)]
        self.graphs = CudaGraphs(self, keys)  # type: ignore[arg-type]
        buckets = sorted(default_buckets(max_rows))
        self.graphs.graphs = [BucketGraph(self, b, keys) for b in buckets]  # type: ignore[arg-type]
        self.filled = 0

    def predict(self, batch: Any) -> torch.Tensor:
        graphs = self.graphs
        if hasattr(graphs, "prepare"):
            graph = graphs.prepare(batch)
        else:  # the code before CudaGraphs.prepare: the same steps
            from shared.dense_inputs import batch_pairs

            assert graphs._refusal(batch) is None
            seg, elem = batch_pairs(batch, self.tables.layout)
            graph = graphs._fit(batch, seg.shape[0])
            if graph is not None:
                graph.fill(batch, seg, elem)
        self.filled += graph is not None
        return torch.zeros(batch.batch_size)


class _Handle:
    def __init__(self, token: int) -> None:
        self.token = token


def _frontend(
    index: int,
    conn: Connection,
    arena_name: str,
    config: Any,
    token: int,
    candidates: int,
    sequence_length: int,
    concurrency: int,
    max_rows: int,
    counts: Any,
    ready: Any,
    go: Any,
    stop: Any,
    latency_file: str,
) -> None:
    """One frontend process: ``concurrency`` threads submitting prebuilt batches; at the end,
    (submit time.monotonic(), round trip s) of every answered request to ``latency_file``."""
    from bench.synthetic_bundle import as_columnar, seed_feature_set, synthetic_request
    from serve.handoff import HandoffClient
    from serve.limits import Limits

    try:
        from serve.slots import SlotArena
    except ImportError:  # the code before serve/slots.py (an A/B against an older revision)
        from serve.handoff import SlotArena  # type: ignore[attr-defined,no-redef]
    from serve.validation import request_inputs
    from shared.fg_request import request_columns_to_batch

    torch.set_num_threads(1)
    fs = seed_feature_set()
    limits = Limits(max_candidates=max(candidates, Limits().max_candidates))
    rng = np.random.default_rng(index)
    batches = []
    for _ in range(8):
        req = synthetic_request(fs, rng, candidates=candidates, sequence_length=sequence_length)
        req = as_columnar(fs, req)
        batches.append(request_columns_to_batch(fs, **vars(request_inputs(req, fs, limits))))
    arena = SlotArena.attach(arena_name, config)
    try:  # an older serve.handoff (no grouping) takes no max_group_rows
        client = HandoffClient(conn, arena, name=f"bench-frontend-{index}", max_group_rows=max_rows)
    except TypeError:
        client = HandoffClient(conn, arena, name=f"bench-frontend-{index}")
    client.start()
    handle = _Handle(token)
    lock = threading.Lock()
    errors: list[str] = []
    trips: list[tuple[float, float]] = []  # (submitted, seconds to the answer)

    def pump(k: int) -> None:
        i = k
        while not stop.is_set():
            batch = batches[i % len(batches)]
            i += 1
            t = time.monotonic()
            try:
                probs = client.submit(handle, batch, deadline=t + 30).result(30)
                assert probs.shape == (batch.batch_size,)
            except Exception as err:  # counted, never fatal: the report says how many
                errors.append(repr(err))
                continue
            trips.append((t, time.monotonic() - t))  # list.append: atomic under the GIL
            with lock:
                counts[2 * index] += 1
                counts[2 * index + 1] += batch.batch_size

    ready[index] = 1
    go.wait()
    threads = [threading.Thread(target=pump, args=(k,), daemon=True) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.save(latency_file, np.asarray(trips, dtype=np.float64).reshape(-1, 2))
    ready[index] = 2 + len(errors)  # 2: done, more: errors
    counts[2 * index] = getattr(client, "groups_sent", 0)  # read by the device side at the end
    counts[2 * index + 1] = getattr(client, "requests_sent", 0)
    client.close()
    arena.close()


def _round_trips(trips: np.ndarray, span: tuple[float, float]) -> dict[str, float]:
    """p50/p99 ms of the round trips (frontend submit to answer) submitted within ``span``."""
    inside = trips[(trips[:, 0] >= span[0]) & (trips[:, 0] < span[1]), 1] * 1e3  # [n] ms
    if not len(inside):
        return {"round_trip_p50_ms": float("nan"), "round_trip_p99_ms": float("nan")}
    p50, p99 = np.percentile(inside, [50, 99])
    return {"round_trip_p50_ms": float(p50), "round_trip_p99_ms": float(p99)}


def measure(a: Any, work: str) -> dict[str, Any]:
    """Start the device side and the frontends (their round trips written under ``work``),
    measure the windows; the report."""
    from serve.batcher import Batcher, BatcherConfig, BatchStats
    from serve.handoff import HandoffServer, ModelRegistry
    from serve.servicer import status_of

    try:
        from serve.slots import HandoffConfig, SlotArena
    except ImportError:  # the code before serve/slots.py (an A/B against an older revision)
        from serve.handoff import HandoffConfig, SlotArena  # type: ignore[attr-defined,no-redef]

    grouping = "inflight" in HandoffConfig.__dataclass_fields__  # False: the code before it
    inflight = {"inflight": a.inflight or 1 << 30} if grouping else {}
    config = HandoffConfig(a.slots, a.slot_kib << 10, **inflight)
    model = _FillModel(a.max_batch_rows) if a.predictor == "fill" else _ZeroModel()
    models = ModelRegistry(lambda: model)
    token = models.register(model)
    batches = [0, 0]  # batches, requests in them

    def on_batch(stats: BatchStats) -> None:
        batches[0] += 1
        batches[1] += stats.requests

    # every pump thread has one request out at all times (closed loop): the server's count of
    # admitted requests, for the batcher's "could another one still join" (serve.batcher)
    batcher = Batcher(
        BatcherConfig(a.max_batch_rows, a.max_wait_us),
        on_batch=on_batch,
        outstanding=lambda: a.frontends * a.concurrency,
    )
    counts = _CTX.RawArray("q", 2 * a.frontends)  # per frontend: requests, candidates done
    ready = _CTX.RawArray("q", a.frontends)
    go, stop = _CTX.Event(), _CTX.Event()
    procs, servers, arenas = [], [], []
    try:
        for i in range(a.frontends):
            arena = SlotArena.create(config)
            arenas.append(arena)
            mine, theirs = _CTX.Pipe(duplex=True)
            args = (
                i,
                theirs,
                arena.name,
                config,
                token,
                a.candidates,
                a.sequence_length,
                a.concurrency,
                a.max_batch_rows,
            )
            trips = str(Path(work) / f"trips-{i}.npy")
            proc = _CTX.Process(
                target=_frontend, args=(*args, counts, ready, go, stop, trips), daemon=True
            )
            proc.start()
            theirs.close()
            procs.append(proc)
            server = HandoffServer(mine, arena, batcher, models, status_of, f"frontend-{i}")
            server.start()
            servers.append(server)
        deadline = time.monotonic() + 120
        while min(ready) < 1:
            if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                raise RuntimeError("the bench frontends did not start")
            time.sleep(0.05)
        go.set()
        time.sleep(a.warmup_s)
        windows = []
        spans = []  # (start, end) time.monotonic() of each window, for the round trips
        for _ in range(a.repeats):
            r0, c0, b0 = sum(counts[0::2]), sum(counts[1::2]), list(batches)
            cpu0, t0 = time.process_time(), time.monotonic()
            time.sleep(a.duration_s)
            cpu1, t1 = time.process_time(), time.monotonic()
            spans.append((t0, t1))
            r1, c1, b1 = sum(counts[0::2]), sum(counts[1::2]), list(batches)
            n, wall = max(r1 - r0, 1), t1 - t0
            windows.append(
                {
                    "requests": r1 - r0,
                    "seconds": wall,
                    "requests_per_s": (r1 - r0) / wall,
                    "candidates_per_s": (c1 - c0) / wall,
                    "main_cpu_s": cpu1 - cpu0,
                    "main_cpu_us_per_request": (cpu1 - cpu0) / n * 1e6,
                    "main_cpu_busy": (cpu1 - cpu0) / wall,
                    "batches": b1[0] - b0[0],
                    "requests_per_batch": (b1[1] - b0[1]) / max(b1[0] - b0[0], 1),
                }
            )
        stop.set()
        for p in procs:
            p.join(30)
        errors = sum(max(int(r) - 2, 0) for r in ready)
        trips_all = np.concatenate(
            [np.load(Path(work) / f"trips-{i}.npy") for i in range(a.frontends)]
        )
        for window, span in zip(windows, spans, strict=True):
            window.update(_round_trips(trips_all, span))
        groups, grouped = sum(counts[0::2]), sum(counts[1::2])  # what the frontends wrote last
    finally:
        stop.set()
        go.set()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for s in servers:
            s.close()
        batcher.close()
        for arena in arenas:
            arena.close()
    keys = [k for k in windows[0] if k not in ("seconds",)]
    return {
        "benchmark": "device-process cost per request of serve --frontends (serve.handoff)",
        "frontends": a.frontends,
        "concurrency": a.concurrency,
        "candidates": a.candidates,
        "sequence_length": a.sequence_length,
        "max_batch_rows": a.max_batch_rows,
        "max_wait_us": a.max_wait_us,
        "handoff_slots": a.slots,
        "handoff_slot_kib": a.slot_kib,
        "grouping": grouping and a.inflight > 0,
        "inflight": a.inflight if grouping else None,
        "predictor": a.predictor,
        "batches_filled": getattr(model, "filled", None),
        "requests_per_handoff": grouped / groups if groups else 1.0,
        "errors": errors,
        "median": {k: statistics.median(w[k] for w in windows) for k in keys},
        "windows": windows,
    }


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    for flag, value in (
        ("--frontends", a.frontends),
        ("--concurrency", a.concurrency),
        ("--candidates", a.candidates),
        ("--sequence-length", a.sequence_length),
        ("--repeats", a.repeats),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if a.duration_s <= 0:
        raise ValueError(f"--duration-s must be > 0, got {a.duration_s}")
    with tempfile.TemporaryDirectory(prefix="bench-handoff-") as work:
        report = measure(a, work)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"errors": report["errors"], **report["median"]}))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
