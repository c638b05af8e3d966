"""Checkpoint → serving bundle (RTP style), and evaluation of a stored checkpoint.

The bundle holds the num_buckets tables as dense matrices, the dynamic tables as is_hashmap
key/value tensors (admitted keys only), fg.json, and the dense part as a ``torch.export`` program
with jagged inputs (see :mod:`shared.bundle` for the layout, :mod:`train.model.dense_arch` for the
program's signature).

The dynamic tables are read from the checkpoint's per-rank files as they are: a checkpoint saved
by ``W`` ranks gives ``W`` parts per table (``<collection>.<table>.keys/part_R_W``, rank ``R``'s
keys), one saved by a single process gives ``part_0_1``; serving joins the parts either way.
Files and tensors are named as TorchEasyRec's RTP export names them (``naming``, default
``TZREC_NAMING``: each dynamic table under its checkpoint collection directory,
:func:`shared.hashtable.checkpoint.collection_paths`), with a dense program that takes the
(candidate, element) pairs as inputs: bundle format 3 (:mod:`shared.bundle.naming`);
``DYNREC_NAMING`` writes bundle format 1, program without the pairs, for servers that predate
format 2.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shared.bundle import DYNREC_NAMING, TZREC_NAMING, BundleNaming, write_bundle
from shared.bundle.writer import check_destination
from shared.config import config_digest, load_config
from shared.dense_inputs import program_input_names, signature_of
from shared.features import build_feature_set
from shared.hashtable.checkpoint import collection_paths
from train.checkpoint import Progress, latest_checkpoint, load_checkpoint
from train.checkpoint_rows import read_rows
from train.data.loader import Loader
from train.dense_ema import use_dense_ema
from train.export_cache import ExportCache
from train.model.multi_tower_din import MultiTowerDIN

if TYPE_CHECKING:  # imported where used: see evaluate_checkpoint
    from train.evaluate import EvalResult


def restore_model(
    config_path: Path,
    *,
    model_dir: Path | None = None,
    checkpoint: Path | None = None,
    device: str = "cpu",
    for_eval: bool = False,
    dynamic_tables: bool = True,
) -> tuple[MultiTowerDIN, Progress, Path]:
    """The model of ``config_path`` with the weights of ``checkpoint`` (default: the newest):
    the dense EMA's averages where the config's ``export_config`` (``eval_config`` with
    ``for_eval``) uses them (:func:`train.dense_ema.use_dense_ema`). ``dynamic_tables=False``:
    the dynamic tables stay empty (exports read their rows from the checkpoint's files,
    :func:`train.checkpoint_rows.read_rows`; :func:`train.checkpoint.load_checkpoint`)."""
    config = load_config(config_path)
    which = config.eval_config if for_eval else config.export_config  # unset: the default
    ema_weights = use_dense_ema(which, config.train_config)
    fs = build_feature_set(config)
    model_dir = Path(model_dir or config.model_dir)
    ckpt = Path(checkpoint) if checkpoint else latest_checkpoint(model_dir)
    if ckpt is None:
        raise FileNotFoundError(
            f"no complete checkpoint under {model_dir}/checkpoints; train first or pass --checkpoint"
        )
    model = MultiTowerDIN.from_config(config, fs, device=device)
    progress = load_checkpoint(ckpt, model, ema_weights=ema_weights, dynamic_tables=dynamic_tables)
    model.eval()
    return model, progress, ckpt


def export_bundle(
    config_path: Path,
    *,
    out_dir: Path,
    model_dir: Path | None = None,
    checkpoint: Path | None = None,
    version: str | None = None,
    overwrite: bool = False,
    naming: BundleNaming = TZREC_NAMING,
    cache: ExportCache | None = None,
) -> Path:
    """Write the serving bundle of a checkpoint to ``out_dir`` (atomically), its files and
    tensors named by ``naming`` (:mod:`shared.bundle.naming`). ``cache``: the traced dense
    program of an earlier export of this process (:mod:`train.export_cache`); None: traced."""
    config = load_config(config_path)
    check_destination(out_dir, overwrite=overwrite)  # before the minutes of restore and export
    # the dynamic tables' rows come from the checkpoint's files (read_rows), not the model
    model, progress, ckpt = restore_model(
        config_path, model_dir=model_dir, checkpoint=checkpoint, device="cpu",
        dynamic_tables=False,
    )  # fmt: skip
    fs = model.fs
    dense_tables = {
        name: w.detach().cpu().contiguous()
        for name, w in model.sparse.dense_table_weights().items()
    }
    rows = read_rows(ckpt, fs)  # each table file read once: the rows and the summaries
    # a part per saving rank, each row with its score (the hotness of serve.tiers)
    hash_tables = {t.name: rows.parts(t.name) for t in fs.dynamic_tables}
    # format 1 servers predate the pair inputs: their program sizes the pairs itself
    pairs = naming.format_version != DYNREC_NAMING.format_version
    cache = cache or ExportCache()
    program = cache.dense_program(model.dense, pairs=pairs)
    with tempfile.TemporaryDirectory() as tmp:
        program_path = Path(tmp) / "dense.pt2"
        torch.export.save(program, program_path)
        path = write_bundle(
            out_dir,
            dense_tables=dense_tables,
            hash_tables=hash_tables,
            feature_set=fs,
            dense_program_path=program_path,
            config_digest=config_digest(config),
            version=version or f"step-{progress.step}",
            # admission counters stay in training (the rows' scores go as their hotness):
            # serving shows this summary
            extra={
                "table_summaries": rows.summaries,
                # online training: the newest trained row's time (freshness, serve.freshness)
                **({"event_time": progress.event_time} if progress.event_time else {}),
            },
            overwrite=overwrite,
            naming=naming.for_tables(collection_paths(fs)),  # tzrec: the checkpoint's dirs
            program_inputs=signature_of(program_input_names(program)),  # what a load tells
        )
    cache.wrote_bundle(path, program)  # the deltas against it compare with these weights
    return path


def evaluate_checkpoint(
    config_path: Path,
    *,
    model_dir: Path | None = None,
    checkpoint: Path | None = None,
    train_path: Path | None = None,
    eval_path: Path | None = None,
    device: str = "cpu",
    batch_size: int | None = None,
    predictions: Path | None = None,
) -> EvalResult:
    """The metrics of a checkpoint on the eval samples (head/tail where the training samples
    are there), and with ``predictions`` every row's prediction in that Parquet file
    (:func:`train.evaluate.write_predictions`).

    :mod:`train.evaluate` is imported here, not with this module: it brings torchmetrics (and
    matplotlib through it), about 0.5 s of a process start, which every exporting process (the
    stream publisher's export process, ``python -m train export``) paid without evaluating."""
    from train.evaluate import UserCounts, evaluate

    config = load_config(config_path)
    model, _progress, _ckpt = restore_model(
        config_path, model_dir=model_dir, checkpoint=checkpoint, device=device, for_eval=True
    )
    loader = Loader(
        Path(eval_path or config.eval_input_path),
        model.fs,
        batch_size=batch_size or config.data_config.batch_size,
        shuffle=False,
        seed=0,
        num_workers=0,
        pin_memory=False,
    )
    train_path = Path(train_path or config.train_input_path)
    counts = UserCounts.from_samples(train_path) if train_path.exists() else None
    return evaluate(
        model, loader.epoch(0), device=device, user_counts=counts, predictions=predictions
    )
