"""Latency of Predict before and during a hot swap of the model version, over gRPC on 127.0.0.1.

Starts ``python -m serve`` (a process of its own, as deployed: CUDA graphs on, ``--frontends``
processes serving the port) on a watched directory holding version 1 (full-scale tables, the
real dense part), drives it with ``--clients`` closed-loop clients in this process (one request =
one user with ``--candidates`` ads), then drops version 2 into the directory and keeps going
until the swap has happened and ``--after-s`` more seconds have passed. Reports p50/p99/max
latency of the steady state before and of the window from the install to the end, their ratio
(issue #19: p99 during the swap <= 1.1x before), errors (must be 0), the versions seen and the
new version's startup split (GetModelMetadata)::

    python -m bench.bench_swap --out results/swap_gpu.json --device cuda
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from bench.bench_serving import ServerGroup, find_py_spy, record_gil, summarize_py_spy
from bench.bench_startup import export_program
from bench.synthetic_bundle import (
    as_columnar,
    keys_per_table,
    seed_feature_set,
    synthetic_request,
    write_synthetic_bundle,
)
from bench.traffic import ClosedLoopClients, install_version, latency_stats
from protos import predict_pb2, predict_pb2_grpc
from serve.model import default_device
from shared.cli import Parser, check_device, plain, run_cli
from shared.cli import exit_code as _exit_code

EXAMPLE = """examples:
  python -m bench.bench_swap --out results/swap_gpu.json --device cuda
  python -m bench.bench_swap --out results/swap_cpu.json --device cpu --keys 300000"""


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_swap", description=plain(__doc__), epilog=EXAMPLE)
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=default_device(),
        help="where the server runs (default: cuda if this machine has one)",
    )
    p.add_argument("--keys", type=int, default=1_500_000, help="keys over the dynamic tables")
    p.add_argument("--clients", type=int, default=4, help="closed-loop gRPC clients")
    p.add_argument("--candidates", type=int, default=100, help="candidate ads per request")
    p.add_argument(
        "--before-s", type=float, default=3.0, help="seconds of steady state before the install"
    )
    p.add_argument(
        "--after-s", type=float, default=2.0, help="seconds measured after the swap happened"
    )
    p.add_argument(
        "--request-format",
        choices=["columnar", "rows"],
        default="columnar",
        help="candidates as candidate_columns or one Features per row (default %(default)s)",
    )
    p.add_argument(
        "--frontends", type=int, default=4, help="the server's --frontends (0: it serves the port)"
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="one more argument for python -m serve (repeatable; e.g. --server-arg=--cuda-graphs "
        "--server-arg=off, --server-arg=--load-switch-interval-ms --server-arg=0)",
    )
    p.add_argument(
        "--py-spy",
        default=None,
        help="py-spy binary (default: found on PATH or sys.path); '' for none. It records the "
        "server's process (--gil) from the install for --profile-s: which share of the GIL the "
        "load takes from serving",
    )
    p.add_argument("--profile-s", type=int, default=2, help="seconds py-spy records")
    return p


# a GIL sample is the load's when a frame of the new version's load is on its stack
_LOAD = re.compile(r"(LoadedModel\.load|ModelManager\._load|CudaGraphs\.capture) \(")


def _gil_split(raw: Path, seconds: int) -> dict[str, object]:
    """GIL-holding samples of the server's process during the swap: the load's and the rest."""
    text = raw.read_text() if raw.exists() else ""
    load = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit() and _LOAD.search(stack):
            load += int(count)
    summary = summarize_py_spy(text, 500, seconds)
    total = summary["samples_holding_gil"]
    summary["load_share_of_gil_samples"] = load / total if total else None
    return summary


def _startup_split(host: str) -> dict[str, float]:
    with grpc.insecure_channel(host) as channel:
        stub = predict_pb2_grpc.PredictionServiceStub(channel)
        meta = stub.GetModelMetadata(predict_pb2.ModelMetadataRequest(), timeout=10)
    return dict(meta.startup_seconds)


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    check_device(a.device)
    a.out.parent.mkdir(parents=True, exist_ok=True)

    fs = seed_feature_set()
    keys = keys_per_table(fs, a.keys)
    rng = np.random.default_rng(0)
    requests = [synthetic_request(fs, rng, candidates=a.candidates) for _ in range(64)]
    if a.request_format == "columnar":  # cheaper for the clients: the p99 is more the server's
        requests = [as_columnar(fs, r) for r in requests]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        program, _ = export_program(fs, root / "dense.pt2")
        models = root / "models"
        models.mkdir()
        write_synthetic_bundle(models / "1", fs, keys=keys, program_path=program, version="1")
        write_synthetic_bundle(
            root / "v2", fs, keys=keys, program_path=program, version="2", seed=1
        )
        server_args = ["--max-candidates", str(max(a.candidates, 1000)), "--frontends"]
        server_args += [str(a.frontends), "--no-verify-checksums", *a.server_arg]
        py_spy = find_py_spy(a.py_spy) if a.py_spy != "" else None
        raw = a.out.with_suffix(".pyspy.txt")
        gil: dict[str, object] | None = None
        server = ServerGroup(
            ["--model-dir", str(models), "--poll-interval-s", "0.1"], a.device, 1, root,
            server_args,
        )  # fmt: skip
        try:
            startup_s = server.start(timeout_s=300)
            traffic = ClosedLoopClients(server.host, requests, a.clients, timeout_s=10).start()
            time.sleep(1.0)  # settle
            t_before = time.perf_counter()
            time.sleep(a.before_s)
            t_install = time.perf_counter()
            spy = (
                None
                if py_spy is None
                else record_gil(py_spy, server.procs[0].pid, a.profile_s, 500, raw)
            )
            install_version(root / "v2", models, "2")
            traffic.wait_for_version("2", timeout_s=60)
            t_swapped = time.perf_counter()
            time.sleep(a.after_s)
            traffic.stop()
            swap_load = _startup_split(server.host)
            if spy is not None:
                _, err = spy.communicate(timeout=a.profile_s + 60)
                gil = _gil_split(raw, a.profile_s) if raw.exists() else {"error": err.decode()}
        finally:
            exit_codes = server.stop()
            log_tail = server.tail(0)

    before = latency_stats(traffic.latencies(t_before, t_install))
    during = latency_stats(traffic.latencies(t_install))
    report = {
        "benchmark": "Predict latency before / during a hot swap (serve.versions)",
        "device": a.device,
        "keys_total": sum(keys.values()),
        "clients": a.clients,
        "candidates": a.candidates,
        "request_format": a.request_format,
        "server_args": server_args,
        "server_startup_s": startup_s,
        "before": before,
        "during_swap_and_after": during,
        "p99_ratio": during["p99_ms"] / before["p99_ms"] if before["count"] else None,
        "goal_p99_ratio": 1.1,
        "swap_seconds_after_install": t_swapped - t_install,
        "new_version_startup_seconds": swap_load,
        "errors": len(traffic.errors),
        "error_examples": traffic.errors[:5],
        "versions_seen": traffic.versions(),
        "server_exit_codes": exit_codes,
        "gil_during_swap": gil,  # py-spy --gil of the server's process from the install
        # 100 ms bins from 0.5 s before the install: where in the load the slow requests fall
        "timeline": traffic.timeline(t_install - 0.5, 0.1),
    }
    if exit_codes != [0]:
        report["server_log_tail"] = log_tail
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        json.dumps(
            {k: report[k] for k in ("before", "during_swap_and_after", "p99_ratio", "errors")}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
