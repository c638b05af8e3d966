"""Training checkpoints: dense state + optimizer state + the hash tables in the dynamicemb layout.

Layout of one checkpoint (written into a temp dir, then renamed, so a crash never leaves a
half-written checkpoint that looks complete)::

    <model_dir>/checkpoints/step_<N>/
        dense.pt             model dense weights, num_buckets tables, optimizer states, progress,
                             the dense EMA (train.dense_ema) when the config has one
        dynamic_tables.json  per dynamic table: collection, dim, score strategy, capacity
        dynamicemb/model.model.embedding_group.emb_impls.__BASE__.ebc/
            user_id_emb_emb_keys.rank_R.world_size_W ...   dynamicemb's files exactly
            user_id_emb_opt_args.json                      (shared.hashtable.checkpoint)
        DONE                 written last

The ``dynamicemb/`` tree is what TorchEasyRec's ``model.ckpt-N/dynamicemb/`` holds (its
``DynamicEmbLoad`` reads it); ``dense.pt`` and ``DONE`` are ours. Checkpoints written before
(``dynamicemb/sparse.dynamic/<table>_keys...``) still load.

Distributed (``world_size > 1``, a process group initialized): rank 0 creates the temp dir and
tells the others its name; every rank writes the dynamic-table files of the keys it owns; after
a barrier rank 0 writes ``dense.pt`` (the replicated state is the same on every rank), ``DONE``
and renames. All ranks must see the same ``model_dir`` (one host, or a shared file system).
Loading under any world size re-shards the dynamic tables by ``key % world_size``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shared.hashtable.checkpoint import TablesSnapshot, collection_paths
from shared.hashtable.checkpoint import save as save_tables
from shared.hashtable.checkpoint_io import CheckpointError
from shared.stale_dirs import remove_stale_dirs
from train.dense_ema import DenseEMA
from train.model.multi_tower_din import MultiTowerDIN

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TZREC_DIR = re.compile(r"^model\.ckpt-(\d+)$")
# save_checkpoint's temp dirs: tempfile.mkdtemp(prefix=".step_N.") adds 8 of [a-z0-9_]
_TEMP_DIR = re.compile(r"^\.step_\d+\.[a-z0-9_]+$")


@dataclass
class Progress:
    """Where training stands: enough to continue on the same data order."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # current epoch
    batch_in_epoch: int = 0  # batches of `epoch` already consumed
    samples: int = 0
    global_batch_size: int = 0  # rows per step over all ranks (0: unknown, older checkpoints)
    # online training (train.stream): the source position committed with this checkpoint (the
    # partition read last and the rows of it trained) and the event time (time_stamp, Unix
    # seconds) of the newest row trained; empty / 0 for batch training
    source_partition: str = ""
    source_row: int = 0
    event_time: int = 0


@dataclass
class Snapshot:
    """Everything a checkpoint holds, copied to the host at one step: written later (by
    :class:`BackgroundCheckpoints`' thread) it is still that step's state."""

    step: int
    dense: dict[str, Any]  # dense.pt's content
    tables: TablesSnapshot  # the dynamic tables' rows (this rank's)
    collections: dict[str, str]  # table -> TorchEasyRec collection directory


def _on_host(obj: Any) -> Any:
    """``obj`` with every tensor copied to the CPU (a copy also where it already is there: the
    training goes on updating the originals in place)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _on_host(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_on_host(v) for v in obj)
    return obj


def snapshot(
    model: MultiTowerDIN,
    optimizers: dict[str, torch.optim.Optimizer],
    progress: Progress,
    dense_ema: DenseEMA | None = None,
) -> Snapshot:
    """The state :func:`write_checkpoint` writes, on the host (device -> host copies)."""
    dense = {
        "dense": model.dense.state_dict(),
        "dense_tables": model.sparse.dense.state_dict(),
        "optimizers": {k: o.state_dict() for k, o in optimizers.items()},
        "progress": asdict(progress),
        "rng": torch.get_rng_state(),
    }
    if dense_ema is not None:
        dense["dense_ema"] = dense_ema.state_dict()
    tables = TablesSnapshot.of(model.sparse.dynamic)
    return Snapshot(progress.step, _on_host(dense), tables, collection_paths(model.fs))


def save_checkpoint(
    model_dir: Path,
    model: MultiTowerDIN,
    optimizers: dict[str, torch.optim.Optimizer],
    progress: Progress,
    *,
    rank: int = 0,
    world_size: int = 1,
    keep: int = 3,
    dense_ema: DenseEMA | None = None,
) -> Path:
    """Write ``checkpoints/step_<N>`` atomically and prune all but the ``keep`` newest.

    With ``world_size > 1`` every rank calls this (a collective; see the module docstring).
    """
    state = snapshot(model, optimizers, progress, dense_ema)
    return write_checkpoint(model_dir, state, rank=rank, world_size=world_size, keep=keep)


def write_checkpoint(
    model_dir: Path, state: Snapshot, *, rank: int = 0, world_size: int = 1, keep: int = 3
) -> Path:
    """:func:`save_checkpoint` of a :func:`snapshot` taken earlier."""
    root = Path(model_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{state.step}"
    main = rank == 0
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{state.step}.", dir=root)) if main else None
    if world_size > 1:
        box = [str(tmp) if main else None]
        dist.broadcast_object_list(box, src=0)
        tmp = Path(str(box[0]))
    assert tmp is not None
    try:
        if main:
            torch.save(state.dense, tmp / "dense.pt")
        save_tables(state.tables, tmp, state.collections, rank=rank, world_size=world_size)
        if world_size > 1:
            dist.barrier()  # every rank's files are in place
        if main:
            (tmp / "DONE").write_text("ok\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if main:
        for old in list_checkpoints(model_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    if world_size > 1:
        dist.barrier()  # nobody reads or prunes before the rename
    return final


class BackgroundCheckpoints:
    """Checkpoints of one process written by a thread, as ``torch.distributed.checkpoint``'s
    ``async_save``: :meth:`save` copies the state to the host (:func:`snapshot`, the one part
    that must see this step's tensors) and returns; the files, ``DONE`` and the rename follow in
    the thread while training goes on (on the H200 the files took 0.25 s a checkpoint of the
    seed config, fsync included, 2026-12-04). One at a time: a save first waits for the one
    before. A failed write is raised by the next :meth:`save` or :meth:`wait`; a crash before
    the rename leaves only a temp dir (removed at the next start), never a checkpoint without
    ``DONE``. Distributed checkpoints are collectives: they stay :func:`save_checkpoint`.

    Example::

        writer = BackgroundCheckpoints(model_dir)
        writer.save(model, optimizers, progress)  # returns after the device -> host copies
        ...                                       # train on
        path = writer.wait()                      # the checkpoint is complete
    """

    def __init__(self, model_dir: Path, *, keep: int = 3) -> None:
        self.model_dir, self.keep = Path(model_dir), keep
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending: Future[Path] | None = None

    def save(
        self,
        model: MultiTowerDIN,
        optimizers: dict[str, torch.optim.Optimizer],
        progress: Progress,
        dense_ema: DenseEMA | None = None,
    ) -> None:
        self.wait()
        state = snapshot(model, optimizers, progress, dense_ema)
        self._pending = self._pool.submit(write_checkpoint, self.model_dir, state, keep=self.keep)

    def wait(self) -> Path | None:
        """The last checkpoint's path once it is complete (None: none pending); raises its
        error if its write failed."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        """:meth:`wait`, then end the thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


def remove_stale_temp_checkpoints(model_dir: Path) -> list[Path]:
    """Remove the ``checkpoints/.step_N.*`` temp dirs that killed runs left (older than this
    process; :mod:`shared.stale_dirs`); call it once at the start of training, on rank 0."""
    return remove_stale_dirs(Path(model_dir) / "checkpoints", _TEMP_DIR)


def list_checkpoints(model_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(model_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / "DONE").exists()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(model_dir: Path) -> Path | None:
    found = list_checkpoints(model_dir)
    return found[-1] if found else None


def foreign_checkpoints(model_dir: Path) -> list[Path]:
    """TorchEasyRec checkpoints of a model dir (``model.ckpt-N``), oldest first."""
    root = Path(model_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _TZREC_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def load_checkpoint(
    path: Path,
    model: MultiTowerDIN,
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    *,
    rank: int = 0,
    world_size: int = 1,
    dense_ema: DenseEMA | None = None,
    ema_weights: bool = False,
    dynamic_tables: bool = True,
) -> Progress:
    """Restore ``model`` (and optimizers, and ``dense_ema``'s average) from ``path``; returns
    the saved progress. ``ema_weights``: the dense part takes the saved dense EMA's averages
    instead of its trained values (evaluation and export: :mod:`train.dense_ema`).
    ``dynamic_tables=False`` leaves the dynamic tables empty: for readers that take the tables'
    rows from the files (:func:`train.checkpoint_rows.read_rows`), inserting every key into a
    hash table only to read it back is most of a restore (15 of 16 s at the full config's
    capacities on CPU)."""
    path = Path(path)
    if not (path / "DONE").exists():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no DONE marker); pass a step_N directory "
            "that holds DONE, or leave --checkpoint out for the newest complete one"
        )
    state = torch.load(path / "dense.pt", map_location="cpu", weights_only=False)
    saved_ema = state.get("dense_ema")
    if ema_weights and saved_ema is None:
        raise CheckpointError(
            f"{path} holds no dense EMA (it was trained without "
            "train_config.dense_optimizer.ema); set use_dense_ema: false in the config's "
            "eval_config / export_config to use its trained weights"
        )
    averages = saved_ema["params"] if ema_weights else {}
    model.dense.load_state_dict({**state["dense"], **averages})
    if dense_ema is not None and saved_ema is not None:
        dense_ema.load_state_dict(saved_ema)
    elif dense_ema is not None:
        log.info("%s holds no dense EMA: the average starts at the next step", path)
    model.sparse.dense.load_state_dict(state["dense_tables"])
    if dynamic_tables and model.fs.dynamic_tables:  # every table (a resume continues them all)
        model.sparse.dynamic.load(
            path, collection_paths(model.fs), rank=rank, world_size=world_size
        )
    if optimizers is not None:
        for name, opt in optimizers.items():
            opt.load_state_dict(state["optimizers"][name])
    torch.set_rng_state(state["rng"])
    return Progress(**state["progress"])
