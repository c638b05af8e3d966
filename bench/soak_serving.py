"""Soak of ``python -m serve`` under mixed good and hostile traffic, then overload (issue #16).

    python -m bench.soak_serving --duration-s 600 --out bench/results/soak_serving_cpu.json

1. A synthetic bundle of the seed config (``bench.bench_serving.make_bundle``: ``--keys`` keys,
   the real MultiTowerDIN dense part, untrained) and one ``python -m serve`` process on the CPU
   with small limits (``--max-queue`` is the admission bound).
2. Soak, ``--duration-s``: ``--clients`` closed-loop client threads (fewer than the admission
   bound, so nothing is refused for load) send good requests (``--good-fraction``) and
   hostile ones (``tests.serve.hostile``: seeded, the robustness test's generator) as raw bytes.
   Every answer is checked against what the serving contract allows for its request; the
   server's RSS (``/proc/<pid>/status`` VmRSS) is sampled every ``--rss-interval-s``. The RSS at
   start is the one after the warm-up (a tenth of the duration, at most a minute).
3. Overload, ``--overload-s``: ``--overload-clients`` (more than the admission bound) send good
   requests of ``max_candidates`` candidates back to back while health and metadata are polled;
   measured: the latency of the RESOURCE_EXHAUSTED answers (goal: p99 < 50 ms) and whether every
   health check answered SERVING.

Writes JSON (requests by status code and request family, errors on good requests, INTERNAL
answers, contract violations with examples, RSS start/end/growth, good-request latency, the
overload numbers, the server's own counters) and exits 1 if a good request failed, an answer
was INTERNAL or UNKNOWN, a health check was not SERVING, or the server died.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import predict_pb2, predict_pb2_grpc
from shared.cli import Parser, plain, run_cli
from shared.cli import exit_code as _exit_code
from tests.serve.hostile import PREDICT_METHOD, HostileCase, HostileGenerator, check_answer

ROOT = Path(__file__).resolve().parents[1]
SERVICE = "dynrec.serving.PredictionService"
GOAL_REJECT_P99_MS = 50.0
RPC_TIMEOUT_S = 10.0
MAX_EXAMPLES = 20


def log(msg: str) -> None:
    print(f"[soak_serving {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(values_s: list[float]) -> dict[str, float | int]:
    """count and p50/p90/p99/max in ms of latencies given in seconds."""
    if not values_s:
        return {"count": 0}
    a = np.asarray(values_s) * 1e3
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "count": len(a),
        "p50_ms": float(p50),
        "p90_ms": float(p90),
        "p99_ms": float(p99),
        "max_ms": float(a.max()),
    }


def rss_kb(pid: int) -> int | None:
    """VmRSS of ``pid`` in kB (None once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


# --------------------------------------------------------------------------- server


@dataclass
class Server:
    """One ``python -m serve`` process on 127.0.0.1 (its log under ``work``)."""

    bundle: Path
    work: Path
    args: list[str]
    port: int = field(default_factory=_free_port)
    metrics_port: int = field(default_factory=_free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.work / "serve.log"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "serve", "--bundle", str(self.bundle), "--device", "cpu",
            "--port", str(self.port), "--metrics-port", str(self.metrics_port), *self.args,
        ]  # fmt: skip

    def start(self, timeout_s: float = 300.0) -> float:
        t0 = time.perf_counter()
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        with open(self.log_path, "wb") as f:
            self.proc = subprocess.Popen(
                self.command(),
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": path},
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout_s
        while "SERVING on" not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not SERVING after {timeout_s:.0f} s:\n{self.tail()}")
            time.sleep(0.2)
        return time.perf_counter() - t0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


# --------------------------------------------------------------------------- traffic


@dataclass
class Tally:
    """What the clients saw, merged over threads under one lock."""

    by_code: collections.Counter[str] = field(default_factory=collections.Counter)
    by_family: dict[str, collections.Counter[str]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    good_latency_s: list[float] = field(default_factory=list)
    family_latency_s: dict[str, list[float]] = field(
        default_factory=lambda: collections.defaultdict(list)
    )
    rejected_latency_s: list[float] = field(default_factory=list)
    good_errors: int = 0
    good_error_examples: list[str] = field(default_factory=list)
    violations: int = 0
    violation_examples: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(
        self, case: HostileCase, code: grpc.StatusCode, details: str | None, dt: float,
        problem: str | None, *, overload: bool = False,
    ) -> None:  # fmt: skip
        with self.lock:
            self.by_code[code.name] += 1
            self.by_family[case.family][code.name] += 1
            good = case.family == "good"
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED and overload:
                self.rejected_latency_s.append(dt)
            elif good and code is grpc.StatusCode.OK:
                self.good_latency_s.append(dt)
            elif good:
                self.good_errors += 1
                if len(self.good_error_examples) < MAX_EXAMPLES:
                    self.good_error_examples.append(f"{code.name}: {(details or '')[:300]}")
            else:
                self.family_latency_s[case.family].append(dt)
            if problem is not None and not (
                overload and code is grpc.StatusCode.RESOURCE_EXHAUSTED
            ):
                self.violations += 1
                if len(self.violation_examples) < MAX_EXAMPLES:
                    self.violation_examples.append(f"{case.describe()} -> {problem}")

    def summary(self) -> dict[str, Any]:
        return {
            "requests": sum(self.by_code.values()),
            "by_code": dict(self.by_code),
            "by_family": {k: dict(v) for k, v in sorted(self.by_family.items())},
            "internal": self.by_code["INTERNAL"],
            "unknown": self.by_code["UNKNOWN"],
            "good": {
                "ok": len(self.good_latency_s),
                "errors": self.good_errors,
                "error_examples": self.good_error_examples,
                "latency": _pct(self.good_latency_s),
            },
            "hostile_latency": _pct([t for v in self.family_latency_s.values() for t in v]),
            "hostile_latency_by_family": {
                k: _pct(v) for k, v in sorted(self.family_latency_s.items())
            },
            "contract_violations": self.violations,
            "violation_examples": self.violation_examples,
        }


def _client(
    address: str,
    pick: Any,
    tally: Tally,
    stop: threading.Event,
    max_detail_bytes: int,
    *,
    overload: bool = False,
) -> None:
    with grpc.insecure_channel(address) as channel:
        predict: grpc.UnaryUnaryMultiCallable[bytes, predict_pb2.PredictResponse]
        predict = channel.unary_unary(
            PREDICT_METHOD,
            request_serializer=None,
            response_deserializer=predict_pb2.PredictResponse.FromString,
        )
        while not stop.is_set():
            case: HostileCase = pick()
            t0 = time.perf_counter()
            try:
                response = predict(case.payload, timeout=RPC_TIMEOUT_S)
                code, details = grpc.StatusCode.OK, None
            except grpc.RpcError as err:
                response, code, details = None, err.code(), err.details()
            dt = time.perf_counter() - t0
            problem = check_answer(case, code, details, response, max_detail_bytes=max_detail_bytes)
            tally.add(case, code, details, dt, problem, overload=overload)


class Picker:
    """Thread-safe cycling over the pools: good with probability ``good_fraction``."""

    def __init__(
        self, good: list[HostileCase], hostile: list[HostileCase], good_fraction: float, seed: int
    ) -> None:
        self._good, self._hostile = good, hostile
        self._fraction = good_fraction
        self._rng = np.random.default_rng(seed)
        self._next = {"good": 0, "hostile": 0}
        self._lock = threading.Lock()

    def __call__(self) -> HostileCase:
        with self._lock:
            kind = "good" if self._rng.random() < self._fraction else "hostile"
            pool = self._good if kind == "good" else self._hostile
            i = self._next[kind]
            self._next[kind] = (i + 1) % len(pool)
            return pool[i]


def _run_clients(
    address: str, n: int, pick: Any, tally: Tally, seconds: float, max_detail_bytes: int,
    *, overload: bool = False, during: Any = None,
) -> None:  # fmt: skip
    stop = threading.Event()
    threads = [
        threading.Thread(
            target=_client,
            args=(address, pick, tally, stop, max_detail_bytes),
            kwargs={"overload": overload},
            daemon=True,
        )
        for _ in range(n)
    ]
    for t in threads:
        t.start()
    try:
        if during is not None:
            during(seconds)
        else:
            time.sleep(seconds)
    finally:
        stop.set()
        for t in threads:
            t.join(RPC_TIMEOUT_S + 5)


class RssSampler:
    def __init__(self, pid: int, interval_s: float) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.samples: list[tuple[float, int]] = []
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> int | None:
        kb = rss_kb(self.pid)
        if kb is not None:
            self.samples.append((round(time.monotonic() - self._t0, 1), kb))
        return kb

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _rss_summary(
    samples: list[tuple[float, int]], start_kb: int, end_kb: int, from_t: float
) -> dict[str, Any]:
    steady = [(t, kb) for t, kb in samples if t >= from_t]
    slope = None
    if len(steady) >= 3:
        t, kb = np.array(steady, dtype=float).T
        slope = float(np.polyfit(t, kb, 1)[0]) * 3600 / 1024  # MB per hour
    return {
        "start_kb": start_kb,
        "end_kb": end_kb,
        "max_kb": max(kb for _, kb in samples),
        "growth_pct": 100.0 * (end_kb - start_kb) / start_kb,
        "steady_slope_mb_per_hour": slope,
        "samples": [list(s) for s in samples],
    }


def _poll_health(address: str, seconds: float) -> dict[str, Any]:
    """Health (both names) and metadata, polled every 0.1 s for ``seconds``."""
    statuses: collections.Counter[str] = collections.Counter()
    errors: list[str] = []
    health_s: list[float] = []
    metadata_s: list[float] = []
    end = time.monotonic() + seconds
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        stub = predict_pb2_grpc.PredictionServiceStub(channel)
        while time.monotonic() < end:
            for service in ("", SERVICE):
                t0 = time.perf_counter()
                try:
                    # types-grpcio-health-checking's HealthStub lacks the Check set in __init__
                    resp = health.Check(  # type: ignore[attr-defined]
                        health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT_S
                    )
                    statuses[health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)] += 1
                except grpc.RpcError as err:
                    statuses[err.code().name] += 1
                    errors.append(f"{service or '(all)'}: {err.code().name} {err.details()}")
                health_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            try:
                stub.GetModelMetadata(predict_pb2.ModelMetadataRequest(), timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as err:
                errors.append(f"metadata: {err.code().name} {err.details()}")
            metadata_s.append(time.perf_counter() - t0)
            time.sleep(0.1)
    return {
        "checks": sum(statuses.values()),
        "by_status": dict(statuses),
        "all_serving": set(statuses) == {"SERVING"},
        "errors": errors[:MAX_EXAMPLES],
        "health_latency": _pct(health_s),
        "metadata_latency": _pct(metadata_s),
    }


# --------------------------------------------------------------------------- main


def _machine() -> dict[str, Any]:
    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "grpc": grpc.__version__,
    }


EXAMPLE = """examples:
  python -m bench.soak_serving --duration-s 600 --out bench/results/soak_serving_cpu.json
  python -m bench.soak_serving --duration-s 60 --keys 5000 --out /tmp/soak.json   # a short one"""


def _parser() -> Parser:
    p = Parser(prog="python -m bench.soak_serving", description=plain(__doc__), epilog=EXAMPLE)
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--duration-s", type=float, default=600.0, help="soak phase, warm-up included")
    p.add_argument(
        "--overload-s",
        type=float,
        default=None,
        help="overload phase (default: min(60, duration/10))",
    )
    p.add_argument("--clients", type=int, default=3, help="soak clients (below --max-queue)")
    p.add_argument(
        "--overload-clients", type=int, default=16, help="overload clients (above --max-queue)"
    )
    p.add_argument("--max-queue", type=int, default=4, help="the server's admission bound")
    p.add_argument("--max-candidates", type=int, default=64, help="the server's --max-candidates")
    p.add_argument(
        "--good-fraction", type=float, default=0.5, help="share of good requests in the soak"
    )
    p.add_argument("--pool", type=int, default=3000, help="distinct hostile requests, cycled")
    p.add_argument("--keys", type=int, default=20_000, help="keys over the dynamic tables")
    p.add_argument("--rss-interval-s", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--seed", type=int, default=0, help="seed of the bundle and of the requests")
    p.add_argument(
        "--bundle", type=Path, default=None, help="serve this bundle (default: a synthetic one)"
    )
    p.add_argument("--work", type=Path, default=None, help="bundle and server log (default: tmp)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _parser()
    a = p.parse_args(argv)
    if a.clients >= a.max_queue:
        p.error(
            f"--clients {a.clients} must be below --max-queue {a.max_queue} (the soak must not "
            "overload the server); lower --clients or raise --max-queue"
        )
    if a.overload_clients <= a.max_queue:
        p.error(
            f"--overload-clients {a.overload_clients} must be above --max-queue "
            f"{a.max_queue}; raise --overload-clients"
        )
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the server is stopped
    warmup_s = min(60.0, a.duration_s / 10)
    overload_s = a.overload_s if a.overload_s is not None else min(60.0, a.duration_s / 10)
    server_args = [
        "--max-queue", str(a.max_queue), "--max-candidates", str(a.max_candidates),
        "--max-sequence-length", "50", "--max-string-bytes", "64",
        "--max-request-bytes", str(256 << 10), "--max-detail-bytes", "256",
    ]  # fmt: skip
    report: dict[str, Any] = {
        "benchmark": "soak: good + hostile Predict traffic against python -m serve (CPU), "
        "then overload past the admission bound",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else argv,
        "machine": _machine(),
        "goal": {"rejected_p99_ms": GOAL_REJECT_P99_MS, "good_errors": 0, "internal": 0},
    }
    failures: list[str] = []
    from bench.bench_serving import work_dir

    with work_dir(a.work, prefix="soak_serving-") as work:
        if a.bundle is None:
            from bench.bench_serving import make_bundle

            log(f"writing a synthetic bundle ({a.keys} keys) under {work}")
            bundle, report["bundle"] = make_bundle(work, a.keys, seed=a.seed)
        else:
            bundle, report["bundle"] = a.bundle.resolve(), {"path": str(a.bundle)}
        server = Server(bundle, work, server_args)
        try:
            startup_s = server.start()
            assert server.proc is not None
            pid, address = server.proc.pid, f"127.0.0.1:{server.port}"
            log(f"server pid {pid} SERVING on {address} after {startup_s:.1f} s")
            with grpc.insecure_channel(address) as channel:
                md = predict_pb2_grpc.PredictionServiceStub(channel).GetModelMetadata(
                    predict_pb2.ModelMetadataRequest(), timeout=RPC_TIMEOUT_S
                )
            limits = md.limits
            report["server"] = {
                "command": server.command()[1:],
                "startup_s": startup_s,
                "limits": {f.name: getattr(limits, f.name) for f in limits.DESCRIPTOR.fields},
            }
            gen = HostileGenerator(md, seed=a.seed)
            t0 = time.perf_counter()
            hostile = gen.cases(a.pool)
            good = [gen.good_case() for _ in range(max(a.pool // 4, 100))]
            log(
                f"{len(hostile)} hostile + {len(good)} good requests in {time.perf_counter() - t0:.1f} s"
            )

            # ---- soak
            tally = Tally()
            rss = RssSampler(pid, a.rss_interval_s).start()
            picker = Picker(good, hostile, a.good_fraction, a.seed)
            marks: dict[str, Any] = {}

            def soak(seconds: float) -> None:
                time.sleep(warmup_s)
                marks["start_kb"] = rss.sample()
                marks["start_t"] = rss.samples[-1][0]
                log(f"warm-up done: RSS {marks['start_kb']} kB")
                left = seconds - warmup_s
                while left > 0 and server.alive():
                    time.sleep(min(left, 30.0))
                    left -= 30.0
                    log(f"soak: {sum(tally.by_code.values())} answers, RSS {rss_kb(pid)} kB")
                marks["end_kb"] = rss.sample()

            t0 = time.perf_counter()
            _run_clients(address, a.clients, picker, tally, a.duration_s, limits.max_detail_bytes, during=soak)  # fmt: skip
            elapsed = time.perf_counter() - t0
            rss.stop()
            report["soak"] = {
                "duration_s": elapsed,
                "warmup_s": warmup_s,
                "clients": a.clients,
                "good_fraction": a.good_fraction,
                "pool": {"hostile": len(hostile), "good": len(good)},
                **tally.summary(),
                "requests_per_s": sum(tally.by_code.values()) / elapsed,
                "rss": _rss_summary(
                    rss.samples, marks["start_kb"], marks["end_kb"], marks["start_t"]
                )
                if marks.get("end_kb")
                else None,
            }

            # ---- overload
            if server.alive():
                big = [
                    gen.good_case(columnar=bool(k % 2), candidates=limits.max_candidates)
                    for k in range(64)
                ]
                over = Tally()
                health: dict[str, Any] = {}
                rr = Picker(big, big, 1.0, a.seed)

                def poll(seconds: float) -> None:
                    health.update(_poll_health(address, seconds))

                log(f"overload: {a.overload_clients} clients, admission bound {a.max_queue}")
                _run_clients(address, a.overload_clients, rr, over, overload_s, limits.max_detail_bytes, overload=True, during=poll)  # fmt: skip
                rejected = _pct(over.rejected_latency_s)
                report["overload"] = {
                    "duration_s": overload_s,
                    "clients": a.overload_clients,
                    "max_queue": a.max_queue,
                    "by_code": dict(over.by_code),
                    "rejected_latency": rejected,
                    "goal_met": bool(
                        rejected.get("count") and rejected["p99_ms"] < GOAL_REJECT_P99_MS
                    ),
                    "admitted_latency": _pct(over.good_latency_s),
                    "errors": over.good_errors,
                    "error_examples": over.good_error_examples,
                    "internal": over.by_code["INTERNAL"],
                    "health": health,
                }
                if not rejected.get("count"):
                    failures.append("overload: nothing was refused (is the bound reachable?)")
                if not health.get("all_serving"):
                    failures.append(
                        f"overload: health not always SERVING: {health.get('by_status')}"
                    )
                if over.good_errors:
                    failures.append(f"overload: {over.good_errors} requests neither OK nor refused")
                if over.by_code["INTERNAL"] or over.by_code["UNKNOWN"]:
                    failures.append("overload: INTERNAL/UNKNOWN answers")
            if server.alive():
                from bench.bench_serving import scrape

                samples = scrape([server.metrics_port])
                wanted = ("dynrec_serving_requests_total", "dynrec_serving_errors_total",
                          "dynrec_serving_rejections_total")  # fmt: skip
                report["server_metrics"] = {
                    f"{name}{{{','.join(f'{k}={v}' for k, v in labels)}}}": value
                    for (name, labels), value in sorted(samples.items())
                    if name in wanted
                }
            else:
                failures.append(f"the server died:\n{server.tail()}")
        finally:
            code = server.stop()
            log_text = server.log_path.read_text(errors="replace")
            report.setdefault("server", {})["exit_code"] = code
            report["server"]["log_internal_errors"] = log_text.count("internal error in")
            report["server"]["log_tracebacks"] = log_text.count("Traceback")

    soak_report = report.get("soak", {})
    if soak_report.get("good", {}).get("errors"):
        failures.append(f"soak: {soak_report['good']['errors']} good requests failed")
    if soak_report.get("internal") or soak_report.get("unknown"):
        failures.append(
            f"soak: {soak_report['internal']} INTERNAL, {soak_report['unknown']} UNKNOWN"
        )
    if report["server"]["log_internal_errors"]:
        failures.append(f"server log: {report['server']['log_internal_errors']} internal errors")
    report["failures"] = failures
    report["ok"] = not failures
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    _print_summary(report)
    log(f"wrote {a.out}")
    return 0 if not failures else 1


def _print_summary(report: dict[str, Any]) -> None:
    soak, over = report.get("soak", {}), report.get("overload", {})
    rss = soak.get("rss") or {}
    print(
        f"soak {soak.get('duration_s', 0):.0f} s: {soak.get('requests', 0)} requests "
        f"{soak.get('by_code')}; good errors {soak.get('good', {}).get('errors')}, "
        f"INTERNAL {soak.get('internal')}, contract violations {soak.get('contract_violations')}; "
        f"good p50 {soak.get('good', {}).get('latency', {}).get('p50_ms', float('nan')):.2f} ms; "
        f"RSS {rss.get('start_kb')} -> {rss.get('end_kb')} kB ({rss.get('growth_pct', float('nan')):+.2f}%)"
    )
    if over:
        rej = over["rejected_latency"]
        print(
            f"overload {over['clients']} clients > bound {over['max_queue']}: {over['by_code']}; "
            f"refusals p50 {rej.get('p50_ms', float('nan')):.2f} ms p99 "
            f"{rej.get('p99_ms', float('nan')):.2f} ms (goal < {GOAL_REJECT_P99_MS:.0f}); "
            f"health {over['health'].get('by_status')}"
        )
    for f in report["failures"]:
        print(f"FAILED: {f}")


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
