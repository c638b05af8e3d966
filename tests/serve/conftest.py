"""Fixtures for serving tests: small bundles of the seed config and sample rows.

The bundles hold random tables (``bench.synthetic_bundle``) and a tiny exported dense program
with the real signature (:class:`TinyDense`). To test against a really trained model instead,
replace :func:`bundle_v1` / :func:`bundle_v2` with exports of ``train/`` (``train.export``);
everything else only needs a bundle directory and rows whose columns carry the feature names.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pytest
import torch
from torch import nn
from torch.export import Dim

from bench.synthetic_bundle import SEED_CONFIG, seed_feature_set, write_synthetic_bundle
from protos import predict_pb2, predict_pb2_grpc
from serve.batcher import BatcherConfig
from serve.limits import Limits
from serve.server import PredictionServer, ServerConfig
from shared.dense_inputs import INPUT_NAMES, cold_layout, dense_layout
from shared.features import FeatureSet, IdTransform, Side, feature_set_from_text

KEYS_PER_TABLE = 64  # ids are drawn below 2x this: about half of the lookups hit


class TinyDense(nn.Module):
    """Pooled sums + linear layers over the six dense inputs; exports with dynamic U, B, T."""

    def __init__(self, du: int, di: int, dq: int, hidden: int = 8) -> None:
        super().__init__()
        self.user = nn.Linear(du, hidden)
        self.item = nn.Linear(di, hidden)
        self.query = nn.Linear(dq, hidden)
        self.seq = nn.Linear(dq, hidden)
        self.out = nn.Linear(hidden, 1)

    def forward(
        self,
        user_deep: torch.Tensor,
        item_deep: torch.Tensor,
        query: torch.Tensor,
        seq_values: torch.Tensor,
        seq_lengths: torch.Tensor,
        user_index: torch.Tensor,
    ) -> torch.Tensor:
        # user_deep [U, Du]; item_deep [B, Di]; query [B, Dq]; seq_values [T, Dq]
        u = user_deep.shape[0]
        users = torch.arange(u, device=seq_values.device)
        seg = torch.repeat_interleave(users, seq_lengths, output_size=seq_values.shape[0])  # [T]
        seq_sum = seq_values.new_zeros(u, seq_values.shape[1]).index_add(0, seg, seq_values)
        h = self.user(user_deep)[user_index] + self.item(item_deep)  # [B, H]
        h = torch.tanh(h + self.query(query) * self.seq(seq_sum)[user_index])
        return self.out(h).squeeze(1)  # [B]


def export_tiny_program(fs: FeatureSet, path: Path, seed: int, hidden: int = 8) -> Path:
    torch.manual_seed(seed)
    lay = dense_layout(fs)
    module = TinyDense(lay.user_deep_dim, lay.item_deep_dim, lay.seq_dim, hidden).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(4.0)  # embeddings are small: spread the logits
    lengths = torch.tensor([3, 0, 2])
    example = {
        "user_deep": torch.randn(3, lay.user_deep_dim),
        "item_deep": torch.randn(4, lay.item_deep_dim),
        "query": torch.randn(4, lay.seq_dim),
        "seq_values": torch.randn(5, lay.seq_dim),
        "seq_lengths": lengths,
        "user_index": torch.tensor([0, 1, 2, 2]),
    }
    u, b, t = Dim("U", min=0), Dim("B", min=0), Dim("T", min=0)
    shapes = {
        "user_deep": {0: u},
        "item_deep": {0: b},
        "query": {0: b},
        "seq_values": {0: t},
        "seq_lengths": {0: u},
        "user_index": {0: b},
    }
    kwargs = {n: example[n] for n in INPUT_NAMES}  # keyword inputs, as train/ exports
    program = torch.export.export(module, (), kwargs=kwargs, dynamic_shapes=shapes, strict=False)
    torch.export.save(program, path)
    return path


def make_bundle(root: Path, fs: FeatureSet, version: str, seed: int) -> Path:
    program = export_tiny_program(fs, root / f"dense-{version}.pt2", seed)
    keys = {t.name: KEYS_PER_TABLE for t in fs.dynamic_tables}
    return write_synthetic_bundle(
        root / "bundles" / version, fs, keys=keys, program_path=program, version=version, seed=seed
    )


@pytest.fixture(scope="session")
def fs() -> FeatureSet:
    return seed_feature_set()


@pytest.fixture(scope="session")
def bundle_v1(fs: FeatureSet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bundle(tmp_path_factory.mktemp("v1"), fs, "1", seed=1)


@pytest.fixture(scope="session")
def bundle_v2(fs: FeatureSet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bundle(tmp_path_factory.mktemp("v2"), fs, "2", seed=2)


# other dims than the seed config's 16: a dynamic user table, a dynamic item table that the click
# sequence shares, dense user, item and context tables (the context one pooled by mean)
MIXED_DIMS = {"user_id": 8, "adgroup_id": 32, "cms_segid": 4, "price": 32, "pid": 8}


def mixed_dim_feature_set() -> FeatureSet:
    """The seed config with the dims of :data:`MIXED_DIMS` (the same features and requests)."""
    text = SEED_CONFIG.read_text()
    for name, dim in MIXED_DIMS.items():  # every block of the feature (sequence ones too)
        text = re.sub(
            rf'(feature_name: "{name}"\n[^}}]*?)embedding_dim: 16',
            rf"\g<1>embedding_dim: {dim}",
            text,
        )
    text = text.replace('feature_name: "pid"\n', 'feature_name: "pid"\npooling: "mean"\n')
    return feature_set_from_text(text, str(SEED_CONFIG))


@pytest.fixture(scope="session")
def fs_mixed() -> FeatureSet:
    return mixed_dim_feature_set()


@pytest.fixture(scope="session")
def bundle_mixed(fs_mixed: FeatureSet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bundle(tmp_path_factory.mktemp("mixed"), fs_mixed, "m1", seed=3)


# --------------------------------------------------------------------------- sample rows


def _raw_value(spec_transform: IdTransform, name: str, rng: np.random.Generator) -> object:
    if spec_transform is IdTransform.BUCKETIZE:
        return float(np.round(rng.uniform(0, 500), 2))
    if spec_transform is IdTransform.HASH:
        return f"430548_{int(rng.integers(1000, 1010))}"
    if name == "pvalue_level" and rng.random() < 0.3:
        return None  # missing in the real data for many users
    return int(rng.integers(0, 2 * KEYS_PER_TABLE))


def sample_rows(fs: FeatureSet, users: int, seed: int = 0) -> list[list[dict[str, object]]]:
    """``users`` groups of rows; the rows of a group share user features, sequences and context."""
    rng = np.random.default_rng(seed)
    scalar = [f for f in fs.features.values() if not f.is_sequence]
    seqs: dict[str, list[str]] = {}
    for f in fs.features.values():
        if f.is_sequence:
            seqs.setdefault(f.sequence_name or f.name, []).append(f.name)
    groups = []
    for u in range(users):
        shared: dict[str, object] = {
            f.name: _raw_value(f.transform, f.name, rng)
            for f in scalar
            if f.side in (Side.USER, Side.CONTEXT)
        }
        for names in seqs.values():
            n = int(rng.integers(0, 12)) if u % 4 else 0  # some users have no clicks
            for name in names:
                shared[name] = [int(x) for x in rng.integers(0, 2 * KEYS_PER_TABLE, n)]
        rows = []
        for _ in range(int(rng.integers(1, 6))):
            row = dict(shared)
            row.update(
                {
                    f.name: _raw_value(f.transform, f.name, rng)
                    for f in scalar
                    if f.side is Side.ITEM
                }
            )
            row["clk"] = 0
            rows.append(row)
        groups.append(rows)
    return groups


def rows_table(fs: FeatureSet, rows: list[dict[str, object]]) -> pa.Table:
    cols: dict[str, pa.Array] = {}
    for name in [*fs.features, "clk"]:
        values = [r[name] for r in rows]
        spec = fs.features.get(name)
        if spec is not None and spec.is_sequence:
            cols[name] = pa.array(values, pa.list_(pa.int64()))
        else:
            cols[name] = pa.array(values)
    return pa.table(cols)


def _value(v: object) -> predict_pb2.Value:
    if v is None:
        return predict_pb2.Value()
    if isinstance(v, int):
        return predict_pb2.Value(int64_value=v)
    if isinstance(v, float):
        return predict_pb2.Value(double_value=v)
    return predict_pb2.Value(string_value=str(v))


def make_request(
    fs: FeatureSet, rows: list[dict[str, object]], request_id: str = ""
) -> predict_pb2.PredictRequest:
    """One request of a group of rows: the first row's user side, every row's item side."""
    req = predict_pb2.PredictRequest(request_id=request_id)
    first = rows[0]
    for f in fs.features.values():
        if f.is_sequence:
            req.sequences[f.name].ids.extend(first[f.name])  # type: ignore[arg-type]
        elif f.side is Side.USER:
            req.user.values[f.name].CopyFrom(_value(first[f.name]))
        elif f.side is Side.CONTEXT:
            req.context.values[f.name].CopyFrom(_value(first[f.name]))
    for r in rows:
        cand = req.candidates.add()
        for f in fs.features.values():
            if f.side is Side.ITEM and not f.is_sequence:
                cand.values[f.name].CopyFrom(_value(r[f.name]))
    return req


@pytest.fixture(scope="session")
def groups(fs: FeatureSet) -> list[list[dict[str, object]]]:
    return sample_rows(fs, users=12, seed=0)


@pytest.fixture(scope="session")
def requests(
    fs: FeatureSet, groups: list[list[dict[str, object]]]
) -> list[predict_pb2.PredictRequest]:
    return [make_request(fs, g, f"r{i}") for i, g in enumerate(groups)]


@pytest.fixture(scope="session")
def table(fs: FeatureSet, groups: list[list[dict[str, object]]]) -> pa.Table:
    return rows_table(fs, [r for g in groups for r in g])


# --------------------------------------------------------------------------- columnar requests


def to_columnar(fs: FeatureSet, req: predict_pb2.PredictRequest) -> predict_pb2.PredictRequest:
    """``req`` with its candidates as ``candidate_columns`` (the same candidates)."""
    from bench.synthetic_bundle import as_columnar

    return as_columnar(fs, req)


def candidate_variants(
    requests: list[predict_pb2.PredictRequest],
) -> dict[str, predict_pb2.PredictRequest]:
    """Row-format requests covering what both candidate encodings must treat alike: explicit
    missing values (some rows, every row), unknown ids, string ids of a dynamic feature, int
    prices, empty and non-empty click sequences, and a one-candidate request."""

    def variant(i: int, mutate) -> predict_pb2.PredictRequest:
        req = predict_pb2.PredictRequest()
        req.CopyFrom(requests[i])
        mutate(req)
        return req

    def some_missing(req: predict_pb2.PredictRequest) -> None:
        req.candidates[0].values["brand"].CopyFrom(predict_pb2.Value())
        req.candidates[-1].values["price"].CopyFrom(predict_pb2.Value())
        req.candidates[-1].values["cate_id"].CopyFrom(predict_pb2.Value())

    def all_missing(req: predict_pb2.PredictRequest) -> None:
        for c in req.candidates:
            c.values["brand"].CopyFrom(predict_pb2.Value())
            c.values["price"].CopyFrom(predict_pb2.Value())

    def unknown_ids(req: predict_pb2.PredictRequest) -> None:
        for k, c in enumerate(req.candidates):
            c.values["adgroup_id"].CopyFrom(predict_pb2.Value(int64_value=10**12 + k))
            c.values["customer"].CopyFrom(predict_pb2.Value(int64_value=2**62 + k))

    def string_ids_int_prices(req: predict_pb2.PredictRequest) -> None:
        for k, c in enumerate(req.candidates):
            c.values["adgroup_id"].CopyFrom(predict_pb2.Value(string_value=f"ad-{k % 3}"))
            c.values["price"].CopyFrom(predict_pb2.Value(int64_value=10 * k))

    def no_clicks(req: predict_pb2.PredictRequest) -> None:
        for seq in req.sequences.values():
            seq.ClearField("ids")

    def one_candidate(req: predict_pb2.PredictRequest) -> None:
        del req.candidates[1:]

    with_clicks = next(
        i for i, r in enumerate(requests) if len(next(iter(r.sequences.values())).ids)
    )
    many = max(range(len(requests)), key=lambda i: len(requests[i].candidates))
    return {
        "as sampled": variant(with_clicks, lambda r: None),
        "empty sequences": variant(0, lambda r: None),
        "some values missing": variant(many, some_missing),
        "a column all missing": variant(many, all_missing),
        "unknown ids": variant(many, unknown_ids),
        "string ids, int prices": variant(many, string_ids_int_prices),
        "no clicks": variant(with_clicks, no_clicks),
        "one candidate": variant(many, one_candidate),
    }


# --------------------------------------------------------------------------- real dense programs


def export_din_program(
    fs: FeatureSet, path: Path, *, pairs: bool, seed: int = 0, backoff: str = "none"
) -> Path:
    """The model's real dense part (:class:`train.model.dense_arch.DenseArch`, small units),
    exported with the pair inputs (bundle format 3) or without (format 2), same weights.
    ``backoff``: "none", or a cold-id backoff (:mod:`train.model.backoff`, bundle format 4)
    with "random" weights or "zero" ones (scores then as without it); the models with a
    backoff also have an item-only tower (``item_tower``), the same in both."""
    from protos import pipeline_pb2
    from train.model.backoff import backoff_sides, backoff_spaces
    from train.model.dense_arch import DenseArch, example_inputs, export_dense_arch

    torch.manual_seed(seed)
    lay = dense_layout(fs)
    config = pipeline_pb2.ColdBackoff()  # every dynamic feature backs off: items named
    cold = cold_layout(fs)
    for f in (*cold.item, *cold.sequence):
        spaces_of = backoff_sides(fs, f)
        config.sources.add(feature_name=f, side_features=spaces_of)
    spaces = () if backoff == "none" else backoff_spaces(fs, config)
    arch = DenseArch(
        lay.user_deep_dim,
        lay.item_deep_dim,
        lay.seq_dim,
        [32, 16],
        [16, 8],
        [8],
        spaces,
        item_tower_units=[8] if spaces else None,
    )
    with torch.no_grad():
        for p in arch.parameters():
            p.mul_(4.0)  # embeddings are small: spread the logits
        if backoff == "random":  # after the others: the same weights in all variants
            generator = torch.Generator().manual_seed(seed + 1)
            for p in arch.backoff.parameters() if arch.backoff is not None else ():
                p.copy_(torch.randn(p.shape, generator=generator))
        if arch.item_tower is not None:  # its output starts at zero: give it a term to add
            generator = torch.Generator().manual_seed(seed + 2)
            for p in arch.item_tower.output.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))
    program = export_dense_arch(arch.eval(), example_inputs(arch, pairs=pairs))
    torch.export.save(program, path)
    return path


def make_din_bundle(
    root: Path, fs: FeatureSet, version: str, *, pairs: bool, backoff: str = "none", seed: int = 0
) -> Path:
    """A bundle with :func:`export_din_program`'s program (its weights from ``seed``); the
    tables depend on ``fs`` only, so the bundles with and without the pairs hold the same
    model."""
    program = export_din_program(
        fs, root / f"dense-{version}.pt2", pairs=pairs, backoff=backoff, seed=seed
    )
    keys = {t.name: KEYS_PER_TABLE for t in fs.dynamic_tables}
    return write_synthetic_bundle(
        root / "bundles" / version, fs, keys=keys, program_path=program, version=version, seed=5
    )


@pytest.fixture(scope="session")
def cold_bundles(fs: FeatureSet, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(format 4 bundle with a random backoff, the same with the backoff zeroed): the same
    dense weights and tables otherwise."""
    root = tmp_path_factory.mktemp("cold")
    return (
        make_din_bundle(root, fs, "cold-random", pairs=True, backoff="random"),
        make_din_bundle(root, fs, "cold-zero", pairs=True, backoff="zero"),
    )


@pytest.fixture(scope="session")
def din_bundles(fs: FeatureSet, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(format 2 bundle, format 3 bundle) of the same DenseArch model and tables."""
    root = tmp_path_factory.mktemp("din")
    return (
        make_din_bundle(root, fs, "din-f2", pairs=False),
        make_din_bundle(root, fs, "din-f3", pairs=True),
    )


@dataclass
class Traffic:
    """What :func:`predict_traffic`'s clients got: (request index, model version, scores) per
    answer, and the errors."""

    results: list[tuple[int, str, np.ndarray]] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)


@contextlib.contextmanager
def predict_traffic(port: int, requests: list, clients: int = 4) -> Iterator[Traffic]:
    """``clients`` threads, each with a channel of its own to 127.0.0.1:``port``, calling
    Predict with ``requests`` in turn until the block ends (they are joined on the way out)."""
    traffic, stop = Traffic(), threading.Event()

    def client(k: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = predict_pb2_grpc.PredictionServiceStub(channel)
            i = k
            while not stop.is_set():
                try:
                    r = stub.Predict(requests[i % len(requests)], timeout=10)
                    traffic.results.append(
                        (i % len(requests), r.model_version, np.array(r.probabilities))
                    )
                except grpc.RpcError as e:
                    traffic.errors.append(e)
                i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    try:
        yield traffic
    finally:
        stop.set()
        for t in threads:
            t.join(10)


@contextlib.contextmanager
def running_server(bundle: Path, limits: Limits, **config: Any) -> Iterator[PredictionServer]:
    """A started CPU server of ``bundle`` with small batches (64 rows, 500 µs), ready, stopped on
    exit. ``config``: more ServerConfig fields (``http_port=0``, ``model_name=...``)."""
    batching = BatcherConfig(max_batch_rows=64, max_wait_us=500)
    cfg = ServerConfig(bundle=bundle, device="cpu", limits=limits, batching=batching, **config)
    srv = PredictionServer(cfg).start()
    try:
        assert srv.wait_ready(60), srv.load_error
        yield srv
    finally:
        srv.stop(grace=0)
