"""Serving a program with a cold-id backoff (bundle format 4): the lookups fill the cold masks on
the device, a candidate known only through its side features scores by its backoff, offline and
through gRPC alike; warm rows score as without the backoff."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pytest
import torch

from protos import predict_pb2_grpc
from serve.batcher import BatcherConfig
from serve.limits import Limits
from serve.model import LoadedModel, load_program
from serve.offline import score_rows, score_table
from serve.server import PredictionServer, ServerConfig
from shared.bundle import read_bundle, read_manifest
from shared.dense_inputs import COLD_NAMES, Signature
from shared.features import FeatureSet
from shared.fg import table_to_batch


def test_format_4_bundle_takes_the_cold_masks(cold_bundles: tuple[Path, Path]) -> None:
    for bundle in cold_bundles:
        assert read_manifest(bundle)["format_version"] == 4
        program = load_program(bundle / "dense.pt2", torch.device("cpu"), cache=None)
        assert program.signature is Signature.COLD and program.takes_pairs


def _cold_rows(model: LoadedModel, fs: FeatureSet, table: pa.Table) -> np.ndarray:
    """[rows] bool: a row (its own user) has a cold feature, its sequence's elements included."""
    batch = model.to_device(table_to_batch(fs, table))
    inputs = model.tables.embed(batch, cold=True)
    user, item, seq = (inputs[n] for n in COLD_NAMES)
    lengths = inputs["seq_lengths"]
    owner = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)  # [T] its user
    seq_any = torch.zeros(lengths.numel(), dtype=torch.bool).index_put(
        (owner,), seq.any(1), accumulate=True
    )
    return (user.any(1) | seq_any)[inputs["user_index"]].numpy() | item.any(1).numpy()


def _warm(fs: FeatureSet, bundle: Path, table: pa.Table) -> pa.Table:
    """``table``'s rows with every dynamic id set to a key of its table and no sequence."""
    hashed = read_bundle(bundle, verify_checksums=False).hash_tables
    for f in fs.features.values():
        if f.sequence_name is not None:
            table = table.set_column(
                table.schema.get_field_index(f.name), f.name, pa.array([""] * table.num_rows)
            )
        elif fs.tables[f.table].is_dynamic:
            key = int(hashed[f.table][0][0])
            kind = table.schema.field(f.name).type
            column = pa.array([key] * table.num_rows).cast(kind)
            table = table.set_column(table.schema.get_field_index(f.name), f.name, column)
    return table


def test_cold_rows_back_off_and_warm_rows_do_not(
    cold_bundles: tuple[Path, Path], fs: FeatureSet, table: pa.Table
) -> None:
    backed, zero = (LoadedModel.load(b, device="cpu", warmup_rounds=1) for b in cold_bundles)
    warm = _warm(fs, cold_bundles[0], table)
    assert not _cold_rows(backed, fs, warm).any() and _cold_rows(backed, fs, table).all()
    for rows, differ in ((warm, False), (table, True)):
        got, plain = score_table(backed, rows, tiled=False), score_table(zero, rows, tiled=False)
        if differ:  # each cold row takes its backoff
            assert (np.abs(got - plain) > 1e-4).all()
        else:
            np.testing.assert_allclose(got, plain, rtol=0, atol=1e-6)


def test_a_candidate_known_only_by_its_side_features(
    cold_bundles: tuple[Path, Path], table: pa.Table
) -> None:
    """An ad never seen (its id in no table) scores by its backoff, unlike with the backoff
    zeroed (its embedding then zeros, as without a backoff)."""
    rows = table.slice(0, 4)
    unseen = pa.array(np.arange(4) + 10**12)
    rows = rows.set_column(rows.schema.get_field_index("adgroup_id"), "adgroup_id", unseen)
    backed, zero = (LoadedModel.load(b, device="cpu", warmup_rounds=0) for b in cold_bundles)
    got, plain = score_table(backed, rows, tiled=False), score_table(zero, rows, tiled=False)
    assert (np.abs(got - plain) > 1e-4).all()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_server_answers_like_the_offline_scorer(
    cold_bundles: tuple[Path, Path], table: pa.Table, requests: list, device: str
) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA (the CUDA graphs of a format 4 program)")
    bundle = cold_bundles[0]
    flat = score_rows(bundle, table, tiled=False)
    config = ServerConfig(
        bundle=bundle,
        device=device,
        batching=BatcherConfig(max_batch_rows=64),
        limits=Limits(max_candidates=64),
    )
    srv = PredictionServer(config).start()
    try:
        assert srv.wait_ready(300), srv.load_error
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = predict_pb2_grpc.PredictionServiceStub(channel)
            got = np.concatenate([stub.Predict(r, timeout=30).probabilities for r in requests])
        model = srv.manager.current
        assert model is not None
        if device == "cuda":
            stats = model.graph_stats()
            assert stats is not None and stats.replays > 0 and stats.failures == {}
    finally:
        srv.stop(grace=0)
    np.testing.assert_allclose(got, flat, rtol=1e-5, atol=1e-6)


def test_a_format_number_that_lies_about_the_program_is_refused(
    cold_bundles: tuple[Path, Path], tmp_path: Path
) -> None:
    """A format 3 manifest over a program taking the cold masks: refused at load, naming both."""
    import json
    import shutil

    from shared.bundle import BundleError

    fake = tmp_path / "fake"
    shutil.copytree(cold_bundles[0], fake)
    manifest = json.loads((fake / "manifest.json").read_text())
    manifest["format_version"] = 3
    (fake / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="format_version 3 says the dense program takes"):
        LoadedModel.load(fake, device="cpu", warmup_rounds=0, verify_checksums=False)
