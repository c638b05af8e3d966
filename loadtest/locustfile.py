"""Locust user that calls ``PredictionService/Predict`` (or the Open Inference Protocol's
``GRPCInferenceService/ModelInfer``) over gRPC with pooled, pre-serialized requests.

Run it through ``python -m loadtest`` (which builds the pool and reads the results), or by hand::

    python -m locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 30s -H 127.0.0.1:50051 \\
        --request-pool out/requests.pool --raw-latency-dir out/raw --final-csv out/locust

The pool decides the request format: candidates as ``candidate_columns`` (the default of
``python -m loadtest`` and ``loadtest.requests.build_request_pool``) or as ``candidates``
(``--no-columnar`` / ``columnar=False``); the pool header's ``format`` says which, and
``--request-format`` makes a run refuse a pool of the other format. The pool's ``protocol``
decides the method: ``predict`` (Predict, answered by a PredictResponse) or ``oip`` (ModelInfer,
built by ``loadtest.oip.oip_pool``; its ``probabilities`` checked in ``raw_output_contents``);
``--request-protocol`` makes a run refuse a pool of the other protocol.

Importing locust gevent-patches the process, so this file only ever runs inside a locust process;
gRPC is made gevent-cooperative (``init_gevent``) before any channel exists.
"""

from __future__ import annotations

import csv
import json
import os
import random
import sys
import time
from pathlib import Path

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import User, events, task
from locust.env import Environment
from locust.runners import WorkerRunner
from locust.stats import PERCENTILES_TO_REPORT, StatsCSV

grpc_gevent.init_gevent()

# locust imports this file by path (as module "locustfile"); make the repository importable.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from loadtest.latency import RawLatencyWriter  # noqa: E402
from loadtest.pool import RequestPool, read_pool  # noqa: E402
from protos import grpc_predict_v2_pb2 as v2  # noqa: E402
from protos import predict_pb2  # noqa: E402

_SERVICE = predict_pb2.DESCRIPTOR.services_by_name["PredictionService"].full_name
_OIP_SERVICE = v2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
PREDICT_METHOD = f"/{_SERVICE}/Predict"
INFER_METHOD = f"/{_OIP_SERVICE}/ModelInfer"
PROTOCOLS = ("predict", "oip")
_MAX_MESSAGE = 64 * 1024 * 1024


class RpcFailure(Exception):
    """A failed call, named by status code so locust's failure table groups it."""


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    parser.add_argument(
        "--request-pool",
        default="",
        env_var="DYNREC_REQUEST_POOL",
        help="request pool file written by loadtest.requests (python -m loadtest builds it)",
    )
    parser.add_argument(
        "--raw-latency-dir",
        default="",
        env_var="DYNREC_RAW_LATENCY_DIR",
        help="directory for exact per-request latencies (latency-<pid>.bin); empty: not recorded",
    )
    parser.add_argument(
        "--final-csv",
        default="",
        help="write locust's CSV statistics (<prefix>_stats.csv, _failures.csv, _exceptions.csv) "
        "once, after the last request; --csv rewrites them every second and can miss the last one",
    )
    parser.add_argument(
        "--progress-file",
        default="",
        help="rewrite this JSON file every second with the requests and failures so far "
        "(python -m loadtest prints them while the test runs)",
    )
    parser.add_argument(
        "--wait-ms", type=float, default=0.0, help="pause per user between requests"
    )
    parser.add_argument("--rpc-timeout-s", type=float, default=10.0, help="deadline of one Predict")
    parser.add_argument(
        "--request-format",
        default="any",
        choices=["any", "columnar", "rows"],
        help="the candidate encoding the pool must hold (its header's format); any: whatever it has",
    )
    parser.add_argument(
        "--request-protocol",
        default="any",
        choices=["any", *PROTOCOLS],
        help="the protocol the pool's requests must be of (its header's protocol); any: whatever "
        "it has",
    )


class _State:
    """What every user of this process shares: the pool and the raw latency file."""

    pool: RequestPool | None = None
    raw: RawLatencyWriter | None = None
    environment: Environment | None = None


@events.init.add_listener
def _on_init(environment: Environment, **_kwargs) -> None:
    opts = environment.parsed_options
    if opts is None:  # a library user building an Environment by hand sets _State itself
        return
    _State.environment = environment
    if not opts.request_pool:
        sys.exit("locustfile: --request-pool is required (build one with python -m loadtest)")
    _State.pool = read_pool(opts.request_pool)
    fmt = _State.pool.info.get("format", "rows")  # pools of before candidate_columns: rows
    if opts.request_format not in ("any", fmt):
        sys.exit(
            f"locustfile: {opts.request_pool} holds {fmt} requests, not {opts.request_format}; "
            "rebuild it (python -m loadtest --columnar / --no-columnar)"
        )
    protocol = pool_protocol(_State.pool)
    if opts.request_protocol not in ("any", protocol):
        sys.exit(
            f"locustfile: {opts.request_pool} holds {protocol} requests, not "
            f"{opts.request_protocol}; rebuild it (python -m loadtest --protocol ...)"
        )
    if opts.raw_latency_dir:
        _State.raw = RawLatencyWriter(opts.raw_latency_dir)


@events.test_stop.add_listener
def _flush_raw(**_kwargs) -> None:
    if _State.raw is not None:
        _State.raw.flush()


@events.quitting.add_listener
def _flush_raw_on_quit(**_kwargs) -> None:
    _flush_raw()


@events.quit.add_listener
def _write_final_csv(**_kwargs) -> None:
    """After ``runner.quit()``: the statistics are final (workers report to their master)."""
    env = _State.environment
    opts = env.parsed_options if env is not None else None
    if env is None or opts is None or not opts.final_csv or isinstance(env.runner, WorkerRunner):
        return
    writer = StatsCSV(env, PERCENTILES_TO_REPORT)
    prefix = opts.final_csv
    for suffix, write in [
        ("stats", writer.requests_csv),
        ("failures", writer.failures_csv),
        ("exceptions", writer.exceptions_csv),
    ]:
        with open(f"{prefix}_{suffix}.csv", "w", newline="") as f:
            write(csv.writer(f))


def pool_protocol(pool: RequestPool) -> str:
    """The protocol of ``pool``'s requests (pools of before the header said it: predict)."""
    protocol = str(pool.info.get("protocol", "predict"))
    if protocol not in PROTOCOLS:
        sys.exit(f"locustfile: the pool's protocol {protocol!r} is not one of {PROTOCOLS}")
    return protocol


def _progress_file(environment: Environment) -> Path | None:
    """``--progress-file``, on the process that holds the totals (local runner or master)."""
    opts, runner = environment.parsed_options, environment.runner
    if opts is None or not opts.progress_file or isinstance(runner, WorkerRunner):
        return None
    return Path(opts.progress_file)


@events.test_start.add_listener
def _start_progress(environment: Environment, **_kwargs) -> None:
    path = _progress_file(environment)
    if path is not None and environment.runner is not None:
        # a greenlet of the runner's group (killed when it quits); time.sleep is gevent's here
        environment.runner.greenlet.spawn(_write_progress_every, environment, path)


@events.test_stop.add_listener
def _final_progress(environment: Environment, **_kwargs) -> None:
    path = _progress_file(environment)
    if path is not None:
        _write_progress(environment, path)


def _write_progress_every(environment: Environment, path: Path, every_s: float = 1.0) -> None:
    while True:
        _write_progress(environment, path)
        time.sleep(every_s)


def _write_progress(environment: Environment, path: Path) -> None:
    """``{"requests": N, "failures": F}`` of this run so far, replaced atomically
    (``--processes``: the master's totals as the workers last reported them)."""
    total = environment.stats.total
    counts = {"requests": total.num_requests, "failures": total.num_failures}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(counts))
    os.replace(tmp, path)


class PredictUser(User):
    """One client with its own gRPC channel and connection, sending the pool's requests
    (PredictRequests, or ModelInferRequests for a pool of protocol ``oip``).

    Attributes:
        host: ``ip:port`` of the PredictionService (locust's ``--host``).
        wait_time: ``--wait-ms`` between a response and the next request (default 0: closed loop).

    Each request fires locust's ``request`` event (request_type ``grpc``, name ``Predict`` or
    ``ModelInfer``, response time in ms, response size in bytes) and a raw record. A response
    with the wrong number of probabilities counts as a failure.
    """

    def wait_time(self) -> float:
        return self.environment.parsed_options.wait_ms / 1000.0

    def on_start(self) -> None:
        if _State.pool is None:
            raise RuntimeError("no request pool loaded; pass --request-pool")
        self._pool = _State.pool
        self._timeout = self.environment.parsed_options.rpc_timeout_s
        self._next = random.randrange(len(self._pool))  # users start at different requests
        if self.host is None:
            raise RuntimeError("no PredictionService address; pass --host ip:port")
        self._channel = grpc.insecure_channel(
            self.host,
            options=[
                ("grpc.max_send_message_length", _MAX_MESSAGE),
                ("grpc.max_receive_message_length", _MAX_MESSAGE),
                # a connection of its own: channels with equal arguments otherwise share one
                # (gRPC's global subchannel pool), so every user of a process would send over
                # one TCP connection, to one server process of several sharing the port
                ("grpc.use_local_subchannel_pool", 1),
            ],
        )
        # no (de)serializers: the pool holds wire bytes and the response size is its byte length
        oip = pool_protocol(self._pool) == "oip"
        self._name = "ModelInfer" if oip else "Predict"
        self._check = _check_infer if oip else _check
        self._predict: grpc.UnaryUnaryMultiCallable[bytes, bytes] = self._channel.unary_unary(
            INFER_METHOD if oip else PREDICT_METHOD
        )

    def on_stop(self) -> None:
        self._channel.close()

    @task
    def predict(self) -> None:
        payload = self._pool.payloads[self._next]
        self._next = (self._next + 1) % len(self._pool)
        response = b""
        exception: Exception | None = None
        start_unix_ns = time.time_ns()
        t0 = time.perf_counter_ns()
        try:
            response = self._predict(payload, timeout=self._timeout)
        except grpc.RpcError as e:
            exception = RpcFailure(f"{e.code().name}: {e.details()}")
        latency_ns = time.perf_counter_ns() - t0
        if exception is None:
            exception = self._check(response, self._pool.num_candidates)
        if _State.raw is not None:
            _State.raw.record(start_unix_ns, latency_ns, exception is None)
        self.environment.events.request.fire(
            request_type="grpc",
            name=self._name,
            response_time=latency_ns / 1e6,
            response_length=len(response),
            exception=exception,
            context={},
        )


def _check(response: bytes, num_candidates: int) -> Exception | None:
    try:
        n = len(predict_pb2.PredictResponse.FromString(response).probabilities)
    except Exception as e:  # a garbled response is a failure of the server, not of the user
        return RpcFailure(f"unparsable PredictResponse: {e}")
    if n != num_candidates:
        return RpcFailure(f"{n} probabilities for {num_candidates} candidates")
    return None


def _check_infer(response: bytes, num_candidates: int) -> Exception | None:
    """A ModelInferResponse holds ``probabilities`` FP32 [num_candidates], raw."""
    try:
        msg = v2.ModelInferResponse.FromString(response)
    except Exception as e:  # a garbled response is a failure of the server, not of the user
        return RpcFailure(f"unparsable ModelInferResponse: {e}")
    if [o.name for o in msg.outputs] != ["probabilities"] or len(msg.raw_output_contents) != 1:
        return RpcFailure("expected one output, probabilities, in raw_output_contents")
    n = len(msg.raw_output_contents[0]) // 4
    if n != num_candidates or list(msg.outputs[0].shape) != [n]:
        return RpcFailure(f"{n} probabilities for {num_candidates} candidates")
    return None
