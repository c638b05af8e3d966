"""One process on the device, N frontend processes on the port: ``python -m serve --frontends N``.

Without it, scaling past one process's GIL means N whole servers on one port (``--reuse-port``),
each with its own CUDA context, batcher and graphs, so the GPU is time-sliced between N
contexts and each batch holds only 1/N of the traffic. With ``--frontends N`` the process
started (the *device process*) loads the model(s) and owns the device exactly as a single
server does (one :class:`~serve.batcher.Batcher`, one :class:`~serve.model.LoadedModel` per
version, its CUDA graphs, the admin service, the model watcher), and N frontend processes
(:func:`run_frontend`, ``multiprocessing`` spawn) each run a gRPC server on the one public port
(SO_REUSEPORT: the kernel spreads connections over them). A frontend does everything of a
Predict up to the batch, with the same code as the single-process server
(:class:`serve.servicer.PredictionServicer`, :mod:`serve.rpc`, :mod:`serve.validation`,
:mod:`shared.fg_request`): parse, limits, validation, feature generation; then it hands the
built batch to the device process through shared memory (:mod:`serve.handoff`), waits for the
probabilities the same way and answers. So the answers, status codes and messages are those of
the single-process server.

Where things run, and why:

- **Limits** (request size, candidates, strings, sequences) and validation: in the frontend,
  where the request is parsed; errors never reach the device process.
- **Admission** (``--max-queue``): one bound for the whole server, as in one process: each
  frontend counts its admitted Predicts in its own cell of a shared array and refuses when the
  sum passes the bound (:class:`SharedAdmission`; no cross-process lock, so a frontend killed
  anywhere cannot wedge the others; two frontends admitting at the same instant at the bound
  may both refuse, or in a rare race let the sum pass it by fewer than N). A frontend that dies
  has its cell reset. Each frontend's thread pool is sized like a single server's.
- **Deadlines**: checked in the frontend before the handoff; the absolute deadline
  (``time.monotonic()``, one clock per host) goes with the batch, so the device process's
  batcher drops an expired request as before, and the frontend waits at most until it.
  A client that goes away cancels its request in the device process (``("cancel", rid)``).
- **Model versions**: loaded, swapped, delta-updated only in the device process
  (:class:`serve.versions.ModelManager`, :mod:`serve.admin`, unchanged). On every swap it sends
  each frontend the new version's :class:`~shared.features.FeatureSet` with a token; a frontend
  validates against the latest it got and sends the token with the batch, so the batch runs on
  the version it was built for (:class:`serve.handoff.ModelRegistry`). ``GetModelMetadata`` is
  answered by the device process (live table stats, refusals), relayed by the frontend.
- **Open Inference Protocol**: each frontend serves ``inference.GRPCInferenceService`` beside
  Predict (:mod:`serve.oip_servicer`, ModelInfer on the same servicer path and admission); its
  HTTP form (``--http-port``) is served by the device process.
- **Admin**: the admin service is the device process's own server (``--admin-address``), as
  before; frontends never serve it.
- **Health**: a frontend is SERVING once it has a model and is bound; NOT_SERVING while it
  stops. The device process's health (the admin server's, and :attr:`PredictionServer.health`)
  is SERVING only while a model serves and at least one frontend is ready.
- **Failures**: a frontend that exits is logged and restarted (backoff up to 10 s; counted in
  ``frontend_restarts_total``, ``frontends_alive`` gauge); requests it held are lost with it.
  When the device process dies, each frontend sees its pipe close (and polls its parent pid)
  and exits: no orphans. SIGTERM stops the frontends first (they finish in-flight requests
  within the grace), then the batcher.
- **Metrics**: the device process's ``/metrics`` (``--metrics-port``) serves its own samples
  summed with every live frontend's (:class:`MergedRegistry`), under the same names as one
  server: request counts, errors, latency and the validate/fg/wait/respond stages come from the
  frontends, batches, queue, tables, graphs and model loads from the device process. A
  frontend's counters restart with it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, cast

import grpc
from grpc_health.v1 import health
from prometheus_client import Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from protos import predict_pb2
from serve import oip_servicer
from serve.admission import Admission, overloaded
from serve.batcher import Batcher
from serve.handoff import HandoffClient, HandoffServer, ModelRegistry
from serve.health import NOT_SERVING, SERVING, add_health
from serve.limits import Limits
from serve.metrics import ServingMetrics
from serve.oip_servicer import DEFAULT_MODEL_NAME, InferenceService, InferenceServicer
from serve.reflection import enable_reflection
from serve.rpc import Method, RpcError, unary_service
from serve.security import TlsConfig, bind
from serve.servicer import SERVICE_NAME, PredictionServicer, status_of
from serve.slots import HandoffConfig, SlotArena
from shared.features import FeatureSet

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 10.0
_CTX = mp.get_context("spawn")  # fork is unsafe with torch and gRPC threads


@dataclass(frozen=True)
class FrontendSettings:
    """What a frontend process needs (pickled to it at spawn)."""

    host: str
    port: int
    limits: Limits
    tls: TlsConfig | None
    reserve_threads: int
    switch_interval_s: float | None
    parent_pid: int
    metadata_timeout_s: float = 10.0
    model_name: str = DEFAULT_MODEL_NAME  # the Open Inference Protocol's name of the model


@dataclass(frozen=True)
class FrontendModel:
    """What a frontend knows of a model version: enough to validate and build its batch."""

    token: int
    version: str
    fs: FeatureSet
    config_digest: str

    @classmethod
    def announced(cls, msg: tuple[Any, ...], last: FrontendModel | None) -> FrontendModel:
        """The model of a ``("model", token, version, fs, config digest)`` message. A new
        version of the same features keeps ``last``'s FeatureSet object, whose plans and
        string-id caches (built per FeatureSet object, :mod:`shared.fg_plan`) are warm: else
        the first requests after every swap would build them again."""
        _, token, version, fs, digest = msg
        if last is not None and last.fs == fs:
            fs = last.fs
        return cls(token, version, fs, digest)


class SharedAdmission(Admission):
    """:class:`~serve.admission.Admission` over every frontend: ``counts`` is a shared int64
    array, one cell per frontend, written only by its frontend; admitted while the sum stays
    within ``limit`` (see the module doc for the races at the bound)."""

    def __init__(self, limit: int, counts: Any, index: int) -> None:
        super().__init__(limit)
        self._counts = counts
        self._index = index

    @property
    def pending(self) -> int:
        return int(sum(self._counts))

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        with self._lock:  # this process's threads: one cell, read-modify-write
            self._counts[self._index] += 1
        total = int(sum(self._counts))
        if total > self.limit:
            with self._lock:
                self._counts[self._index] -= 1
            raise overloaded(total - 1, self.limit)
        try:
            yield
        finally:
            with self._lock:
                self._counts[self._index] -= 1


# --------------------------------------------------------------------------- frontend process


def run_frontend(
    index: int,
    conn: Connection,
    arena_name: str,
    handoff: HandoffConfig,
    settings: FrontendSettings,
    counts: Any,
    max_group_rows: int | None = None,
) -> None:
    """A frontend process's main (spawned by :class:`FrontendPool`); ``max_group_rows`` bounds
    the requests it sends as one group (the batcher's ``max_batch_rows``)."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s frontend-{index} %(name)s: %(message)s",
        force=True,
    )
    try:
        code = _serve_frontend(index, conn, arena_name, handoff, settings, counts, max_group_rows)
    except Exception:
        log.exception("frontend %d failed", index)
        code = 1
    sys.exit(code)


def _handler(
    servicer: PredictionServicer,
    client: HandoffClient,
    settings: FrontendSettings,
    metrics: ServingMetrics,
    admission: SharedAdmission,
) -> grpc.GenericRpcHandler:
    """The frontend's PredictionService: Predict through ``servicer``, metadata from the
    device process."""
    limits = settings.limits

    def metadata(
        request: predict_pb2.ModelMetadataRequest, context: grpc.ServicerContext
    ) -> predict_pb2.ModelMetadata:
        remaining = context.time_remaining()
        timeout = settings.metadata_timeout_s
        if remaining is not None:
            timeout = max(min(timeout, remaining), 0.0)
        return predict_pb2.ModelMetadata.FromString(client.call("metadata", timeout))

    return unary_service(
        SERVICE_NAME,
        [
            Method("Predict", predict_pb2.PredictRequest, servicer.predict, admission),
            Method("GetModelMetadata", predict_pb2.ModelMetadataRequest, metadata),
        ],
        metrics=metrics,
        status_of=status_of,
        limits=limits,
    )


def _grpc_server(
    settings: FrontendSettings,
    handlers: tuple[grpc.GenericRpcHandler, ...],
    checks: health.HealthServicer,
) -> grpc.Server:
    """The frontend's gRPC server on the shared port (not started): the services, health and
    reflection."""
    limits = settings.limits
    transport = limits.transport_bytes
    server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=limits.max_pending + settings.reserve_threads, thread_name_prefix="rpc"
        ),
        options=[
            ("grpc.max_receive_message_length", transport),
            ("grpc.max_send_message_length", transport),
            ("grpc.so_reuseport", 1),
        ],
    )
    server.add_generic_rpc_handlers(handlers)
    add_health(server, checks)
    services = (SERVICE_NAME, oip_servicer.SERVICE_NAME, health.SERVICE_NAME)
    enable_reflection(server, services, pools=[oip_servicer.DESCRIPTOR_POOL])
    return server


def _serve_frontend(
    index: int,
    conn: Connection,
    arena_name: str,
    handoff: HandoffConfig,
    settings: FrontendSettings,
    counts: Any,
    max_group_rows: int | None = None,
) -> int:
    import torch

    stop = threading.Event()
    grace = [1.0]
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the device process stops us
    torch.set_num_threads(1)
    if settings.switch_interval_s is not None:
        sys.setswitchinterval(settings.switch_interval_s)
    limits = settings.limits
    arena = SlotArena.attach(arena_name, handoff)
    client = HandoffClient(conn, arena, name=f"frontend-{index}", max_group_rows=max_group_rows)
    metrics = ServingMetrics(lambda: None)
    admission = SharedAdmission(limits.max_pending, counts, index)
    checks = health.HealthServicer()
    for name in ("", SERVICE_NAME):
        checks.set(name, NOT_SERVING)
    current: list[FrontendModel | None] = [None]
    started = threading.Event()

    def on_message(msg: tuple[Any, ...]) -> None:
        if msg[0] == "model":
            current[0] = FrontendModel.announced(msg, current[0])
            if started.is_set():
                _ready()
        elif msg[0] == "stop":
            grace[0] = float(msg[1])
            stop.set()

    def _ready() -> None:
        model = current[0]
        if model is not None and not stop.is_set():
            for name in ("", SERVICE_NAME):
                checks.set(name, SERVING)
            client.send(("ready", model.token))

    client.on_message = on_message
    client.on_gone = stop.set
    client.call_handlers["metrics"] = lambda: generate_latest(metrics.registry).decode()
    # the servicer reads only .fs and .version of the model and hands it to the batcher's
    # submit: a FrontendModel and the HandoffClient stand in for LoadedModel and Batcher
    servicer = PredictionServicer(
        cast(Any, lambda: current[0]), cast(Batcher, client), limits, metrics, admission
    )

    handler = _handler(servicer, client, settings, metrics, admission)
    inference = InferenceService(servicer, lambda: current[0], settings.model_name)
    oip = InferenceServicer(inference, admission).handler(metrics, limits)
    server = _grpc_server(settings, (handler, oip), checks)
    client.start()
    bind(server, f"{settings.host}:{settings.port}", settings.tls)
    server.start()
    started.set()
    gc.collect()  # what start-up made lives as long as the process: see serve.__main__
    gc.freeze()
    client.send(("hello", os.getpid()))
    _ready()
    log.info("frontend %d (pid %d) on %s:%d", index, os.getpid(), settings.host, settings.port)
    while not stop.wait(0.5):
        if os.getppid() != settings.parent_pid:
            log.error("frontend %d: the serving process is gone; exiting", index)
            break
    for name in ("", SERVICE_NAME):
        checks.set(name, NOT_SERVING)
    server.stop(grace[0]).wait()
    client.close()
    arena.close()
    return 0


# --------------------------------------------------------------------------- device process


@dataclass
class _Frontend:
    process: Any  # multiprocessing SpawnProcess
    endpoint: HandoffServer
    arena: SlotArena
    started: float
    ready: bool = False
    pid: int | None = None


class FrontendPool:
    """The device process's side: spawns, feeds, watches and restarts ``count`` frontends.

    ``current`` gives the serving model, ``metadata`` the serialized ``GetModelMetadata`` answer
    (or raises RpcError), ``on_change`` is called when a frontend becomes ready or dies.
    """

    def __init__(
        self,
        count: int,
        settings: FrontendSettings,
        handoff: HandoffConfig,
        batcher: Batcher,
        current: Callable[[], Any],
        metadata: Callable[[], bytes],
        metrics: ServingMetrics,
        *,
        restart: bool = True,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        if count < 1:
            raise ValueError(f"frontends must be >= 1, got {count}")
        self.count = count
        self.settings = settings
        self.handoff = handoff
        self._batcher = batcher
        self._metadata = metadata
        self._restart = restart
        self._on_change = on_change
        self.models = ModelRegistry(current)
        self._counts = _CTX.RawArray("q", count)  # admitted Predicts per frontend
        self._frontends: list[_Frontend | None] = [None] * count
        self._restart_at = [0.0] * count
        self._backoff = [0.5] * count
        self._lock = threading.RLock()
        self._model_msg: tuple[Any, ...] | None = None
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._port_hold: socket.socket | None = None
        self.port = settings.port
        r = metrics.registry
        self.restarts = Counter(
            "dynrec_serving_frontend_restarts", "Frontend processes restarted", registry=r
        )
        self.alive_gauge = Gauge(
            "dynrec_serving_frontends_alive", "Frontend processes running", registry=r
        )
        self.alive_gauge.set_function(self.alive)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> int:
        """Hold the port (SO_REUSEPORT, never listening), start the frontends; the port."""
        family, kind, proto, _, address = socket.getaddrinfo(
            self.settings.host, self.settings.port, type=socket.SOCK_STREAM
        )[0]
        hold = socket.socket(family, kind, proto)
        hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        hold.bind(address)
        self._port_hold = hold
        self.port = int(hold.getsockname()[1])
        self.settings = FrontendSettings(**{**vars(self.settings), "port": self.port})
        for i in range(self.count):
            self._spawn(i)
        self._supervisor = threading.Thread(
            target=self._supervise, name="frontend-supervisor", daemon=True
        )
        self._supervisor.start()
        return self.port

    def _spawn(self, i: int) -> None:
        arena = SlotArena.create(self.handoff)  # a fresh one: the old may still be written
        mine, theirs = _CTX.Pipe(duplex=True)
        process = _CTX.Process(
            target=run_frontend,
            args=(
                i,
                theirs,
                arena.name,
                self.handoff,
                self.settings,
                self._counts,
                self._batcher.config.max_batch_rows,
            ),
            name=f"frontend-{i}",
            daemon=True,
        )
        process.start()
        theirs.close()
        endpoint = HandoffServer(
            mine, arena, self._batcher, self.models, status_of, f"frontend-{i}"
        )
        endpoint.on_message = lambda msg: self._on_message(i, msg)
        endpoint.call_handlers["metadata"] = self._metadata
        with self._lock:
            self._frontends[i] = _Frontend(process, endpoint, arena, time.monotonic())
            if self._model_msg is not None:
                endpoint.send(self._model_msg)
        endpoint.start()
        log.info("started frontend %d (pid %s)", i, process.pid)

    def announce(self, model: Any) -> None:
        """``model`` now serves: frontends validate new requests against its feature set."""
        token = self.models.register(model)
        msg = ("model", token, model.version, model.fs, model.bundle.config_digest)
        with self._lock:
            self._model_msg = msg
            live = [f for f in self._frontends if f is not None]
        for f in live:
            f.endpoint.send(msg)

    def _on_message(self, i: int, msg: tuple[Any, ...]) -> None:
        with self._lock:
            f = self._frontends[i]
            if f is None:
                return
            if msg[0] == "hello":
                f.pid = int(msg[1])
            elif msg[0] == "ready":
                f.ready = True
        if msg[0] == "ready":
            self._on_change()

    def _supervise(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                live = {f.process.sentinel: i for i, f in enumerate(self._frontends) if f}
            if live:
                for sentinel in multiprocessing.connection.wait(list(live), timeout=0.5):
                    if not self._stopping.is_set():
                        self._on_death(live[cast(int, sentinel)])
            else:
                self._stopping.wait(0.5)
            now = time.monotonic()
            for i in range(self.count):
                if (
                    self._restart
                    and not self._stopping.is_set()
                    and self._frontends[i] is None
                    and now >= self._restart_at[i]
                ):
                    try:
                        self._spawn(i)
                        self.restarts.inc()
                    except Exception:
                        log.exception("restarting frontend %d failed; will retry", i)
                        self._restart_at[i] = now + self._backoff[i]

    def _on_death(self, i: int) -> None:
        with self._lock:
            f = self._frontends[i]
            if f is None:
                return
            self._frontends[i] = None
            self._counts[i] = 0  # its admitted requests died with it
        f.process.join(1)  # reaped: its exit code
        lived = time.monotonic() - f.started
        self._backoff[i] = 0.5 if lived > 30 else min(self._backoff[i] * 2, MAX_BACKOFF_S)
        self._restart_at[i] = time.monotonic() + (self._backoff[i] if lived < 30 else 0.0)
        log.error(
            "frontend %d (pid %s) exited with code %s after %.1f s; %s",
            i,
            f.process.pid,
            f.process.exitcode,
            lived,
            f"restarting in {self._restart_at[i] - time.monotonic():.1f} s"
            if self._restart
            else "not restarted (restarts off)",
        )
        f.endpoint.close()
        f.arena.close()
        self._on_change()

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop every frontend (each finishes its in-flight requests within ``grace``)."""
        self._stopping.set()
        g = 1.0 if grace is None else grace
        if self._supervisor is not None:
            self._supervisor.join(5)
        with self._lock:
            live = [f for f in self._frontends if f is not None]
            self._frontends = [None] * self.count
        for f in live:
            f.endpoint.send(("stop", g))
        for f in live:
            f.process.join(g + 10)
            if f.process.is_alive():
                log.warning("frontend pid %s did not stop; terminating it", f.process.pid)
                f.process.terminate()
                f.process.join(2)
            if f.process.is_alive():
                f.process.kill()
                f.process.join(2)
            f.endpoint.close()
            f.arena.close()
        if self._port_hold is not None:
            self._port_hold.close()
        self._stopped.set()

    def wait(self) -> None:
        while not self._stopped.wait(0.5):
            pass

    # ------------------------------------------------------------------ state

    def alive(self) -> int:
        with self._lock:
            return sum(1 for f in self._frontends if f is not None and f.process.is_alive())

    def ready(self) -> int:
        with self._lock:
            return sum(1 for f in self._frontends if f is not None and f.ready)

    def pids(self) -> list[int | None]:
        with self._lock:
            return [None if f is None else f.process.pid for f in self._frontends]

    def pending(self) -> int:
        """Predicts admitted by the frontends and not yet answered."""
        return int(sum(self._counts))

    def wait_ready(self, timeout: float | None) -> bool:
        """Block until every frontend is ready (bound, with a model); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.ready() < self.count:
            if self._stopping.is_set() or (deadline is not None and time.monotonic() > deadline):
                return False
            time.sleep(0.05)
        return True

    def metrics_texts(self, timeout: float = 2.0) -> list[str]:
        """Every live frontend's metrics (Prometheus text); frontends that do not answer in
        ``timeout`` are left out."""
        with self._lock:
            live = [f.endpoint for f in self._frontends if f is not None and f.ready]
        if not live:
            return []

        def ask(endpoint: HandoffServer) -> str | None:
            try:
                return str(endpoint.call("metrics", timeout))
            except RpcError:
                return None

        with futures.ThreadPoolExecutor(len(live)) as pool:
            return [t for t in pool.map(ask, live) if t is not None]


class MergedRegistry:
    """A registry's samples plus the frontends', summed by (name, labels): what the device
    process's ``/metrics`` serves (a frontend's ``*_created`` samples are left out)."""

    def __init__(self, registry: Any, texts: Callable[[], list[str]]) -> None:
        self._registry = registry
        self._texts = texts

    def collect(self) -> Iterator[Any]:
        families: dict[str, Any] = {}
        values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for fam in self._registry.collect():
            families[fam.name] = fam
            values[fam.name] = {
                (s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples
            }
        for text in self._texts():
            for fam in text_string_to_metric_families(text):
                if fam.name.endswith("_created"):
                    continue
                if fam.name not in families:
                    families[fam.name] = fam
                    values[fam.name] = {}
                merged = values[fam.name]
                for s in fam.samples:
                    if s.name.endswith("_created"):
                        continue
                    key = (s.name, tuple(sorted(s.labels.items())))
                    merged[key] = merged.get(key, 0.0) + s.value
        for name, fam in families.items():
            fam.samples = [Sample(n, dict(labels), v) for (n, labels), v in values[name].items()]
            yield fam
