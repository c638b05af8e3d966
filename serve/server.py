"""The gRPC server: PredictionService + standard health checking + reflection + Prometheus.

Startup order: the port opens first with health NOT_SERVING (for ``""`` and the service name),
the model loads in a background thread (read, table build, program load, warm-up), and only then
does health turn SERVING. With ``model_dir`` the directory is watched for new versions
(:mod:`serve.versions`).

Threads: each Predict holds an RPC thread until its batch is done, so the pool is the admission
bound (``limits.max_pending``) plus ``reserve_threads``: Predicts past the bound are refused at
once (:mod:`serve.admission`) and health checks, metadata and those refusals always find a
thread. gRPC's own concurrency limit is off, so every refusal is the server's and is counted.
TLS (``tls``) secures the public port; the admin service (``admin``, off by default) has a
server of its own (:class:`serve.admin.AdminServer`). Example::

    server = PredictionServer(ServerConfig(bundle=Path("exports/v1"))).start()
    server.wait_ready(60)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    ...
    server.stop()
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import grpc
import torch
from grpc_health.v1 import health

from protos import predict_pb2
from serve import oip_servicer
from serve.admin import AdminConfig, AdminServer
from serve.admission import Admission
from serve.batcher import Batcher, BatcherConfig
from serve.delta import Applied, apply_delta
from serve.delta_watch import DeltaWatcher
from serve.frontend import FrontendPool, FrontendSettings, MergedRegistry
from serve.graphs import Bucket, default_buckets
from serve.health import NOT_SERVING, SERVING, add_health
from serve.limits import Limits
from serve.metrics import ServingMetrics
from serve.model import LoadedModel, default_device
from serve.oip_servicer import DEFAULT_MODEL_NAME, InferenceService, InferenceServicer
from serve.reflection import enable_reflection
from serve.security import TlsConfig, bind
from serve.servicer import SERVICE_NAME, PredictionServicer
from serve.slots import HandoffConfig
from serve.spare import Spare, adopt
from serve.tiers import TierConfig
from serve.versions import ModelManager

if TYPE_CHECKING:
    from serve.oip_http import HttpServer

log = logging.getLogger(__name__)

STOP_LOAD_WAIT_S = 60.0  # stop() waits this long for a first load still under way


@dataclass(frozen=True)
class ServerConfig:
    """Everything the server needs; one of ``bundle`` and ``model_dir`` is required."""

    bundle: Path | None = None
    model_dir: Path | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0: ephemeral (see PredictionServer.port)
    metrics_port: int | None = None  # None: no HTTP endpoint; 0: ephemeral
    device: str | None = None  # None: cuda when available, else cpu
    # CUDA: capture a CUDA graph per shape bucket at model load and replay batches through them
    # (serve.graphs; buckets up to the larger of max_batch_rows and max_candidates)
    cuda_graphs: bool = True
    # with CUDA graphs: the replaced version is kept as a spare and the next version written
    # into its tensors, so a swap captures no graphs (serve.spare); one more copy held
    reuse_graphs: bool = True
    limits: Limits = field(default_factory=Limits)
    batching: BatcherConfig = field(default_factory=BatcherConfig)
    # threads beyond the admission bound (limits.max_pending): health, metadata, refusals
    reserve_threads: int = 8
    # torch intra-op threads of the process (None: torch's default, one per core). The batcher
    # runs one batch at a time while the RPC threads do feature generation beside it, so on a
    # small CPU host one thread each keeps them from spinning against each other.
    torch_threads: int | None = None
    poll_interval_s: float = 2.0
    verify_checksums: bool = True
    tls: TlsConfig | None = None  # None: plaintext public port
    admin: AdminConfig | None = None  # None: no ModelAdminService at all
    # follow the deltas an online trainer publishes under <dir>/<base version>/ (every
    # poll_interval_s; serve.delta_watch); None: deltas only through the admin's ApplyDelta
    watch_deltas: Path | None = None
    reuse_port: bool = False  # SO_REUSEPORT: several server processes on one port
    switch_interval_s: float | None = None  # sys.setswitchinterval (None: Python's, 5 ms)
    # the switch interval while a version loads (and captures its graphs) beside the one serving:
    # the batcher then waits at most this for the GIL the load thread holds (None: unchanged)
    load_switch_interval_s: float | None = 0.0002
    # > 0: this process owns the device and that many frontend processes serve the public port
    # (parse, validation, feature generation), handing batches over in shared memory
    # (serve.frontend, serve.handoff); 0: this process serves the port itself
    frontends: int = 0
    handoff: HandoffConfig = field(default_factory=HandoffConfig)
    restart_frontends: bool = True  # a frontend that exits is started again
    # the Open Inference Protocol (serve.oip_servicer) serves the model under this name
    model_name: str = DEFAULT_MODEL_NAME
    # its HTTP/JSON form on this port (None: off; 0: ephemeral), served by this process
    http_port: int | None = None
    # where the dynamic tables live (serve.tiers: per-table cache factors, HBM budget);
    # None: as each bundle's fg.json says
    tiers: TierConfig | None = None

    def __post_init__(self) -> None:
        if (self.bundle is None) == (self.model_dir is None):
            raise ValueError("give exactly one of bundle (one version) or model_dir (watched)")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1 (or None), got {self.torch_threads}")
        for name in ("switch_interval_s", "load_switch_interval_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 (or None), got {value}")
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        if self.frontends < 0:
            raise ValueError(f"frontends must be >= 0, got {self.frontends}")
        if self.reserve_threads < 1:
            raise ValueError(
                f"reserve_threads must be >= 1 (health checks need a thread), "
                f"got {self.reserve_threads}"
            )

    @property
    def rpc_threads(self) -> int:
        """Handler threads: one per admitted Predict plus the reserve."""
        return self.limits.max_pending + self.reserve_threads


_LOADS = threading.Lock()
_loading: list[float] = []  # the switch interval before the first of the loads under way


@contextlib.contextmanager
def _switch_interval(seconds: float | None) -> Iterator[None]:
    """Python's GIL switch interval at most ``seconds`` inside (None: unchanged): a thread that
    holds the GIL (a version loading, mostly Python) hands it on that soon to one waiting for it
    (the batcher), instead of after the process's interval (5 ms by default, the size of a spike
    in the served version's latency). Loads of several servers in one process may overlap: the
    last to finish puts the process's interval back."""
    if seconds is None:
        yield
        return
    with _LOADS:
        _loading.append(sys.getswitchinterval())
        sys.setswitchinterval(min(sys.getswitchinterval(), seconds))
    try:
        yield
    finally:
        with _LOADS:
            previous = _loading.pop()
            if not _loading:
                sys.setswitchinterval(previous)


class PredictionServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.device = config.device or default_device()
        self.metrics = ServingMetrics(lambda: self.manager.current)
        self.manager = ModelManager(
            self._load,
            on_loaded=self._on_loaded,
            on_refused=self._on_refused,
            on_retired=self._on_retired,
        )
        self.batcher = Batcher(
            config.batching, on_batch=self.metrics.on_batch, outstanding=self._outstanding
        )
        self.admission = Admission(config.limits.max_pending)
        self.metrics.queue_depth.set_function(self.batcher.depth)
        self.metrics.pending.set_function(lambda: self.admission.pending)
        self.health = health.HealthServicer()
        self.admin: AdminServer | None = None
        self.admin_port: int | None = None
        self.load_error: Exception | None = None
        self.port = 0
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self._http: HttpServer | None = None
        self._grpc: grpc.Server | None = None
        self.frontends: FrontendPool | None = None
        self._stopping = False
        self._loading: threading.Thread | None = None
        self._load_done = threading.Event()
        self.spare = Spare()  # the replaced version, for the next one (serve.spare)
        self.delta_watcher: DeltaWatcher | None = None

    def _outstanding(self) -> int:
        """Predicts admitted and not answered (the batcher's hint: who could still join)."""
        return self.frontends.pending() if self.frontends is not None else self.admission.pending

    def _load(self, path: Path) -> LoadedModel:
        cfg = self.config
        with _switch_interval(cfg.load_switch_interval_s):
            keeps = self._keeps_spare()
            written = (
                adopt(
                    self.spare,
                    path,
                    verify_checksums=cfg.verify_checksums,
                    warmup_candidates=self._warmup_candidates(),
                )
                if keeps
                else None
            )
            model = self._load_in_full(path) if written is None else written
            self.metrics.on_load_path("full" if written is None else "spare")
            if keeps and self.manager.current is None and not self.spare.ready:
                self._build_spare(path, model)
            return model

    def _load_in_full(self, path: Path) -> LoadedModel:
        return LoadedModel.load(
            path,
            device=self.device,
            verify_checksums=self.config.verify_checksums,
            warmup_candidates=self._warmup_candidates(),
            graph_buckets=self.graph_buckets(),
            tiers=self.config.tiers,
        )

    def _warmup_candidates(self) -> int:
        return min(self.config.limits.max_candidates, 100)

    def _keeps_spare(self) -> bool:
        """Whether replaced versions are kept for the next one: only with CUDA graphs, whose
        capture is what a spare saves (serve.spare)."""
        cfg = self.config
        watched = cfg.model_dir is not None  # new versions come (a single bundle: only deltas)
        return cfg.reuse_graphs and watched and bool(self.graph_buckets()) and not self._stopping

    def _build_spare(self, path: Path, serving: LoadedModel) -> None:
        """A second copy of the first version, as the spare (so the first swap captures no
        graphs either); the server serves without one if it cannot be had."""
        try:
            self.spare.offer(self._load_in_full(path), serving)
        except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError
            log.warning(
                "no spare model (%s: %s): the next version loads in full and captures its CUDA "
                "graphs while this one serves",
                type(err).__name__,
                str(err)[:300],
            )

    def _on_retired(self, model: LoadedModel) -> None:
        if self._keeps_spare():
            self.spare.offer(model, self.manager.current)
        else:
            model.retire()

    def graph_buckets(self) -> tuple[Bucket, ...]:
        """The CUDA graph buckets of loaded models (none on the CPU or with graphs off)."""
        cfg = self.config
        if not cfg.cuda_graphs or torch.device(self.device).type != "cuda":
            return ()
        return default_buckets(max(cfg.batching.max_batch_rows, cfg.limits.max_candidates))

    def _on_loaded(self, model: LoadedModel) -> None:
        self.metrics.on_model(model)
        if self.frontends is not None:
            self.frontends.announce(model)
        self._update_health()

    def _update_health(self) -> None:
        """SERVING once a model serves (and, with frontends, while one of them is ready)."""
        serving = (
            not self._stopping
            and self.manager.current is not None
            and (self.frontends is None or self.frontends.ready() > 0)
        )
        for name in ("", SERVICE_NAME):
            self.health.set(name, SERVING if serving else NOT_SERVING)
        if self.admin is not None:
            self.admin.set_serving(serving)

    def _on_refused(self, _path: Path, _err: Exception) -> None:
        refusal = self.manager.last_refusal
        if refusal is not None:
            self.metrics.on_refused(refusal.version, refusal.at_unix)

    def start(self) -> PredictionServer:
        cfg = self.config
        if cfg.torch_threads is not None:
            torch.set_num_threads(cfg.torch_threads)
        if cfg.switch_interval_s is not None:
            sys.setswitchinterval(cfg.switch_interval_s)
        if cfg.frontends:
            self._start_frontends()
        else:
            self._start_grpc()
        if cfg.http_port is not None:
            self._start_http()
        if cfg.admin is not None:
            self.admin = AdminServer(
                cfg.admin,
                self.manager,
                self.metrics,
                tls=cfg.tls,
                verify_checksums=cfg.verify_checksums,
                warmup_candidates=min(cfg.limits.max_candidates, 100),
            ).start()
            self.admin_port = self.admin.port
        if cfg.metrics_port is not None:
            registry = None
            if self.frontends is not None:
                registry = MergedRegistry(self.metrics.registry, self.frontends.metrics_texts)
            self.metrics_port = self.metrics.serve_http(cfg.metrics_port, cfg.host, registry)
        log.info(
            "listening on %s:%d (%s; HTTP: %s; metrics: %s; admin: %s), device %s, at most %d "
            "requests in flight",
            cfg.host,
            self.port,
            "TLS" if cfg.tls is not None else "plaintext",
            self.http_port,
            self.metrics_port,
            "off" if cfg.admin is None else cfg.admin.address,
            self.device,
            cfg.limits.max_pending,
        )
        self._loading = threading.Thread(target=self._initial_load, name="model-load", daemon=True)
        self._loading.start()
        return self

    def _start_grpc(self) -> None:
        """The public port served by this process (the default)."""
        cfg = self.config
        limit = cfg.limits.transport_bytes
        opts = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", int(cfg.reuse_port)),
        ]
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=cfg.rpc_threads, thread_name_prefix="rpc"),
            options=opts,
        )
        servicer = self._servicer()
        oip = InferenceServicer(self._inference(servicer), self.admission)
        server.add_generic_rpc_handlers((servicer.handler(), oip.handler(self.metrics, cfg.limits)))
        add_health(server, self.health)
        for name in ("", SERVICE_NAME):
            self.health.set(name, NOT_SERVING)
        services = (SERVICE_NAME, oip_servicer.SERVICE_NAME, health.SERVICE_NAME)
        enable_reflection(server, services, pools=[oip_servicer.DESCRIPTOR_POOL])
        self.port = bind(server, f"{cfg.host}:{cfg.port}", cfg.tls)
        server.start()
        self._grpc = server

    def _servicer(self) -> PredictionServicer:
        """The Predict/ModelMetadata servicer over this server's models, batcher and limits."""
        return PredictionServicer(
            lambda: self.manager.current,
            self.batcher,
            self.config.limits,
            self.metrics,
            self.admission,
            last_refusal=lambda: self.manager.last_refusal,
        )

    def _inference(self, servicer: PredictionServicer) -> InferenceService:
        """The Open Inference Protocol over ``servicer``'s Predict path and this server's models."""
        return InferenceService(servicer, lambda: self.manager.current, self.config.model_name)

    def _start_http(self) -> None:
        """The protocol's HTTP/JSON form (serve.oip_http) on ``http_port``, served by this
        process (with frontends: the device process, its batcher directly)."""
        from serve.oip_http import HttpServer  # FastAPI + uvicorn: only when asked for

        cfg = self.config
        assert cfg.http_port is not None
        self._http = HttpServer(
            self._inference(self._servicer()),
            host=cfg.host,
            port=cfg.http_port,
            tls=cfg.tls,
            threads=cfg.rpc_threads,
        ).start()
        self.http_port = self._http.port

    def _start_frontends(self) -> None:
        """The public port served by ``frontends`` processes (serve.frontend); this one keeps
        the batcher, the models and the device."""
        cfg = self.config
        for name in ("", SERVICE_NAME):
            self.health.set(name, NOT_SERVING)
        servicer = self._servicer()
        no_context = cast(grpc.ServicerContext, None)  # metadata() does not use it

        def metadata() -> bytes:
            answer = servicer.metadata(predict_pb2.ModelMetadataRequest(), no_context)
            return answer.SerializeToString()

        settings = FrontendSettings(
            host=cfg.host,
            port=cfg.port,
            limits=cfg.limits,
            tls=cfg.tls,
            reserve_threads=cfg.reserve_threads,
            switch_interval_s=cfg.switch_interval_s,
            parent_pid=os.getpid(),
            model_name=cfg.model_name,
        )
        self.frontends = FrontendPool(
            cfg.frontends,
            settings,
            cfg.handoff,
            self.batcher,
            lambda: self.manager.current,
            metadata,
            self.metrics,
            restart=cfg.restart_frontends,
            on_change=self._update_health,
        )
        self.metrics.pending.set_function(self.frontends.pending)
        self.port = self.frontends.start()

    def _initial_load(self) -> None:
        cfg = self.config
        try:
            if cfg.bundle is not None:
                ok = self.manager.load(cfg.bundle)
            else:
                assert cfg.model_dir is not None
                ok = self.manager.poll(cfg.model_dir)
                self.manager.watch(cfg.model_dir, cfg.poll_interval_s)
            if not ok:
                where = cfg.bundle or cfg.model_dir
                self.load_error = RuntimeError(f"no loadable model bundle in {where} (see log)")
            if cfg.watch_deltas is not None and not self._stopping:
                self._watch_deltas(cfg.watch_deltas)
        except Exception as err:  # keep the server up (NOT_SERVING) and say why
            log.exception("initial model load failed")
            self.load_error = err
        finally:
            self._load_done.set()

    def _watch_deltas(self, root: Path) -> None:
        """Apply the newest published delta of the served base, now and on every poll."""
        cfg = self.config

        def apply(model: LoadedModel, path: Path) -> Applied:
            with _switch_interval(cfg.load_switch_interval_s):
                return apply_delta(
                    model,
                    path,
                    verify_checksums=cfg.verify_checksums,
                    warmup_candidates=self._warmup_candidates(),
                    label=f"delta {path.parent.name}/{path.name}",
                )

        self.delta_watcher = DeltaWatcher(
            self.manager,
            root,
            apply=apply,
            on_applied=lambda a: self.metrics.on_delta(a.path.value),
            on_refused=lambda _path, _err: self.metrics.delta_refusals.inc(),
        )
        self.delta_watcher.start(cfg.poll_interval_s)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until a model serves (True) or the first load attempt failed / timed out;
        with frontends, until every frontend is also ready to serve it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._load_done.wait(timeout)
        if not self.manager.ready.is_set():
            return False
        if self.frontends is None:
            return True
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        return self.frontends.wait_ready(left)

    def wait(self) -> None:
        if self.frontends is not None:
            self.frontends.wait()
            return
        assert self._grpc is not None
        self._grpc.wait_for_termination()

    def stop(self, grace: float | None = 1.0) -> None:
        self._stopping = True
        for name in ("", SERVICE_NAME):
            self.health.set(name, NOT_SERVING)
        self.manager.stop()
        if self._loading is not None and self._loading is not threading.current_thread():
            # a stop during the first load: its CUDA work (captures) must not outlive the
            # server, nor may the spare it builds
            self._loading.join(STOP_LOAD_WAIT_S)
            if self._loading.is_alive():
                log.warning("the first model load is still running after %.0fs", STOP_LOAD_WAIT_S)
        if self.delta_watcher is not None:  # started by the first load, joined above
            self.delta_watcher.stop()
        self.spare.clear()
        if self.admin is not None:
            self.admin.stop(grace)
        if self.frontends is not None:  # they finish their requests on the batcher: first
            self.frontends.stop(grace)
        if self._http is not None:
            self._http.stop(grace)
        if self._grpc is not None:
            self._grpc.stop(grace).wait()
        self.batcher.close()
        self.metrics.close()
