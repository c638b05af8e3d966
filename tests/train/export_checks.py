"""Helpers of the export tests: a checkpoint saved by ``W`` ranks, a bundle's files, the model
two bundles hold.

:func:`saved_by_ranks`: distributed training (``write_checkpoint`` with a process group) has
rank 0 write ``dense.pt`` and every rank write the dynamic-table files of the keys it owns
(``key % W == rank``) through ``shared.hashtable.checkpoint.save``. Here one process restores
the model of a one-process checkpoint and calls that same ``save`` for each rank in turn: the
files are those ``W`` ranks holding this model state would write (each rank's table holds its
own keys only, which ``save`` filters to), without starting ``W`` gloo processes
(``tests/train/distributed`` exports a checkpoint of real gloo ranks). The model state is the
same, so every export of it must give the same rows, scores and summaries as the one-process
checkpoint's (:func:`assert_same_model`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from shared.bundle.reader import Bundle
from shared.hashtable.checkpoint import collection_paths
from tests.conftest import SEED_CONFIG
from train.checkpoint_rows import key_order
from train.export import restore_model


def saved_by_ranks(ckpt: Path, out: Path, world_size: int, config: Path = SEED_CONFIG) -> Path:
    """``ckpt`` (saved by one process) saved again by ``world_size`` ranks into ``out``
    (a ``step_N`` directory: ``dense.pt``, the tables' ``rank_R.world_size_W`` files, ``DONE``)."""
    model, _progress, _ckpt = restore_model(config, checkpoint=ckpt)
    out.mkdir(parents=True)
    shutil.copyfile(ckpt / "dense.pt", out / "dense.pt")
    for rank in range(world_size):
        model.sparse.dynamic.save(out, collection_paths(model.fs), rank, world_size)
    (out / "DONE").write_text("ok\n")
    return out


def by_ranks(ckpt: Path, root: Path, sizes: tuple[int, ...] = (2, 3)) -> dict[int, Path]:
    """``ckpt`` (saved by one process) by world size: itself as 1, and as each of ``sizes``
    ranks save it (:func:`saved_by_ranks`, under ``root/w<W>/<ckpt's name>``)."""
    out = {1: ckpt}
    for w in sizes:
        out[w] = saved_by_ranks(ckpt, root / f"w{w}" / ckpt.name, w)
    return out


def bundle_files(path: Path) -> dict[str, bytes]:
    """Every file of a bundle or delta; the manifest without its time of writing."""
    out = {p.name: p.read_bytes() for p in path.iterdir() if p.name != "manifest.json"}
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.pop("created_at")
    out["manifest.json"] = json.dumps(manifest, sort_keys=True).encode()
    return out


def assert_same_model(one: Bundle, many: Bundle, world_size: int) -> None:
    """``many`` (exported from ``world_size`` ranks' files) holds the model of ``one`` (from
    one process's): W parts per table (``part_R_W``) that a load joins into the same rows and
    scores by key, the same dense part and program bytes, and summaries but for the files'
    world size."""
    assert one.hash_tables.keys() == many.hash_tables.keys()
    for name, (keys, values) in one.hash_tables.items():
        hot, many_hot = one.hotness(name), many.hotness(name)
        assert hot is not None and many_hot is not None
        many_keys, many_values = many.hash_tables[name]
        order, many_order = key_order(keys), key_order(many_keys)
        assert torch.equal(keys[order], many_keys[many_order]), name
        assert torch.equal(values[order], many_values[many_order]), name
        assert torch.equal(hot[order], many_hot[many_order]), name
        parts = [m for m in many.metadata.values() if _hashmap_table(m) == name]
        assert len(parts) == world_size, name
    assert one.dense_tables.keys() == many.dense_tables.keys()
    assert all(torch.equal(w, many.dense_tables[n]) for n, w in one.dense_tables.items())
    assert one.dense_program_path.read_bytes() == many.dense_program_path.read_bytes()
    summaries = one.manifest["extra"]["table_summaries"]
    want = {n: {**s, "world_size": world_size} for n, s in summaries.items()}
    assert many.manifest["extra"]["table_summaries"] == want


def _hashmap_table(meta: dict[str, Any]) -> str | None:
    """The table of a hash part's entry (``<collection>.<table>.<part>``), None for others."""
    return str(meta["hashmap_key"]).split(".")[-2] if meta["is_hashmap"] else None
