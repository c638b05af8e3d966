"""Hostile ModelInfer traffic over real gRPC: every answer is a deliberate status (as
``test_robustness.py`` does for Predict).

Seeded edits of good OIP requests (wrong datatypes, shapes and byte counts, extreme and
non-finite numbers, malformed BYTES, bad missing masks, unknown, missing and duplicate tensors,
raw and typed contents mixed, other models, oversize messages, undecodable bytes) go to a real
server from a few threads. No answer may be INTERNAL or UNKNOWN; INVALID_ARGUMENT details start
with the tensor edited (or ``request``); other models are NOT_FOUND; good requests score bit for
bit as before.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from loadtest.oip import infer_request
from protos import grpc_predict_v2_pb2 as v2
from serve.limits import Limits
from serve.server import PredictionServer

from .conftest import candidate_variants, running_server, to_columnar

LIMITS = Limits(
    max_candidates=8,
    max_sequence_length=20,
    max_string_bytes=64,
    max_request_bytes=64 << 10,
    max_detail_bytes=256,
    max_pending=16,
)
CASES = 1200
SEED = 54  # the number
METHOD = "/inference.GRPCInferenceService/ModelInfer"
EXTREMES = (-(2**63), 2**63 - 1, -1, 0, 2**53 + 1)
DOUBLES = (np.nan, np.inf, -np.inf, -0.0, 5e-324, 1e308, -1.0)
DATATYPES = ("INT64", "FP64", "FP32", "BOOL", "BYTES", "INT32", "UINT8", "", "int64")


@dataclass(frozen=True)
class Case:
    family: str
    payload: bytes
    fields: tuple[str, ...] | None  # INVALID_ARGUMENT must name one of these (None: any)
    ok: bool = True  # OK allowed
    found: bool = True  # False: NOT_FOUND expected


@pytest.fixture(scope="module")
def server(bundle_v1: Path) -> Iterator[PredictionServer]:
    with running_server(bundle_v1, LIMITS) as srv:
        yield srv


class Generator:
    def __init__(self, goods: list[v2.ModelInferRequest], seed: int) -> None:
        self.goods, self.rng = goods, np.random.default_rng(seed)

    def _base(self) -> tuple[v2.ModelInferRequest, int]:
        msg = v2.ModelInferRequest()
        msg.CopyFrom(self.goods[int(self.rng.integers(len(self.goods)))])
        return msg, int(self.rng.integers(len(msg.inputs)))

    def _bytes(self, n: int) -> bytes:
        return self.rng.integers(0, 256, n, dtype=np.uint8).tobytes()

    def datatype(self) -> Case:
        msg, i = self._base()
        t = msg.inputs[i]
        t.datatype = str(self.rng.choice(DATATYPES))
        size = int(self.rng.choice([0, 1, 4, 8, 16]))
        msg.raw_input_contents[i] = self._bytes(size * max(int(np.prod(t.shape)), 1))
        return Case("datatype", msg.SerializeToString(), (t.name,))

    def shape(self) -> Case:
        msg, i = self._base()
        t = msg.inputs[i]
        dims = [[], [0], [-1], [2**62], [1, 1], [3, -3], [9], [2**31, 2**31], [1] * 9]
        del t.shape[:]
        t.shape.extend(dims[int(self.rng.integers(len(dims)))])
        return Case("shape", msg.SerializeToString(), None)

    def raw_length(self) -> Case:
        msg, i = self._base()
        raw = msg.raw_input_contents[i]
        cut = int(self.rng.integers(1, 9))
        msg.raw_input_contents[i] = (
            raw[:-cut] if len(raw) >= cut and self.rng.random() < 0.5 else raw + self._bytes(cut)
        )
        return Case("raw_length", msg.SerializeToString(), None)

    def values(self) -> Case:
        msg, i = self._base()
        t, raw = msg.inputs[i], msg.raw_input_contents[i]
        if t.datatype == "INT64" and len(raw):
            arr = np.frombuffer(raw, "<i8").copy()
            arr[int(self.rng.integers(len(arr)))] = int(self.rng.choice(EXTREMES))
            msg.raw_input_contents[i] = arr.tobytes()
        elif t.datatype == "FP64" and len(raw):
            arr = np.frombuffer(raw, "<f8").copy()
            arr[int(self.rng.integers(len(arr)))] = float(self.rng.choice(DOUBLES))
            msg.raw_input_contents[i] = arr.tobytes()
        elif t.datatype == "BYTES":
            n = int(np.prod(t.shape))
            pick = int(self.rng.integers(4))
            strings = [b"\xff\xfe", b"", b"x" * 65, "é".encode() * 40][pick]
            msg.raw_input_contents[i] = b"".join(
                len(strings).to_bytes(4, "little") + strings for _ in range(n)
            )
            if self.rng.random() < 0.3:  # a length past the end
                msg.raw_input_contents[i] = (2**32 - 1).to_bytes(4, "little") + b"ab"
        return Case("values", msg.SerializeToString(), (t.name,))

    def names(self) -> Case:
        msg, i = self._base()
        t = msg.inputs[i]
        kind = int(self.rng.integers(4))
        if kind == 0:  # dropped
            del msg.inputs[i]
            del msg.raw_input_contents[i]
            return Case("names", msg.SerializeToString(), (t.name,), ok=t.name.endswith(".missing"))
        if kind == 1:  # sent twice
            msg.inputs.add().CopyFrom(t)
            msg.raw_input_contents.append(msg.raw_input_contents[i])
            return Case("names", msg.SerializeToString(), (t.name,), ok=False)
        name = "x" * int(self.rng.integers(1, 2000)) if kind == 2 else t.name + ".missing.missing"
        t.name = name
        shown = name if len(name) <= 64 else f"{name[:48]}...({len(name)} chars)"
        return Case("names", msg.SerializeToString(), (shown, t.name.split(".")[0]), ok=False)

    def mask(self) -> Case:
        msg, _ = self._base()
        target = msg.inputs[int(self.rng.integers(len(msg.inputs)))]
        n = int(np.prod(target.shape))
        datatype = str(self.rng.choice(["BOOL", "BOOL", "INT64"]))
        shape = [n + int(self.rng.integers(-1, 2))] if n else [0]
        name = target.name if target.name.endswith(".missing") else target.name + ".missing"
        msg.inputs.add(name=name, datatype=datatype, shape=shape)
        msg.raw_input_contents.append(
            self._bytes(max(shape[0], 0) * (8 if datatype == "INT64" else 1))
        )
        return Case("mask", msg.SerializeToString(), (name, target.name.split(".")[0]))

    def request(self) -> Case:
        msg, i = self._base()
        kind = int(self.rng.integers(5))
        found, fields = True, ("request",)
        if kind == 0:
            del msg.raw_input_contents[-1]
        elif kind == 1:
            msg.inputs[i].contents.int64_contents.append(1)
            fields = (msg.inputs[i].name,)
        elif kind == 2:
            msg.model_name = str(self.rng.choice(["", "other", "dynrec "]))
            found = False
        elif kind == 3:
            msg.model_version = "v" * int(self.rng.integers(1, 300))
            found = False
        else:
            msg.outputs.add(name="x" * int(self.rng.integers(1, 100)))
            fields = None
        return Case("request", msg.SerializeToString(), fields, ok=False, found=found)

    def raw(self) -> Case:
        msg, _ = self._base()
        payload = msg.SerializeToString()
        kind = int(self.rng.integers(3))
        if kind == 0:
            payload = self._bytes(int(self.rng.integers(1, 300)))
        elif kind == 1:
            payload = payload[: int(self.rng.integers(1, len(payload)))]
        else:
            payload = payload + b"x" * (LIMITS.max_request_bytes + 1)
        return Case("raw", payload, None)

    def cases(self, n: int) -> list[Case]:
        families: list[Callable[[], Case]] = [
            self.datatype,
            self.shape,
            self.raw_length,
            self.values,
            self.names,
            self.mask,
            self.request,
            self.raw,
        ]
        return [families[k % len(families)]() for k in range(n)]


def _call(method, case: Case) -> tuple[grpc.StatusCode, str]:
    try:
        method(case.payload, timeout=30)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as err:
        return err.code(), err.details() or ""


def _problem(case: Case, code: grpc.StatusCode, details: str) -> str | None:
    if code is grpc.StatusCode.OK:
        return None if case.ok and case.found else "OK"
    if not case.found:
        return None if code is grpc.StatusCode.NOT_FOUND else code.name
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and case.family == "raw":
        return None
    if code is not grpc.StatusCode.INVALID_ARGUMENT:
        return code.name
    if len(details.encode()) > LIMITS.max_detail_bytes:
        return "details too long"
    if case.fields is None:
        return None if ": " in details[:200] else "no field"
    if any(details.startswith(f"{f}: ") for f in case.fields) or details.startswith("request: "):
        return None
    return f"does not name {case.fields}"


def test_hostile_oip_traffic_gets_deliberate_answers(
    server: PredictionServer, fs, requests
) -> None:
    variants = list(candidate_variants(requests).values())
    goods = [
        infer_request(r, "dynrec")
        for r in [*requests, *variants, *map(lambda r: to_columnar(fs, r), variants)]
    ]
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        method = channel.unary_unary(
            METHOD, request_serializer=None, response_deserializer=v2.ModelInferResponse.FromString
        )
        before = [method(g.SerializeToString(), timeout=30).raw_output_contents[0] for g in goods]
        cases = Generator(goods, SEED).cases(CASES)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda c: _call(method, c), cases))
        after = [method(g.SerializeToString(), timeout=30).raw_output_contents[0] for g in goods]
    codes = collections.Counter(code.name for code, _ in answers)
    failures = [
        f"[{c.family}] {code.name} {details[:160]!r}: {p}"
        for c, (code, details) in zip(cases, answers, strict=True)
        if (p := _problem(c, code, details)) is not None
    ]
    assert codes["INTERNAL"] == 0 and codes["UNKNOWN"] == 0, (codes, failures[:20])
    assert not failures, f"{len(failures)} of {len(cases)} ({dict(codes)}):\n" + "\n".join(
        failures[:20]
    )
    assert (
        codes["OK"]
        and codes["INVALID_ARGUMENT"]
        and codes["NOT_FOUND"]
        and codes["RESOURCE_EXHAUSTED"]
    )
    assert after == before
    assert not server.metrics.registry.get_sample_value(
        "dynrec_serving_errors_total", {"method": "ModelInfer", "code": "INTERNAL"}
    )
