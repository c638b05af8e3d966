"""Latency of Predict before and during a hot swap of the model version, over gRPC on 127.0.0.1.

Starts ``python -m serve`` (a process of its own, as deployed: CUDA graphs on, ``--frontends``
processes serving the port) on a watched directory holding version 1 (full-scale tables, the
real dense part), drives it with ``--clients`` closed-loop clients in this process (one request =
one user with ``--candidates`` ads), then drops versions 2, 3, ... (``--swaps``) into the
directory one after the other, each once the last has served ``--after-s`` seconds. Reports
p50/p99/max latency of the steady state before and of the windows from each install to its
end, their ratio (issue #19: p99 during a swap <= 1.1x before), each swap's ratio, timeline and
startup split (GetModelMetadata), errors (must be 0) and the versions seen. With CUDA graphs the
first swap writes into the spare the server built at startup, the later ones into the version
replaced before (:mod:`serve.spare`)::

    python -m bench.bench_swap --out results/swap_gpu.json --device cuda
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from bench.bench_serving import ServerGroup, summarize_py_spy
from bench.bench_startup import export_program
from bench.py_spy import find_py_spy, record_stacks
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
        "--after-s",
        type=float,
        default=2.5,
        help="seconds measured after each swap happened (more than the server's 2 s before a "
        "replaced version is retired and becomes the spare the next swap writes into)",
    )
    p.add_argument(
        "--swaps", type=int, default=2, help="versions installed one after the other (2, 3, ...)"
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


@dataclass
class _Swap:
    """One swap's window (perf_counter seconds) and what is reported of it."""

    start: float
    end: float
    report: dict[str, object]


def _swap(
    traffic: ClosedLoopClients, bundle: Path, models: Path, version: str, a: argparse.Namespace,
    host: str,
) -> _Swap:  # fmt: skip
    """Install ``version`` under traffic, wait for its answers and ``--after-s`` more: its
    window, the swap's time and the new version's startup split (the window's latency once the
    traffic has stopped, :func:`main`: requests still in flight at its end are answered later)."""
    t_install = time.perf_counter()
    install_version(bundle, models, version)
    traffic.wait_for_version(version, timeout_s=60)
    t_swapped = time.perf_counter()
    time.sleep(a.after_s)
    t_end = time.perf_counter()
    return _Swap(t_install, t_end, {
        "version": version,
        "swap_seconds_after_install": t_swapped - t_install,
        "new_version_startup_seconds": _startup_split(host),
    })  # fmt: skip


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
    versions = [str(k) for k in range(2, a.swaps + 2)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        program, _ = export_program(fs, root / "dense.pt2")
        models = root / "models"
        models.mkdir()
        write_synthetic_bundle(models / "1", fs, keys=keys, program_path=program, version="1")
        for v in versions:  # other rows and keys, the same program
            write_synthetic_bundle(
                root / f"v{v}", fs, keys=keys, program_path=program, version=v, seed=int(v)
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
        swaps: list[_Swap] = []
        try:
            startup_s = server.start(timeout_s=300)
            traffic = ClosedLoopClients(server.host, requests, a.clients, timeout_s=10).start()
            time.sleep(1.0)  # settle
            t_before = time.perf_counter()
            time.sleep(a.before_s)
            spy = (
                None
                if py_spy is None  # the first swap's
                else record_stacks(py_spy, server.procs[0].pid, a.profile_s, 500, raw)
            )
            for v in versions:
                swaps.append(_swap(traffic, root / f"v{v}", models, v, a, server.host))
            traffic.stop()
            if spy is not None:
                _, err = spy.communicate(timeout=a.profile_s + 60)
                gil = _gil_split(raw, a.profile_s) if raw.exists() else {"error": err.decode()}
        finally:
            exit_codes = server.stop()
            log_tail = server.tail(0)

    before = latency_stats(traffic.latencies(t_before, swaps[0].start))
    windows = [traffic.latencies(w.start, w.end) for w in swaps]
    during = latency_stats([x for lats in windows for x in lats])
    for w, lats in zip(swaps, windows, strict=True):
        window = latency_stats(lats)
        w.report["window"] = window
        w.report["p99_ratio"] = window["p99_ms"] / before["p99_ms"] if before["count"] else None
        # 100 ms bins from 0.5 s before the install: where in the load the slow requests fall
        w.report["timeline"] = traffic.timeline(w.start - 0.5, 0.1, end=w.end)
    report = {
        "benchmark": "Predict latency before / during hot swaps (serve.versions)",
        "device": a.device,
        "keys_total": sum(keys.values()),
        "clients": a.clients,
        "candidates": a.candidates,
        "request_format": a.request_format,
        "server_args": server_args,
        "server_startup_s": startup_s,
        "before": before,
        "during_swap_and_after": during,  # every swap's window
        "p99_ratio": during["p99_ms"] / before["p99_ms"] if before["count"] else None,
        "goal_p99_ratio": 1.1,
        "swaps": [w.report for w in swaps],
        "errors": len(traffic.errors),
        "error_examples": traffic.errors[:5],
        "versions_seen": traffic.versions(),
        "server_exit_codes": exit_codes,
        "gil_during_swap": gil,  # py-spy --gil of the server's process from the first install
    }
    if exit_codes != [0]:
        report["server_log_tail"] = log_tail
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    summary = {k: report[k] for k in ("before", "during_swap_and_after", "p99_ratio", "errors")}
    summary["swap_ratios"] = [w.report["p99_ratio"] for w in swaps]
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
