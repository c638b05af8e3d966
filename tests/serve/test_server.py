"""The server over a real gRPC channel on 127.0.0.1 (started in-process on ephemeral ports)."""

from __future__ import annotations

import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from protos import predict_pb2, predict_pb2_grpc
from serve.batcher import BatcherConfig
from serve.limits import Limits
from serve.model import STAGES
from serve.offline import score_rows
from serve.server import PredictionServer, ServerConfig
from serve.servicer import SERVICE_NAME
from shared.features import FeatureSet

from .conftest import candidate_variants, predict_traffic, to_columnar

LIMITS = Limits(max_candidates=8, max_sequence_length=20, max_request_bytes=64 << 10)
BATCHING = BatcherConfig(max_batch_rows=64, max_wait_us=2000)
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _config(**kw: object) -> ServerConfig:
    base = dict(
        device="cpu",
        limits=LIMITS,
        batching=BATCHING,
        metrics_port=0,
    )
    base.update(kw)
    return ServerConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def server(bundle_v1: Path) -> Iterator[PredictionServer]:
    srv = PredictionServer(_config(bundle=bundle_v1)).start()
    assert srv.wait_ready(60), srv.load_error
    yield srv
    srv.stop(grace=0)


@pytest.fixture(scope="module")
def stub(server: PredictionServer) -> Iterator[predict_pb2_grpc.PredictionServiceStub]:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield predict_pb2_grpc.PredictionServiceStub(channel)


def _expected(
    bundle: Path, table: pa.Table, groups: list[list[dict[str, object]]]
) -> list[np.ndarray]:
    flat = score_rows(bundle, table, tiled=False)
    bounds = np.cumsum([0] + [len(g) for g in groups])
    return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@pytest.fixture(scope="module")
def expected_v1(bundle_v1: Path, table: pa.Table, groups: list) -> list[np.ndarray]:
    return _expected(bundle_v1, table, groups)


@pytest.fixture(scope="module")
def expected_v2(bundle_v2: Path, table: pa.Table, groups: list) -> list[np.ndarray]:
    return _expected(bundle_v2, table, groups)


def test_predictions_equal_offline_scorer(stub, requests, expected_v1) -> None:
    for req, want in zip(requests, expected_v1, strict=True):
        resp = stub.Predict(req, timeout=10)
        assert resp.model_version == "1"
        assert resp.request_id == req.request_id
        np.testing.assert_allclose(resp.probabilities, want, rtol=1e-5, atol=1e-6)


def test_mixed_dim_predictions_equal_offline_scorer(
    bundle_mixed: Path, fs_mixed: FeatureSet, table: pa.Table, groups, requests
) -> None:
    """Tables of dims 4, 8, 16 and 32 (a dim-8 one pooled by mean): gRPC answers, rows and
    columnar, equal the offline scorer, tiled or not."""
    assert len({t.dim for t in fs_mixed.tables.values()}) == 4
    expected = _expected(bundle_mixed, table, groups)
    np.testing.assert_allclose(
        score_rows(bundle_mixed, table, tiled=True), np.concatenate(expected), atol=1e-6
    )
    srv = PredictionServer(_config(bundle=bundle_mixed)).start()
    try:
        assert srv.wait_ready(60), srv.load_error
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = predict_pb2_grpc.PredictionServiceStub(channel)
            for req, want in zip(requests, expected, strict=True):
                for sent in (req, to_columnar(fs_mixed, req)):
                    resp = stub.Predict(sent, timeout=10)
                    assert resp.model_version == "m1"
                    np.testing.assert_allclose(resp.probabilities, want, rtol=1e-5, atol=1e-6)
    finally:
        srv.stop(grace=0)


def test_tiled_offline_equals_untiled(bundle_v1: Path, table: pa.Table) -> None:
    np.testing.assert_allclose(
        score_rows(bundle_v1, table, tiled=True),
        score_rows(bundle_v1, table, tiled=False),
        atol=1e-6,
    )


def test_concurrent_clients_get_sequential_answers(stub, requests) -> None:
    sequential = [np.array(stub.Predict(r, timeout=10).probabilities) for r in requests]
    work = [i % len(requests) for i in range(8 * len(requests))]
    with ThreadPoolExecutor(8) as pool:
        got = list(
            pool.map(lambda i: np.array(stub.Predict(requests[i], timeout=10).probabilities), work)
        )
    for i, probs in zip(work, got, strict=True):
        np.testing.assert_allclose(probs, sequential[i], rtol=1e-5, atol=1e-6)


def test_metadata(stub, fs: FeatureSet) -> None:
    md = stub.GetModelMetadata(predict_pb2.ModelMetadataRequest(), timeout=10)
    assert md.model_version == "1"
    assert [f.name for f in md.features] == list(fs.features)
    types = {f.name: f.value_type for f in md.features}
    assert types["price"] == "double" and types["pid"] == "string" and types["user_id"] == "int64"
    assert {t.name for t in md.tables} == set(fs.tables)
    assert set(md.startup_seconds) == set(STAGES)  # read, ..., warmup, graphs, total
    assert md.max_candidates == LIMITS.max_candidates and md.device == "cpu"
    # sequences: where they go in a request, the length the server enforces (the flag's
    # 20 caps the config's 50) and the config's sequence_delim (how sample rows join the ids)
    sides = {f.name: f.side for f in md.features}
    seq = [n for n, spec in fs.features.items() if spec.is_sequence]
    assert {sides[n] for n in seq} == {"sequence"} and sides["adgroup_id"] == "item"
    assert [(s.name, list(s.features), s.max_length, s.delimiter) for s in md.sequences] == [
        ("click_50_seq", seq, 20, fs.features[seq[0]].sequence_delim)
    ]
    assert md.sequences[0].delimiter == "|"
    assert md.max_sequence_length == 20
    assert {f.max_length for f in md.features if f.name in seq} == {20}
    assert md.limits.max_candidates == 8 and md.limits.max_request_bytes == 64 << 10
    assert md.limits.max_pending == LIMITS.max_pending
    assert md.limits.max_string_bytes == LIMITS.max_string_bytes
    assert not md.HasField("last_refusal")


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_the_services(server: PredictionServer, version: str) -> None:
    """Both reflection versions answer (grpcurl asks v1 first); v1 and v1alpha messages are
    the same on the wire, so the v1alpha stubs speak v1 under the v1 method path."""
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        listing = reflection_pb2.ServerReflectionRequest(list_services="")
        lookup = reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME)
        listed, found = list(call(iter([listing, lookup]), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {
        SERVICE_NAME,
        "grpc.health.v1.Health",
        f"grpc.reflection.{version}.ServerReflection",
    } <= names
    assert "dynrec.serving.ModelAdminService" not in names  # the admin service is off
    assert found.file_descriptor_response.file_descriptor_proto


def test_metrics_endpoint(server: PredictionServer, stub, requests) -> None:
    stub.Predict(requests[0], timeout=10)
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10)
        .read()
        .decode()
    )
    for name in (
        'dynrec_serving_requests_total{method="Predict"}',
        "dynrec_serving_request_latency_seconds_bucket",
        "dynrec_serving_batch_rows_bucket",
        "dynrec_serving_queue_depth",
        'dynrec_serving_table_lookups_total{result="hit",table="user_id_emb"}',
        'dynrec_serving_startup_seconds{stage="table_build"}',
        'dynrec_serving_model_loads_total{result="ok"} 1.0',
        'dynrec_serving_model_load_paths_total{path="full"} 1.0',  # no spare on the CPU
    ):
        assert name in text, name
    # where the time goes: request stages in the RPC thread, batch stages in the batcher
    for stage, clocks in {
        "validate": ("wall", "cpu"),
        "fg": ("wall", "cpu"),
        "wait": ("wall",),
        "respond": ("wall", "cpu"),
        "queue_wait": ("wall",),
        "concat": ("wall",),
        "h2d": ("wall",),
        "compute": ("wall",),
        "sync": ("wall",),
        "batch": ("wall", "cpu"),
    }.items():
        for clock in clocks:
            assert f'dynrec_serving_stage_seconds_count{{clock="{clock}",stage="{stage}"}}' in text


def test_servers_share_a_port_with_reuse_port(bundle_v1: Path, requests) -> None:
    first = PredictionServer(_config(bundle=bundle_v1, reuse_port=True, metrics_port=None))
    first.start()
    second = PredictionServer(
        _config(bundle=bundle_v1, reuse_port=True, metrics_port=None, port=first.port)
    )
    try:
        second.start()
        assert second.port == first.port
        assert first.wait_ready(60) and second.wait_ready(60)
        with grpc.insecure_channel(f"127.0.0.1:{first.port}") as channel:
            stub = predict_pb2_grpc.PredictionServiceStub(channel)
            assert len(stub.Predict(requests[0], timeout=10).probabilities) > 0
    finally:
        first.stop(grace=0)
        second.stop(grace=0)


# --------------------------------------------------------------------------- bad input


def _bad_cases() -> dict[str, tuple[object, str]]:
    """name → (mutation of a good request, field the error must name)."""

    def set_value(features, name, **kw):
        features.values[name].CopyFrom(predict_pb2.Value(**kw))

    seq = "click_50_seq__"
    return {
        "empty candidates": (lambda r: r.ClearField("candidates"), "candidates"),
        "too many candidates": (
            lambda r: r.candidates.extend([r.candidates[0]] * (LIMITS.max_candidates + 1)),
            "candidates",
        ),
        "missing user feature": (lambda r: r.user.values.pop("user_id"), "user.user_id"),
        "missing context feature": (lambda r: r.context.values.pop("pid"), "context.pid"),
        "missing candidate feature": (
            lambda r: r.candidates[0].values.pop("adgroup_id"),
            "candidates[0].adgroup_id",
        ),
        "unknown feature": (
            lambda r: set_value(r.user, "favourite_colour", int64_value=1),
            "user.favourite_colour",
        ),
        "double for an id": (
            lambda r: set_value(r.user, "user_id", double_value=1.5),
            "user.user_id",
        ),
        "string for a bucket id": (
            lambda r: set_value(r.user, "cms_segid", string_value="x"),
            "user.cms_segid",
        ),
        "non-numeric price": (
            lambda r: set_value(r.candidates[0], "price", string_value="cheap"),
            "candidates[0].price",
        ),
        "NaN price": (
            lambda r: set_value(r.candidates[0], "price", double_value=float("nan")),
            "candidates[0].price",
        ),
        "negative price": (
            lambda r: set_value(r.candidates[1], "price", double_value=-3.0),
            "candidates[1].price",
        ),
        "string too long": (
            lambda r: set_value(r.context, "pid", string_value="4" * 300),
            "context.pid",
        ),
        "negative id": (lambda r: set_value(r.user, "age_level", int64_value=-2), "user.age_level"),
        "sequence too long": (
            lambda r: [
                r.sequences[f"{seq}{n}"].ids.extend([1] * 21)
                for n in ("adgroup_id", "cate_id", "brand")
            ],
            f"sequences.{seq}adgroup_id",
        ),
        "unequal sequence lengths": (
            lambda r: r.sequences[f"{seq}cate_id"].ids.append(5),
            f"sequences.{seq}cate_id",
        ),
        "missing sequence": (lambda r: r.sequences.pop(f"{seq}brand"), f"sequences.{seq}brand"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_is_invalid_argument_naming_the_field(stub, requests, case: str) -> None:
    mutate, field = _bad_cases()[case]
    req = predict_pb2.PredictRequest()
    req.CopyFrom(requests[1])
    mutate(req)
    with pytest.raises(grpc.RpcError) as info:
        stub.Predict(req, timeout=10)
    assert info.value.code() == INVALID, info.value.details()
    assert info.value.details().startswith(f"{field}: "), info.value.details()
    assert stub.Predict(requests[1], timeout=10).probabilities  # still answers


# --------------------------------------------------------------------------- columnar candidates


def test_columnar_requests_score_like_row_requests(stub, fs: FeatureSet, requests) -> None:
    """The same candidates as ``candidates`` and as ``candidate_columns``: the same scores."""
    cases = {f"sample {i}": r for i, r in enumerate(requests)} | candidate_variants(requests)
    for name, rows in cases.items():
        columns = to_columnar(fs, rows)
        assert not columns.candidates and columns.candidate_columns.num_candidates > 0
        want = stub.Predict(rows, timeout=10)
        got = stub.Predict(columns, timeout=10)
        assert got.request_id == want.request_id and got.model_version == want.model_version
        assert len(got.probabilities) == len(rows.candidates), name
        np.testing.assert_allclose(
            got.probabilities, want.probabilities, rtol=1e-6, atol=1e-7, err_msg=name
        )


def test_columnar_placeholders_of_missing_rows_are_ignored(stub, fs: FeatureSet, requests) -> None:
    rows = candidate_variants(requests)["some values missing"]
    columns = to_columnar(fs, rows)
    cols = columns.candidate_columns.columns
    last = columns.candidate_columns.num_candidates - 1
    cols["price"].doubles.values[last] = float("nan")  # missing: not checked, not used
    cols["cate_id"].int64s.values[last] = -5
    cols["brand"].int64s.values[0] = -1
    want = stub.Predict(rows, timeout=10).probabilities
    np.testing.assert_allclose(stub.Predict(columns, timeout=10).probabilities, want, rtol=1e-6)


def _columnar_bad_cases() -> dict[str, tuple[object, str, str]]:
    """name → (mutation of a good columnar request, field the error must name, words in it)."""

    def col(name: str):
        return lambda r: r.candidate_columns.columns[name]

    def set_doubles(r, name: str, values: list[float]) -> None:
        c = r.candidate_columns.columns[name]
        c.ClearField("kind")
        c.doubles.values.extend(values)

    def n(r) -> int:
        return r.candidate_columns.num_candidates

    def field(name: str) -> str:
        return f'candidate_columns.columns["{name}"]'

    return {
        "rows and columns": (
            lambda r: r.candidates.add(),
            "candidate_columns",
            "not both",
        ),
        "no candidates": (
            lambda r: setattr(r.candidate_columns, "num_candidates", 0),
            "candidate_columns.num_candidates",
            "empty",
        ),
        "too many candidates": (
            lambda r: setattr(r.candidate_columns, "num_candidates", LIMITS.max_candidates + 1),
            "candidate_columns.num_candidates",
            "more than the limit",
        ),
        "short column": (
            lambda r: col("adgroup_id")(r).int64s.values.pop(),
            field("adgroup_id"),
            "values, expected num_candidates",
        ),
        "long column": (
            lambda r: col("price")(r).doubles.values.append(1.0),
            field("price"),
            "values, expected num_candidates",
        ),
        "missing mask length": (
            lambda r: col("brand")(r).missing.extend([False] * (n(r) + 1)),
            field("brand"),
            "missing has",
        ),
        "absent column": (
            lambda r: r.candidate_columns.columns.pop("cate_id"),
            field("cate_id"),
            "missing required feature",
        ),
        "unknown column": (
            lambda r: r.candidate_columns.columns["colour"].int64s.values.extend([1] * n(r)),
            field("colour"),
            "unknown feature",
        ),
        "user feature as a column": (
            lambda r: r.candidate_columns.columns["user_id"].int64s.values.extend([1] * n(r)),
            field("user_id"),
            "unknown feature",
        ),
        "no values": (
            lambda r: col("customer")(r).ClearField("kind"),
            field("customer"),
            "no values",
        ),
        "doubles for an id": (
            lambda r: set_doubles(r, "adgroup_id", [1.5] * n(r)),
            field("adgroup_id"),
            "expected int64s or strings, got doubles",
        ),
        "strings for a price": (
            lambda r: (
                col("price")(r).ClearField("kind"),
                col("price")(r).strings.values.extend(["cheap"] * n(r)),
            ),
            field("price"),
            "expected a number (doubles), got strings",
        ),
        "NaN price": (
            lambda r: set_doubles(r, "price", [1.0] * (n(r) - 1) + [float("nan")]),
            field("price"),
            "finite",
        ),
        "negative price": (
            lambda r: set_doubles(r, "price", [-3.0] * n(r)),
            field("price"),
            "negative",
        ),
        "negative id": (
            lambda r: col("adgroup_id")(r).int64s.values.__setitem__(0, -2),
            field("adgroup_id"),
            "negative id",
        ),
    }


@pytest.mark.parametrize("case", list(_columnar_bad_cases()))
def test_bad_columnar_input_is_invalid_argument_naming_the_field(
    stub, fs: FeatureSet, requests, case: str
) -> None:
    mutate, field, words = _columnar_bad_cases()[case]
    good = to_columnar(fs, candidate_variants(requests)["unknown ids"])  # int64s, doubles
    req = predict_pb2.PredictRequest()
    req.CopyFrom(good)
    mutate(req)
    with pytest.raises(grpc.RpcError) as info:
        stub.Predict(req, timeout=10)
    assert info.value.code() == INVALID, info.value.details()
    assert info.value.details().startswith(f"{field}: "), info.value.details()
    assert words in info.value.details()
    assert stub.Predict(good, timeout=10).probabilities  # still answers


def test_oversize_message_is_refused_and_counted(server, stub, requests) -> None:
    counted = ("Predict", "request_too_large")
    before = _sample(server, "dynrec_serving_rejections_total", counted)
    req = predict_pb2.PredictRequest()
    req.CopyFrom(requests[0])
    req.request_id = "x" * (70 << 10)  # past the 64 kB limit: the server refuses it
    with pytest.raises(grpc.RpcError) as info:
        stub.Predict(req, timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details().startswith("request: "), info.value.details()
    assert _sample(server, "dynrec_serving_rejections_total", counted) == before + 1
    req.request_id = "x" * (LIMITS.transport_bytes + 1)  # past the transport's own limit
    with pytest.raises(grpc.RpcError) as info:
        stub.Predict(req, timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.Predict(requests[0], timeout=10).probabilities


def _sample(server: PredictionServer, name: str, labels: tuple[str, str]) -> float:
    value = server.metrics.registry.get_sample_value(
        name, {"method": labels[0], "reason": labels[1]}
    )
    return value or 0.0


def test_undecodable_bytes_are_invalid_argument(server, requests) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        raw = channel.unary_unary(
            f"/{SERVICE_NAME}/Predict",
            request_serializer=None,
            response_deserializer=predict_pb2.PredictResponse.FromString,
        )
        for junk in (b"\xff\xff\xff", requests[0].SerializeToString()[:-3], b"\x0a\x05ab"):
            with pytest.raises(grpc.RpcError) as info:
                raw(junk, timeout=10)
            assert info.value.code() == INVALID, info.value.details()
            assert info.value.details().startswith("request: not a valid"), info.value.details()
        assert raw(requests[0].SerializeToString(), timeout=10).probabilities


def test_undecodable_bytes_to_health_and_reflection_are_invalid_argument(server) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None)
        with pytest.raises(grpc.RpcError) as info:
            check(b"\xff\xff\xff", timeout=10)
        assert info.value.code() == INVALID, info.value.details()
        ok = health_pb2.HealthCheckRequest(service="").SerializeToString()
        answer = health_pb2.HealthCheckResponse.FromString(check(ok, timeout=10))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        info_call = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", request_serializer=None
        )
        with pytest.raises(grpc.RpcError) as info:
            list(info_call(iter([b"\xff\xff"]), timeout=10))
        assert info.value.code() == INVALID, info.value.details()


def test_predict_without_a_deadline(stub, requests, expected_v1) -> None:
    resp = stub.Predict(requests[0])  # no timeout: no deadline, as grpcurl and Postman send
    np.testing.assert_allclose(resp.probabilities, expected_v1[0], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- lifecycle


def _health(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_health_not_serving_until_warm(bundle_v1: Path, requests) -> None:
    srv = PredictionServer(_config(bundle=bundle_v1, metrics_port=None))
    gate = threading.Event()
    load = srv.manager._loader

    def gated(path: Path):
        gate.wait(30)
        return load(path)

    srv.manager._loader = gated
    srv.start()
    try:
        for service in ("", SERVICE_NAME):
            assert _health(srv.port, service) == health_pb2.HealthCheckResponse.NOT_SERVING
        with (
            grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel,
            pytest.raises(grpc.RpcError) as info,
        ):
            predict_pb2_grpc.PredictionServiceStub(channel).Predict(requests[0], timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        gate.set()
        assert srv.wait_ready(60)
        for service in ("", SERVICE_NAME):
            assert _health(srv.port, service) == health_pb2.HealthCheckResponse.SERVING
    finally:
        srv.stop(grace=0)


def _install(src: Path, model_dir: Path, version: str, corrupt: bool = False) -> None:
    """Copy a bundle in as ``model_dir/version`` atomically (hidden temp dir + rename)."""
    tmp = model_dir / f".{version}.tmp"
    shutil.copytree(src, tmp)
    if corrupt:
        shard = next(tmp.glob("*.safetensors"))
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0xFF  # same size, different sha256
        shard.write_bytes(bytes(data))
    tmp.rename(model_dir / version)


@pytest.mark.parametrize("frontends", [0, 2], ids=["one_process", "two_frontends"])
def test_hot_swap_under_traffic_then_corrupt_bundle_refused(
    tmp_path: Path,
    bundle_v1: Path,
    bundle_v2: Path,
    requests,
    expected_v1,
    expected_v2,
    frontends: int,
) -> None:
    """Clients call while version 2 is installed: every answer is OK and has its version's
    offline scores (also through frontends, whose batches reach the device process in shared
    memory); then a corrupt version 3 is refused and version 2 keeps serving."""
    model_dir = tmp_path / "models"
    model_dir.mkdir()
    _install(bundle_v1, model_dir, "1")
    config = _config(model_dir=model_dir, poll_interval_s=0.05, frontends=frontends)
    srv = PredictionServer(config).start()
    assert srv.wait_ready(60), srv.load_error
    expected = {"1": expected_v1, "2": expected_v2}
    try:
        with predict_traffic(srv.port, requests) as traffic:
            time.sleep(0.3)
            _install(bundle_v2, model_dir, "2")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(
                v == "2" for _, v, _ in traffic.results[-20:]
            ):
                time.sleep(0.05)
            time.sleep(0.3)  # traffic on the new version too
        assert not traffic.errors, traffic.errors[:3]
        versions = [v for _, v, _ in traffic.results]
        assert versions[0] == "1" and versions[-1] == "2"
        assert versions.index("2") > 0 and "1" not in versions[versions.index("2") + 8 :]
        for i, v, probs in traffic.results:
            np.testing.assert_allclose(probs, expected[v][i], rtol=1e-5, atol=1e-6)

        # a corrupt version 3: refused, version 2 keeps serving
        loads = srv.metrics.model_loads.labels("refused")
        _install(bundle_v2, model_dir, "3", corrupt=True)
        deadline = time.monotonic() + 30
        while loads._value.get() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loads._value.get() == 1
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = predict_pb2_grpc.PredictionServiceStub(channel)
            r = stub.Predict(requests[0], timeout=10)
            md = stub.GetModelMetadata(predict_pb2.ModelMetadataRequest(), timeout=10)
        assert r.model_version == "2"
        # which version was refused, and why: in the metadata and as a metric
        assert md.last_refusal.version == "3" and "sha256" in md.last_refusal.reason
        labels = {"version": "3"}
        refused_at = srv.metrics.registry.get_sample_value(
            "dynrec_serving_model_last_refusal_timestamp_seconds", labels
        )
        assert refused_at == md.last_refusal.at_unix
        np.testing.assert_allclose(r.probabilities, expected_v2[0], rtol=1e-5, atol=1e-6)
        time.sleep(0.2)  # further polls do not retry the refused bundle
        assert loads._value.get() == 1
    finally:
        srv.stop(grace=0)


def test_a_load_runs_with_a_short_gil_switch_interval(bundle_v1: Path, monkeypatch) -> None:
    """A version loads beside the one serving with the load's switch interval, and the
    process's interval is back after it (also when the load fails)."""
    import sys

    from serve.model import LoadedModel

    seen: list[float] = []
    real = LoadedModel.load

    def load(*args, **kwargs):
        seen.append(sys.getswitchinterval())
        if len(seen) == 2:
            raise RuntimeError("a broken bundle")
        return real(*args, **kwargs)

    monkeypatch.setattr(LoadedModel, "load", load)
    before = sys.getswitchinterval()
    server = PredictionServer(
        ServerConfig(bundle=bundle_v1, device="cpu", load_switch_interval_s=0.0003)
    )
    assert server.manager.load(bundle_v1)
    assert not server.manager.load(bundle_v1)  # refused: the old one keeps serving
    assert seen == [pytest.approx(0.0003)] * 2 and sys.getswitchinterval() == before
    server.stop(grace=0)
