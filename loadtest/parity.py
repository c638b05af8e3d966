"""Online/offline parity: the server's answers for eval rows against the offline scorer's.

For each check, one eval row gives the user part (user features, click sequences, context) and
``num_candidates`` eval rows give the candidate ads. The same (user, ad) pairs are laid out as
sample rows and scored from the bundle alone (:func:`serve.offline.score_table`); the gRPC
answers must match within ``atol``, with the candidates sent in both encodings (``candidates``
and ``candidate_columns``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds

from loadtest.requests import (
    SequenceFormat,
    columnar_request,
    sequence_formats_from_metadata,
    sides_from_metadata,
    value_types_from_metadata,
)
from loadtest.run import fetch_metadata
from protos import predict_pb2, predict_pb2_grpc


@dataclass
class ParityResult:
    requests: int
    candidates: int
    max_abs_diff: float
    model_version: str
    formats: tuple[str, ...] = ("rows", "columnar")  # each request was sent in these encodings

    def to_dict(self) -> dict[str, object]:
        return self.__dict__.copy()


def _value(v: int | float | str | None, value_type: str) -> predict_pb2.Value:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return predict_pb2.Value()  # explicit missing
    if value_type == "int64":
        return predict_pb2.Value(int64_value=int(v))
    if value_type == "double":
        return predict_pb2.Value(double_value=float(v))
    return predict_pb2.Value(string_value=str(v))


def _ids(
    name: str, seq: str | Sequence[int | None] | None, fmt: SequenceFormat | None
) -> list[int]:
    if seq is None or seq == "":
        return []
    if isinstance(seq, str):
        if fmt is None or not fmt.delimiter:
            raise ValueError(
                f"sequence column {name!r} holds joined strings, but the model metadata gives no "
                "delimiter for it (ModelMetadata.sequences); serve the model with this version "
                "of serve"
            )
        return [int(t) if t.strip() else 0 for t in seq.split(fmt.delimiter)]
    return [0 if t is None else int(t) for t in seq]  # list column


def request_for_rows(
    table: pa.Table,
    sides: dict[str, str],
    types: dict[str, str],
    request_id: str,
    *,
    sequence_formats: Mapping[str, SequenceFormat],
) -> predict_pb2.PredictRequest:
    """A request whose user/sequence/context come from row 0 and candidates from every row.

    String sequence columns are split on their ``sequence_formats`` delimiter (from
    :func:`~loadtest.requests.sequence_formats_from_metadata`)."""
    rows = table.to_pylist()
    req = predict_pb2.PredictRequest(request_id=request_id)
    for name, side in sides.items():
        if side == "user":
            req.user.values[name].CopyFrom(_value(rows[0][name], types[name]))
        elif side == "context":
            req.context.values[name].CopyFrom(_value(rows[0][name], types[name]))
        elif side == "sequence":
            req.sequences[name].ids.extend(_ids(name, rows[0][name], sequence_formats.get(name)))
    longest = max((len(s.ids) for s in req.sequences.values()), default=0)
    for seq in req.sequences.values():
        if longest == 1 and len(seq.ids) == 0:  # "" beside one-click rows: one missing id
            seq.ids.append(0)
    for row in rows:
        cand = req.candidates.add()
        for name, side in sides.items():
            if side == "item":
                cand.values[name].CopyFrom(_value(row[name], types[name]))
    return req


def check_parity(
    host: str,
    bundle_dir: str | Path,
    samples: str | Path,
    *,
    num_requests: int = 20,
    num_candidates: int = 20,
    seed: int = 0,
    atol: float = 1e-5,
) -> ParityResult:
    """Send ``num_requests`` requests and compare with offline scores; raises on a mismatch."""
    from serve.model import LoadedModel
    from serve.offline import score_table

    metadata = fetch_metadata(host)
    sides = sides_from_metadata(metadata)
    types = value_types_from_metadata(metadata)
    formats = sequence_formats_from_metadata(metadata)
    dataset = ds.dataset(str(samples), format="parquet")
    labels = [c for c in ("clk",) if c in dataset.schema.names]  # the offline batch wants labels
    table = dataset.head(20_000, columns=[*sides, *labels])
    model = LoadedModel.load(bundle_dir, device="cpu", warmup_rounds=0)
    rng = np.random.default_rng(seed)
    worst = 0.0
    with grpc.insecure_channel(host) as channel:
        stub = predict_pb2_grpc.PredictionServiceStub(channel)
        for i in range(num_requests):
            user_row = int(rng.integers(table.num_rows))
            cands = rng.choice(table.num_rows, num_candidates, replace=False)
            rows = table.take(pa.array(cands))
            user_part = table.take(pa.array([user_row] * num_candidates))
            for name, side in sides.items():  # user side of every row from the one user row
                if side != "item":
                    rows = rows.set_column(
                        rows.schema.get_field_index(name), name, user_part.column(name)
                    )
            req = request_for_rows(rows, sides, types, f"parity-{i}", sequence_formats=formats)
            offline = score_table(model, rows, tiled=True).astype(np.float64)
            for fmt, sent in (("rows", req), ("columnar", columnar_request(req, types))):
                response = stub.Predict(sent, timeout=30)
                online = np.asarray(response.probabilities, dtype=np.float64)
                if online.shape != offline.shape:
                    raise AssertionError(
                        f"request {i} ({fmt}): {online.shape} answers for {offline.shape} rows"
                    )
                worst = max(worst, float(np.abs(online - offline).max()))
    if worst > atol:
        raise AssertionError(f"online vs offline max abs diff {worst:.3g} > {atol}")
    return ParityResult(num_requests, num_requests * num_candidates, worst, metadata.model_version)
