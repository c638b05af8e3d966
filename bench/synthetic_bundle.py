"""Bundles with random tables for benchmarks and serving tests (no training needed).

The tables follow a FeatureSet (dense tables with their configured rows, dynamic tables with a
chosen number of keys each); the dense program is passed in, so tests use a tiny exported
module and the benchmarks the real MultiTowerDIN dense part (:func:`export_seed_program`).
Example::

    fs = seed_feature_set()
    keys = keys_per_table(fs, total=1_500_000)   # split like the full Taobao vocabularies
    p = export_seed_program(fs, work / "dense.pt2", pairs=True)   # format 3: CUDA graphs
    write_synthetic_bundle(out, fs, keys=keys, program_path=p, version="1", seed=0)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from protos import predict_pb2
from shared.bundle import write_bundle
from shared.features import FeatureSet, FeatureSpec, IdTransform, Side, feature_set_from_text

ROOT = Path(__file__).resolve().parents[1]
SEED_CONFIG = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config"
DIGEST = "0" * 64

# distinct ids in the full public Taobao data, by dynamic table (the split of --keys)
TAOBAO_VOCAB = {
    "user_id_emb": 1_141_729,
    "adgroup_id_emb": 846_811,
    "campaign_id_emb": 423_436,
    "customer_emb": 255_875,
    "brand_emb": 99_814,
    "cate_id_emb": 6_769,
}


def seed_feature_set() -> FeatureSet:
    return feature_set_from_text(SEED_CONFIG.read_text(), str(SEED_CONFIG))


def keys_per_table(fs: FeatureSet, total: int) -> dict[str, int]:
    """``total`` keys split over the dynamic tables in proportion to the Taobao vocabularies."""
    weights = {t.name: TAOBAO_VOCAB.get(t.name, 1) for t in fs.dynamic_tables}
    scale = total / sum(weights.values())
    return {name: max(1, round(w * scale)) for name, w in weights.items()}


def random_keys(n: int, rng: np.random.Generator, *, id_range: int | None = None) -> np.ndarray:
    """``n`` distinct non-negative int64 ids below ``id_range`` (default 2n), shuffled."""
    high = id_range or 2 * n
    if high < n:
        raise ValueError(f"cannot draw {n} distinct ids below {high}")
    return rng.permutation(high)[:n].astype(np.int64)


def write_synthetic_bundle(
    out: Path,
    fs: FeatureSet,
    *,
    keys: Mapping[str, int | np.ndarray],
    program_path: Path,
    version: str,
    seed: int = 0,
    scale: float = 0.05,
    overwrite: bool = False,
) -> Path:
    """Write a bundle of ``fs`` with N(0, scale) embeddings.

    ``keys[table]`` is either a count (distinct random ids below 2·count) or the ids themselves.
    """
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    dense = {
        t.name: torch.randn(int(t.num_rows or 0), t.dim, generator=gen) * scale
        for t in fs.dense_tables
    }
    hashed = {}
    for t in fs.dynamic_tables:
        k = keys[t.name]
        ids = random_keys(k, rng) if isinstance(k, int) else np.asarray(k, np.int64)
        values = torch.randn(len(ids), t.dim, generator=gen) * scale
        hashed[t.name] = [(torch.from_numpy(ids), values)]
    return write_bundle(
        out,
        dense_tables=dense,
        hash_tables=hashed,
        feature_set=fs,
        dense_program_path=program_path,
        config_digest=DIGEST,
        version=version,
        overwrite=overwrite,
    )


def export_seed_program(fs: FeatureSet, path: Path, *, pairs: bool = True, seed: int = 0) -> Path:
    """The seed config's real dense part (MultiTowerDIN's :class:`DenseArch`, its configured
    units) with random weights, exported to ``path``: with the pair inputs (``pairs``, what a
    format 3 bundle holds and CUDA graphs need) or without (format 2). Cost does not depend on
    the weights, so benchmarks need no training."""
    from shared.config import load_config
    from train.model.dense_arch import DenseArch, example_inputs, export_dense_arch

    torch.manual_seed(seed)
    arch = DenseArch.from_config(fs, load_config(SEED_CONFIG).model_config).eval()
    program = export_dense_arch(arch, example_inputs(arch, pairs=pairs))
    torch.export.save(program, path)
    return path


def as_columnar(fs: FeatureSet, request: predict_pb2.PredictRequest) -> predict_pb2.PredictRequest:
    """``request`` with its candidates as ``candidate_columns`` (the same candidates), each
    column of the kind ``fs`` gives its feature."""
    from loadtest.requests import columnar_request
    from serve.validation import value_type

    return columnar_request(request, {f.name: value_type(f) for f in fs.features.values()})


def synthetic_request(
    fs: FeatureSet,
    rng: np.random.Generator,
    *,
    candidates: int = 100,
    sequence_length: int = 5,
    id_range: int = 1000,
) -> predict_pb2.PredictRequest:
    """A valid PredictRequest of ``fs`` with random raw values (ids below ``id_range``)."""

    def value(spec: FeatureSpec) -> predict_pb2.Value:
        if spec.transform is IdTransform.BUCKETIZE:
            return predict_pb2.Value(double_value=float(rng.uniform(0, 500)))
        if spec.transform is IdTransform.HASH:
            return predict_pb2.Value(string_value=f"430548_{int(rng.integers(1000, 1010))}")
        return predict_pb2.Value(int64_value=int(rng.integers(0, id_range)))

    req = predict_pb2.PredictRequest()
    for f in fs.features.values():
        if f.is_sequence:
            req.sequences[f.name].ids.extend(rng.integers(0, id_range, sequence_length).tolist())
        elif f.side is Side.USER:
            req.user.values[f.name].CopyFrom(value(f))
        elif f.side is Side.CONTEXT:
            req.context.values[f.name].CopyFrom(value(f))
    items = [f for f in fs.features.values() if f.side is Side.ITEM and not f.is_sequence]
    for _ in range(candidates):
        cand = req.candidates.add()
        for f in items:
            cand.values[f.name].CopyFrom(value(f))
    return req
