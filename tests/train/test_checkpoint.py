"""train.checkpoint: a background checkpoint is the state of the step it was taken at, written
as a synchronous one would be, and its failures surface."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from train.checkpoint import BackgroundCheckpoints, load_checkpoint, save_checkpoint
from train.trainer import Trainer, TrainOptions, train_step


def _trainer(tiny: Path, model_dir: Path) -> Trainer:
    from tests.conftest import SEED_CONFIG

    options = TrainOptions(
        config_path=SEED_CONFIG, model_dir=model_dir, train_path=tiny / "train",
        eval_path=tiny / "eval", batch_size=256, num_workers=0, progress_bar=False,
    )  # fmt: skip
    return Trainer(options)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _files(ckpt: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(ckpt)): p.read_bytes()
        for p in sorted(ckpt.rglob("*"))
        if p.is_file() and p.name != "dense.pt"
    }


def test_a_background_checkpoint_is_its_step_while_training_goes_on(
    tiny_samples: Path, tmp_path: Path
) -> None:
    trainer = _trainer(tiny_samples, tmp_path / "m")
    model, opts = trainer.model, trainer.optimizers
    batches = list(trainer.loader.epoch(0))[:4]
    progress = trainer._start_progress()
    for step, batch in enumerate(batches[:2]):
        train_step(model, opts, batch, step)
    progress.step = 2
    want = save_checkpoint(tmp_path / "sync", model, opts, progress)
    writer = BackgroundCheckpoints(tmp_path / "async")
    writer.save(model, opts, progress)
    for step, batch in enumerate(batches[2:], start=2):  # the state moves on meanwhile
        train_step(model, opts, batch, step)
    got = writer.wait()
    writer.close()
    assert got is not None and got.name == "step_2" and (got / "DONE").exists()
    assert _files(got) == _files(want)  # the dynamicemb files, byte for byte
    dense = [torch.load(p / "dense.pt", weights_only=False) for p in (got, want)]
    assert _same(dense[0], dense[1])
    # and it loads as the step-2 state, not the step-4 one the model holds now
    fresh = _trainer(tiny_samples, tmp_path / "other")
    assert load_checkpoint(got, fresh.model, fresh.optimizers).step == 2
    keys, values = fresh.model.sparse.dynamic.export_table("user_id_emb")
    ref = _trainer(tiny_samples, tmp_path / "ref")
    load_checkpoint(want, ref.model, ref.optimizers)
    ref_keys, ref_values = ref.model.sparse.dynamic.export_table("user_id_emb")
    assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)


def test_a_failed_background_write_is_raised_by_the_next_call(
    tiny_samples: Path, tmp_path: Path
) -> None:
    trainer = _trainer(tiny_samples, tmp_path / "m")
    progress = trainer._start_progress()
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "checkpoints").write_text("a file where the checkpoints directory belongs")
    writer = BackgroundCheckpoints(blocked)
    writer.save(trainer.model, trainer.optimizers, progress)  # returns: the thread fails
    with pytest.raises(FileExistsError):
        writer.wait()
    assert writer.wait() is None  # raised once; nothing pending now
    writer.close()
