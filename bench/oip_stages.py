"""Where one request's host time goes, per protocol: Predict's parse and validation, the Open
Inference Protocol's parse, tensor decoding (:func:`serve.oip.call_of_grpc`) and validation
(:func:`serve.oip.fg_inputs`), feature generation of either, and each answer's serialization.
Medians in microseconds, in one process and thread (``bench.bench_oip``'s ``per_request_us``)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def _median_us(stage: Callable[[], object], iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        stage()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _stages(fs: Any, limits: Any, p_wire: bytes, i_wire: bytes) -> dict[str, Callable[[], object]]:
    """The host stages of one request over each protocol, as calls to time."""
    from protos import grpc_predict_v2_pb2 as v2
    from protos import predict_pb2
    from serve import oip
    from serve.validation import request_inputs
    from shared.fg_request import request_columns_to_batch

    p = predict_pb2.PredictRequest.FromString(p_wire)
    m = v2.ModelInferRequest.FromString(i_wire)
    call = oip.call_of_grpc(m)
    p_in = request_inputs(p, fs, limits)
    o_in = oip.fg_inputs(call.tensors, fs, limits)
    probs = np.random.default_rng(0).random(p_in.num_candidates, np.float32)
    result = oip.InferResult("dynrec", "1", m.id, probs, binary_output=True)

    def predict_response() -> bytes:
        return predict_pb2.PredictResponse(
            probabilities=probs.tolist(), model_version="1", request_id=p.request_id
        ).SerializeToString()

    return {
        "predict.parse": lambda: predict_pb2.PredictRequest.FromString(p_wire),
        "predict.validate": lambda: request_inputs(p, fs, limits),
        "predict.fg": lambda: request_columns_to_batch(fs, **vars(p_in)),
        "predict.respond": predict_response,
        "oip.parse": lambda: v2.ModelInferRequest.FromString(i_wire),
        "oip.decode": lambda: oip.call_of_grpc(m),
        "oip.validate": lambda: oip.fg_inputs(call.tensors, fs, limits),
        "oip.fg": lambda: request_columns_to_batch(fs, **vars(o_in)),
        "oip.respond": lambda: oip.grpc_response(result).SerializeToString(),
    }


def per_request(
    bundle: Path, predict: list[bytes], infer: list[bytes], n: int, iters: int
) -> dict[str, float]:
    """Median microseconds of each host stage of one request, per protocol, over the first
    ``n`` requests of the pool (each stage's median per request, then the median of those)."""
    from serve.limits import Limits
    from shared.bundle.layout import FG_JSON
    from shared.fg_spec import feature_set_from_dict

    path = bundle / FG_JSON  # the features only (the tables stay on disk)
    fs = feature_set_from_dict(json.loads(path.read_text()), source=str(path))
    limits = Limits(max_candidates=1 << 20)
    times: dict[str, list[float]] = {}
    for p_wire, i_wire in zip(predict[:n], infer[:n], strict=True):
        for name, stage in _stages(fs, limits, p_wire, i_wire).items():
            times.setdefault(name, []).append(_median_us(stage, iters))
    out = {k: statistics.median(v) for k, v in times.items()}
    for proto, parts in [
        ("predict", ("parse", "validate")),
        ("oip", ("parse", "decode", "validate")),
    ]:
        out[f"{proto}.before_fg"] = sum(out[f"{proto}.{x}"] for x in parts)
    return out
