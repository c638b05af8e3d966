"""Standard gRPC health checking (``grpc.health.v1.Health``), served from raw bytes.

grpcio-health-checking's servicer with its own registration would answer undecodable bytes
with gRPC's INTERNAL; here its ``Check`` and ``Watch`` parse their requests themselves
(:mod:`serve.rpc`), so any client gets INVALID_ARGUMENT. Example::

    servicer = health.HealthServicer()
    add_health(server, servicer)
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2

from serve.rpc import parsed_unary, parsed_unary_stream

SERVICE_NAME = health.SERVICE_NAME
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def add_health(server: grpc.Server, servicer: health.HealthServicer) -> None:
    request = health_pb2.HealthCheckRequest
    handlers = {
        "Check": parsed_unary(servicer.Check, request),
        "Watch": parsed_unary_stream(servicer.Watch, request),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
