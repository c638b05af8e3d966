"""ExportCache: a cached export writes the bytes of a cold one; another graph is traced again."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from serve.program_cache import program_digest
from shared.bundle import TZREC_NAMING, read_bundle
from shared.bundle.naming import format_version
from shared.bundle.reader import read_manifest
from shared.bundle.writer import program_signature
from shared.delta import delta_format_version
from tests.conftest import SEED_CONFIG
from tests.train.export_checks import assert_same_model, bundle_files
from train.export import export_bundle, restore_model
from train.export_cache import ExportCache
from train.model.dense_arch import DenseArch, example_inputs, export_dense_arch
from train.tools.delta import export_delta


def test_cached_exports_write_the_bytes_of_cold_ones(dyn_run, tmp_path: Path) -> None:
    """As the stream's export process: a full bundle (traces), then deltas (reuse the program
    with new weights, read the base once); each equals the export of a fresh process."""
    cache = ExportCache()
    full = export_bundle(
        SEED_CONFIG, out_dir=tmp_path / "full", checkpoint=dyn_run.base_checkpoint, cache=cache
    )
    # against the bundle this cache wrote: its program's weights are known, no load
    export_delta(SEED_CONFIG, base=full, checkpoint=dyn_run.checkpoint, out=tmp_path / "on-full",
                 cache=cache)  # fmt: skip
    assert (cache.traced, cache.reused, cache.bases_read, cache.base_programs_loaded) == (
        1,
        1,
        1,
        0,
    )
    kw = {"base": dyn_run.base_bundle, "checkpoint": dyn_run.checkpoint}
    export_delta(SEED_CONFIG, out=tmp_path / "warm-1", cache=cache, **kw)
    export_delta(SEED_CONFIG, out=tmp_path / "warm-2", cache=cache, **kw)
    export_delta(SEED_CONFIG, out=tmp_path / "cold", **kw)
    assert (cache.traced, cache.reused, cache.bases_read) == (1, 3, 2)
    assert cache.base_programs_loaded == 1  # the fixture's base program, once
    assert bundle_files(full) == bundle_files(dyn_run.base_bundle)  # the fixture's, exported cold
    cold = bundle_files(tmp_path / "cold")
    assert "dense.pt2" in cold  # 4 steps moved the dense weights: the delta has a program
    # the formats told from the programs in memory are those a load of the files tells
    signature = program_signature(full / "dense.pt2")
    assert read_manifest(full)["format_version"] == format_version(TZREC_NAMING, signature)
    delta_manifest = json.loads(cold["manifest.json"])
    assert delta_manifest["format_version"] == delta_format_version(tmp_path / "cold" / "dense.pt2")
    assert bundle_files(tmp_path / "warm-1") == cold
    assert bundle_files(tmp_path / "warm-2") == cold
    on_full = bundle_files(tmp_path / "on-full")
    assert on_full["delta.safetensors"] == cold["delta.safetensors"]
    assert on_full["dense.pt2"] == cold["dense.pt2"]
    # the reused program holds step 8's weights, not those of step 4 it was traced with
    program = torch.export.load(tmp_path / "warm-2" / "dense.pt2")
    model, _, _ = restore_model(SEED_CONFIG, checkpoint=dyn_run.checkpoint, dynamic_tables=False)
    base, _, _ = restore_model(SEED_CONFIG, checkpoint=dyn_run.base_checkpoint)
    got = {**program.state_dict, **program.constants}
    weights = model.dense.state_dict()
    assert all(torch.equal(got[n], w) for n, w in weights.items())
    assert not all(torch.equal(got[n], w) for n, w in base.dense.state_dict().items())


def _arch(tower: list[int]) -> DenseArch:
    torch.manual_seed(len(tower) + sum(tower))
    return DenseArch(6, 5, 4, tower, [8], [8]).eval()


def _saved(program: torch.export.ExportedProgram, path: Path) -> Path:
    torch.export.save(program, path)
    return path


def test_another_graph_is_traced_again_and_the_same_graph_reused(tmp_path: Path) -> None:
    cache = ExportCache()
    a, b = _arch([16, 8]), _arch([32, 8])  # another tower width: another graph
    a_digest = program_digest(_saved(cache.dense_program(a, pairs=True), tmp_path / "a.pt2"))
    b_program = cache.dense_program(b, pairs=True)
    assert (cache.traced, cache.reused) == (2, 0)
    b_digest = program_digest(_saved(b_program, tmp_path / "b.pt2"))
    cold = export_dense_arch(b, example_inputs(b, pairs=True))
    assert b_digest == program_digest(_saved(cold, tmp_path / "b-cold.pt2")) != a_digest
    cache.dense_program(b, pairs=False)  # other inputs: another graph
    assert (cache.traced, cache.reused) == (3, 0)

    plain = cache.dense_program(b, pairs=False)  # the same graph and weights
    b_before = copy.deepcopy(b.state_dict())
    b2 = _arch([32, 8])
    with torch.no_grad():
        for w in b2.parameters():
            w.add_(0.5)
    again = cache.dense_program(b2, pairs=False)
    assert again is plain and (cache.traced, cache.reused) == (3, 2)
    loaded = torch.export.load(_saved(again, tmp_path / "b2.pt2"))
    held = {**loaded.state_dict, **loaded.constants}
    assert all(torch.equal(held[n], w) for n, w in b2.state_dict().items())
    # the module of the earlier export keeps its weights (the program holds copies)
    assert all(torch.equal(b.state_dict()[n], w) for n, w in b_before.items())
    cold_plain = export_dense_arch(b2, example_inputs(b2, pairs=False))
    assert program_digest(tmp_path / "b2.pt2") == program_digest(
        _saved(cold_plain, tmp_path / "b2-cold.pt2")
    )


def test_cached_exports_of_ranks_checkpoints(
    dyn_ranks: dict[int, Path], dyn_rank_bundles: dict[int, Path], tmp_path: Path
) -> None:
    """As the stream's export process, over checkpoints saved by 1, 2 and 3 ranks of one model
    state: each full export through one cache writes the bytes of a cold export of the same
    checkpoint (the session's) and holds the one-process bundle's model; a delta of the 3
    ranks' checkpoint against the one-process bundle changes nothing (same rows bit for bit,
    same program)."""
    ckpts = dyn_ranks
    cache = ExportCache()
    full = {
        w: export_bundle(SEED_CONFIG, out_dir=tmp_path / f"full-{w}", checkpoint=c, cache=cache)
        for w, c in ckpts.items()
    }
    assert (cache.traced, cache.reused) == (1, 2)
    for w in (2, 3):
        assert bundle_files(full[w]) == bundle_files(dyn_rank_bundles[w])
        assert_same_model(read_bundle(full[1]), read_bundle(full[w]), w)
    report = export_delta(
        SEED_CONFIG, base=full[1], checkpoint=ckpts[3], out=tmp_path / "delta", cache=cache
    )
    assert report["dense_program"] is False
    hashed = {n: t for n, t in report["tables"].items() if t["is_hashmap"]}
    assert hashed and all(t["new"] == t["updated"] == t["evicted"] == 0 for t in hashed.values())
    assert all(t["rows"] == 0 for t in report["tables"].values())
