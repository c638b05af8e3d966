"""Prometheus metrics of the server, in a registry of its own (several servers per process in tests).

Names (all prefixed ``dynrec_serving_``): ``requests_total{method}``, ``errors_total{method,code}``
(every failed RPC, by status code), ``rejections_total{method,reason}`` (refused before any
work: ``overloaded``, ``request_too_large``, ``undecodable``), ``pending_requests`` (admitted,
not yet answered; the admission bound is ``serve --max-queue``),
``request_latency_seconds{method}`` (histogram), ``batch_rows`` / ``batch_requests`` (histograms),
``queue_depth``, ``expired_requests_total``, ``table_lookups_total{table,result=hit|miss}``,
``model_loads_total{result=ok|refused}``, ``model_load_paths_total{path=spare|full}`` (whether a
version was written into the spare, :mod:`serve.spare`), ``delta_applies_total{path=in_place|rebuild}`` (how
each delta reached the tables, :mod:`serve.delta`), ``model_last_refusal_timestamp_seconds{version}`` (the
last version refused, and when), ``model_info{version,device}``,
``startup_seconds{stage}`` (read, table_build, program_load, warmup, graphs, total), the
current model's CUDA graphs (``graph_replays_total``, ``graph_eager_batches_total{reason}``,
``graph_captures``, ``graph_memory_bytes{kind=allocated|reserved}``; none without graphs), and ``stage_seconds{stage,clock}`` (histogram), where serving time
goes: per request in its RPC thread (``validate``, ``fg``, ``wait`` = queue + batch,
``respond``), per batch in the batcher thread (``queue_wait`` of its oldest request,
``concat``, the model's ``h2d``, ``compute``, ``sync``, and ``batch`` = all of it), each as
``clock="wall"`` and, for work done in one thread, ``clock="cpu"`` (that thread's CPU time: wall
minus cpu is time spent waiting, e.g. for the GIL). Exposed over HTTP by
:meth:`ServingMetrics.serve_http`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from serve.batcher import BatchStats
from serve.freshness import event_time, model_age
from serve.model import LoadedModel

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
_ROW_BUCKETS = (1, 10, 50, 100, 200, 500, 1000, 2000, 4000, 8000)
_REQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class _TableCollector(Collector):
    """Reads cumulative hit/miss counts from the current model at scrape time."""

    def __init__(self, current: Callable[[], LoadedModel | None]) -> None:
        self._current = current

    def collect(self) -> Any:
        fam = CounterMetricFamily(
            "dynrec_serving_table_lookups",
            "Dynamic-table key lookups of the current model version (miss: zeros returned)",
            labels=["table", "result"],
        )
        model = self._current()
        if model is not None:
            for s in model.table_stats():
                if s.is_hashmap:
                    fam.add_metric([s.name, "hit"], s.hits)
                    fam.add_metric([s.name, "miss"], s.misses)
        yield fam


class _TierCollector(Collector):
    """Where the current model's dynamic tables live (:mod:`serve.tiers`), read at scrape time:
    per table the found keys read from each tier (``hbm``: an HBM_ONLY table's every hit, a
    CACHING table's hot rows; ``host``: a CACHING table's rows read from host memory), the hit
    rate of HBM among them, and the bytes each tier holds. The cache is a static hot set chosen
    at load: no rows move between tiers while a version serves (no evictions to count).

    A table's ``host`` bytes are what the current version reads, whether or not another version
    (the spare, one retiring) shares them; ``host_tier_bytes`` is the host memory of every
    version the server holds, each shared store counted once (:class:`serve.tiers.HostTiers`),
    and ``host_tier_copies`` how many stores that is."""

    def __init__(self, current: Callable[[], LoadedModel | None]) -> None:
        self._current = current

    def collect(self) -> Any:
        p = "dynrec_serving_table_"
        reads = CounterMetricFamily(
            f"{p}tier_reads",
            "Found dynamic-table keys by the tier their row was read from (hbm, host)",
            labels=["table", "tier"],
        )
        rate = GaugeMetricFamily(
            f"{p}hbm_hit_ratio",
            "Share of a dynamic table's found keys read from HBM since the version loaded "
            "(1 for HBM_ONLY tables; NaN before any lookup)",
            labels=["table", "mode"],
        )
        size = GaugeMetricFamily(
            f"{p}bytes",
            "Bytes of each table per tier (hbm, host) of the current version",
            labels=["table", "tier"],
        )
        held = GaugeMetricFamily(
            "dynrec_serving_host_tier_bytes",
            "Host memory of the CACHING tables of every version held (served, spare, retiring), "
            "each store shared between versions counted once",
        )
        copies = GaugeMetricFamily(
            "dynrec_serving_host_tier_copies",
            "Distinct host stores of CACHING table groups held by all versions (equal rows shared)",
        )
        model = self._current()
        if model is not None:
            held.add_metric([], model.tables.host_tiers.nbytes)
            copies.add_metric([], model.tables.host_tiers.copies)
        for s in [] if model is None else model.table_stats():
            size.add_metric([s.name, "hbm"], s.hbm_bytes)
            size.add_metric([s.name, "host"], s.host_bytes)
            if s.is_hashmap:
                reads.add_metric([s.name, "hbm"], s.hits - s.host_reads)
                reads.add_metric([s.name, "host"], s.host_reads)
                ratio = (s.hits - s.host_reads) / s.hits if s.hits else math.nan
                rate.add_metric([s.name, s.mode], ratio)
        yield reads
        yield rate
        yield size
        yield held
        yield copies


class _GraphCollector(Collector):
    """The current model's CUDA graph stats at scrape time (:class:`serve.graphs.GraphStats`;
    nothing without graphs). The counters are the model's: they restart at a new version."""

    def __init__(self, current: Callable[[], LoadedModel | None]) -> None:
        self._current = current

    def collect(self) -> Any:
        model = self._current()
        stats = None if model is None else model.graph_stats()
        if stats is None:
            return
        p = "dynrec_serving_graph_"
        replays = CounterMetricFamily(f"{p}replays", "Batches replayed from a CUDA graph")
        replays.add_metric([], stats.replays)
        eager = CounterMetricFamily(
            f"{p}eager_batches", "Batches run eagerly, by reason", labels=["reason"]
        )
        for reason, n in stats.eager.items():
            eager.add_metric([reason], n)
        captures = GaugeMetricFamily(f"{p}captures", "CUDA graphs captured (buckets)")
        captures.add_metric([], stats.captures)
        skipped = GaugeMetricFamily(
            f"{p}skipped", "Buckets not captured for lack of GPU memory (they run eagerly)"
        )
        skipped.add_metric([], len(stats.skipped))
        memory = GaugeMetricFamily(
            f"{p}memory_bytes", "Device memory the graphs took at capture", labels=["kind"]
        )
        memory.add_metric(["allocated"], stats.memory_allocated_bytes)
        memory.add_metric(["reserved"], stats.memory_reserved_bytes)
        yield from (replays, eager, captures, skipped, memory)


class ServingMetrics:
    def __init__(self, current_model: Callable[[], LoadedModel | None]) -> None:
        r = self.registry = CollectorRegistry()
        p = "dynrec_serving_"
        self.requests = Counter(f"{p}requests", "RPCs received", ["method"], registry=r)
        self.errors = Counter(
            f"{p}errors", "RPCs failed, by status code", ["method", "code"], registry=r
        )
        self.rejections = Counter(
            f"{p}rejections",
            "RPCs refused before any work, by reason (overloaded, request_too_large, undecodable)",
            ["method", "reason"],
            registry=r,
        )
        self.pending = Gauge(
            f"{p}pending_requests", "Predicts admitted and not yet answered", registry=r
        )
        self.latency = Histogram(
            f"{p}request_latency_seconds",
            "RPC latency in the servicer",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_rows = Histogram(
            f"{p}batch_rows", "Candidate rows per executed batch", buckets=_ROW_BUCKETS, registry=r
        )
        self.batch_requests = Histogram(
            f"{p}batch_requests", "Requests per executed batch", buckets=_REQ_BUCKETS, registry=r
        )
        self.batch_seconds = Histogram(
            f"{p}batch_run_seconds", "Model time per batch", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_depth = Gauge(f"{p}queue_depth", "Requests waiting to be batched", registry=r)
        self.expired = Counter(
            f"{p}expired_requests", "Requests dropped in the queue past their deadline", registry=r
        )
        self._version_metrics(r, p)
        self._freshness_metrics(r, p, current_model)
        self.stage_seconds = Histogram(
            f"{p}stage_seconds",
            "Serving time per request (validate, fg, wait, respond) and per batch (queue_wait, "
            "concat, h2d, compute, sync, batch); clock wall or the thread's cpu time",
            ["stage", "clock"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._stages: dict[tuple[str, str], Any] = {}
        r.register(_TableCollector(current_model))
        r.register(_TierCollector(current_model))
        r.register(_GraphCollector(current_model))
        self._http: Any = None

    def _version_metrics(self, r: CollectorRegistry, p: str) -> None:
        """The metrics of model versions: loads, their paths, deltas, refusals, startup."""
        self.model_loads = Counter(
            f"{p}model_loads", "Model version loads, ok or refused", ["result"], registry=r
        )
        self.load_paths = Counter(
            f"{p}model_load_paths",
            "Model versions loaded to serve, by path: spare (written into the replaced "
            "version's tensors and CUDA graphs, serve.spare) or full",
            ["path"],
            registry=r,
        )
        self.delta_applies = Counter(
            f"{p}delta_applies",
            "Deltas applied, by path: in_place (written into the live tables) or rebuild",
            ["path"],
            registry=r,
        )
        self.delta_refusals = Counter(
            f"{p}delta_refusals",
            "Published deltas refused by the delta watcher (serve.delta_watch)",
            registry=r,
        )
        self.last_refusal = Gauge(
            f"{p}model_last_refusal_timestamp_seconds",
            "Unix time of the last refused model version (its name in the label)",
            ["version"],
            registry=r,
        )
        self.model_info = Gauge(
            f"{p}model_info",
            "1 for the model version being served",
            ["version", "device"],
            registry=r,
        )
        self.startup = Gauge(
            f"{p}startup_seconds",
            "Startup time split of the current version",
            ["stage"],
            registry=r,
        )

    def _freshness_metrics(
        self, r: CollectorRegistry, p: str, current: Callable[[], LoadedModel | None]
    ) -> None:
        """The served model's freshness (serve.freshness); NaN while unknown."""

        def stamp() -> float:
            model = current()
            t = None if model is None else event_time(model)
            return math.nan if t is None else t

        def age() -> float:
            a = model_age(current())
            return math.nan if a is None else a

        self.event_time = Gauge(
            f"{p}model_event_time_seconds",
            "Unix time of the newest training row in the served model (online training)",
            registry=r,
        )
        self.event_time.set_function(stamp)
        self.model_age = Gauge(
            f"{p}model_age_seconds",
            "Now minus the event time of the newest training row in the served model",
            registry=r,
        )
        self.model_age.set_function(age)

    def _stage(self, stage: str, clock: str) -> Any:
        child = self._stages.get((stage, clock))
        if child is None:
            child = self._stages[stage, clock] = self.stage_seconds.labels(stage, clock)
        return child

    def on_request(self, stages: dict[str, tuple[float, float | None]]) -> None:
        """Per-request stage times: ``{stage: (wall seconds, thread CPU seconds or None)}``."""
        for stage, (wall, cpu) in stages.items():
            self._stage(stage, "wall").observe(wall)
            if cpu is not None:
                self._stage(stage, "cpu").observe(cpu)

    def on_batch(self, stats: BatchStats) -> None:
        if stats.expired:
            self.expired.inc(stats.expired)
        if stats.requests:
            self.batch_rows.observe(stats.rows)
            self.batch_requests.observe(stats.requests)
            self.batch_seconds.observe(stats.run_s)
            self._stage("queue_wait", "wall").observe(stats.queue_wait_s)
            self._stage("concat", "wall").observe(stats.concat_s)
            for stage, seconds in stats.stages.items():
                self._stage(stage, "wall").observe(seconds)
            self._stage("batch", "wall").observe(stats.concat_s + stats.run_s)
            self._stage("batch", "cpu").observe(stats.cpu_s)

    def on_model(self, model: LoadedModel) -> None:
        self.model_loads.labels("ok").inc()
        self.model_info.clear()
        self.model_info.labels(model.version, str(model.device)).set(1)
        for stage, seconds in model.startup.as_dict().items():
            self.startup.labels(stage).set(seconds)

    def on_load_path(self, path: str) -> None:
        """A version loaded to serve by ``path``: "spare" or "full" (serve.spare)."""
        self.load_paths.labels(path).inc()

    def on_delta(self, path: str) -> None:
        """A delta applied by ``path`` (serve.delta.ApplyPath: in_place or rebuild)."""
        self.delta_applies.labels(path).inc()

    def on_refused(self, version: str, at_unix: float) -> None:
        self.model_loads.labels("refused").inc()
        self.last_refusal.clear()
        self.last_refusal.labels(version).set(at_unix)

    def serve_http(self, port: int, host: str = "127.0.0.1", registry: Any = None) -> int:
        """Start the /metrics HTTP endpoint; returns the bound port (``port=0``: ephemeral).
        ``registry``: what it serves instead of :attr:`registry` (anything with ``collect()``:
        :class:`serve.frontend.MergedRegistry` adds the frontends' metrics)."""
        server, _thread = start_http_server(
            port, addr=host, registry=self.registry if registry is None else registry
        )
        self._http = server
        return int(server.server_address[1])

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
