"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``), with Triton's own
client (tritonclient.grpc) against a real server on 127.0.0.1.

Liveness, readiness and metadata; ModelInfer gives Predict's scores bit for bit for the same
rows, with the tensors in ``raw_input_contents`` and in typed ``contents`` (their tensors give
the batch of Predict's validation); malformed tensors and bad values are INVALID_ARGUMENT naming
the tensor; other models and versions NOT_FOUND; the protocol's
other RPCs UNIMPLEMENTED; server reflection lists and describes the service.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

from loadtest.oip import OipTensor, infer_request, tensors_of_predict
from protos import grpc_predict_v2_pb2 as v2
from protos import grpc_predict_v2_pb2_grpc as v2_grpc
from protos import predict_pb2, predict_pb2_grpc
from serve import oip
from serve.limits import Limits
from serve.server import PredictionServer, ServerConfig
from serve.validation import FgInputs, request_inputs
from shared.features import FeatureSet
from shared.fg_request import request_columns_to_batch

from .conftest import candidate_variants, running_server, to_columnar

tg = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

LIMITS = Limits(max_candidates=8, max_sequence_length=20, max_string_bytes=64, max_pending=16)
TIMEOUT_S = 30.0
OIP_FILE = "protos/grpc_predict_v2.proto"


@pytest.fixture(scope="module")
def server(bundle_v1: Path) -> Iterator[PredictionServer]:
    with running_server(bundle_v1, LIMITS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: PredictionServer) -> Iterator[object]:
    c = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    yield c
    c.close()


@pytest.fixture(scope="module")
def channel(server: PredictionServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


def triton_inputs(tensors: list[OipTensor]) -> list[object]:
    inputs = []
    for t in tensors:
        i = tg.InferInput(t.name, t.shape, t.datatype)
        i.set_data_from_numpy(t.as_numpy())
        inputs.append(i)
    return inputs


def infer_scores(client, request: predict_pb2.PredictRequest, *, raw: bool) -> bytes:
    """ModelInfer's probabilities as float32 bytes: tritonclient's InferInputs (raw, answered
    raw) or its stub with a request of typed contents (tritonclient builds only raw ones),
    answered in typed contents."""
    if raw:
        result = client.infer(
            "dynrec",
            triton_inputs(tensors_of_predict(request)),
            request_id=request.request_id,
            client_timeout=TIMEOUT_S,
        )
        assert result.get_response().id == request.request_id
        return result.as_numpy("probabilities").astype(np.float32).tobytes()
    msg = infer_request(request, "dynrec", raw=False)
    triton_msg = tg.service_pb2.ModelInferRequest.FromString(msg.SerializeToString())
    response = client._client_stub.ModelInfer(triton_msg, timeout=TIMEOUT_S)
    assert response.id == request.request_id
    # typed contents in, typed contents out (as KServe's server; tritonclient reads only raw)
    assert not response.raw_output_contents
    (output,) = response.outputs
    assert (output.name, output.datatype, list(output.shape)) == (
        "probabilities",
        "FP32",
        [len(output.contents.fp32_contents)],
    )
    return np.array(output.contents.fp32_contents, np.float32).tobytes()


def predict_scores(channel: grpc.Channel, request: predict_pb2.PredictRequest) -> bytes:
    stub = predict_pb2_grpc.PredictionServiceStub(channel)
    return np.asarray(stub.Predict(request, timeout=TIMEOUT_S).probabilities, np.float32).tobytes()


def test_liveness_readiness_and_metadata(client, server: PredictionServer, fs: FeatureSet) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("dynrec") and client.is_model_ready("dynrec", "1")
    assert client.get_server_metadata().name == "dynrec"
    md = client.get_model_metadata("dynrec")
    assert md.name == "dynrec" and list(md.versions) == ["1"]
    inputs = {t.name: (t.datatype, list(t.shape)) for t in md.inputs}
    assert set(inputs) == set(fs.features)
    assert inputs["user_id"] == ("INT64", [1]) and inputs["pid"] == ("BYTES", [1])
    assert inputs["price"] == ("FP64", [-1]) and inputs["adgroup_id"] == ("INT64", [-1])
    assert inputs["click_50_seq__brand"] == ("INT64", [-1])
    assert [(t.name, t.datatype, list(t.shape)) for t in md.outputs] == [
        ("probabilities", "FP32", [-1])
    ]


def test_other_models_versions_and_rpcs(client) -> None:
    assert not _ok(lambda: client.is_model_ready("other"))
    for call, code in [
        (lambda: client.get_model_metadata("other"), "StatusCode.NOT_FOUND"),
        (lambda: client.get_model_metadata("dynrec", "7"), "StatusCode.NOT_FOUND"),
        (lambda: client.get_model_config("dynrec"), "StatusCode.UNIMPLEMENTED"),
        (lambda: client.get_model_repository_index(), "StatusCode.UNIMPLEMENTED"),
    ]:
        with pytest.raises(InferenceServerException) as err:
            call()
        assert err.value.status() == code, err.value


def _ok(call) -> bool:
    try:
        return bool(call())
    except InferenceServerException:
        return False


@pytest.mark.parametrize("raw", [True, False], ids=["raw_input_contents", "contents"])
def test_infer_gives_predicts_scores(
    client, channel: grpc.Channel, fs, requests, raw: bool
) -> None:
    variants = candidate_variants(requests)
    cases = [*requests, *variants.values(), *(to_columnar(fs, r) for r in variants.values())]
    for req in cases:
        assert infer_scores(client, req, raw=raw) == predict_scores(channel, req), req.request_id


def _good(requests) -> v2.ModelInferRequest:
    variants = candidate_variants(requests)
    return infer_request(variants["as sampled"], "dynrec", raw=True)


def _edit(msg: v2.ModelInferRequest, name: str, **changes) -> v2.ModelInferRequest:
    """``msg`` with input ``name`` changed (datatype, shape, raw bytes), or dropped (None)."""
    out = v2.ModelInferRequest()
    out.CopyFrom(msg)
    del out.inputs[:]
    del out.raw_input_contents[:]
    for t, raw in zip(msg.inputs, msg.raw_input_contents, strict=True):
        if t.name == name:
            if changes.get("drop"):
                continue
            t = v2.ModelInferRequest.InferInputTensor(
                name=changes.get("rename", t.name),
                datatype=changes.get("datatype", t.datatype),
                shape=changes.get("shape", t.shape),
            )
            raw = changes.get("raw", raw)
        out.inputs.append(t)
        out.raw_input_contents.append(raw)
    return out


def _i64(*xs: int) -> bytes:
    return np.array(xs, "<i8").tobytes()


MALFORMED = {
    # case: (tensor, changes, the tensor the details must start with)
    "wrong datatype": ("user_id", {"datatype": "FP64", "raw": np.array([1.0], "<f8").tobytes()}),
    "unsupported datatype": ("price", {"datatype": "INT8"}),
    "user feature of shape [2]": ("user_id", {"shape": [2], "raw": _i64(1, 2)}),
    "shape of rank 2": ("adgroup_id", {"shape": [1, 1], "raw": _i64(1)}),
    "raw bytes against the shape": ("user_id", {"raw": _i64(1, 2)}),
    "candidate count unlike the others": ("brand", {"shape": [1], "raw": _i64(1)}),
    "missing input": ("cms_segid", {"drop": True}),
    "unknown name": ("cms_segid", {"rename": "cms_segment"}),
    "too many candidates": ("adgroup_id", {"shape": [9], "raw": _i64(*range(9))}),
    "sequence too long": ("click_50_seq__brand", {"shape": [21], "raw": _i64(*range(21))}),
    "sequence lengths differ": ("click_50_seq__brand", {"shape": [0], "raw": b""}),
    "NaN price": ("price", {}),
    "invalid UTF-8": ("pid", {"raw": b"\x02\x00\x00\x00\xff\xfe"}),
    "missing mask of another shape": ("pvalue_level", {}),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_tensors_are_invalid_argument_naming_the_tensor(channel, requests, case) -> None:
    name, changes = MALFORMED[case]
    msg = _good(requests)
    n = next(
        len(np.frombuffer(r, "<i8"))
        for t, r in zip(msg.inputs, msg.raw_input_contents, strict=True)
        if t.name == "adgroup_id"
    )
    if case == "NaN price":
        changes = {"datatype": "FP64", "shape": [n], "raw": np.full(n, np.nan, "<f8").tobytes()}
    if case == "candidate count unlike the others" and n == 1:
        changes = {"shape": [2], "raw": _i64(1, 2)}
    msg = _edit(msg, name, **changes)
    if case == "missing mask of another shape":
        msg.inputs.add(name="pvalue_level.missing", datatype="BOOL", shape=[2])
        msg.raw_input_contents.append(b"\x01\x00")
    if case == "unknown name":
        name = "cms_segment"
    stub = v2_grpc.GRPCInferenceServiceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(msg, timeout=TIMEOUT_S)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    want = "pvalue_level.missing" if case == "missing mask of another shape" else name
    if case == "missing input":
        want = "cms_segid"
    assert err.value.details().startswith(f"{want}: "), (case, err.value.details())


def test_infer_errors_of_the_request(channel, requests) -> None:
    stub = v2_grpc.GRPCInferenceServiceStub(channel)
    good = _good(requests)
    bad_model = v2.ModelInferRequest()
    bad_model.CopyFrom(good)
    bad_model.model_name = "other"
    bad_version = v2.ModelInferRequest()
    bad_version.CopyFrom(good)
    bad_version.model_version = "9"
    fewer_raw = v2.ModelInferRequest()
    fewer_raw.CopyFrom(good)
    del fewer_raw.raw_input_contents[-1]
    output = v2.ModelInferRequest()
    output.CopyFrom(good)
    output.outputs.add(name="logits")
    for msg, code, start in [
        (bad_model, grpc.StatusCode.NOT_FOUND, "model 'other' not found"),
        (bad_version, grpc.StatusCode.NOT_FOUND, "model 'dynrec' version '9' not found"),
        (fewer_raw, grpc.StatusCode.INVALID_ARGUMENT, "request: "),
        (output, grpc.StatusCode.INVALID_ARGUMENT, "logits: unknown output"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(msg, timeout=TIMEOUT_S)
        assert err.value.code() is code and err.value.details().startswith(start), err.value
    # the served version by name, and the answer's model and id
    ok = v2.ModelInferRequest()
    ok.CopyFrom(good)
    ok.model_version, ok.id = "1", "id-42"
    answer = stub.ModelInfer(ok, timeout=TIMEOUT_S)
    assert (answer.model_name, answer.model_version, answer.id) == ("dynrec", "1", "id-42")


def test_metrics_count_the_protocol_apart(server: PredictionServer, client, requests) -> None:
    before = (
        server.metrics.registry.get_sample_value(
            "dynrec_serving_requests_total", {"method": "ModelInfer"}
        )
        or 0.0
    )
    infer_scores(client, requests[0], raw=True)
    after = server.metrics.registry.get_sample_value(
        "dynrec_serving_requests_total", {"method": "ModelInfer"}
    )
    assert after == before + 1


def test_infer_through_frontends(bundle_v1: Path, requests) -> None:
    """With --frontends the frontends serve ModelInfer on Predict's path too."""
    config = ServerConfig(bundle=bundle_v1, device="cpu", limits=LIMITS, frontends=1)
    srv = PredictionServer(config).start()
    try:
        assert srv.wait_ready(120), srv.load_error
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = v2_grpc.GRPCInferenceServiceStub(ch)
            for req in requests[:3]:
                answer = stub.ModelInfer(infer_request(req, "dynrec"), timeout=TIMEOUT_S)
                got = np.frombuffer(answer.raw_output_contents[0], "<f4").tobytes()
                assert got == predict_scores(ch, req) and answer.id == req.request_id
            names, files = reflected(ch)
            assert "inference.GRPCInferenceService" in names
            assert files == [[OIP_FILE], [OIP_FILE]]
    finally:
        srv.stop(grace=0)


def _batch(inputs: FgInputs, fs: FeatureSet):
    return request_columns_to_batch(fs, **vars(inputs))


def test_tensors_give_the_batch_of_predicts_validation(fs: FeatureSet, requests) -> None:
    """fg_inputs (no PredictRequest in between) and Predict's request_inputs of the same
    features build the very same batch: rows and columns, missing values, string ids."""
    variants = candidate_variants(requests)
    cases = [*requests, *variants.values(), *(to_columnar(fs, r) for r in variants.values())]
    for req in cases:
        call = oip.call_of_grpc(infer_request(req, "dynrec"))
        got = _batch(oip.fg_inputs(call.tensors, fs, LIMITS), fs)
        want = _batch(request_inputs(req, fs, LIMITS), fs)
        for side in ("user", "item", "sequence"):
            a, b = getattr(got, side), getattr(want, side)
            assert a.keys() == b.keys(), (req.request_id, side)
            assert torch.equal(a.values(), b.values()), (req.request_id, side)
            assert torch.equal(a.lengths(), b.lengths()), (req.request_id, side)


def test_a_bad_value_names_the_tensor_and_candidate(channel, requests) -> None:
    """A value feature generation refuses (a negative id) is named as Predict names it, with
    the tensor for the field: ``adgroup_id: ... (candidate i)``."""
    msg = _good(requests)
    (raw,) = [
        r for t, r in zip(msg.inputs, msg.raw_input_contents, strict=True) if t.name == "adgroup_id"
    ]
    ids = np.frombuffer(raw, "<i8").copy()
    ids[-1] = -7
    bad = _edit(msg, "adgroup_id", raw=ids.tobytes())
    with pytest.raises(grpc.RpcError) as err:
        v2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(bad, timeout=TIMEOUT_S)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details()
    assert details.startswith("adgroup_id: ") and details.endswith(f"(candidate {len(ids) - 1})")


def reflected(channel: grpc.Channel) -> tuple[set[str], list[list[str]]]:
    """(the services reflection v1 lists, the files served for the service and for its
    ModelInfer method: each a list of file names)."""
    call = channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    symbols = ["inference.GRPCInferenceService", "inference.GRPCInferenceService.ModelInfer"]
    requests = [reflection_pb2.ServerReflectionRequest(list_services="")] + [
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=s) for s in symbols
    ]
    listed, *found = list(call(iter(requests), timeout=TIMEOUT_S))
    files = [
        [
            descriptor_pb2.FileDescriptorProto.FromString(raw).name
            for raw in f.file_descriptor_response.file_descriptor_proto
        ]
        for f in found
    ]
    return {s.name for s in listed.list_services_response.service}, files


def test_reflection_lists_and_describes_the_service(channel) -> None:
    """grpcurl and Postman see the protocol: listed, and the file served is the one compiled
    here (the protocol's own descriptor pool), even in a process where tritonclient registered
    Triton's grpc_service.proto of the same names (this one)."""
    names, files = reflected(channel)
    assert {"inference.GRPCInferenceService", "dynrec.serving.PredictionService"} <= names
    assert files == [[OIP_FILE], [OIP_FILE]]
