"""Server reflection under both names clients ask for: ``grpc.reflection.v1`` and ``v1alpha``.

grpcio-reflection ships only the v1alpha service; grpcurl, Postman and recent grpc tools ask for
v1 first. The two protos are the same messages under another package, so the same servicer
answers both: its v1alpha messages are byte-identical on the wire to v1's. The v1 file
descriptor is derived from the v1alpha one (package renamed) and added to the default pool,
so a client can resolve the v1 service itself too. A service compiled into a descriptor pool
of its own (the Open Inference Protocol's, since tritonclient registers the same names in the
default pool) is found through ``pools``: descriptors are looked up in each of these, then in
the default pool (where a client library of the same names, imported in the same process, must
not answer for the service served). Methods are found too (``pkg.Service.Method``). Example::

    enable_reflection(
        server,
        ["dynrec.serving.PredictionService", "inference.GRPCInferenceService", health.SERVICE_NAME],
        pools=[grpc_predict_v2_pb2.POOL],
    )
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

from serve.rpc import parsed_stream_stream

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
_V1_FILE = "grpc/reflection/v1/reflection.proto"
T = TypeVar("T")


class _Pools:
    """The lookups reflection makes, over several descriptor pools in order (the first that
    has the name answers; KeyError when none has it, as one pool), methods included."""

    def __init__(self, pools: Sequence[descriptor_pool.DescriptorPool]) -> None:
        self._pools = pools

    def _first(self, find: Callable[[descriptor_pool.DescriptorPool], T]) -> T:
        for pool in self._pools:
            try:
                return find(pool)
            except KeyError:
                continue
        raise KeyError("not found in any descriptor pool")

    def FindFileByName(self, name: str) -> Any:  # noqa: N802 (DescriptorPool's names)
        return self._first(lambda p: p.FindFileByName(name))

    def FindFileContainingSymbol(self, symbol: str) -> Any:  # noqa: N802
        return self._first(lambda p: _file_containing(p, symbol))

    def FindMessageTypeByName(self, name: str) -> Any:  # noqa: N802
        return self._first(lambda p: p.FindMessageTypeByName(name))

    def FindExtensionByNumber(self, message: Any, number: int) -> Any:  # noqa: N802
        return message.file.pool.FindExtensionByNumber(message, number)

    def FindAllExtensions(self, message: Any) -> Any:  # noqa: N802
        return message.file.pool.FindAllExtensions(message)


def _file_containing(pool: descriptor_pool.DescriptorPool, symbol: str) -> Any:
    """The file of ``symbol``, a method's too (``pkg.Service.Method``: grpcurl's ``describe``
    asks for one; the pools find messages, fields and services, not methods)."""
    try:
        return pool.FindFileContainingSymbol(symbol)
    except KeyError:
        service, _, method = symbol.rpartition(".")
        if not service or method not in pool.FindServiceByName(service).methods_by_name:
            raise
        return pool.FindFileContainingSymbol(service)


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


def enable_reflection(
    server: grpc.Server,
    service_names: Iterable[str],
    pools: Sequence[descriptor_pool.DescriptorPool] = (),
) -> None:
    """Serve reflection v1 and v1alpha on ``server``, listing ``service_names`` and both
    reflection services; descriptors from ``pools``, then the default pool."""
    _register_v1_descriptor()
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = reflection.ReflectionServicer(
        names, pool=_Pools([*pools, descriptor_pool.Default()])
    )
    for service in (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME):
        handler = parsed_stream_stream(
            servicer.ServerReflectionInfo, reflection_pb2.ServerReflectionRequest
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"ServerReflectionInfo": handler}),)
        )
