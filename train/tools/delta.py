"""``delta-export``: the rows of a checkpoint that changed since a base bundle, as a delta.

The delta (:mod:`shared.delta` for the format) holds what a full export of the checkpoint would
hold minus what the base bundle already has: for dynamic tables the new keys, the keys whose row
changed and the keys evicted since; for num_buckets tables the changed rows; the dense program
only when its weights changed, with the pair inputs when the base bundle's program takes them
(format 3: the delta is then of format version 2, which servers that predate pair programs
refuse, :mod:`shared.delta`). Deltas are relative to their base bundle, so a server applies any
of them to its base in any order (:mod:`serve.admin`); publish a new full bundle when a
delta gets close to its size. The config must be the one the base was exported with (checked by
digest): a changed config (features, dims, towers) needs a full bundle. Example::

    report = export_delta(cfg, base=Path("exports/v1"), model_dir=Path("runs/dyn"),
                          out=Path("exports/v1-deltas/step-2000"))
    report["tables"]["user_id_emb"]   # {"new": 812, "updated": 30911, "evicted": 17, ...}
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from shared.bundle import read_bundle
from shared.bundle.naming import program_signature
from shared.config import config_digest, load_config
from shared.delta import DeltaError, diff_tables, write_delta
from shared.delta_reader import read_delta
from shared.hashtable.summary import checkpoint_summaries
from train.export import restore_model
from train.model.dense_arch import example_inputs, export_dense_arch
from train.model.multi_tower_din import MultiTowerDIN


def program_changed(base_program: Path, model: MultiTowerDIN) -> bool:
    """Whether the dense weights of ``model`` differ (bitwise) from the base ``dense.pt2``."""
    ep = torch.export.load(base_program)
    old = {**ep.state_dict, **ep.constants}
    new = model.dense.state_dict()
    if set(new) - set(old):
        return True
    return any(not torch.equal(old[k], v.detach().cpu()) for k, v in new.items())


def export_delta(
    config_path: Path,
    *,
    base: Path,
    out: Path,
    model_dir: Path | None = None,
    checkpoint: Path | None = None,
    delta_id: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the delta of ``checkpoint`` (default: the newest in ``model_dir``) against the
    bundle ``base`` to ``out``; returns the delta's manifest plus ``path`` and ``bytes``."""
    config = load_config(config_path)
    digest = config_digest(config)
    base_bundle = read_bundle(base)
    if base_bundle.config_digest != digest:
        raise DeltaError(
            f"{base} was exported with another config (digest {base_bundle.config_digest[:12]}, "
            f"{config_path}: {digest[:12]}); a config change needs a full bundle "
            "(python -m train export)"
        )
    model, progress, ckpt = restore_model(
        config_path, model_dir=model_dir, checkpoint=checkpoint, device="cpu"
    )
    dense = {n: w.detach().cpu() for n, w in model.sparse.dense_table_weights().items()}
    hashed = {t.name: model.sparse.dynamic.export_table(t.name) for t in model.fs.dynamic_tables}
    tables = diff_tables(base_bundle.dense_tables, base_bundle.hash_tables, dense, hashed)
    summaries = checkpoint_summaries(ckpt)
    target = f"step-{progress.step}"
    with tempfile.TemporaryDirectory() as tmp:
        program: Path | None = None
        if program_changed(base_bundle.dense_program_path, model):
            program = Path(tmp) / "dense.pt2"
            # the base's program signature: a server runs either, but graphs need the pairs
            pairs = program_signature(base_bundle.format_version).takes_pairs
            example = example_inputs(model.dense, pairs=pairs)
            torch.export.save(export_dense_arch(model.dense, example), program)
        path = write_delta(
            out,
            tables=tables,
            base_manifest=base_bundle.manifest,
            delta_id=delta_id or target,
            target_version=target,
            config_digest=digest,
            dense_program_path=program,
            table_summaries=summaries,
            overwrite=overwrite,
            event_time=progress.event_time or None,
        )
    manifest = read_delta(path, verify_checksums=False).manifest
    size = sum(f.stat().st_size for f in path.iterdir())
    return {"path": str(path), "bytes": size, "checkpoint": str(ckpt), **manifest}
