"""Hostile traffic over real gRPC (issue #16): every answer is a deliberate status.

More than a thousand seeded hostile requests (:mod:`tests.serve.hostile`: wrong kinds, extreme
numbers, over-limit strings and sequences, unknown and missing features, bad columns, oversize
and undecodable bytes) go to a real server on 127.0.0.1 from a few threads. No answer may be
INTERNAL or UNKNOWN; each is one the serving contract allows for that request (OK for the ones
valid after all, INVALID_ARGUMENT whose details start with the field path and name the
candidate, RESOURCE_EXHAUSTED past the size limit); details stay within ``max_detail_bytes``;
and good requests score bit for bit as they did before the traffic.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from protos import predict_pb2, predict_pb2_grpc
from serve.limits import Limits
from serve.server import PredictionServer
from shared.features import FeatureSet

from .conftest import candidate_variants, running_server, to_columnar
from .hostile import (
    FAMILIES,
    OK,
    PREDICT_METHOD,
    Expect,
    HostileCase,
    HostileGenerator,
    check_answer,
    invalid,
)

LIMITS = Limits(
    max_candidates=8,
    max_sequence_length=20,
    max_string_bytes=64,
    max_request_bytes=256 << 10,
    max_detail_bytes=256,
    max_pending=16,
)
CASES = 1500
SEED = 16  # the number: any fixed seed gives the same bytes every run
THREADS = 4
TIMEOUT_S = 30.0  # generous for a loaded 2-core machine; no deadline may pass anyway

Answer = tuple[grpc.StatusCode, str | None, predict_pb2.PredictResponse | None]


@pytest.fixture(scope="module")
def server(bundle_v1: Path) -> Iterator[PredictionServer]:
    with running_server(bundle_v1, LIMITS) as srv:
        yield srv


@pytest.fixture(scope="module")
def channel(server: PredictionServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


def _call(predict: grpc.UnaryUnaryMultiCallable, payload: bytes) -> Answer:
    try:
        return grpc.StatusCode.OK, None, predict(payload, timeout=TIMEOUT_S)
    except grpc.RpcError as err:
        return err.code(), err.details(), None


def _scores(stub: predict_pb2_grpc.PredictionServiceStub, reqs) -> list[bytes]:
    """Each request's probabilities as raw float32 bytes, one request at a time (each batch is
    that request alone, so the same request gives the same bits)."""
    return [
        np.asarray(stub.Predict(r, timeout=TIMEOUT_S).probabilities, np.float32).tobytes()
        for r in reqs
    ]


def test_hostile_traffic_gets_deliberate_answers(
    server: PredictionServer, channel: grpc.Channel, fs: FeatureSet, requests
) -> None:
    stub = predict_pb2_grpc.PredictionServiceStub(channel)
    md = stub.GetModelMetadata(predict_pb2.ModelMetadataRequest(), timeout=TIMEOUT_S)
    assert md.limits.max_detail_bytes == LIMITS.max_detail_bytes
    assert md.limits.max_string_bytes == LIMITS.max_string_bytes
    good = list(requests) + [to_columnar(fs, r) for r in candidate_variants(requests).values()]
    before = _scores(stub, good)

    gen = HostileGenerator(md, seed=SEED)
    cases = gen.cases(CASES)
    assert len(cases) >= 1000 and {c.family for c in cases} == set(FAMILIES)
    predict = channel.unary_unary(
        PREDICT_METHOD,
        request_serializer=None,  # bytes as they are, decodable or not
        response_deserializer=predict_pb2.PredictResponse.FromString,
    )
    with ThreadPoolExecutor(THREADS) as pool:
        answers = list(pool.map(lambda c: _call(predict, c.payload), cases))

    codes = collections.Counter(code.name for code, _, _ in answers)
    failures: list[str] = []
    for case, (code, details, response) in zip(cases, answers, strict=True):
        problem = check_answer(
            case, code, details, response, max_detail_bytes=LIMITS.max_detail_bytes
        )
        if problem is not None:
            failures.append(f"{case.describe()}\n    -> {problem}")
    by_family = _by_family(cases, answers)
    assert codes["INTERNAL"] == 0 and codes["UNKNOWN"] == 0, (codes, failures[:30])
    assert not failures, f"{len(failures)} of {len(cases)} answers break the contract " + (
        f"({dict(codes)}; by family {by_family}):\n" + "\n".join(failures[:30])
    )
    # every kind of answer the traffic is meant to draw did come
    assert codes["OK"] and codes["INVALID_ARGUMENT"] and codes["RESOURCE_EXHAUSTED"], codes

    assert _scores(stub, good) == before  # bit for bit: the traffic changed nothing
    errors = server.metrics.registry.get_sample_value(
        "dynrec_serving_errors_total", {"method": "Predict", "code": "INTERNAL"}
    )
    assert not errors


def _by_family(cases: list[HostileCase], answers: list[Answer]) -> dict[str, dict[str, int]]:
    out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for case, (code, _, _) in zip(cases, answers, strict=True):
        out[case.family][code.name] += 1
    return {k: dict(v) for k, v in out.items()}


def test_predict_without_a_deadline_succeeds(channel: grpc.Channel, requests) -> None:
    stub = predict_pb2_grpc.PredictionServiceStub(channel)
    resp = stub.Predict(requests[0])  # no timeout: no deadline, which is not a deadline of 0
    assert len(resp.probabilities) == len(requests[0].candidates)
    assert resp.request_id == requests[0].request_id


INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("expect", "code", "details", "wrong"),
    [
        (invalid("candidates[3].price"), INVALID, "candidates[3].price: negative", None),
        (invalid("candidates[3].price"), INVALID, "candidates[*].price: negative", "no candidate"),
        (invalid("candidates[3].price"), INVALID, "candidates.price: negative", "field path"),
        (invalid("candidates[3].price"), INVALID, "price: value -3 is negative", "field path"),
        (invalid("candidates[3].price"), INVALID, "candidates[2].price: negative", "expected"),
        (invalid("user.user_id"), INVALID, "user.user_id: " + "x" * 300, "max_detail_bytes"),
        (invalid("user.user_id"), grpc.StatusCode.INTERNAL, "internal error", "INTERNAL"),
        (invalid("user.user_id"), grpc.StatusCode.UNKNOWN, "Exception calling", "UNKNOWN"),
        (invalid("user.user_id"), grpc.StatusCode.OK, None, "OK, expected"),
        (OK, INVALID, "candidates[0].adgroup_id: cannot convert", "expected OK"),
        (Expect(invalid=()), INVALID, "user.x: unknown feature", None),
        (Expect(invalid=()), INVALID, "Exception deserializing request!", "field path"),
        (
            invalid('candidate_columns.columns["price"]', index=2),
            INVALID,
            'candidate_columns.columns["price"]: expected a finite number, got nan',
            "not naming candidate 2",
        ),
        (
            invalid('candidate_columns.columns["price"]', index=2),
            INVALID,
            'candidate_columns.columns["price"]: expected a finite number (candidate 2)',
            None,
        ),
    ],
)
def test_the_checker_catches_contract_breaks(expect, code, details, wrong) -> None:
    """The checker itself: a wrong answer of each kind is caught (and right ones pass)."""
    case = HostileCase("test", "a case", b"", expect, candidates=1)
    response = predict_pb2.PredictResponse(probabilities=[0.5]) if code.name == "OK" else None
    problem = check_answer(case, code, details, response, max_detail_bytes=256)
    if wrong is None:
        assert problem is None
    else:
        assert problem is not None and wrong in problem, problem


def test_the_generator_is_reproducible() -> None:
    md = predict_pb2.ModelMetadata()
    for name, side, vtype, table in [
        ("user_id", "user", "int64", "u"),
        ("pid", "context", "string", ""),
        ("adgroup_id", "item", "int64", "a"),
        ("price", "item", "double", ""),
        ("seq__adgroup_id", "item", "int64", "a"),
    ]:
        kind = "sequence_id" if name.startswith("seq") else "id"
        md.features.add(name=name, side=side, value_type=vtype, table=table, kind=kind)
    md.tables.add(name="u", is_hashmap=True)
    md.tables.add(name="a", is_hashmap=True)
    md.sequences.add(name="seq", features=["seq__adgroup_id"], max_length=5)
    md.limits.max_candidates, md.limits.max_string_bytes = 4, 16
    md.limits.max_request_bytes, md.limits.max_detail_bytes = 64 << 10, 256
    first = [c.payload for c in HostileGenerator(md, seed=3).cases(2 * len(FAMILIES))]
    again = [c.payload for c in HostileGenerator(md, seed=3).cases(2 * len(FAMILIES))]
    other = [c.payload for c in HostileGenerator(md, seed=4).cases(2 * len(FAMILIES))]
    assert first == again and first != other
