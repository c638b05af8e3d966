"""delta-export: base bundle + delta == a full export of the same checkpoint; format checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shared.bundle import read_bundle
from shared.bundle.naming import PAIR_PROGRAM_FORMAT
from shared.bundle.writer import program_signature
from shared.delta import PAIR_PROGRAM_DELTA_FORMAT, DeltaError, apply_delta_tables, manifest_digest
from shared.delta_reader import read_delta
from shared.dense_inputs import Signature
from tests.conftest import SEED_CONFIG, write_config
from train.tools.__main__ import main
from train.tools.delta import export_delta


@pytest.fixture(scope="module")
def delta_dir(dyn_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("delta") / "step-8"
    export_delta(SEED_CONFIG, base=dyn_run.base_bundle, checkpoint=dyn_run.checkpoint, out=out)
    return out


def _as_dict(keys: torch.Tensor, values: torch.Tensor) -> dict[int, list[float]]:
    return dict(zip(keys.tolist(), values.tolist(), strict=True))


def test_base_plus_delta_equals_the_full_export(dyn_run, delta_dir: Path) -> None:
    base, full = read_bundle(dyn_run.base_bundle), read_bundle(dyn_run.full_bundle)
    delta = read_delta(delta_dir)
    assert delta.base_version == "step-4" and delta.target_version == "step-8"
    assert delta.base_digest == manifest_digest(base.manifest)
    dense, hashed = apply_delta_tables(base.dense_tables, base.hash_tables, delta)
    assert set(dense) == set(full.dense_tables) and set(hashed) == set(full.hash_tables)
    for name, w in full.dense_tables.items():
        assert torch.equal(dense[name], w), name
    changed = 0
    for name, (keys, values) in full.hash_tables.items():
        assert _as_dict(*hashed[name]) == _as_dict(keys, values), name
        t = delta.tables[name]
        base_keys = set(base.hash_tables[name][0].tolist())
        assert t.new == len(set(keys.tolist()) - base_keys)
        assert t.evicted == len(base_keys - set(keys.tolist()))
        changed += t.new + t.updated
    assert changed > 0
    assert delta.dense_program_path is not None  # 4 more steps moved the dense weights
    # the base bundle's tensors are untouched by the merge
    assert _as_dict(*read_bundle(dyn_run.base_bundle).hash_tables["user_id_emb"]) == _as_dict(
        *base.hash_tables["user_id_emb"]
    )
    summaries = json.loads((delta_dir / "manifest.json").read_text())["table_summaries"]
    assert summaries["user_id_emb"]["size"] == full.hash_tables["user_id_emb"][0].numel()


def test_unchanged_checkpoint_gives_an_empty_delta(dyn_run, tmp_path: Path, capsys) -> None:
    args = ["delta-export", "--config", str(SEED_CONFIG), "--base", str(dyn_run.base_bundle)]
    args += ["--checkpoint", str(dyn_run.base_checkpoint), "--out", str(tmp_path / "d"), "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dense_program"] is False and report["delta_id"] == "step-4"
    for counts in report["tables"].values():
        assert counts["new"] == counts["updated"] == counts["evicted"] == counts["rows"] == 0
    assert not (tmp_path / "d" / "dense.pt2").exists()
    assert main(args) == 2  # exists: needs --overwrite
    assert "--overwrite" in capsys.readouterr().err


def test_damaged_or_foreign_deltas_are_refused(
    dyn_run, delta_dir: Path, tiny_samples: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(delta_dir, bad)
    data = bytearray((bad / "delta.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (bad / "delta.safetensors").write_bytes(bytes(data))
    with pytest.raises(DeltaError, match="sha256"):
        read_delta(bad)
    other = write_config(
        SEED_CONFIG,
        tmp_path / "other.config",
        train=tiny_samples / "train",
        eval_=tiny_samples / "eval",
        replace={"num_buckets: 98": "num_buckets: 99"},
    )
    with pytest.raises(DeltaError, match="full bundle"):
        export_delta(
            other, base=dyn_run.base_bundle, checkpoint=dyn_run.checkpoint, out=tmp_path / "x"
        )


def test_delta_against_a_format_1_base_is_the_same(
    dyn_run, delta_dir: Path, tmp_path: Path
) -> None:
    """delta-export reads its base bundle in either naming: against the same checkpoint exported
    in ours (format 1) it finds the same changes as against TorchEasyRec's names (the default)."""
    from shared.bundle import DYNREC_NAMING
    from train.export import export_bundle

    base = export_bundle(
        SEED_CONFIG,
        out_dir=tmp_path / "base-format-1",
        checkpoint=dyn_run.base_checkpoint,
        naming=DYNREC_NAMING,
    )
    assert (base / "model-00000-of-00001.json").is_file()
    out = export_delta(SEED_CONFIG, base=base, checkpoint=dyn_run.checkpoint, out=tmp_path / "d")
    ours, theirs = read_delta(out["path"]), read_delta(delta_dir)
    assert ours.base_digest == manifest_digest(read_bundle(base).manifest) != theirs.base_digest
    assert ours.manifest["tables"] == theirs.manifest["tables"]
    for name, t in theirs.tables.items():
        mine = ours.tables[name].tensors()
        for key, x in t.tensors().items():
            assert torch.equal(x, mine[key]), key
    # the program follows its base: a format 1 base's takes no pairs (format_version 1)
    assert ours.format_version == 1 and ours.program_signature is Signature.PLAIN
    assert ours.dense_program_path is not None
    assert program_signature(ours.dense_program_path) is Signature.PLAIN


def test_delta_program_takes_the_pairs_of_a_format_3_base(dyn_run, delta_dir: Path) -> None:
    """The default base (format 3) has a pair program: so has the delta, format_version 2."""
    assert read_bundle(dyn_run.base_bundle).format_version == PAIR_PROGRAM_FORMAT
    delta = read_delta(delta_dir)
    assert delta.format_version == PAIR_PROGRAM_DELTA_FORMAT
    assert delta.dense_program_path is not None
    assert program_signature(delta.dense_program_path) is delta.program_signature is Signature.PAIRS


def _with_manifest(src: Path, dst: Path, **fields: object) -> Path:
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    (dst / "manifest.json").write_text(json.dumps({**manifest, **fields}))
    return dst


def test_unknown_or_inconsistent_delta_versions_are_refused(
    delta_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(DeltaError, match=r"version 9; expected 'dynrec-delta' version 1 or 2 or 3"):
        read_delta(_with_manifest(delta_dir, tmp_path / "v9", format_version=9))
    with pytest.raises(DeltaError, match="'dense_program' is false"):
        read_delta(_with_manifest(delta_dir, tmp_path / "v2", dense_program=False))
