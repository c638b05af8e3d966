"""Headless load test against a running server (Predict or the Open Inference Protocol): pool → locust subprocess → report.

    python -m loadtest --host 127.0.0.1:50051 --users 8 --spawn-rate 8 --duration 30 \\
        --candidates 100 --samples data/samples/eval --out out/loadtest [--protocol oip]

Requests carry their candidates as ``candidate_columns`` (``--columnar``, the default: cheaper
for the server) or as one ``Features`` per candidate (``--no-columnar``); same candidates.
``--protocol oip`` sends the same requests as the Open Inference Protocol's ModelInfer (one
tensor per feature, raw, for ``--model-name``) instead of Predict: two runs with the same
``--seed`` compare the protocols on the same requests.

Writes into ``--out``: ``requests.pool`` (the serialized requests), ``raw/latency-<pid>.bin``
(exact latencies), ``locust_stats.csv`` & co. (locust's CSV, final numbers), ``locust.log``, ``summary.json`` and
``latency.png``. Locust runs in a subprocess because importing it gevent-patches the caller.

While it runs, stderr shows elapsed seconds, requests and failures (from ``progress.json``,
which the locust process rewrites each second): a bar on a terminal, else a line every 5 s::

    loadtest: 10/20 s (50%) 8,301 requests, 0 failures, eta 10 s
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc

from loadtest import report
from loadtest.latency import RawLatencies, read_raw_latencies
from loadtest.oip import oip_pool
from loadtest.pool import RequestPool, write_pool
from loadtest.requests import (
    build_request_pool,
    sequence_formats_from_metadata,
    sides_from_metadata,
    value_types_from_metadata,
)
from protos import predict_pb2, predict_pb2_grpc
from shared.cli import Parser, plain, run_cli
from shared.progress import ProgressLine

ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
PROGRESS_EVERY_S = 5.0  # between plain progress lines (stderr not a terminal)
PROTOCOLS = ("predict", "oip")


def wait_until_serving(host: str, timeout_s: float = 120.0, service: str = "") -> float:
    """Poll the standard gRPC health service until ``service`` is SERVING; returns seconds waited."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    start = time.perf_counter()
    deadline = start + timeout_s
    with grpc.insecure_channel(host) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                # types-grpcio-health-checking's HealthStub lacks the Check set in its __init__
                check = stub.Check  # type: ignore[attr-defined]
                reply = check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.perf_counter() - start
            except grpc.RpcError:
                pass  # not listening yet
            if time.perf_counter() > deadline:
                raise TimeoutError(
                    f"{host} not SERVING after {timeout_s:.0f} s; see the server log"
                )
            time.sleep(0.1)


def fetch_metadata(host: str, timeout_s: float = 30.0) -> predict_pb2.ModelMetadata:
    """The served model's metadata; waits up to ``timeout_s`` for the server to accept calls.

    ConnectionError (an OSError) when it does not answer: a user's mistake, not a bug."""
    with grpc.insecure_channel(host) as channel:
        stub = predict_pb2_grpc.PredictionServiceStub(channel)
        try:
            return stub.GetModelMetadata(
                predict_pb2.ModelMetadataRequest(), timeout=timeout_s, wait_for_ready=True
            )
        except grpc.RpcError as e:
            raise ConnectionError(
                f"GetModelMetadata on {host} failed ({e.code().name}: {e.details()}); is the "
                "server running and listening there? (--host HOST:PORT)"
            ) from e


def run_load_test(
    host: str,
    samples: str | Path,
    out: str | Path,
    *,
    users: int = 8,
    spawn_rate: float = 8.0,
    duration_s: int = 30,
    num_candidates: int = 100,
    num_requests: int = 2000,
    seed: int = 0,
    wait_ms: float = 0.0,
    rpc_timeout_s: float = 10.0,
    processes: int = 1,
    columnar: bool = True,
    connect_timeout_s: float = 30.0,
    protocol: str = "predict",
    model_name: str = "dynrec",
) -> dict[str, object]:
    """Run one headless locust test against ``host`` (``ip:port``) and return the summary.

    ``protocol``: ``predict`` (PredictionService/Predict) or ``oip`` (the Open Inference
    Protocol's ModelInfer of the same requests, for model ``model_name``).

    The summary (also ``<out>/summary.json``) holds exact percentiles from the raw latencies;
    locust's own numbers (whole ms below 100 ms) are under ``"locust"``. ``connect_timeout_s``:
    how long to wait for the server to answer its first call.
    """
    if int(duration_s) != duration_s or duration_s < 1:
        raise ValueError(
            f"--duration {duration_s}: must be a whole number of seconds >= 1 (locust's -t); "
            "pass --duration 1 or more"
        )
    if protocol not in PROTOCOLS:
        raise ValueError(f"--protocol {protocol!r}: not one of {PROTOCOLS}")
    out = Path(out)
    raw_dir = _clear_outputs(out)
    metadata = _served_metadata(host, num_candidates, connect_timeout_s)
    pool, pool_file, build_s = _write_request_pool(
        samples,
        metadata,
        out / "requests.pool",
        num_requests=num_requests,
        num_candidates=num_candidates,
        seed=seed,
        columnar=columnar,
        protocol=protocol,
        model_name=model_name,
    )
    log_file, progress_file = out / "locust.log", out / "progress.json"
    cmd = _locust_command(
        host,
        pool_file,
        raw_dir,
        out / "locust",
        progress_file,
        users=users,
        spawn_rate=spawn_rate,
        duration_s=duration_s,
        wait_ms=wait_ms,
        rpc_timeout_s=rpc_timeout_s,
        processes=processes,
    )
    exit_code, raw = _run_locust(
        cmd, log_file, raw_dir, progress_file, duration_s=duration_s, timeout_s=duration_s + 120
    )

    run = {
        "host": host,
        "model_version": metadata.model_version,
        "users": users,
        "spawn_rate": spawn_rate,
        "duration_s": duration_s,
        "processes": processes,
        "candidates_per_request": num_candidates,
        "request_format": "columnar" if columnar else "rows",
        "protocol": protocol,
        "request_pool": {"requests": len(pool), "build_s": build_s, **pool.info},
    }
    return _write_summary(out, run, raw, exit_code, log_file)


def _write_summary(
    out: Path, run: dict[str, object], raw: RawLatencies, exit_code: int, log_file: Path
) -> dict[str, object]:
    """``run`` plus exact latency percentiles, locust's own stats and the plot, as
    ``<out>/summary.json``."""
    num_candidates = run["candidates_per_request"]
    assert isinstance(num_candidates, int)
    rows = report.timeline(raw, num_candidates)
    summary: dict[str, object] = {
        **run,
        **report.latency_stats(raw, num_candidates),
        "timeline": rows,
        "locust": {"exit_code": exit_code, **report.read_locust_csv(out / "locust")},
    }
    title = (
        f"{run['host']} ({run['protocol']}): {run['users']} users, "
        f"{num_candidates} candidates/request"
    )
    summary["files"] = {
        "summary": str(out / "summary.json"),
        "plot": str(report.plot(rows, out / "latency.png", title, num_candidates)),
        "raw_latencies": [str(f) for f in raw.files],
        "locust_csv": str(out / "locust_stats.csv"),
        "locust_log": str(log_file),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _clear_outputs(out: Path) -> Path:
    """Create ``out`` without an earlier run's raw latencies and locust CSVs (they would be
    counted or reported); returns the raw-latency directory."""
    raw_dir = out / "raw"
    shutil.rmtree(raw_dir, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "progress.json").unlink(missing_ok=True)
    for stale in out.glob("locust_*.csv"):
        stale.unlink()
    return raw_dir


def _served_metadata(
    host: str, num_candidates: int, timeout_s: float = 30.0
) -> predict_pb2.ModelMetadata:
    """The served model's metadata, refusing more candidates per request than it accepts."""
    metadata = fetch_metadata(host, timeout_s)
    if metadata.max_candidates and num_candidates > metadata.max_candidates:
        raise ValueError(
            f"--candidates {num_candidates} exceeds the server's max_candidates "
            f"{metadata.max_candidates}; lower --candidates"
        )
    return metadata


def _write_request_pool(
    samples: str | Path,
    metadata: predict_pb2.ModelMetadata,
    path: Path,
    *,
    num_requests: int,
    num_candidates: int,
    seed: int,
    columnar: bool,
    protocol: str = "predict",
    model_name: str = "dynrec",
) -> tuple[RequestPool, Path, float]:
    """(pool, its file, seconds to build and write it): requests laid out as ``metadata`` says
    (sides, value types, each sequence's delimiter and length limit), of ``protocol``."""
    t0 = time.perf_counter()
    pool = build_request_pool(
        samples,
        sides_from_metadata(metadata),
        value_types=value_types_from_metadata(metadata),
        num_requests=num_requests,
        num_candidates=num_candidates,
        seed=seed,
        sequence_formats=sequence_formats_from_metadata(metadata),
        columnar=columnar,
    )
    pool.info["model_version"] = metadata.model_version
    pool.info["protocol"] = "predict"
    if protocol == "oip":
        pool = oip_pool(pool, model_name)
    pool_file = write_pool(path, pool)
    return pool, pool_file, time.perf_counter() - t0


def _locust_command(
    host: str,
    pool_file: Path,
    raw_dir: Path,
    csv_prefix: Path,
    progress_file: Path,
    *,
    users: int,
    spawn_rate: float,
    duration_s: int,
    wait_ms: float,
    rpc_timeout_s: float,
    processes: int,
) -> list[str]:
    """The headless locust command line of one run of :data:`LOCUSTFILE`."""
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "-u", str(users), "-r", str(spawn_rate), "-t", f"{int(duration_s)}s", "-H", host,
        "--final-csv", str(csv_prefix), "--only-summary", "--loglevel", "WARNING",
        "--request-pool", str(pool_file), "--raw-latency-dir", str(raw_dir),
        "--wait-ms", str(wait_ms), "--rpc-timeout-s", str(rpc_timeout_s),
        "--progress-file", str(progress_file),
    ]  # fmt: skip
    if processes > 1:
        cmd += ["--processes", str(processes)]
    return cmd


def _run_locust(
    cmd: list[str],
    log_file: Path,
    raw_dir: Path,
    progress_file: Path,
    *,
    duration_s: int,
    timeout_s: float,
) -> tuple[int, RawLatencies]:
    """Run ``cmd`` from the repo root, output to ``log_file``, its progress on stderr;
    (exit code, raw latencies).

    Exit code 1 is a run with failed requests; any other failure, or no latencies at all, is
    a RuntimeError quoting the log's tail; past ``timeout_s``, subprocess.TimeoutExpired."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    with open(log_file, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            returncode = _wait_showing_progress(proc, progress_file, duration_s, timeout_s)
        finally:
            if proc.poll() is None:  # timed out or interrupted
                proc.kill()
                proc.wait()
    raw = read_raw_latencies(raw_dir)
    if returncode not in (0, 1) or len(raw) == 0:  # 1 = the run had failures
        tail = log_file.read_text()[-3000:]
        raise RuntimeError(
            f"locust exited with {returncode} and {len(raw)} requests; {log_file}:\n{tail}"
        )
    return returncode, raw


def _wait_showing_progress(
    proc: subprocess.Popen, progress_file: Path, duration_s: int, timeout_s: float
) -> int:
    """``proc``'s exit code; meanwhile, each second, the seconds since it started (up to
    ``duration_s``) and the counts of ``progress_file`` (written by the locustfile) on a
    :class:`~shared.progress.ProgressLine`."""
    progress = ProgressLine(
        "loadtest", total=duration_s, unit="s", label="", every_s=PROGRESS_EVERY_S
    )
    start = time.perf_counter()
    try:
        while True:
            try:
                code: int | None = proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                if time.perf_counter() - start > timeout_s:
                    raise subprocess.TimeoutExpired(proc.args, timeout_s) from None
                code = None
            counts = _read_progress(progress_file)  # the last one also after the exit
            if counts is not None:
                progress.set_status(
                    f"{counts['requests']:,} requests, {counts['failures']:,} failures"
                )
            seconds = duration_s if code in (0, 1) else int(time.perf_counter() - start)
            progress.update(min(seconds, duration_s) - progress.n)
            if code is not None:
                return code
    finally:
        progress.close()


def _read_progress(path: Path) -> dict[str, int] | None:
    """The locustfile's ``--progress-file`` (None before it wrote one)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


def _parser() -> argparse.ArgumentParser:
    doc = plain(__doc__).split("\n\n")
    p = Parser(
        prog="python -m loadtest",
        description="\n\n".join([doc[0], *doc[2:]]),
        epilog="example:\n" + doc[1],
    )
    p.add_argument("--host", required=True, help="PredictionService address, e.g. 127.0.0.1:50051")
    p.add_argument("--samples", required=True, help="eval samples: Parquet file or directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--users", type=int, default=8, help="concurrent locust users")
    p.add_argument("--spawn-rate", type=float, default=8.0, help="users started per second")
    p.add_argument("--duration", type=int, default=30, help="seconds")
    p.add_argument("--candidates", type=int, default=100, help="candidates per request")
    p.add_argument("--requests", type=int, default=2000, help="distinct requests in the pool")
    p.add_argument("--seed", type=int, default=0, help="seed of the request sampling")
    p.add_argument("--wait-ms", type=float, default=0.0, help="per-user pause between requests")
    p.add_argument("--rpc-timeout", type=float, default=10.0, help="deadline of one call, seconds")
    p.add_argument(
        "--processes", type=int, default=1, help="locust processes (load generator cores)"
    )
    p.add_argument(
        "--columnar",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send candidates as candidate_columns or, with --no-columnar, as one "
        "Features map per candidate (the row format)",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the server to answer its first call",
    )
    p.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="predict",
        help="predict: PredictionService/Predict; oip: the same requests as the Open Inference "
        "Protocol's GRPCInferenceService/ModelInfer (one tensor per feature)",
    )
    p.add_argument(
        "--model-name",
        help="--protocol oip: the model's name (serve --model-name; default dynrec)",
    )
    return p


def _main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    if a.model_name is not None and a.protocol != "oip":
        raise ValueError(
            f"--model-name {a.model_name!r} names the model of the Open Inference Protocol; "
            "pass it with --protocol oip, or drop it"
        )
    if not Path(a.samples).exists():
        raise FileNotFoundError(
            f"--samples {a.samples}: no such file or directory; pass the eval samples "
            "(python -m train.data build writes OUT/eval)"
        )
    s = run_load_test(
        a.host,
        a.samples,
        a.out,
        users=a.users,
        spawn_rate=a.spawn_rate,
        duration_s=a.duration,
        num_candidates=a.candidates,
        num_requests=a.requests,
        seed=a.seed,
        wait_ms=a.wait_ms,
        rpc_timeout_s=a.rpc_timeout,
        processes=a.processes,
        columnar=a.columnar,
        connect_timeout_s=a.connect_timeout,
        protocol=a.protocol,
        model_name=a.model_name or "dynrec",
    )
    lat = s["latency_ms"]
    assert isinstance(lat, dict)
    ms = " ".join(f"{k} {'-' if lat[k] is None else f'{lat[k]:.2f}'}" for k in report.PERCENTILES)
    print(
        f"{a.protocol}: {s['requests']} requests, {s['failures']} failures, {s['qps']:.1f} req/s, "
        f"{s['candidates_per_s']:.0f} candidates/s; latency ms {ms} -> {a.out}/summary.json"
    )
    return 1 if s["failures"] else 0
