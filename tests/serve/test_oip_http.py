"""The Open Inference Protocol's HTTP/JSON form (``serve --http-port``) with tritonclient.http,
and plain HTTP for what the docs show with curl.

Health, readiness and metadata (plain and versioned paths); infer gives Predict's scores bit
for bit with the tensors as JSON ``data`` and as binary data (tritonclient's default), answered
in JSON or binary; malformed tensors are 400 naming the tensor, other models 404, a body over
the limit 413; with the server's TLS (mutual too), HTTPS only.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from loadtest.oip import tensors_of_predict
from protos import predict_pb2
from serve.limits import Limits
from serve.security import TlsConfig
from serve.server import PredictionServer

from .conftest import candidate_variants, running_server, to_columnar
from .test_oip import predict_scores
from .test_tls import _issue

th = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

LIMITS = Limits(max_candidates=8, max_sequence_length=20, max_request_bytes=64 << 10)


@pytest.fixture(scope="module")
def server(bundle_v1: Path) -> Iterator[PredictionServer]:
    with running_server(bundle_v1, LIMITS, http_port=0, model_name="ctr") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: PredictionServer) -> Iterator[object]:
    c = th.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    yield c
    c.close()


@pytest.fixture(scope="module")
def channel(server: PredictionServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


def _http(server: PredictionServer, path: str, body: dict | None = None) -> tuple[int, dict]:
    url = f"http://127.0.0.1:{server.http_port}{path}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_health_and_metadata(client, server: PredictionServer, fs) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("ctr") and client.is_model_ready("ctr", "1")
    assert not client.is_model_ready("dynrec")
    assert client.get_server_metadata()["extensions"] == ["binary_tensor_data"]
    md = client.get_model_metadata("ctr")
    assert md == client.get_model_metadata("ctr", "1")
    assert md["name"] == "ctr" and md["versions"] == ["1"]
    assert {t["name"] for t in md["inputs"]} == set(fs.features)
    assert md["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1]}]
    assert _http(server, "/v2/models/dynrec")[0] == 404
    assert _http(server, "/v2/models/ctr/versions/7")[0] == 404
    status, body = _http(server, "/v2/no/such/path")
    assert status == 404 and "error" in body


def _infer(client, req: predict_pb2.PredictRequest, binary_in: bool, binary_out: bool) -> bytes:
    inputs = []
    for t in tensors_of_predict(req):
        i = th.InferInput(t.name, t.shape, t.datatype)
        i.set_data_from_numpy(t.as_numpy(), binary_data=binary_in)
        inputs.append(i)
    outputs = [th.InferRequestedOutput("probabilities", binary_data=binary_out)]
    result = client.infer("ctr", inputs, outputs=outputs, request_id=req.request_id)
    assert result.get_response()["id"] == req.request_id
    return result.as_numpy("probabilities").astype(np.float32).tobytes()


@pytest.mark.parametrize(
    ("binary_in", "binary_out"),
    [(True, True), (False, False), (True, False)],
    ids=["binary", "json", "binary-in-json-out"],
)
def test_infer_gives_predicts_scores(client, channel, fs, requests, binary_in, binary_out) -> None:
    variants = candidate_variants(requests)
    cases = [*requests, *variants.values(), *(to_columnar(fs, r) for r in variants.values())]
    for req in cases:
        got = _infer(client, req, binary_in, binary_out)
        assert got == predict_scores(channel, req), req.request_id


def _json_body(req: predict_pb2.PredictRequest) -> dict:
    inputs = []
    for t in tensors_of_predict(req):
        data = [b.decode() for b in t.values] if t.datatype == "BYTES" else t.values.tolist()
        inputs.append({"name": t.name, "datatype": t.datatype, "shape": t.shape, "data": data})
    return {"id": "curl-1", "inputs": inputs}


def test_plain_json_as_curl_sends_it(server: PredictionServer, channel, requests) -> None:
    req = requests[1]
    status, body = _http(server, "/v2/models/ctr/versions/1/infer", _json_body(req))
    assert status == 200, body
    assert body["id"] == "curl-1" and body["model_version"] == "1"
    (out,) = body["outputs"]
    got = np.asarray(out["data"], np.float32).tobytes()
    assert out["shape"] == [len(req.candidates)] and got == predict_scores(channel, req)


def test_malformed_tensors_are_400_naming_the_tensor(server: PredictionServer, requests) -> None:
    good = _json_body(requests[1])

    def edited(tensor: str, **change) -> dict:
        body = json.loads(json.dumps(good))
        for t in body["inputs"]:
            if t["name"] == tensor:
                t.update(change)
        body["inputs"] = [t for t in body["inputs"] if t.get("name") != "drop"]
        return body

    for body, tensor in [
        (edited("user_id", datatype="FP64", data=[1.5]), "user_id"),
        (edited("user_id", shape=[2], data=[1, 2]), "user_id"),
        (edited("adgroup_id", data=["x"] * len(requests[1].candidates)), "adgroup_id"),
        (edited("cms_segid", name="drop"), "cms_segid"),
        (edited("cms_segid", name="cms_segment"), "cms_segment"),
        (edited("price", parameters={"binary_data_size": 8}), "price"),
        (edited("click_50_seq__brand", shape=[21], data=list(range(21))), "click_50_seq__brand"),
    ]:
        status, answer = _http(server, "/v2/models/ctr/infer", body)
        assert status == 400 and answer["error"].startswith(f"{tensor}: "), (tensor, answer)
    status, answer = _http(server, "/v2/models/dynrec/infer", good)
    assert status == 404 and "not found" in answer["error"]
    status, answer = _http(server, "/v2/models/ctr/infer", {"inputs": "none"})
    assert status == 400 and answer["error"].startswith("request: ")


def test_limits_as_on_grpc(client, server: PredictionServer, requests) -> None:
    big = json.loads(json.dumps(_json_body(requests[1])))
    big["padding"] = "x" * (LIMITS.max_request_bytes + 1)
    status, answer = _http(server, "/v2/models/ctr/infer", big)
    assert status == 413 and "--max-request-bytes" in answer["error"]
    wide = [th.InferInput("adgroup_id", [9], "INT64")]
    wide[0].set_data_from_numpy(np.arange(9, dtype=np.int64))
    with pytest.raises(InferenceServerException) as err:
        client.infer("ctr", wide)
    assert err.value.status() == "400"
    rejected = server.metrics.registry.get_sample_value(
        "dynrec_serving_rejections_total",
        {"method": "http/ModelInfer", "reason": "request_too_large"},
    )
    assert rejected == 1.0


def test_http_serves_tls_when_the_server_has_tls(bundle_v1: Path, tmp_path: Path, requests) -> None:
    """--tls-cert/--tls-key (and --tls-client-ca) cover --http-port as they cover gRPC: HTTPS
    with the server's certificate, plain HTTP and clients that trust another root refused, a
    client certificate required under mutual TLS; infer over HTTPS gives Predict's scores."""
    ca_pem, ca_cert, ca_key = _issue(tmp_path, "ca", issuer=None, ca=True)
    server_pem = _issue(tmp_path, "server", issuer=(ca_cert, ca_key), server=True)[0]
    client_pem = _issue(tmp_path, "client", issuer=(ca_cert, ca_key))[0]
    other_ca = _issue(tmp_path, "other-ca", issuer=None, ca=True)[0]
    tls = TlsConfig(cert=server_pem.cert, key=server_pem.key, client_ca=ca_pem.cert)
    with running_server(bundle_v1, LIMITS, http_port=0, model_name="ctr", tls=tls) as srv:
        url = f"127.0.0.1:{srv.http_port}"
        mine = {"ca_certs": str(ca_pem.cert)}
        with_cert = mine | {"certfile": str(client_pem.cert), "keyfile": str(client_pem.key)}
        client = th.InferenceServerClient(url, ssl=True, ssl_options=with_cert)
        try:
            assert client.is_server_ready() and client.is_model_ready("ctr")
            req = requests[1]
            creds = grpc.ssl_channel_credentials(
                root_certificates=ca_pem.cert.read_bytes(),
                private_key=client_pem.key.read_bytes(),
                certificate_chain=client_pem.cert.read_bytes(),
            )
            with grpc.secure_channel(f"127.0.0.1:{srv.port}", creds) as secure:
                assert _infer(client, req, True, True) == predict_scores(secure, req)
        finally:
            client.close()
        refused = [
            {"ssl": True, "ssl_options": mine},  # no client certificate
            {"ssl": True, "ssl_options": with_cert | {"ca_certs": str(other_ca.cert)}},
            {"ssl": False},  # plain HTTP to a TLS port
        ]
        for options in refused:
            other = th.InferenceServerClient(url, **options)
            try:
                with pytest.raises(Exception):  # noqa: B017  # TLS alerts, resets: the OS's words
                    other.is_server_live()
            finally:
                other.close()
