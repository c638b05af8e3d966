"""The Open Inference Protocol's HTTP/JSON form (KServe v2 REST) on ``serve --http-port``.

FastAPI on uvicorn, the stack of KServe's own Python model server: both are maintained,
ASGI, and uvicorn serves TLS (with client certificates) from the same PEM files as gRPC. The
routes answer with the same :class:`~serve.oip_servicer.InferenceService` as gRPC, each call
run by :class:`serve.rpc.MethodRunner` (admission, size limit, status mapping, metrics under
``http/<Method>``), so answers and errors are those of ``inference.GRPCInferenceService``::

    GET  /v2                                   server metadata
    GET  /v2/health/live | /v2/health/ready    200, or 503 while no model is loaded
    GET  /v2/models/{name}[/versions/{v}]      model metadata: every input, datatype and shape
    GET  /v2/models/{name}[/versions/{v}]/ready
    POST /v2/models/{name}[/versions/{v}]/infer

Tensors come as JSON ``data`` (flat or nested, row-major) or, with the binary tensor data
extension (what tritonclient.http sends by default), as raw bytes after the JSON: the header
``Inference-Header-Content-Length`` gives the JSON's length and each such input's
``parameters.binary_data_size`` its bytes, in input order. ``probabilities`` is answered in
binary when the request asks (``parameters.binary_data_output`` or the output's
``parameters.binary_data``), else as JSON ``data``. Errors are ``{"error": "<tensor>: ..."}``
with the status of the gRPC code (:data:`HTTP_STATUS`). Triton's ``timeout`` request parameter
(microseconds) is the request's deadline.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn, cast

import anyio
import grpc
import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from protos import grpc_predict_v2_pb2 as v2
from serve import oip
from serve.oip_servicer import EXTENSIONS, InferenceService, ModelInfo, server_version
from serve.rpc import Method, MethodRunner, RpcError
from serve.security import TlsConfig, server_credentials
from serve.servicer import status_of
from serve.validation import RequestError

log = logging.getLogger(__name__)

HEADER_LENGTH = "Inference-Header-Content-Length"
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,  # request_too_large: 413
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.UNIMPLEMENTED: 501,
}
_MAX_DEPTH = 16  # nesting of JSON data


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class HttpContext:
    """The part of ``grpc.ServicerContext`` the serving path uses: a deadline, callbacks, and
    ``abort``, which raises for the route to answer."""

    def __init__(self) -> None:
        self.deadline: float | None = None  # time.monotonic()

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def add_callback(self, _callback: Callable[[], None]) -> bool:
        return True  # a client that goes away is not seen: the request runs to its end

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise _Abort(code, details)


def _grpc_context(ctx: HttpContext) -> grpc.ServicerContext:
    return cast(grpc.ServicerContext, ctx)  # the methods the serving path calls


# --------------------------------------------------------------------------- JSON ↔ tensors


def _flatten(name: str, data: object, depth: int = 0) -> list[object]:
    if not isinstance(data, list):
        return [data]
    if depth > _MAX_DEPTH:
        raise RequestError(name, f"data nested deeper than {_MAX_DEPTH}")
    if not any(isinstance(x, list) for x in data):
        return data
    out: list[object] = []
    for x in data:
        out.extend(_flatten(name, x, depth + 1))
    return out


def _json_tensor(t: object, binary: memoryview, offset: int) -> tuple[oip.Tensor, int]:
    """One input of the JSON and the binary bytes it took."""
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        raise RequestError("request", "each input must be an object with a string 'name'")
    name = oip.short_name(t["name"])
    datatype, shape, params = t.get("datatype"), t.get("shape"), t.get("parameters") or {}
    if not isinstance(datatype, str):
        raise RequestError(name, "needs a string 'datatype'")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in shape
    ):
        raise RequestError(name, "needs 'shape', a list of integers")
    if not isinstance(params, dict):
        raise RequestError(name, "'parameters' must be an object")
    size = params.get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or "data" in t:
            raise RequestError(name, "binary_data_size must be an integer >= 0, without 'data'")
        if offset + size > len(binary):
            raise RequestError(name, f"binary_data_size {size} runs past the body's end")
        raw = bytes(binary[offset : offset + size])
        return oip.decode_raw(name, datatype, shape, raw), size
    if "data" not in t:
        raise RequestError(name, "needs 'data' (or parameters.binary_data_size)")
    values = _flatten(name, t["data"])
    if datatype == "BYTES":
        strings = [v for v in values if isinstance(v, str)]
        if len(strings) != len(values):
            raise RequestError(name, "BYTES data must be strings")
        try:
            values = [v.encode("utf-8") for v in strings]
        except UnicodeEncodeError:
            raise RequestError(name, "BYTES data not valid UTF-8 (a lone surrogate)") from None
    return oip.decode_list(name, datatype, shape, values), 0


def _binary_output(head: dict[str, Any]) -> tuple[list[str], bool]:
    """The requested outputs, and whether to answer them in binary."""
    outputs = head.get("outputs") or []
    params = head.get("parameters") or {}
    if not isinstance(outputs, list) or not isinstance(params, dict):
        raise RequestError("request", "'outputs' must be a list and 'parameters' an object")
    names, binary = [], params.get("binary_data_output") is True
    for o in outputs:
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise RequestError("request", "each output must be an object with a string 'name'")
        names.append(o["name"])
        o_params = o.get("parameters") or {}
        binary = binary or (isinstance(o_params, dict) and o_params.get("binary_data") is True)
    return names, binary


def call_of_http(
    body: bytes, header_length: str | None, name: str, version: str, context: HttpContext
) -> oip.InferCall:
    """An infer request's body as an InferCall (errors name the tensor, or ``request``)."""
    split = len(body)
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise RequestError(
                "request", f"{HEADER_LENGTH} {header_length[:24]!r}: not a length within the body"
            )
        split = int(header_length)
    try:
        head = json.loads(body[:split])
    except (ValueError, RecursionError) as err:
        raise RequestError("request", f"not JSON ({str(err)[:120]})") from None
    if not isinstance(head, dict) or not isinstance(head.get("inputs"), list):
        raise RequestError("request", "expected a JSON object with an 'inputs' list")
    request_id = head.get("id", "")
    if not isinstance(request_id, str):
        raise RequestError("request", "'id' must be a string")
    binary, offset, tensors = memoryview(body)[split:], 0, []
    for t in head["inputs"]:
        tensor, used = _json_tensor(t, binary, offset)
        tensors.append(tensor)
        offset += used
    if offset != len(binary):
        raise RequestError("request", f"{len(binary) - offset} binary bytes no input claims")
    outputs, binary_output = _binary_output(head)
    params = head.get("parameters") or {}
    timeout = params.get("timeout")
    if isinstance(timeout, int) and not isinstance(timeout, bool) and timeout > 0:
        context.deadline = time.monotonic() + timeout / 1e6
    return oip.InferCall(name, version, request_id, tensors, outputs, binary_output)


def infer_response(result: oip.InferResult) -> Response:
    probs = np.ascontiguousarray(result.probabilities, dtype="<f4")
    output: dict[str, Any] = {"name": oip.OUTPUT, "datatype": "FP32", "shape": [len(probs)]}
    head: dict[str, Any] = {
        "model_name": result.model_name,
        "model_version": result.model_version,
        "outputs": [output],
    }
    if result.id:
        head["id"] = result.id
    if not result.binary_output:
        output["data"] = probs.tolist()
        return Response(json.dumps(head), media_type="application/json")
    output["parameters"] = {"binary_data_size": probs.nbytes}
    text = json.dumps(head).encode()
    return Response(
        text + probs.tobytes(),
        media_type="application/octet-stream",
        headers={HEADER_LENGTH: str(len(text))},
    )


def _metadata_json(info: ModelInfo) -> dict[str, Any]:
    def tensors(ts: list[tuple[str, str, list[int]]]) -> list[dict[str, Any]]:
        return [{"name": n, "datatype": d, "shape": s} for n, d, s in ts]

    return {
        "name": info.name,
        "versions": info.versions,
        "platform": info.platform,
        "inputs": tensors(info.inputs),
        "outputs": tensors(info.outputs),
    }


# --------------------------------------------------------------------------- app


def _error(code: grpc.StatusCode, details: str, status: int | None = None) -> JSONResponse:
    return JSONResponse({"error": details}, status_code=status or HTTP_STATUS.get(code, 500))


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The body, or None past ``limit`` bytes (read no further)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


class _Routes:
    """The route bodies: each call through a :class:`MethodRunner` of its own."""

    def __init__(self, service: InferenceService, threads: int) -> None:
        self.service = service
        self._threads = threads
        self._limiter: anyio.CapacityLimiter | None = None
        p = service.predictor
        self.limit = p.limits.max_request_bytes

        def runner(
            name: str, behavior: Callable[[Any, Any], Any], gated: bool = False
        ) -> MethodRunner:
            method = Method(
                f"http/{name}", v2.ModelInferRequest, behavior, p.admission if gated else None
            )
            return MethodRunner(method, metrics=p.metrics, status_of=status_of, limits=p.limits)

        self.infer_runner = runner("ModelInfer", service.infer, gated=True)
        self.metadata_runner = runner("ModelMetadata", lambda key, _c: service.model_info(*key))
        self.ready_runner = runner("ModelReady", lambda key, _c: service.model_ready(*key))

    def limiter(self) -> anyio.CapacityLimiter:
        if self._limiter is None:  # made in the event loop's thread
            self._limiter = anyio.CapacityLimiter(self._threads)
        return self._limiter

    async def infer(self, request: Request, name: str, version: str) -> Response:
        ctx = HttpContext()
        body = await _read_body(request, self.limit)
        header_length = request.headers.get(HEADER_LENGTH)
        encoding = request.headers.get("content-encoding", "identity")

        def parse() -> oip.InferCall:
            if body is None:
                raise RpcError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"request: more than the limit {self.limit} bytes (serve "
                    "--max-request-bytes); send fewer candidates per request",
                    reason="request_too_large",
                )
            if encoding != "identity":
                raise RequestError(
                    "request",
                    f"Content-Encoding {encoding[:32]!r} not supported; send it uncompressed",
                )
            return call_of_http(body, header_length, name, version, ctx)

        try:
            result = await anyio.to_thread.run_sync(
                lambda: self.infer_runner.run(_grpc_context(ctx), parse), limiter=self.limiter()
            )
        except _Abort as err:
            return _error(err.code, err.details, 413 if body is None else None)
        return infer_response(result)

    def metadata(self, name: str, version: str) -> Response:
        try:
            info = self.metadata_runner.run(_grpc_context(HttpContext()), lambda: (name, version))
        except _Abort as err:
            return _error(err.code, err.details)
        return JSONResponse(_metadata_json(info))

    def model_ready(self, name: str, version: str) -> Response:
        try:
            ready = self.ready_runner.run(_grpc_context(HttpContext()), lambda: (name, version))
        except _Abort as err:
            return _error(err.code, err.details)
        return JSONResponse({"name": name, "ready": ready}, status_code=200 if ready else 503)


def build_app(service: InferenceService, threads: int) -> FastAPI:
    """The ASGI app of ``service`` (``threads``: infer calls running at once, beyond which
    they wait for a thread; the admission bound refuses past ``--max-queue`` first)."""
    app = FastAPI(
        title="dynrec Open Inference Protocol", openapi_url=None, docs_url=None, redoc_url=None
    )
    routes = _Routes(service, threads)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> Response:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    @app.get("/v2")
    def server_metadata() -> Response:
        return JSONResponse(
            {"name": "dynrec", "version": server_version(), "extensions": EXTENSIONS}
        )

    @app.get("/v2/health/live")
    def live() -> Response:
        return JSONResponse({"live": True})

    @app.get("/v2/health/ready")
    def ready() -> Response:
        ok = service.ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        app.add_api_route(prefix, _bind(routes.metadata), methods=["GET"])
        app.add_api_route(f"{prefix}/ready", _bind(routes.model_ready), methods=["GET"])
        app.add_api_route(f"{prefix}/infer", _bind_async(routes.infer), methods=["POST"])
    return app


def _bind(fn: Callable[[str, str], Response]) -> Callable[..., Response]:
    def route(name: str, version: str = "") -> Response:
        return fn(name, version)

    return route


def _bind_async(fn: Callable[[Request, str, str], Any]) -> Callable[..., Any]:
    async def route(request: Request, name: str, version: str = "") -> Response:
        return await fn(request, name, version)

    return route


class HttpServer:
    """uvicorn serving :func:`build_app` in a thread of this process. Example::

    http = HttpServer(service, host="127.0.0.1", port=0, tls=None, threads=72).start()
    requests.get(f"http://127.0.0.1:{http.port}/v2/health/ready")
    http.stop()
    """

    def __init__(
        self,
        service: InferenceService,
        *,
        host: str,
        port: int,
        tls: TlsConfig | None,
        threads: int,
    ) -> None:
        self._service = service
        self._host, self.port, self._tls, self._threads = host, port, tls, threads
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def _config(self) -> uvicorn.Config:
        tls: dict[str, Any] = {}
        if self._tls is not None:
            server_credentials(self._tls)  # the same checks as gRPC: a bad file is named
            tls = {"ssl_certfile": str(self._tls.cert), "ssl_keyfile": str(self._tls.key)}
            if self._tls.client_ca is not None:
                tls |= {
                    "ssl_ca_certs": str(self._tls.client_ca),
                    "ssl_cert_reqs": ssl.CERT_REQUIRED,
                }
        app = build_app(self._service, self._threads)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", **tls)
        config.load()  # here, so that a failure is raised to the caller
        return config

    def start(self, timeout_s: float = 30.0) -> HttpServer:
        config = self._config()
        family, kind, proto, _, address = socket.getaddrinfo(
            self._host, self.port, type=socket.SOCK_STREAM
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as err:
            sock.close()
            raise OSError(
                f"--http-port {self.port}: cannot bind {self._host} ({err.strerror})"
            ) from None
        self.port = int(sock.getsockname()[1])
        server = self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="oip-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on port {self.port} did not start")
            time.sleep(0.01)
        log.info("Open Inference Protocol HTTP on %s:%d", self._host, self.port)
        return self

    def stop(self, grace: float | None = 1.0) -> None:
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join((grace or 0.0) + 5.0)
        self._server = None
