"""Server reflection under both names clients ask for: ``grpc.reflection.v1`` and ``v1alpha``.

grpcio-reflection ships only the v1alpha service; grpcurl, Postman and recent grpc tools ask for
v1 first. The two protos are the same messages under another package, so the same servicer
answers both: its v1alpha messages are byte-identical on the wire to v1's. The v1 file
descriptor is derived from the v1alpha one (package renamed) and added to the default pool,
so a client can resolve the v1 service itself too. Example::

    enable_reflection(server, ["dynrec.serving.PredictionService", health.SERVICE_NAME])
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

from serve.rpc import parsed_stream_stream

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _register_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return  # registered (by us earlier, or by a v1 module of grpcio-reflection)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name = _V1_FILE
    proto.package = "grpc.reflection.v1"
    for message in proto.message_type:
        for f in message.field:
            if f.type_name.startswith(".grpc.reflection.v1alpha."):
                f.type_name = f.type_name.replace(".v1alpha.", ".v1.", 1)
    for service in proto.service:
        for m in service.method:
            m.input_type = m.input_type.replace(".v1alpha.", ".v1.", 1)
            m.output_type = m.output_type.replace(".v1alpha.", ".v1.", 1)
    pool.Add(proto)


def enable_reflection(server: grpc.Server, service_names: Iterable[str]) -> None:
    """Serve reflection v1 and v1alpha on ``server``, listing ``service_names`` and both
    reflection services."""
    _register_v1_descriptor()
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = reflection.ReflectionServicer(names)
    for service in (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME):
        handler = parsed_stream_stream(
            servicer.ServerReflectionInfo, reflection_pb2.ServerReflectionRequest
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"ServerReflectionInfo": handler}),)
        )
