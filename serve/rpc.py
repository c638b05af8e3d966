"""Unary RPCs that end in a deliberate status: the one place requests are parsed and failures
become status codes, for every service of the server.

gRPC's generated registration parses a request before the servicer runs, so bytes that do not
decode reach the client as INTERNAL ("Exception deserializing request!") with a traceback in
the log. Here a method receives the raw bytes: an admission bound is taken first (no bytes are
touched past it), the size is checked, then the message is parsed; undecodable bytes are
INVALID_ARGUMENT naming ``request``. A failure of the method is mapped by the service's
``status_of`` (its expected errors → codes); anything else is INTERNAL, logged with its
traceback under a request id that the client sees instead of the exception text. Details are
cut to the configured size, so echoed client input never overflows gRPC's metadata limit.
Every RPC and every failure is counted (``requests_total``, ``errors_total{method,code}``, and
``rejections_total{method,reason}`` for what was refused before any work). Example::

    handler = unary_service(
        "dynrec.serving.PredictionService",
        [Method("Predict", predict_pb2.PredictRequest, servicer.predict, admission=adm)],
        metrics=metrics,
        status_of=servicer_status,
        limits=limits,
    )
    server.add_generic_rpc_handlers((handler,))
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from serve.admission import Admission, OverloadedError
from serve.limits import Limits, truncate
from serve.metrics import ServingMetrics

log = logging.getLogger(__name__)

# grpcio reports "no deadline" as a deadline centuries away
_NO_DEADLINE_S = 1e9


class RpcError(Exception):
    """An expected failure with its status code; ``reason`` (optional) labels a rejection in
    ``rejections_total`` (refused before any work: overload, size, undecodable)."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: str | None = None) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.reason = reason


StatusOf = Callable[[BaseException], RpcError | None]


@dataclass(frozen=True)
class Method:
    """One unary method: ``behavior(request, context) -> response``; ``admission`` bounds the
    calls in flight (None: unbounded, for cheap methods such as metadata)."""

    name: str
    request_type: type[Message]
    behavior: Callable[[Any, grpc.ServicerContext], Any]  # gRPC: a Message
    admission: Admission | None = None


def deadline_of(context: grpc.ServicerContext) -> float | None:
    """The client's deadline as a ``time.monotonic()`` time; None without one."""
    remaining = context.time_remaining()
    if remaining is None or not math.isfinite(remaining) or remaining > _NO_DEADLINE_S:
        return None
    return time.monotonic() + remaining


def check_deadline(deadline: float | None, stage: str) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline exceeded {stage}")


def _parse(method: Method, raw: bytes, limits: Limits) -> Message:
    if len(raw) > limits.max_request_bytes:
        raise RpcError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"request: {len(raw)} bytes, more than the limit {limits.max_request_bytes} "
            "(serve --max-request-bytes); send fewer candidates per request",
            reason="request_too_large",
        )
    return _decode(method.request_type, raw)


def _decode(request_type: type[Message], raw: bytes) -> Message:
    """``raw`` as a ``request_type``; bytes that do not decode are INVALID_ARGUMENT."""
    try:
        return request_type.FromString(raw)
    except (DecodeError, RecursionError, ValueError) as err:
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request: not a valid {request_type.DESCRIPTOR.full_name} message "
            f"({truncate(str(err), 200)}); check the client's proto against GetModelMetadata's "
            "service (server reflection serves it)",
            reason="undecodable",
        ) from None


class MethodRunner:
    """One method's calls: admission, parse, behavior, status mapping and metrics. gRPC calls
    it with the raw bytes (:func:`unary_service`); another transport (:mod:`serve.oip_http`)
    calls :meth:`run` with its own parse and a context whose ``abort`` raises."""

    def __init__(
        self,
        method: Method,
        *,
        metrics: ServingMetrics,
        status_of: StatusOf,
        limits: Limits,
    ) -> None:
        self._method = method
        self._metrics = metrics
        self._status_of = status_of
        self._limits = limits

    def __call__(self, raw: bytes, context: grpc.ServicerContext) -> Message:
        return self.run(context, lambda: _parse(self._method, raw, self._limits))

    def run(self, context: grpc.ServicerContext, parse: Callable[[], Any]) -> Any:
        """``behavior(parse(), context)`` inside the admission bound; a failure aborts
        ``context`` with its status (counted, INTERNAL logged under a request id)."""
        method = self._method
        self._metrics.requests.labels(method.name).inc()
        start = time.perf_counter()
        try:
            gate = method.admission.admit() if method.admission is not None else nullcontext()
            with gate:
                return method.behavior(parse(), context)
        except Exception as err:
            status = self._status(err)
            self._metrics.errors.labels(method.name, status.code.name).inc()
            if status.reason is not None:
                self._metrics.rejections.labels(method.name, status.reason).inc()
            context.abort(status.code, truncate(status.details, self._limits.max_detail_bytes))
            raise  # not reached: abort raises
        finally:
            self._metrics.latency.labels(method.name).observe(time.perf_counter() - start)

    def _status(self, err: Exception) -> RpcError:
        if isinstance(err, RpcError):
            return err
        if isinstance(err, OverloadedError):
            return RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err), reason="overloaded")
        try:
            status = self._status_of(err)
        except Exception:  # a bug in the mapping must not hide the original error
            log.exception("status mapping failed")
            status = None
        if status is not None:
            return status
        request_id = uuid.uuid4().hex[:12]
        log.error(
            "internal error in %s (request id %s)", self._method.name, request_id, exc_info=err
        )
        return RpcError(
            grpc.StatusCode.INTERNAL,
            f"internal error (request id {request_id}, {type(err).__name__}); the server log "
            "has the traceback under this id",
        )


def unary_service(
    service: str,
    methods: Sequence[Method],
    *,
    metrics: ServingMetrics,
    status_of: StatusOf,
    limits: Limits,
) -> grpc.GenericRpcHandler:
    """The generic handler of ``service`` (full name) serving ``methods`` from raw bytes."""
    handlers: dict[str, grpc.RpcMethodHandler[bytes, Message]] = {
        m.name: grpc.unary_unary_rpc_method_handler(
            MethodRunner(m, metrics=metrics, status_of=status_of, limits=limits),
            request_deserializer=None,  # the raw bytes: parsed (and refused) by the handler
            response_serializer=lambda msg: msg.SerializeToString(),
        )
        for m in methods
    }
    return grpc.method_handlers_generic_handler(service, handlers)


def _parse_or_abort(
    request_type: type[Message], raw: bytes, context: grpc.ServicerContext
) -> Message:
    try:
        return _decode(request_type, raw)
    except RpcError as err:
        context.abort(err.code, err.details)
        raise  # not reached: abort raises


def parsed_unary(
    behavior: Callable[[Any, grpc.ServicerContext], Message], request_type: type[Message]
) -> grpc.RpcMethodHandler:
    """A unary method of a library servicer (health), served from raw bytes, so that bytes
    that do not decode are INVALID_ARGUMENT instead of gRPC's INTERNAL."""
    return grpc.unary_unary_rpc_method_handler(
        lambda raw, ctx: behavior(_parse_or_abort(request_type, raw, ctx), ctx),
        request_deserializer=None,
        response_serializer=lambda msg: msg.SerializeToString(),
    )


def parsed_unary_stream(
    behavior: Callable[[Any, grpc.ServicerContext], Iterator[Message]],
    request_type: type[Message],
) -> grpc.RpcMethodHandler:
    """:func:`parsed_unary` for a server-streaming method (health's Watch)."""
    return grpc.unary_stream_rpc_method_handler(
        lambda raw, ctx: behavior(_parse_or_abort(request_type, raw, ctx), ctx),
        request_deserializer=None,
        response_serializer=lambda msg: msg.SerializeToString(),
    )


def parsed_stream_stream(
    behavior: Callable[[Iterator[Any], grpc.ServicerContext], Iterator[Message]],
    request_type: type[Message],
) -> grpc.RpcMethodHandler:
    """:func:`parsed_unary` for a bidirectional method (reflection): each message is parsed
    as it arrives."""

    def run(raws: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[Message]:
        return behavior((_parse_or_abort(request_type, raw, ctx) for raw in raws), ctx)

    return grpc.stream_stream_rpc_method_handler(
        run, request_deserializer=None, response_serializer=lambda msg: msg.SerializeToString()
    )
