"""Open Inference Protocol (gRPC ModelInfer) against Predict at the same load, in the same run.

    python -m bench.bench_oip --device cpu --keys 100000 --clients 2 4 --rounds 4 --duration 8 \\
        --out bench/results/bench_oip_cpu.json
    python -m bench.bench_oip --device cuda --candidates 500 --clients 16 8 --procs 4 \\
        --keys 2000000 --frontends 4 --rounds 6 --out bench/results/bench_oip_h100.json

One ``python -m serve`` (``bench.bench_serving``'s synthetic bundle with the real MultiTowerDIN
dense part, and eval rows of ``train.data`` as requests, ``loadtest.requests``); per
concurrency N, closed-loop clients (``--procs`` processes x threads, raw bytes on the wire, no
parsing of the answers) send the same requests over both protocols: Predict's columnar
PredictRequest and the ModelInferRequest of the same features (``loadtest.oip``, tensors in
raw_input_contents). The scores of both are compared first (bit-equal on CPU; on CUDA within
``MAX_SCORE_GAP``, next to Predict's own gap between two calls).

``--mode mixed`` (the default): each round is ONE window of ``--duration`` s (after
``--warmup`` s) in which both protocols run at once, N/2 concurrent calls each, against the same
server, started and stopped at the same instants; every client process runs both, and each of
its N/2 connections carries one closed loop of each (:mod:`bench.oip_load`). The loops are
closed, so the slower protocol completes fewer requests; the round's ratio is OIP candidates/s
over Predict's in that window. Why one window: the alternating phases measured the host's drift,
not the protocol (on an H100 on 2026-12-07 their rounds' ratios were 0.36-1.03 and Predict's own
phases swung from 463K to 685K candidates/s at equal host time per request). Why both protocols
on every connection: a connection reaches one frontend (SO_REUSEPORT), and when each protocol
had its own client processes (one connection each), a round's ratio was that of the frontends
they reached: 0.54 or 0.99 at 16 clients and 0.60, 0.99 or 1.66 at 8 on the H100 on
2026-12-07, at equal pooled p99 (issue #54; the evidence is in :mod:`bench.oip_load`).
Each window records, per client process, its requests per protocol and the frontend of each of
its connections (``windows``); a window in which a process completed no request of a protocol is
listed in ``windows_with_idle_procs``.

``--mode alternating``: the previous method, kept to compare with: phases of one protocol at a
time, all N calls, Predict first in even rounds and ModelInfer first in odd ones (on the H100
on 2026-12-06 the first ModelInfer phase ran at 0.64-0.76x Predict's and the second at
1.02-1.03x).

Either mode starts each concurrency with the windows of one round, unmeasured and ``--settle`` s
long (the server's first calls). Per protocol and concurrency: candidates/s, per round and
pooled, p50/p99 latency (all rounds pooled), p99 and requests per client process per round;
the ratios OIP/Predict: pooled (the goal's figure), per round and their median, and the p99
ratio beside them. The issue's bar: OIP candidates/s >= 0.9x Predict's at equal p99 (closed
loop at equal concurrency: p99 ratio ~1).

``per_request_us`` is where one request's host time goes (:mod:`bench.oip_stages`), on the
first ``--profile-requests`` requests of the pool.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from enum import Enum, unique
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.bench_serving import ServerGroup, _machine, _pct, make_bundle, make_samples, work_dir
from bench.oip_load import Protocol, Window, window
from bench.oip_stages import per_request
from shared.cli import Parser, plain, run_cli, write_result

PREDICT = "/dynrec.serving.PredictionService/Predict"
INFER = "/inference.GRPCInferenceService/ModelInfer"
GOAL_RATIO = 0.9


@unique
class Mode(Enum):
    """How the two protocols share the measured time (the module docstring says why mixed)."""

    MIXED = "mixed"  # one window per round, N/2 calls of each protocol at once
    ALTERNATING = "alternating"  # two windows per round, N calls of one protocol each

    def __str__(self) -> str:  # argparse's choices and --help
        return self.value


GOAL = {
    Mode.MIXED: f"OIP candidates/s >= {GOAL_RATIO} x Predict's in the same windows (N/2 calls "
    "each, at once; pooled over the rounds; ratio_p99 beside it)",
    Mode.ALTERNATING: f"OIP candidates/s >= {GOAL_RATIO} x Predict's at the same concurrency "
    "(alternating windows, pooled over the rounds; ratio_p99 beside it)",
}


def round_windows(
    mode: Mode, r: int, predict: list[bytes], infer: list[bytes], clients: int, procs: int
) -> list[Window]:
    """The windows of round ``r``."""
    p, o = Protocol("predict", PREDICT, predict), Protocol("oip", INFER, infer)
    if mode is Mode.MIXED:  # each connection one loop of each: clients / 2 connections
        return [Window((p, o), clients, procs)]
    phases = [Window((p,), clients, procs), Window((o,), clients, procs)]
    # odd rounds OIP first: neither always runs after the other
    return phases[::-1] if r % 2 else phases


def _rate(phase: dict[str, Any], candidates: int) -> float:
    return len(phase["latencies"]) * candidates / phase["seconds"]


def summarize(phases: list[dict[str, Any]], candidates: int) -> dict[str, Any]:
    """One protocol over its phases (one per round): pooled and per round. The rounds' p99 and
    requests per client process show a round in which the protocol's calls were slower or a
    process sent less."""
    lat = np.array([x for p in phases for x in p["latencies"]]) * 1e3
    seconds = sum(p["seconds"] for p in phases)
    return {
        "requests": len(lat),
        "candidates_per_s": len(lat) * candidates / seconds,
        "candidates_per_s_rounds": [_rate(p, candidates) for p in phases],
        "latency_ms": _pct(lat),
        "p99_ms_rounds": [_pct(np.array(p["latencies"]) * 1e3)["p99"] for p in phases],
        "requests_per_proc_rounds": [p["requests_per_proc"] for p in phases],
        "errors": [e for p in phases for e in p["errors"]][:10],
    }


def compare(by: dict[str, list[dict[str, Any]]], candidates: int) -> dict[str, Any]:
    """Each protocol's summary and the ratios OIP/Predict of ``by`` (one phase per protocol and
    round): pooled (the goal's figure), per round, their median, and the p99 ratio."""
    summary = {k: summarize(v, candidates) for k, v in by.items()}
    p99 = {k: s["latency_ms"]["p99"] or float("nan") for k, s in summary.items()}
    ratio = summary["oip"]["candidates_per_s"] / max(summary["predict"]["candidates_per_s"], 1e-9)
    paired = [
        o / max(p, 1e-9)
        for p, o in zip(
            summary["predict"]["candidates_per_s_rounds"],
            summary["oip"]["candidates_per_s_rounds"],
            strict=True,
        )
    ]
    return {
        **summary,
        "ratio_candidates_per_s": ratio,
        "ratio_candidates_per_s_rounds": paired,
        "ratio_candidates_per_s_median_of_rounds": statistics.median(paired),
        "ratio_p99": p99["oip"] / p99["predict"],
        "meets_goal": ratio >= GOAL_RATIO,
    }


def measure(
    host: str,
    predict: list[bytes],
    infer: list[bytes],
    clients: int,
    servers: list[int],
    a: argparse.Namespace,
) -> dict[str, Any]:
    """One concurrency: the settle round (unmeasured), then ``a.rounds`` rounds. ``servers``:
    the pids of the processes on the port (the frontends), whose index each connection reports.
    Beside the protocols' figures, ``windows``: per window its client processes' requests and
    frontends; ``windows_with_idle_procs``: those in which a process completed no request of a
    protocol (a stalled process: its round's ratio is suspect)."""
    if a.settle > 0:
        for w in round_windows(a.mode, 0, predict, infer, clients, a.procs):
            window(host, w, a.settle, a.warmup, servers)
    by: dict[str, list[dict[str, Any]]] = {"predict": [], "oip": []}
    windows: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for w in round_windows(a.mode, r, predict, infer, clients, a.procs):
            got = window(host, w, a.duration, a.warmup, servers)
            for name, phase in got.pop("phases").items():
                by[name].append(phase)
            windows.append({"round": r, "protocols": [p.name for p in w.protocols], **got})
    idle = [i for i, w in enumerate(windows) if w["idle_procs"]]
    if idle:
        print(f"clients {clients}: windows {idle} had a client process that completed no "
              "request of a protocol (see 'windows' in the JSON)", flush=True)  # fmt: skip
    share = clients // 2 if a.mode is Mode.MIXED else clients
    return {
        "clients": clients,
        "clients_per_protocol": share,
        **compare(by, a.candidates),
        "windows": windows,
        "windows_with_idle_procs": idle,
    }


def _payloads(host: str, samples: Path, a: argparse.Namespace) -> tuple[list[bytes], list[bytes]]:
    """(Predict payloads, ModelInfer payloads) of the same requests."""
    from loadtest.oip import infer_request
    from loadtest.requests import (
        build_request_pool,
        sequence_formats_from_metadata,
        sides_from_metadata,
        value_types_from_metadata,
    )
    from protos import predict_pb2, predict_pb2_grpc

    with grpc.insecure_channel(host) as channel:
        md = predict_pb2_grpc.PredictionServiceStub(channel).GetModelMetadata(
            predict_pb2.ModelMetadataRequest(), timeout=60
        )
    pool = build_request_pool(
        samples,
        sides_from_metadata(md),
        value_types=value_types_from_metadata(md),
        num_requests=a.requests,
        num_candidates=a.candidates,
        sequence_formats=sequence_formats_from_metadata(md),
    )
    predict = list(pool.payloads)
    infer = [
        infer_request(predict_pb2.PredictRequest.FromString(p), "dynrec").SerializeToString()
        for p in predict
    ]
    return predict, infer


# Scores of the two protocols on one request: bit-equal on CPU (the tests assert it); on CUDA a
# GPU reduction may round differently from one call to the next, so the check compares the gap
# with Predict's own gap between two calls of the same request. A translation error (a feature
# hashed differently, a value lost) moves scores by far more than this bound.
MAX_SCORE_GAP = 1e-4


def check_same_scores(
    host: str, predict: list[bytes], infer: list[bytes], n: int = 20
) -> dict[str, Any]:
    from protos import grpc_predict_v2_pb2 as v2
    from protos import predict_pb2

    gap = repeat_gap = 0.0
    with grpc.insecure_channel(host) as channel:
        p: Any = channel.unary_unary(
            PREDICT,
            request_serializer=None,
            response_deserializer=predict_pb2.PredictResponse.FromString,
        )
        o: Any = channel.unary_unary(
            INFER, request_serializer=None, response_deserializer=v2.ModelInferResponse.FromString
        )
        for a, b in zip(predict[:n], infer[:n], strict=True):
            want = np.asarray(p(a, timeout=60).probabilities, np.float32)
            again = np.asarray(p(a, timeout=60).probabilities, np.float32)
            got = np.frombuffer(o(b, timeout=60).raw_output_contents[0], "<f4")
            if want.shape != got.shape:
                raise SystemExit(f"ModelInfer gave {got.shape} scores, Predict {want.shape}")
            gap = max(gap, float(np.abs(want - got).max(initial=0.0)))
            repeat_gap = max(repeat_gap, float(np.abs(want - again).max(initial=0.0)))
    if gap > MAX_SCORE_GAP:
        raise SystemExit(
            f"ModelInfer and Predict disagree on the same request: max |gap| {gap:.3g} (Predict "
            f"against itself: {repeat_gap:.3g})"
        )
    return {"requests": n, "max_abs_gap": gap, "predict_repeat_max_abs_gap": repeat_gap}


def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    bundle, bundle_info = (
        make_bundle(work, a.keys) if a.bundle is None else (a.bundle, {"path": str(a.bundle)})
    )
    samples = a.samples or make_samples(work, a.size)
    extra = [
        "--max-candidates",
        str(max(a.candidates, 1000)),
        "--torch-threads",
        str(a.torch_threads),
    ]
    if a.frontends:
        extra += ["--frontends", str(a.frontends)]
    group = ServerGroup(["--bundle", str(bundle)], a.device, 1, work, extra)
    startup = group.start()
    try:
        servers = server_pids(group.tail(0, 100_000), group.procs[0].pid)
        predict, infer = _payloads(group.host, samples, a)
        checked = check_same_scores(group.host, predict, infer)
        stages = per_request(bundle, predict, infer, a.profile_requests, a.profile_iters)
        print(", ".join(f"{k} {v:.1f} us" for k, v in stages.items()), flush=True)
        runs: list[dict[str, Any]] = []
        result = {
            "command": "python -m bench.bench_oip " + " ".join(sys.argv[1:]),
            "machine": _machine(),
            "device": a.device,
            "mode": a.mode.value,
            "bundle": bundle_info,
            "startup_s": startup,
            "candidates": a.candidates,
            "requests": a.requests,
            "scores_checked": checked,
            "per_request_us": stages,
            "settings": {
                k: str(v) if isinstance(v, Mode) else v
                for k, v in vars(a).items()
                if k not in ("out",) and not isinstance(v, Path)
            },
            "goal": GOAL[a.mode],
            "server_pids": servers,
            "runs": runs,
        }
        for clients in a.clients:
            runs.append(measure(group.host, predict, infer, clients, servers, a))
            write_result(a.out, result)  # each concurrency as it ends: a run cut short keeps it
            print(_line(runs[-1]), flush=True)
    finally:
        group.stop()
    return result


def server_pids(log: str, pid: int) -> list[int]:
    """The pids of the processes that accept connections on the port: the frontends the server's
    log names on its SERVING line (``--frontends N``; one not running then, ``None`` there, is left
    out: connections to it report no frontend), else the server ``pid`` itself."""
    found = re.search(r"SERVING on .*frontend pids \[([^\]]*)\]", log)
    if found is None:
        return [pid]
    return [int(x) for x in found.group(1).split(",") if x.strip().isdigit()]


def _line(run: dict[str, Any]) -> str:
    p, o = run["predict"], run["oip"]
    rounds = ", ".join(f"{x:.2f}" for x in run["ratio_candidates_per_s_rounds"])
    return (
        f"clients {run['clients']}: predict {p['candidates_per_s']:,.0f} cand/s p99 "
        f"{p['latency_ms']['p99']:.2f} ms; oip {o['candidates_per_s']:,.0f} cand/s p99 "
        f"{o['latency_ms']['p99']:.2f} ms; ratio {run['ratio_candidates_per_s']:.3f} (rounds "
        f"{rounds}), p99 ratio {run['ratio_p99']:.3f}"
    )


def _mode(text: str) -> Mode:
    try:
        return Mode(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give one of {', '.join(m.value for m in Mode)}"
        ) from None


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_oip", description=plain(__doc__))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--bundle", type=Path, help="serve this bundle (default: a synthetic one)")
    p.add_argument("--keys", type=int, default=200_000, help="synthetic bundle: dynamic keys")
    p.add_argument("--samples", type=Path, help="eval samples (default: train.data --size)")
    p.add_argument("--size", default="tiny", help="train.data size for the samples")
    p.add_argument("--candidates", type=int, default=100)
    p.add_argument("--requests", type=int, default=200, help="distinct requests in the pool")
    p.add_argument("--clients", type=int, nargs="+", default=[4], help="concurrent calls")
    p.add_argument(
        "--mode",
        type=_mode,
        choices=list(Mode),
        default=Mode.MIXED,
        help="mixed: both protocols in one window, N/2 calls each; alternating: one at a time",
    )
    p.add_argument(
        "--procs",
        type=int,
        default=2,
        help="client processes (each runs every protocol of the window; no more than connections)",
    )
    p.add_argument("--rounds", type=int, default=2, help="measured rounds per concurrency")
    p.add_argument("--duration", type=float, default=10.0, help="seconds measured per window")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds before each window")
    p.add_argument(
        "--settle",
        type=float,
        default=10.0,
        help="seconds of each window of one unmeasured round per concurrency, first (0: none)",
    )
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--frontends", type=int, default=0, help="serve --frontends N")
    p.add_argument("--profile-requests", type=int, default=20, help="requests of per_request_us")
    p.add_argument(
        "--profile-iters", type=int, default=50, help="runs of each stage per request (medians)"
    )
    p.add_argument("--work", type=Path, help="work directory (default: a temporary one)")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


def _check(p: Parser, a: argparse.Namespace) -> None:
    """Refuse what the mode cannot honour: in mixed mode each connection carries one call of
    each protocol, so every --clients value must be even (an odd one would give one protocol
    more load, and the ratio would measure that)."""
    if a.rounds < 1 or a.procs < 1 or min(a.clients) < 1:
        p.error("--rounds, --procs and --clients must be at least 1")
    if a.mode is not Mode.MIXED:
        return
    odd = [c for c in a.clients if c % 2]
    if odd:
        p.error(
            f"--mode mixed splits each --clients value in half between Predict and ModelInfer; "
            f"{' '.join(map(str, odd))} is odd: give even values (or --mode alternating)"
        )


def _main(argv: list[str]) -> int:
    parser = _parser()
    a = parser.parse_args(argv)
    _check(parser, a)
    with work_dir(a.work, "bench_oip-") as work:
        write_result(a.out, run(a, work))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
