"""Predict throughput and latency of ``python -m serve`` under locust, GPU against a CPU baseline
in the same run, with a profile of where the server's time goes.

    python -m bench.bench_serving --out results/serving --devices cuda cpu --candidates 500 \\
        --users 32 --workers 1 4 --duration 20 --processes 4 [--formats columnar rows]
    python -m bench.bench_serving --out results/serving --run cuda:1:500:32:rows --run cuda:1:500:32

Steps (one call, everything under ``--work`` except what lands in ``--out``):

1. A bundle: ``--bundle``, or a synthetic one with ``--keys`` keys over the six dynamic tables
   (split like the full Taobao vocabularies, dim 16) and the seed config's real MultiTowerDIN
   dense part (random weights: cost does not depend on them) exported with the pair inputs
   (bundle format 3, :func:`bench.synthetic_bundle.export_seed_program`), so that CUDA servers
   can replay their batches from CUDA graphs (:mod:`serve.graphs`).
2. Eval samples for the requests: ``--samples``, or ``python -m train.data all --size small``.
   Requests are real eval rows (user, click sequences, context) with ``--candidates`` ads each
   (``loadtest.requests``), their candidates as ``candidate_columns`` (format ``columnar``) or
   as one ``Features`` per ad (format ``rows``).
3. Offline profile per device, in this process before any server starts: per request and per
   request format (rows and columnar, the same requests) the wire parse, validation, feature
   generation and response building; per batch of k requests the
   concatenation, host-to-device copy, lookups + dense program and the copy back, each timed
   with the device synchronized, and on CUDA a torch.profiler table of ``predict`` of one batch (one
   request of ``--candidates``: kernel time, kernel and graph launches, host syncs). On CUDA the
   profile is made once per ``--cuda-graphs`` value (the same bundle, the model loaded with the
   server's default graph buckets or none), with the graph stats (captures, replays, batches run
   eagerly by reason, capture seconds and memory).
4. Per run (device x workers x candidates x users x switch interval x request format,
   ``--run DEVICE:WORKERS:CANDIDATES:USERS[:SWITCH_MS][:FORMAT]``): ``workers`` server
   processes ``python -m serve --reuse-port`` on one port (WORKERS ``fN``, or ``--frontends N``:
   one ``python -m serve --frontends N`` owning the device, N frontend processes on the port), then locust (``loadtest.run``, its
   ``--processes`` load-generator processes, closed loop) for ``--duration`` s; a CUDA run is
   made once per ``--cuda-graphs`` value (``serve --cuda-graphs on|off``). Measured: exact
   percentiles of the raw latencies (whole run and steady state after ``--warmup-s``),
   candidates/s, the server's own stage times (``dynrec_serving_stage_seconds``: validate, fg,
   queue wait, concat, h2d, compute, sync, respond; wall and thread-CPU), batch sizes, CPU cores
   used by the servers and by the whole machine, GPU utilization (nvidia-smi), the servers'
   graph stats (``dynrec_serving_graph_*``: replays, eager batches by reason), and a py-spy
   ``--gil`` profile of the first server process (what holds the GIL, and how often anything
   does), when py-spy is installed. Servers are always stopped (SIGTERM, then SIGKILL).

Writes ``<out>/bench_serving.json`` and ``<out>/pyspy_raw.txt`` (collapsed stacks per run) and
prints a table last. On the GPU machine (no locust there): carry the wheels of
``scripts/gpu_wheels.py`` in ``.whl`` (see ``bench/run_serving_gpu.sh``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import itertools
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.py_spy import find_py_spy, record_stacks
from shared.cli import Parser, plain, run_cli
from shared.cli import exit_code as _exit_code

ROOT = Path(__file__).resolve().parents[1]
# issue #19: throughput at a p99 bound, and the p99 of a run at low load
GOAL = {"candidates_per_s": 1_000_000, "p99_ms": 10.0}
LATENCY_GOAL = {"candidates_per_s": 100_000, "p99_ms": 5.0}
REQUEST_FORMATS = ("rows", "columnar")  # PredictRequest.candidates / .candidate_columns
EXAMPLE = """examples:
  python -m bench.bench_serving --out results/serving --devices cuda cpu --candidates 500 \\
      --users 32 --workers 1 4 --duration 20 --processes 4
  python -m bench.bench_serving --out results/serving --run cuda:1:500:32:rows --run cuda:1:500:32"""
PERCENTILES = {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0, "p99.9": 99.9}


def log(msg: str) -> None:
    print(f"[bench_serving {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- inputs


def make_bundle(work: Path, keys: int, seed: int = 0) -> tuple[Path, dict[str, Any]]:
    """A synthetic bundle (format 3) of the seed config with ``keys`` dynamic keys and the real
    dense part taking the pair inputs."""
    from bench.synthetic_bundle import (
        export_seed_program,
        keys_per_table,
        seed_feature_set,
        write_synthetic_bundle,
    )
    from shared.bundle import read_bundle

    fs = seed_feature_set()
    per_table = keys_per_table(fs, keys)
    t0 = time.perf_counter()
    program = export_seed_program(fs, work / "dense.pt2", pairs=True, seed=seed)
    path = write_synthetic_bundle(
        work / "bundle", fs, keys=per_table, program_path=program, version="bench", seed=seed,
        overwrite=True,
    )  # fmt: skip
    info = {
        "path": str(path),
        "synthetic": True,
        "keys_total": sum(per_table.values()),
        "keys_per_table": per_table,
        "dense_program": "MultiTowerDIN dense part (seed config, random weights, pair inputs)",
        "format_version": read_bundle(path, verify_checksums=False).format_version,
        "build_s": time.perf_counter() - t0,
    }
    return path, info


def make_samples(work: Path, size: str) -> Path:
    out = work / "data"
    samples = out / "samples" / "eval"
    if not samples.is_dir():
        cmd = [sys.executable, "-m", "train.data", "all", "--size", size, "--out", str(out)]
        subprocess.run(cmd, cwd=ROOT, env=_env(), check=True, stdout=subprocess.DEVNULL)
    return samples


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(values_ms: np.ndarray) -> dict[str, float | None]:
    if not len(values_ms):
        return dict.fromkeys([*PERCENTILES, "mean", "max"], None)
    pct = np.percentile(values_ms, list(PERCENTILES.values()))
    out: dict[str, float | None] = {k: float(v) for k, v in zip(PERCENTILES, pct, strict=True)}
    out["mean"] = float(values_ms.mean())
    out["max"] = float(values_ms.max())
    return out


def _median_ms(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * 1e3


# --------------------------------------------------------------------------- offline profile


def offline_profile(
    bundle: Path,
    device: str,
    samples: Path,
    candidates: int,
    *,
    torch_threads: int,
    graph_buckets: Sequence[Any] = (),
    batch_requests: Sequence[int] = (1, 4, 16),
    iters: int = 30,
) -> dict[str, Any]:
    """Per-stage medians of the request path on ``device`` in this process, device synced.
    ``graph_buckets`` (CUDA): the model replays its batches from CUDA graphs, as a server with
    ``--cuda-graphs on`` (``predict_unsynced`` and the profile; the other per-batch times are
    the eager path's pieces, timed one by one)."""
    import torch

    from loadtest.requests import (
        build_request_pool,
        sequence_formats_from_metadata,
        sides_from_metadata,
        value_types_from_metadata,
    )
    from protos import predict_pb2
    from serve.batcher import concat_batches
    from serve.limits import Limits
    from serve.model import LoadedModel
    from serve.servicer import model_metadata
    from serve.validation import request_inputs
    from shared.fg_request import request_columns_to_batch

    torch.set_num_threads(torch_threads)
    limits = Limits(max_candidates=max(candidates, 1000))
    model = LoadedModel.load(bundle, device=device, graph_buckets=graph_buckets)
    dev = model.device

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    md = model_metadata(model, limits)
    out: dict[str, Any] = {
        "device": str(dev),
        "candidates": candidates,
        "cuda_graphs": model.graphs is not None,
        "startup_seconds": model.startup.as_dict(),
        "request_bytes_mean": {},
        "per_request_ms": {},  # per request format: parse, validate, fg, respond, host_total
    }
    batches = []
    for fmt in REQUEST_FORMATS:  # the same requests (same seed), candidates encoded two ways
        pool = build_request_pool(
            samples, sides_from_metadata(md), value_types=value_types_from_metadata(md),
            num_requests=64, num_candidates=candidates,
            sequence_formats=sequence_formats_from_metadata(md), columnar=fmt == "columnar",
        )  # fmt: skip
        per_request: dict[str, list[float]] = collections.defaultdict(list)
        for payload in itertools.islice(itertools.cycle(pool.payloads), max(iters, 64)):
            t0 = time.perf_counter()
            req = predict_pb2.PredictRequest.FromString(payload)
            t1 = time.perf_counter()
            inputs = request_inputs(req, model.fs, limits)
            t2 = time.perf_counter()
            batch = request_columns_to_batch(model.fs, **vars(inputs))
            t3 = time.perf_counter()
            probs = np.zeros(candidates, np.float32)
            wire = predict_pb2.PredictResponse(
                probabilities=probs.tolist(), model_version=model.version, request_id="x"
            ).SerializeToString()
            t4 = time.perf_counter()
            for k, dt in zip(("parse", "validate", "fg", "respond"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):  # fmt: skip
                per_request[k].append(dt)
            if fmt == "columnar":
                batches.append(batch)
        row = {k: _median_ms(v) for k, v in per_request.items()}
        row["host_total"] = sum(row.values())
        out["per_request_ms"][fmt] = row
        out["request_bytes_mean"][fmt] = float(np.mean([len(p) for p in pool.payloads]))
    out["response_bytes"] = len(wire)
    per_batch: dict[str, Any] = {}
    for k in batch_requests:
        times: dict[str, list[float]] = collections.defaultdict(list)
        for rep in range(max(iters // 2, 5) + 2):
            group = [batches[(rep * k + j) % len(batches)] for j in range(k)]
            sync()
            t0 = time.perf_counter()
            b = concat_batches(group)
            t1 = time.perf_counter()
            on_dev = model.to_device(b)
            sync()
            t2 = time.perf_counter()
            with torch.inference_mode():
                logits = model._logits(on_dev)
            t3 = time.perf_counter()
            sync()
            t4 = time.perf_counter()
            logits.float().cpu()
            t5 = time.perf_counter()
            timings: dict[str, float] = {}
            model.predict(b, timings=timings)  # the same batch as the batcher runs it
            t6 = time.perf_counter()
            b.to(dev, non_blocking=True)  # the copy before batch_to_device: a tensor at a time
            sync()
            t7 = time.perf_counter()
            if rep < 2:
                continue  # warm-up of this shape
            for name, dt in (
                ("concat", t1 - t0), ("h2d", t2 - t1), ("compute_launch", t3 - t2),
                ("compute_device_wait", t4 - t3), ("d2h", t5 - t4), ("predict_unsynced", t6 - t5),
                ("h2d_per_tensor", t7 - t6),
            ):  # fmt: skip
                times[name].append(dt)
        row = {name: _median_ms(v) for name, v in times.items()}
        row["rows"] = k * candidates
        row["candidates_per_s_model_only"] = k * candidates / (row["predict_unsynced"] / 1e3)
        per_batch[str(k)] = row
    out["per_batch_ms"] = per_batch
    if dev.type == "cuda":
        out["torch_profiler"] = _torch_profile(model, batches[0])  # one request's batch
    stats = model.graph_stats()
    out["graph_stats"] = None if stats is None else stats.as_dict()
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _torch_profile(model: Any, batch: Any) -> dict[str, Any]:
    """Kernel time vs host time of one predict() of ``batch``, launches and host syncs: a graph
    replay is one ``cudaGraphLaunch`` for all its kernels (``launches`` counts both kinds)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        model.predict(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        model.predict(batch)
        wall = time.perf_counter() - t0
    events = prof.key_averages()

    def total(pred: Any, attr: str = "count") -> float:
        return float(sum(getattr(e, attr) for e in events if pred(e.key)))

    rows = []
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
        rows.append(
            {
                "op": e.key,
                "count": e.count,
                "self_cpu_us": e.self_cpu_time_total,
                "self_device_us": e.self_device_time_total,
            }
        )
    kernel_us = sum(
        e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA
    )
    return {
        "batch_rows": int(batch.batch_size),
        "wall_ms": wall * 1e3,
        "device_kernel_ms": kernel_us / 1e3,
        "kernel_launches": (kernels := total(lambda k: k in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))),
        "graph_launches": (graphs := total(lambda k: k in ("cudaGraphLaunch", "cuGraphLaunch"))),
        "launches": kernels + graphs,
        "memcpy_calls": total(lambda k: k.startswith("cudaMemcpy")),
        "stream_syncs": total(lambda k: k in ("cudaStreamSynchronize", "cudaDeviceSynchronize")),
        "item_calls": total(lambda k: k in ("aten::item", "aten::_local_scalar_dense")),
        "aten_ops": total(lambda k: k.startswith("aten::")),
        "top_device_ops": rows,
    }  # fmt: skip


# --------------------------------------------------------------------------- servers


@dataclass
class ServerGroup:
    """``workers`` ``python -m serve`` processes sharing one port (SO_REUSEPORT), serving
    ``source`` (``["--bundle", DIR]`` or ``["--model-dir", DIR, ...]``)."""

    source: Sequence[str]
    device: str
    workers: int
    work: Path
    extra_args: list[str]
    port: int = field(default_factory=_free_port)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    metrics_ports: list[int] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300.0) -> float:
        """Start every worker; returns seconds until all printed SERVING."""
        t0 = time.perf_counter()
        for i in range(self.workers):
            mport = _free_port()
            log_file = self.work / f"serve-{self.device}-{self.port}-{i}.log"
            cmd = [
                sys.executable, "-m", "serve", *self.source,
                "--port", str(self.port), "--reuse-port", "--metrics-port", str(mport),
                "--device", self.device, *self.extra_args,
            ]  # fmt: skip
            with open(log_file, "wb") as f:
                proc = subprocess.Popen(
                    cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT
                )
            self.procs.append(proc)
            self.metrics_ports.append(mport)
            self.logs.append(log_file)
        deadline = time.monotonic() + timeout_s
        pending = set(range(self.workers))
        while pending:
            for i in list(pending):
                if "SERVING on" in self.logs[i].read_text(errors="replace"):
                    pending.discard(i)
                elif self.procs[i].poll() is not None:
                    raise RuntimeError(
                        f"server {i} exited with {self.procs[i].returncode}:\n{self.tail(i)}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"servers {sorted(pending)} not SERVING after {timeout_s:.0f} s")
            time.sleep(0.2)
        return time.perf_counter() - t0

    def tail(self, i: int, chars: int = 3000) -> str:
        return self.logs[i].read_text(errors="replace")[-chars:]

    def stop(self) -> list[int | None]:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes: list[int | None] = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=15))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                codes.append(None)
        return codes


def _with_children(pids: Sequence[int]) -> list[int]:
    """``pids`` and their child processes (a ``--frontends`` server's frontends)."""
    out = list(pids)
    for pid in pids:
        with contextlib.suppress(OSError):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return out


def scrape(ports: Sequence[int]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus samples of every port, summed over the ports: {(name, labels): value}."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = collections.defaultdict(float)
    for port in ports:
        with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[s.name, tuple(sorted(s.labels.items()))] += float(s.value)
    return out


def _sum(scrapes: Sequence[dict[Any, float]]) -> dict[Any, float]:
    out: dict[Any, float] = collections.defaultdict(float)
    for one in scrapes:
        for k, v in one.items():
            out[k] += v
    return out


def server_profile(
    before: dict[Any, float],
    after: dict[Any, float],
    elapsed_s: float | None = None,
    workers: int = 1,
) -> dict[str, Any]:
    """Means per request / per batch of the server's stage histograms between two scrapes.

    With ``elapsed_s`` (the load window) also the share of time each worker's batcher thread
    was running a batch (1.0: it is the bottleneck) and the cores the stages' CPU time adds to.
    """
    d = {k: after[k] - before.get(k, 0.0) for k in after}

    def get(name: str, **labels: str) -> float:
        return d.get((name, tuple(sorted(labels.items()))), 0.0)

    p = "dynrec_serving_"
    requests = get(f"{p}request_latency_seconds_count", method="Predict")
    batches = get(f"{p}batch_rows_count")
    stages: dict[str, dict[str, float | None]] = {}
    names = sorted({dict(k[1]).get("stage", "") for k in d if k[0] == f"{p}stage_seconds_sum"})
    for stage in names:
        row: dict[str, float | None] = {}
        for clock in ("wall", "cpu"):
            n = get(f"{p}stage_seconds_count", stage=stage, clock=clock)
            s = get(f"{p}stage_seconds_sum", stage=stage, clock=clock)
            row[f"{clock}_ms_mean"] = s / n * 1e3 if n else None
            row[f"{clock}_ms_per_request"] = s / requests * 1e3 if requests and n else None
        stages[stage] = row
    errors = {
        dict(k[1]).get("code", "?"): v for k, v in d.items() if k[0] == f"{p}errors_total" and v
    }
    busy: dict[str, float | None] = {}
    if elapsed_s:
        total = elapsed_s * workers

        def cpu(*names: str) -> float:
            return sum(get(f"{p}stage_seconds_sum", stage=n, clock="cpu") for n in names)

        wall = get(f"{p}stage_seconds_sum", stage="batch", clock="wall")
        busy = {
            "batcher_busy_fraction": wall / total,
            "batcher_cpu_fraction": cpu("batch") / total,
            "rpc_stage_cpu_cores": cpu("validate", "fg", "respond") / elapsed_s,
            "batcher_cpu_cores": cpu("batch") / elapsed_s,
        }
    return {
        "requests": requests,
        "batches": batches,
        **busy,
        "rows_per_batch": get(f"{p}batch_rows_sum") / batches if batches else None,
        "requests_per_batch": get(f"{p}batch_requests_sum") / batches if batches else None,
        "server_latency_ms_mean": (
            get(f"{p}request_latency_seconds_sum", method="Predict") / requests * 1e3
            if requests
            else None
        ),
        "errors": errors,
        "stages": stages,
    }


# --------------------------------------------------------------------------- samplers


class CpuSampler:
    """Every ``interval`` s: CPU seconds of the server processes, of the load generator (this
    process's descendants running locust) and of the whole machine."""

    def __init__(self, pids: Sequence[int], interval: float = 0.5) -> None:
        import psutil

        self._procs = [psutil.Process(p) for p in pids]
        self._servers = set(pids)
        self._me = psutil.Process()
        self._psutil = psutil
        # (unix time, server cpu s, load generator cpu s, machine busy s)
        self.samples: list[tuple[float, float, float, float]] = []
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> tuple[float, float, float, float]:
        server = load = 0.0
        for p in self._procs:
            with contextlib.suppress(Exception):
                t = p.cpu_times()
                server += t.user + t.system
        for c in self._me.children(recursive=True):
            with contextlib.suppress(Exception):
                if c.pid not in self._servers and "locust" in " ".join(c.cmdline()):
                    t = c.cpu_times()
                    load += t.user + t.system
        t = self._psutil.cpu_times()
        busy = sum(
            getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal")
        )
        return time.time(), server, load, busy

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._read())
            self._stop.wait(self._interval)

    def start(self) -> CpuSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def rates(self, t0: float, t1: float) -> dict[str, float | None]:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return {"server_cores": None, "load_generator_cores": None, "machine_busy_cores": None}
        (a, sa, la, ba), (b, sb, lb, bb) = inside[0], inside[-1]
        return {
            "server_cores": (sb - sa) / (b - a),
            "load_generator_cores": (lb - la) / (b - a),  # locust's processes (#19: its CPU)
            "machine_busy_cores": (bb - ba) / (b - a),
            "machine_cores": float(os.cpu_count() or 0),
        }


class GpuSampler:
    """nvidia-smi utilization and memory every 200 ms (nothing when nvidia-smi is missing)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []  # (unix time, util %, MiB used)
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> GpuSampler:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return self
        cmd = [exe, "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits", "-lms", "200"]  # fmt: skip
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            with contextlib.suppress(ValueError):
                util, mem = (float(x) for x in line.split(",")[:2])
                self.samples.append((time.time(), util, mem))

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)

    def stats(self, t0: float, t1: float) -> dict[str, float | None] | None:
        if self._proc is None:
            return None
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside:
            return {"util_pct_mean": None, "util_pct_p50": None, "mem_used_mib_max": None}
        util = np.array([s[1] for s in inside])
        return {
            "util_pct_mean": float(util.mean()),
            "util_pct_p50": float(np.median(util)),
            "mem_used_mib_max": float(max(s[2] for s in inside)),
            "samples": len(inside),
        }


# py-spy frames look like "Class.method (path:line)"; a sample's category is that of its
# innermost frame that matches (so the dense program under _run_batch counts as the program)
def _fn(name: str, path: str = "") -> re.Pattern[str]:
    return re.compile(rf"(^|\.){name} \(.*{path}")


_CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    (
        "batch: concat",
        _fn("(concat_batches|merge_batches|concat)", r"serve/(batcher|host_batch)\.py"),
    ),
    ("batch: h2d", _fn("(batch_to_device|to_device)", r"serve/model\.py")),
    ("batch: lookups", _fn("embed", r"serve/lookup\.py")),
    ("batch: dense program", _fn("(_logits|logits)", r"serve/model\.py")),
    ("batch: other", _fn("(_run_batch|_run|_take)", r"serve/batcher\.py")),
    ("rpc: validate", _fn("request_inputs", r"serve/validation\.py")),
    ("rpc: fg", _fn("request_columns_to_batch", r"shared/fg_request\.py")),
    ("rpc: metrics", re.compile(r"prometheus_client|serve/metrics\.py")),
    ("rpc: servicer", re.compile(r"serve/servicer\.py")),
    ("grpc: (de)serialize, dispatch", re.compile(r"grpc/")),
]


def summarize_py_spy(raw: str, rate: int, seconds: float) -> dict[str, Any]:
    """GIL-holding samples (py-spy --gil) by category, and the hottest leaf functions."""
    cats: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        leaves[re.sub(r":\d+\)$", ")", frames[-1])] += n
        cat = "other"
        for frame in reversed(frames):
            hit = next((name for name, pat in _CATEGORIES if pat.search(frame)), None)
            if hit:
                cat = hit
                break
        cats[cat] += n
    expected = rate * seconds
    return {
        "samples_holding_gil": total,
        "samples_expected": expected,
        "gil_busy_fraction": total / expected if expected else None,
        "by_category": {k: v / total for k, v in cats.most_common()} if total else {},
        "top_leaf_functions": [{"frame": k, "share": v / total} for k, v in leaves.most_common(15)]
        if total
        else [],
    }


# --------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class RunSpec:
    device: str
    workers: int
    candidates: int
    users: int
    switch_interval_ms: float | None
    request_format: str = "columnar"  # candidates as candidate_columns, or "rows" (candidates)
    cuda_graphs: str | None = None  # CUDA servers: "on" or "off" (serve --cuda-graphs)
    # > 0: one device process with this many frontends (serve --frontends N; WORKERS "fN")
    frontends: int = 0

    @classmethod
    def parse(cls, text: str, default_format: str = "columnar") -> RunSpec:
        """``DEVICE:WORKERS:CANDIDATES:USERS[:SWITCH_MS][:FORMAT]``, e.g. ``cuda:4:500:32``,
        ``cuda:1:500:32:0.5``, ``cuda:1:500:32:rows``; FORMAT is ``columnar`` or ``rows``
        (default ``default_format``). WORKERS ``fN`` (``cuda:f8:500:64``): one server process
        owning the device with N frontend processes (``serve --frontends N``) instead of
        WORKERS whole servers."""
        parts = text.split(":")
        usage = f"--run {text!r}: expected DEVICE:WORKERS:CANDIDATES:USERS[:SWITCH_MS][:FORMAT]"
        if not 4 <= len(parts) <= 6 or parts[0] not in ("cuda", "cpu"):
            raise SystemExit(usage)
        fmt, rest = default_format, parts[4:]
        if rest and rest[-1] in REQUEST_FORMATS:
            fmt, rest = rest[-1], rest[:-1]
        if len(rest) > 1:
            raise SystemExit(usage)
        try:
            switch = float(rest[0]) if rest and rest[0] else None
            frontends = int(parts[1][1:]) if parts[1].startswith("f") else 0
            workers = 1 if frontends else int(parts[1])
            if parts[1].startswith("f") and frontends < 1:
                raise ValueError(parts[1])
            return cls(
                parts[0], workers, int(parts[2]), int(parts[3]), switch, fmt, frontends=frontends
            )
        except ValueError:
            raise SystemExit(f"{usage} (FORMAT: {' or '.join(REQUEST_FORMATS)})") from None

    @property
    def name(self) -> str:
        procs = f"f{self.frontends}" if self.frontends else f"w{self.workers}"
        s = f"{self.device}-{procs}-c{self.candidates}-u{self.users}"
        if self.switch_interval_ms is not None:
            s += f"-si{self.switch_interval_ms:g}"
        s += f"-{self.request_format}"
        return s if self.cuda_graphs is None else f"{s}-graphs-{self.cuda_graphs}"

    def with_graphs(self, choices: Sequence[str]) -> list[RunSpec]:
        """This run once per ``--cuda-graphs`` choice on CUDA; as it is on the CPU."""
        if self.device != "cuda":
            return [self]
        return [dataclasses.replace(self, cuda_graphs=g) for g in choices]


def run_one(spec: RunSpec, a: argparse.Namespace, bundle: Path, samples: Path, work: Path,
            py_spy: str | None, spy_out: Any) -> dict[str, Any]:  # fmt: skip
    from loadtest.latency import read_raw_latencies
    from loadtest.run import run_load_test

    extra = ["--max-candidates", str(max(spec.candidates, 1000))]
    extra += ["--torch-threads", str(a.torch_threads if spec.device == "cuda" else a.cpu_torch_threads)]  # fmt: skip
    if a.max_batch_rows:
        extra += ["--max-batch-rows", str(a.max_batch_rows)]
    if a.max_wait_us is not None:
        extra += ["--max-wait-us", str(a.max_wait_us)]
    if spec.switch_interval_ms is not None:
        extra += ["--switch-interval-ms", str(spec.switch_interval_ms)]
    if a.max_queue:
        extra += ["--max-queue", str(a.max_queue)]
    if spec.cuda_graphs is not None:
        extra += ["--cuda-graphs", spec.cuda_graphs]
    if spec.frontends:
        extra += ["--frontends", str(spec.frontends)]
        if a.handoff_inflight is not None:
            extra += ["--handoff-inflight", str(a.handoff_inflight)]
    result: dict[str, Any] = {"run": spec.name, **vars(spec), "server_args": extra}
    group = ServerGroup(["--bundle", str(bundle)], spec.device, spec.workers, work, extra)
    cpu = gpu = None
    spy: subprocess.Popen[bytes] | None = None
    spy_file = work / f"pyspy-{spec.name}.txt"
    try:
        result["startup_s"] = group.start()
        log(
            f"{spec.name}: {spec.workers} server(s) SERVING on {group.host} in {result['startup_s']:.1f}s"
        )
        before = [scrape([port]) for port in group.metrics_ports]
        cpu = CpuSampler(_with_children([p.pid for p in group.procs])).start()
        gpu = GpuSampler().start() if spec.device == "cuda" else None
        spy_s = int(max(a.duration - a.warmup_s - 1, 1))
        if py_spy:
            # starts profiling once the load is up: locust needs ~2 s to spawn its processes
            pid = group.procs[0].pid
            spy = record_stacks(py_spy, pid, spy_s, a.py_spy_rate, spy_file, after_s=a.warmup_s + 2)
        load_dir = work / f"load-{spec.name}"
        summary = run_load_test(
            group.host, samples, load_dir, users=spec.users, spawn_rate=spec.users,
            duration_s=a.duration, num_candidates=spec.candidates, num_requests=a.requests,
            processes=a.processes, rpc_timeout_s=a.rpc_timeout,
            columnar=spec.request_format == "columnar",
        )  # fmt: skip
        after = [scrape([port]) for port in group.metrics_ports]
        cpu.stop()
        if gpu is not None:
            gpu.stop()
        raw = read_raw_latencies(load_dir / "raw")
        t_first = raw.start_unix_ns.min() / 1e9
        t_last = (raw.start_unix_ns + raw.latency_ns).max() / 1e9
        steady = (raw.start_unix_ns / 1e9 >= t_first + a.warmup_s) & raw.ok
        steady_window = max(t_last - (t_first + a.warmup_s), 1e-9)
        result["load"] = {
            k: summary[k]
            for k in ("requests", "failures", "failure_rate", "window_s", "qps", "candidates_per_s", "latency_ms", "processes")
        }  # fmt: skip
        result["load"]["locust_failures"] = summary["locust"]["failures"][:5]  # type: ignore[index]
        lat = raw.latency_ns[steady] / 1e6
        result["steady"] = {
            "from_s": a.warmup_s,
            "requests": int(steady.sum()),
            "qps": float(steady.sum()) / steady_window,
            "candidates_per_s": float(steady.sum()) / steady_window * spec.candidates,
            "latency_ms": _pct(lat),
        }
        # the load window (first request to last answer): the servers idle outside it
        window = t_last - t_first
        result["server"] = server_profile(_sum(before), _sum(after), window, spec.workers)
        result["graphs"] = graph_profile(_sum(before), _sum(after))
        result["server"]["requests_per_worker"] = [
            server_profile(b, x)["requests"] for b, x in zip(before, after, strict=True)
        ]
        result["cpu"] = cpu.rates(t_first + a.warmup_s, t_last)
        result["gpu"] = gpu.stats(t_first + a.warmup_s, t_last) if gpu is not None else None
        if spy is not None:
            _, err = spy.communicate(timeout=spy_s + 60)
            if spy_file.exists():
                text = spy_file.read_text()
                result["py_spy"] = {
                    "pid_profiled": "worker 0",
                    "seconds": spy_s,
                    "rate": a.py_spy_rate,
                    **summarize_py_spy(text, a.py_spy_rate, spy_s),
                }
                spy_out.write(f"### {spec.name} (py-spy --gil, worker 0, {spy_s}s)\n{text}\n")
            else:
                result["py_spy"] = {"error": err.decode(errors="replace")[-800:]}
        result["bound"] = verdict(result)
        result["goal_met"] = _meets(result, summary, GOAL)
        result["latency_goal_met"] = _meets(result, summary, LATENCY_GOAL)
    except Exception as err:  # keep going with the other runs; say why this one failed
        log(f"{spec.name}: FAILED {type(err).__name__}: {err}")
        result["error"] = f"{type(err).__name__}: {err}"
        result["server_log_tail"] = group.tail(0) if group.logs else ""
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
        for sampler in (cpu, gpu):
            if sampler is not None:
                sampler.stop()
        result["server_exit_codes"] = group.stop()
    return result


def graph_profile(before: dict[Any, float], after: dict[Any, float]) -> dict[str, Any] | None:
    """The servers' CUDA graph stats over the run (summed over workers): batches replayed and
    run eagerly (by reason) between two scrapes, graphs captured and their memory; None when
    the servers have no graphs (CPU, ``--cuda-graphs off``, a program without the pairs)."""
    p = "dynrec_serving_graph_"
    if not any(name.startswith(p) for name, _ in after):
        return None

    def delta(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    eager = {
        dict(labels)["reason"]: delta(name, labels)
        for name, labels in after
        if name == f"{p}eager_batches_total"
    }
    replays = delta(f"{p}replays_total")
    batches = replays + sum(eager.values())
    return {
        "replays": replays,
        "eager": eager,
        "replayed_fraction": replays / batches if batches else None,
        "captures": after.get((f"{p}captures", ()), 0.0),
        "memory_bytes": {
            kind: after.get((f"{p}memory_bytes", (("kind", kind),)), 0.0)
            for kind in ("allocated", "reserved")
        },
    }


def _meets(result: dict[str, Any], summary: dict[str, Any], goal: dict[str, float]) -> bool:
    """Whether a run's steady state reached ``goal``: at least its candidates/s, at most its
    p99, without failures."""
    steady = result["steady"]
    return bool(
        steady["candidates_per_s"] >= goal["candidates_per_s"]
        and (steady["latency_ms"]["p99"] or 1e9) <= goal["p99_ms"]
        and summary["failures"] == 0
    )


def verdict(r: dict[str, Any]) -> str:
    """What bounds the run, read off its profile (not a guess): the first limit that is hit."""
    spy = r.get("py_spy") or {}
    gil = spy.get("gil_busy_fraction")
    cpu = r.get("cpu") or {}
    gpu = r.get("gpu") or {}
    stages = (r.get("server") or {}).get("stages", {})
    busy, cores = cpu.get("machine_busy_cores"), cpu.get("machine_cores")
    parts = []
    if gil is not None and gil >= 0.85:
        top = list((spy.get("by_category") or {}).items())[:3]
        parts.append(
            f"GIL of the server process ({gil:.0%} of samples hold it; "
            + ", ".join(f"{k} {v:.0%}" for k, v in top)
            + ")"
        )
    server = r.get("server") or {}
    batcher = server.get("batcher_busy_fraction")
    if batcher is not None and batcher >= 0.85:
        cpu_share = (server.get("batcher_cpu_fraction") or 0.0) / batcher
        parts.append(
            f"the batcher thread ({batcher:.0%} busy running batches, {cpu_share:.0%} of that on "
            "its CPU, the rest waiting for the GIL or the device)"
        )
    if gpu.get("util_pct_mean") is not None and gpu["util_pct_mean"] >= 85:
        parts.append(f"GPU ({gpu['util_pct_mean']:.0f}% busy)")
    if busy is not None and cores and busy >= 0.9 * cores:
        parts.append(f"machine CPU ({busy:.1f} of {cores:.0f} cores busy)")
    if not parts:
        wait = (stages.get("queue_wait") or {}).get("wall_ms_mean")
        parts.append(
            "not saturated by the server's GIL, the GPU or the cores"
            + (f" (queue wait {wait:.2f} ms)" if wait is not None else "")
            + ": more users or load processes"
        )
    return "; ".join(parts)


# --------------------------------------------------------------------------- main


def _table(runs: list[dict[str, Any]]) -> str:
    head = (
        f"{'run':<34} {'QPS':>8} {'cand/s':>10} {'p50':>7} {'p95':>7} {'p99':>7} {'fail':>5} "
        f"{'rows/b':>7} {'srv cores':>9} {'bat%':>5} {'GPU%':>5} {'GIL%':>5}  bound"
    )
    lines = [head, "-" * len(head)]
    for r in runs:
        if "error" in r:
            lines.append(f"{r['run']:<34} ERROR {r['error'][:100]}")
            continue
        s, lat = r["steady"], r["steady"]["latency_ms"]
        gpu = (r.get("gpu") or {}).get("util_pct_mean")
        gil = (r.get("py_spy") or {}).get("gil_busy_fraction")
        rows = r["server"]["rows_per_batch"]
        bat = r["server"].get("batcher_busy_fraction")
        lines.append(
            f"{r['run']:<34} {s['qps']:>8.1f} {s['candidates_per_s']:>10.0f} "
            f"{lat['p50']:>7.2f} {lat['p95']:>7.2f} {lat['p99']:>7.2f} {r['load']['failures']:>5} "
            f"{(rows or 0):>7.0f} {(r['cpu']['server_cores'] or 0):>9.2f} "
            f"{'-' if bat is None else f'{bat * 100:.0f}':>5} "
            f"{'-' if gpu is None else f'{gpu:.0f}':>5} {'-' if gil is None else f'{gil * 100:.0f}':>5}  "
            f"{r['bound']}"
        )
    return "\n".join(lines)


def _offline_table(profiles: dict[str, Any]) -> str:
    """Host ms per request by stage, and model ms per batch of 1/4/16 requests (device synced)."""
    lines = []
    for name, prof in profiles.items():
        for fmt, req in prof["per_request_ms"].items():
            lines.append(
                f"offline {name} {fmt:>8}: per request (host, one thread) "
                + ", ".join(f"{k} {v:.2f}" for k, v in req.items())
                + f" ms; {prof['request_bytes_mean'][fmt] / 1e3:.1f} kB"
            )
        for k, row in prof["per_batch_ms"].items():
            lines.append(
                f"  batch of {k:>2} ({row['rows']:>5} rows): concat {row['concat']:.2f}, h2d "
                f"{row['h2d']:.2f} (per tensor: {row['h2d_per_tensor']:.2f}), compute launch {row['compute_launch']:.2f} + device wait "
                f"{row['compute_device_wait']:.2f}, d2h {row['d2h']:.2f}; predict() as served "
                f"{row['predict_unsynced']:.2f} ms"
            )
        tp = prof.get("torch_profiler")
        if tp:
            lines.append(
                f"  torch.profiler, one predict of {tp['batch_rows']} rows: wall {tp['wall_ms']:.2f} "
                f"ms, kernels {tp['device_kernel_ms']:.2f} ms, {tp['kernel_launches']:.0f} kernel + "
                f"{tp['graph_launches']:.0f} graph launches, "
                f"{tp['stream_syncs']:.0f} stream syncs, {tp['memcpy_calls']:.0f} memcpy calls, "
                f"{tp['item_calls']:.0f} item()"
            )
        gs = prof.get("graph_stats")
        if gs:
            lines.append(
                f"  CUDA graphs: {gs['captures']} captured in {gs['capture_seconds']:.2f}s "
                f"(+{gs['memory_reserved_bytes'] / 2**20:.0f} MiB reserved), {gs['replays']} "
                f"replays, eager {gs['eager']}, failures {len(gs['failures'])}"
            )
    return "\n".join(lines)


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_serving", description=plain(__doc__), epilog=EXAMPLE)
    p.add_argument("--out", type=Path, required=True, help="bench_serving.json and pyspy_raw.txt")
    p.add_argument("--work", type=Path, default=None, help="scratch (default: a temporary dir)")
    p.add_argument(
        "--bundle",
        type=Path,
        default=None,
        help="bundle to serve (default: a synthetic one of --keys keys)",
    )
    p.add_argument(
        "--keys", type=int, default=1_500_000, help="dynamic keys of the synthetic bundle"
    )
    p.add_argument("--samples", type=Path, default=None, help="eval samples (default: generated)")
    p.add_argument(
        "--data-size",
        default="small",
        choices=["tiny", "small"],
        help="synthetic data to generate for the requests when --samples is not given",
    )
    p.add_argument(
        "--devices",
        nargs="+",
        default=["cuda", "cpu"],
        choices=["cuda", "cpu"],
        help="devices of the cross product (and of the offline profile)",
    )
    p.add_argument("--workers", type=int, nargs="+", default=[1], help="server processes per run")
    p.add_argument(
        "--frontends",
        type=int,
        nargs="+",
        default=[0],
        help="N > 0: also a run of one server with N frontend processes (serve --frontends N) "
        "per device x candidates x users (default 0: only --workers runs)",
    )
    p.add_argument("--candidates", type=int, nargs="+", default=[500], help="per request")
    p.add_argument("--users", type=int, nargs="+", default=[32], help="locust users (closed loop)")
    p.add_argument("--switch-interval-ms", type=float, nargs="+", default=[None],
                   help="server GIL switch intervals to try (default: Python's 5 ms)")  # fmt: skip
    p.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="DEVICE:WORKERS:CANDIDATES:USERS[:SWITCH_MS][:FORMAT]",
        help="explicit runs instead of the cross product above (repeatable), e.g. cuda:4:500:32, "
        "cuda:1:500:32:rows (FORMAT: columnar or rows; default: the first of --formats); "
        "WORKERS fN (cuda:f8:500:64): one device process with N frontends (serve --frontends)",
    )
    p.add_argument(
        "--formats",
        nargs="+",
        default=["columnar"],
        choices=list(REQUEST_FORMATS),
        help="request formats of the cross product: candidates as candidate_columns (columnar) "
        "or one Features per candidate (rows)",
    )
    p.add_argument("--processes", type=int, default=4, help="locust load-generator processes")
    p.add_argument("--duration", type=int, default=20, help="seconds of load per run")
    p.add_argument("--warmup-s", type=float, default=3.0, help="excluded from steady-state stats")
    p.add_argument("--requests", type=int, default=1000, help="distinct requests in the pool")
    p.add_argument("--rpc-timeout", type=float, default=10.0, help="seconds per Predict call")
    p.add_argument("--torch-threads", type=int, default=1, help="CUDA servers' torch threads")
    p.add_argument("--cpu-torch-threads", type=int, default=1, help="CPU servers' torch threads")
    p.add_argument(
        "--max-batch-rows",
        type=int,
        default=None,
        help="server batch bound in rows (default: the server's)",
    )
    p.add_argument(
        "--max-wait-us",
        type=int,
        default=None,
        help="server batching wait in microseconds (default: the server's)",
    )
    p.add_argument(
        "--max-queue", type=int, default=None, help="server admission bound (default: the server's)"
    )
    p.add_argument(
        "--handoff-inflight",
        type=int,
        default=None,
        help="frontend runs (WORKERS fN): serve --handoff-inflight, the handoffs a frontend has "
        "waiting before it groups the requests queued behind them (default: the server's)",
    )
    p.add_argument(
        "--cuda-graphs",
        nargs="+",
        default=["on", "off"],
        choices=["on", "off"],
        help="CUDA runs and offline profiles are made once per value: batches replayed from CUDA "
        "graphs (serve --cuda-graphs on) or run eagerly (off); default both, to compare",
    )
    p.add_argument("--no-offline", action="store_true", help="skip the offline profile")
    p.add_argument("--py-spy", default=None, help="py-spy executable (default: found on PATH)")
    p.add_argument("--no-py-spy", action="store_true", help="skip the py-spy GIL profile")
    p.add_argument("--py-spy-rate", type=int, default=200, help="py-spy samples per second")
    return p


def _machine() -> dict[str, Any]:
    import grpc
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "grpc": grpc.__version__,
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    with contextlib.suppress(Exception):
        out = subprocess.run([sys.executable, "-m", "locust", "--version"], capture_output=True, text=True, timeout=60, env=_env())  # fmt: skip
        info["locust"] = out.stdout.strip().split(" from ")[0]
    return info


def _offline_cases(
    a: argparse.Namespace, devices: Sequence[str]
) -> list[tuple[str, dict[str, Any]]]:
    """(name, offline_profile keywords) per device x candidates, CUDA once per --cuda-graphs
    value with the buckets a server of these settings captures (serve.server's choice)."""
    from serve.__main__ import DEFAULT_BATCH_ROWS
    from serve.graphs import default_buckets

    out = []
    for device, c in itertools.product(devices, a.candidates):
        threads = a.torch_threads if device == "cuda" else a.cpu_torch_threads
        base = {"device": device, "candidates": c, "torch_threads": threads}
        if device != "cuda":
            out.append((f"{device}-c{c}", base))
            continue
        rows = a.max_batch_rows or DEFAULT_BATCH_ROWS["cuda"]
        buckets = default_buckets(max(rows, c, 1000))  # the servers' --max-candidates
        for g in a.cuda_graphs:
            graphs = {"graph_buckets": buckets if g == "on" else ()}
            out.append((f"{device}-c{c}-graphs-{g}", {**base, **graphs}))
    return out


@contextlib.contextmanager
def work_dir(path: Path | None, prefix: str = "bench_serving-") -> Iterator[Path]:
    """``path`` (created), or a temporary directory removed afterwards."""
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path.resolve()
    else:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            yield Path(tmp)


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    # a timeout's SIGTERM unwinds (finally: servers stopped, locust killed); JSON is saved per run
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch

    specs = [RunSpec.parse(r, a.formats[0]) for r in a.run] or [
        RunSpec(d, 1 if fe else w, c, u, si, f, frontends=fe)
        for d in a.devices
        for fe in a.frontends
        for w in (a.workers if not fe else [1])
        for c in a.candidates
        for u in a.users
        for si in a.switch_interval_ms
        for f in a.formats
    ]
    specs = [g for s in specs for g in s.with_graphs(a.cuda_graphs)]
    wanted = list(dict.fromkeys(s.device for s in specs))
    devices = [d for d in wanted if d != "cuda" or torch.cuda.is_available()]
    skipped = sorted(set(wanted) - set(devices))
    if skipped:
        log(f"skipping {skipped}: no CUDA device here")
    a.candidates = sorted({s.candidates for s in specs})
    a.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "benchmark": "Predict throughput/latency under locust (python -m serve), GPU vs CPU baseline",
        "argv": sys.argv[1:] if argv is None else argv,
        "goal": GOAL,
        "latency_goal": LATENCY_GOAL,
        "machine": _machine(),
        "devices_skipped": skipped,
    }
    out_json = a.out / "bench_serving.json"
    py_spy = None if a.no_py_spy else find_py_spy(a.py_spy)
    report["py_spy"] = py_spy
    if py_spy is None and not a.no_py_spy:
        log("py-spy not found: no GIL profile (pip install py-spy, or carry its wheel)")

    def save() -> None:
        out_json.write_text(json.dumps(report, indent=2, default=str) + "\n")

    with work_dir(a.work) as work, open(a.out / "pyspy_raw.txt", "w") as spy_out:
        t0 = time.perf_counter()
        if a.bundle is None:
            bundle, report["bundle"] = make_bundle(work, a.keys)
        else:
            bundle, report["bundle"] = (
                a.bundle.resolve(),
                {"path": str(a.bundle), "synthetic": False},
            )
        samples = (a.samples or make_samples(work, a.data_size)).resolve()
        report["samples"] = str(samples)
        log(f"bundle and samples ready in {time.perf_counter() - t0:.1f}s")
        save()
        if not a.no_offline:
            report["offline_profile"] = {}
            for name, kwargs in _offline_cases(a, devices):
                t = time.perf_counter()
                report["offline_profile"][name] = prof = offline_profile(
                    bundle, samples=samples, **kwargs
                )
                host = prof["per_request_ms"]
                log(
                    f"offline {name}: host {host['rows']['host_total']:.2f} ms/request "
                    f"as rows, {host['columnar']['host_total']:.2f} as columns, "
                    f"batch x16 {prof['per_batch_ms']['16']['predict_unsynced']:.2f} ms "
                    f"[{time.perf_counter() - t:.1f}s]"
                )
                save()
        report["runs"] = []
        specs = [s for s in specs if s.device in devices]
        for spec in specs:
            t = time.perf_counter()
            report["runs"].append(run_one(spec, a, bundle, samples, work, py_spy, spy_out))
            spy_out.flush()
            log(f"{spec.name} done in {time.perf_counter() - t:.1f}s")
            save()
    report["table"] = _table(report["runs"])
    met = [r["run"] for r in report["runs"] if r.get("goal_met")]
    report["goal_met_by"] = met
    fast = [r["run"] for r in report["runs"] if r.get("latency_goal_met")]
    report["latency_goal_met_by"] = fast
    save()
    if report.get("offline_profile"):
        print(_offline_table(report["offline_profile"]))
    print(report["table"])
    print(
        f"goal ({GOAL['candidates_per_s']:,} candidates/s at p99 <= {GOAL['p99_ms']} ms, steady "
        f"state, no failures): {'met by ' + ', '.join(met) if met else 'not met by any run'}"
    )
    print(
        f"latency goal (p99 <= {LATENCY_GOAL['p99_ms']} ms at >= "
        f"{LATENCY_GOAL['candidates_per_s']:,} candidates/s): "
        f"{'met by ' + ', '.join(fast) if fast else 'not met by any run'}"
    )
    print(f"-> {out_json}")
    return 0 if all("error" not in r for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
