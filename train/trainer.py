"""The training loop: sparse Adagrad for every embedding, Adam for dense layers, periodic eval,
atomic checkpoints, resume to the same result, a progress bar (plain lines in a log,
:mod:`shared.progress`), JSON-lines metrics and a plot.

With ``TrainOptions.dist`` (a ``torchrun`` launch, see :mod:`train.distributed`) the same loop runs
on every rank: each reads its part of every global batch, the dynamic tables are sharded ROW_WISE
(:class:`~train.distributed.sharded_dynamic.ShardedDynamicEmbedding`), the rest is replicated
(:class:`~train.distributed.replicated.GradSync`); rank 0 writes metrics, dense checkpoint state
and the plot, every rank writes its own dynamic-table files.

Single-process CUDA training replays the dense forward+backward from CUDA graphs
(:mod:`train.model.graphed`, ``TrainOptions.cuda_graphs``, on by default there); CPU and
distributed runs stay eager. The graphs live beside the model, never in it: checkpoints and
the exported program are the same either way.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from protos import pipeline_pb2
from shared.batch import Batch
from shared.config import load_config
from shared.features import build_feature_set
from shared.hashtable import host_memory
from shared.progress import ProgressLine
from train.checkpoint import (
    BackgroundCheckpoints,
    Progress,
    foreign_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    remove_stale_temp_checkpoints,
    save_checkpoint,
)
from train.data.loader import MESSAGE_ROWS, Loader
from train.data.prefetch import prefetch_to_device, with_next
from train.dense_ema import DenseEMA, use_dense_ema
from train.distributed.comm import CommStats
from train.distributed.env import DistEnv
from train.distributed.replicated import GradSync
from train.distributed.sharded_dynamic import ShardedDynamicEmbedding
from train.evaluate import EvalResult, UserCounts, evaluate
from train.fine_tune import load_weights
from train.lr_schedule import Schedule, schedule_of
from train.metrics_log import MetricsLog
from train.model.fused_tables import keep_per_table_state
from train.model.graphed import DenseArchGraphs
from train.model.multi_tower_din import MultiTowerDIN, sparse_adagrad

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class TrainOptions:
    """Run options that are not part of the model config (paths, device, limits)."""

    config_path: Path
    model_dir: Path | None = None  # default: the config's model_dir
    train_path: Path | None = None  # default: the config's train_input_path
    eval_path: Path | None = None  # default: the config's eval_input_path
    device: str = "cpu"
    batch_size: int | None = None  # default: data_config.batch_size
    num_workers: int | None = None  # default: data_config.num_workers
    # rows of whole batches a loader worker sends at once (train.data.loader.MESSAGE_ROWS)
    message_rows: int = MESSAGE_ROWS
    max_steps: int | None = None  # stop early (tests, smoke runs)
    eval_every: int | None = None  # steps between evaluations; None: at the end only
    eval_max_batches: int | None = None
    checkpoint_every: int | None = None  # default: train_config.save_checkpoints_steps
    log_every: int | None = None  # default: train_config.log_step_count_steps
    resume: bool = False
    # not resuming: start from these weights (checkpoint, model dir, init-ckpt; train.fine_tune)
    fine_tune_checkpoint: Path | None = None
    # the dynamic tables to take from it (None: all, or an init checkpoint's; others start empty)
    fine_tune_tables: tuple[str, ...] | None = None
    seed: int = 0
    progress_bar: bool = True
    dist: DistEnv | None = None  # set under torchrun (train.distributed.env.init_from_env)
    # dense forward+backward through CUDA graphs (train.model.graphed); None: CUDA_GRAPHS_DEFAULT.
    # Only single-process CUDA training uses them (CPU and distributed runs are always eager).
    cuda_graphs: bool | None = None
    # device memory (GiB) the dynamic tables may use; None: train_config.table_hbm_budget_gib
    hbm_budget_gib: float | None = None
    # CACHING tables on the static step (CUDA graphs): the next batch's rows prefetched beside
    # the step (shared.hashtable.embedding.DynamicEmbeddingCollection.use_static_step); off: the
    # step reads its misses itself
    static_prefetch: bool = False
    # how CACHING tables' host tiers are made on CUDA (shared.hashtable.host_memory.KINDS):
    # "register" (cudaHostRegister) or "driver" (the CUDA driver's cuMemCreate host memory)
    host_memory: str = "register"
    # CACHING tables on the static step (CUDA graphs): this many host threads move their rows
    # between the tiers (the host-node fill and the write-backs by cores beside the step,
    # StaticCacheLines.move_rows_with_cores); None: the device's reads and writes
    cache_row_threads: int | None = None


def _refuse_tier_options(options: TrainOptions, device: torch.device) -> None:
    """ValueError naming the option where the cached tables' host memory or row threads ask
    for what this run cannot do (before any loader worker starts)."""
    if options.host_memory not in host_memory.KINDS or (
        options.host_memory != "register" and device.type != "cuda"
    ):
        raise ValueError(
            f"TrainOptions.host_memory={options.host_memory!r}: give one of "
            f"{', '.join(host_memory.KINDS)}; 'driver' is made by the CUDA driver, so train "
            f"on a CUDA device (not {device})"
        )
    threads, dist = options.cache_row_threads, options.dist is not None
    if threads is not None and (
        threads < 1 or device.type != "cuda" or options.cuda_graphs is False or dist
    ):
        raise ValueError(
            f"TrainOptions.cache_row_threads={threads}: host threads (>= 1) that move cached "
            "tables' rows in the static step, which runs only in single-process CUDA training "
            f"with CUDA graphs (device {device}, cuda_graphs {options.cuda_graphs}, "
            f"distributed {dist})"
        )


# CUDA graphs for the dense part when TrainOptions.cuda_graphs is None: on (single-process CUDA)
CUDA_GRAPHS_DEFAULT = True


@dataclass
class LoopTimes:
    """Seconds of the training loop spent outside the steps: ``input_wait`` (blocked on the
    next batch: the loader is the bound when this is a large share), ``log`` (the ``train``
    records: the loss and the tables' statistics read from the device), ``checkpoint`` and
    ``eval`` (on their cadences, inside the loop), ``row_prefetch`` (CACHING tables: the next
    batch's rows brought to the device tier, ``SparseArch.prefetch``; 0 without such tables)."""

    seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(
            ("input_wait", "log", "checkpoint", "eval", "row_prefetch"), 0.0
        )
    )

    def timed(self, what: str, call: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        try:
            return call()
        finally:
            self.seconds[what] += time.perf_counter() - t0


@dataclass
class TrainResult:
    progress: Progress
    final_eval: EvalResult | None
    train_seconds: float
    samples_per_second: float
    checkpoint: Path
    history: list[dict] = field(default_factory=list)
    loop_times: LoopTimes = field(default_factory=LoopTimes)


@dataclass
class _LossWindow:
    """The training loss since the last ``train`` record, summed on the device (no host sync
    per step), and when and at how many samples that window opened."""

    loss_sum: torch.Tensor
    steps: int
    since: float  # time.perf_counter()
    samples: int
    loop: dict[str, float] = field(default_factory=dict)  # LoopTimes.seconds when it opened

    @classmethod
    def open(cls, samples: int, device: torch.device) -> _LossWindow:
        return cls(torch.zeros((), device=device), 0, time.perf_counter(), samples)

    def add(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss
        self.steps += 1

    def restart(self, now: float, samples: int, loop: dict[str, float]) -> None:
        self.loss_sum.zero_()
        self.steps = 0
        self.since, self.samples, self.loop = now, samples, dict(loop)

    def loop_seconds(self, loop: dict[str, float]) -> dict[str, float]:
        """The loop's time outside the steps since this window opened (:class:`LoopTimes`)."""
        return {k: v - self.loop.get(k, 0.0) for k, v in loop.items()}


def _amp_context(mode: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast for the dense MLPs on GPU only; embeddings stay fp32."""
    if not mode or device.type != "cuda":
        return contextlib.nullcontext()
    dtype = {"BF16": torch.bfloat16, "FP16": torch.float16}.get(mode.upper())
    if dtype is None:
        raise ValueError(f"train_config.mixed_precision: {mode!r} is not '', BF16 or FP16")
    return torch.autocast("cuda", dtype=dtype)


def build_optimizers(
    model: MultiTowerDIN, config: pipeline_pb2.TrainConfig
) -> dict[str, torch.optim.Optimizer]:
    """Adam (dense layers) and Adagrad (num_buckets tables: one parameter per fused dim, one per
    large table; its saved state stays one entry per table). Dynamic tables
    are updated inside their backward by the hash-table core with the same Adagrad settings."""
    dense_cfg = config.dense_optimizer
    if dense_cfg.WhichOneof("optimizer") not in (None, "adam_optimizer"):
        raise ValueError("train_config.dense_optimizer: only adam_optimizer is implemented")
    adam = dense_cfg.adam_optimizer
    ada = sparse_adagrad(config)
    params = list(model.dense.parameters())
    # on CUDA one fused kernel updates every dense parameter (foreach: several per tensor list)
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    sparse = torch.optim.Adagrad(
        list(model.sparse.dense_parameters()),
        lr=ada.lr,
        eps=ada.eps,
        initial_accumulator_value=ada.initial_accumulator_value,
    )
    keep_per_table_state(sparse, model.sparse.dense)  # saved state: one entry per table
    return {
        "dense": torch.optim.Adam(
            params,
            lr=adam.lr,
            betas=(adam.beta1, adam.beta2),
            eps=adam.eps,
            weight_decay=adam.weight_decay,
            fused=fused or None,
        ),
        "sparse": sparse,
    }


def learning_rate_schedules(config: pipeline_pb2.TrainConfig) -> dict[str, Schedule]:
    """The schedules of :func:`build_optimizers`' optimizers (``train_config``'s
    ``learning_rate`` oneofs, :mod:`train.lr_schedule`); ValueError naming a bad field."""
    return {
        "sparse": schedule_of(
            config.sparse_optimizer, sparse_adagrad(config).lr, "train_config.sparse_optimizer"
        ),
        "dense": schedule_of(
            config.dense_optimizer,
            config.dense_optimizer.adam_optimizer.lr,
            "train_config.dense_optimizer",
        ),
    }


def set_learning_rates(
    model: MultiTowerDIN,
    optimizers: dict[str, torch.optim.Optimizer],
    schedules: dict[str, Schedule],
    step: int,
    epoch: int,
) -> dict[str, float]:
    """Each optimizer's rate for the step after ``step`` steps (in ``epoch``), the sparse one's
    on the dynamic tables too; returns them (by optimizer name)."""
    rates = {}
    for name, schedule in schedules.items():
        lr = rates[name] = schedule.rate(step, epoch)
        if schedule.constant:
            continue
        for group in optimizers[name].param_groups:
            group["lr"] = lr
        if name == "sparse":
            model.sparse.dynamic.set_learning_rate(lr)
    return rates


def train_step(
    model: MultiTowerDIN,
    optimizers: dict[str, torch.optim.Optimizer],
    batch: Batch,
    step: int,
    amp: str = "",
    *,
    sync: GradSync | None = None,
    global_rows: int | None = None,
    graphs: DenseArchGraphs | None = None,
    ema: DenseEMA | None = None,
) -> torch.Tensor:
    """One optimizer step; returns the loss as a device tensor (no host sync).

    Distributed (``sync``): the loss is this rank's share of the mean over the ``global_rows``
    rows of all ranks (the shares sum to the global mean) and gradients are summed over ranks.
    ``graphs`` (built on ``model.dense``; ignored with ``sync``) runs the dense forward+backward
    through CUDA graphs where it can (:mod:`train.model.graphed`), else eagerly. ``ema``: the
    dense EMA, updated after the optimizer steps (:mod:`train.dense_ema`; no host sync).
    """
    labels = batch.labels
    if labels is None:
        raise ValueError(
            "train_step needs a labelled batch (batch.labels is None): train on data with labels"
        )
    device = batch.user_index.device
    model.sparse.dynamic.set_step(step)
    for opt in optimizers.values():
        opt.zero_grad(set_to_none=True)
    inputs: dict[str, torch.Tensor | None] = dict(model.dense_inputs(batch))  # fp32 embeddings
    if batch.rows_are_users:  # the DIN's path without a host sync (train.model.din)
        inputs["user_index"] = None
    dense: Callable[..., torch.Tensor] = model.dense if sync is None else sync.dense
    if graphs is not None and sync is None:
        dense = graphs  # same call signature; falls back to model.dense itself when it must
    with _amp_context(amp, device):
        logits = dense(**inputs)  # [B]
    if sync is None:
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), labels)
    else:
        loss = sync.loss(logits.float(), labels, global_rows or batch.batch_size)
    loss.backward()  # dynamic tables: fused Adagrad happens here
    if sync is not None:
        sync.all_reduce_table_grads()
    for opt in optimizers.values():
        opt.step()
    if ema is not None:
        ema.update()
    return loss.detach()


def cuda_graphs_for(
    model: MultiTowerDIN, *, static_prefetch: bool = False, cache_row_threads: int | None = None
) -> DenseArchGraphs:
    """The CUDA graphs of a single-process CUDA training step: the dense part's (returned, to
    keep beside the model and pass to :func:`train_step`) and the dynamic tables' static step
    (switched on in the model: :mod:`shared.hashtable.static_step`, taken by a storage once its
    table is at max capacity, eager before). The tables take their max capacity now, so that
    the static step runs from the first step (growing there took 128 eager steps, about 0.8 s
    of the seed config's full-data epoch on the H200). ``static_prefetch``: CACHING tables
    prefetch the next batch's rows beside the step (``use_static_step(prefetch=True)``);
    ``cache_row_threads``: that many host threads move their rows between the tiers
    (``move_cache_rows_with_cores``)."""
    model.sparse.dynamic.use_static_step(capture=True, prefetch=static_prefetch)
    model.sparse.dynamic.reserve_max_capacity()
    if cache_row_threads is not None:  # after the reservation: the tiers hold their rows now
        names = model.sparse.dynamic.move_cache_rows_with_cores(cache_row_threads)
        log.info("cached storages %s: rows moved between the tiers by %d host threads",
                 names, cache_row_threads)  # fmt: skip
    # a shape is captured at its second step: the partial last batches of an epoch (one per
    # loader stream, each seen once) cost a capture each at the first (H200, 2026-12-04)
    return DenseArchGraphs(model.dense, capture_after=2)


class Trainer:
    def __init__(self, options: TrainOptions) -> None:
        self.options = options
        self.config = load_config(options.config_path)
        self.fs = build_feature_set(self.config)
        cfg = self.config
        self.model_dir = Path(options.model_dir or cfg.model_dir or "experiments/run")
        self.train_path = Path(options.train_path or cfg.train_input_path)
        self.eval_path = Path(options.eval_path or cfg.eval_input_path)
        self.dist = options.dist
        self.rank, self.world_size = (self.dist.rank, self.dist.world_size) if self.dist else (0, 1)
        self.device = self.dist.device if self.dist else torch.device(options.device)
        _refuse_tier_options(options, self.device)
        self.batch_size = options.batch_size or cfg.data_config.batch_size
        workers = (
            cfg.data_config.num_workers if options.num_workers is None else options.num_workers
        )
        self.num_workers = workers
        tc = cfg.train_config
        self.schedules = learning_rate_schedules(tc)  # a bad one fails before any data is read
        self.checkpoint_every = options.checkpoint_every or tc.save_checkpoints_steps
        self.log_every = options.log_every or tc.log_step_count_steps
        self.amp = tc.mixed_precision
        self.loader = Loader(
            self.train_path,
            self.fs,
            batch_size=self.batch_size,
            shuffle=cfg.data_config.shuffle,
            seed=options.seed,
            num_workers=workers,
            pin_memory=self.device.type == "cuda",
            drop_last=cfg.data_config.drop_remainder,
            rank=self.rank,
            world_size=self.world_size,
            message_rows=options.message_rows,
        )
        # a fresh run reads from epoch 0's first batch: its workers start now, before the model
        # is built (and CUDA initialized), so that they read their first batches meanwhile
        self._started: tuple[int, Iterator[Batch]] | None = (
            None if options.resume else (0, self.loader.epoch(0))
        )
        host_memory.use(options.host_memory)  # the tables built next make their host tiers so
        self.model = MultiTowerDIN.from_config(
            cfg,
            self.fs,
            device=self.device,
            seed=options.seed,
            hbm_budget_gib=options.hbm_budget_gib,
        )
        self.comm: CommStats | None = None
        self.sync: GradSync | None = None
        if self.dist is not None:
            self.comm = CommStats(self.device)
            local = self.model.sparse.dynamic
            # same interface as the local collection (forward, set_step, stats, save, load)
            sharded = ShardedDynamicEmbedding(local, self.dist, self.comm)
            self.model.sparse.dynamic = sharded  # type: ignore[assignment]
            self.sync = GradSync(self.model, self.dist)
        self.optimizers = build_optimizers(self.model, tc)
        self.rates: dict[str, float] = {}  # of the last step (the train records show them)
        self.dense_ema = DenseEMA.of_config(self.model.dense, tc)
        self.eval_with_ema = self.dense_ema is not None and use_dense_ema(cfg.eval_config, tc)
        self.graphs = self._cuda_graphs()
        # in-loop checkpoints of a single process are written by a thread (distributed ones
        # are collectives: written in the loop)
        self._writer = BackgroundCheckpoints(self.model_dir) if self.dist is None else None
        # rank 0 writes the metrics; the others keep their records in memory only
        self.metrics = MetricsLog(self.model_dir / "metrics.jsonl" if self.rank == 0 else None)

    def _cuda_graphs(self) -> DenseArchGraphs | None:
        """CUDA graphs for the step (the dense part's, returned, and the dynamic tables' static
        step: :func:`cuda_graphs_for`): single-process CUDA training only (DDP-wrapped dense
        stays eager; its gradient hooks cannot run inside a replayed graph)."""
        want = self.options.cuda_graphs
        if want is None:
            want = CUDA_GRAPHS_DEFAULT
        if not want:
            return None
        if self.device.type != "cuda":
            if self.options.cuda_graphs:
                log.info("cuda_graphs: device %s is not CUDA; the dense part runs eagerly",
                         self.device)  # fmt: skip
            return None
        if self.dist is not None:
            log.info("cuda_graphs: off under distributed training (DDP-wrapped dense part)")
            return None
        return cuda_graphs_for(self.model, static_prefetch=self.options.static_prefetch,
                               cache_row_threads=self.options.cache_row_threads)  # fmt: skip

    def _eval_batches(self) -> Iterator[Batch]:
        loader = Loader(
            self.eval_path,
            self.fs,
            batch_size=self.batch_size,
            shuffle=False,
            seed=0,
            num_workers=min(self.num_workers, 1),
            pin_memory=False,
            rank=self.rank,
            world_size=self.world_size,
        )
        for i, batch in enumerate(loader.epoch(0)):
            if self.options.eval_max_batches is not None and i >= self.options.eval_max_batches:
                return
            yield batch

    def run_eval(self, user_counts: UserCounts | None, step: int) -> EvalResult:
        """Evaluate (with the dense EMA's averages where the config says: train.dense_ema)."""
        ema = self.dense_ema if self.eval_with_ema else None
        with ema.average_parameters() if ema is not None else contextlib.nullcontext():
            result = evaluate(
                self.model,
                self._eval_batches(),
                device=self.device,
                user_counts=user_counts,
                dist=self.dist,
            )
        self.metrics.write({"kind": "eval", "step": step, **result.to_dict()})
        log.info("eval step %d: %s", step, json.dumps(result.to_dict()))
        return result

    def _table_stats(self) -> dict[str, dict[str, float]]:
        """Dynamic-table statistics of the whole table (a collective when distributed)."""
        dyn = self.model.sparse.dynamic
        if isinstance(dyn, ShardedDynamicEmbedding):
            assert self.dist is not None
            return dyn.global_stats(self.dist)
        return dyn.stats()

    def _peak_memory(self) -> float:
        """Peak bytes of this process (CUDA: allocated tensors; CPU: max RSS), max over ranks."""
        if self.device.type == "cuda":
            peak = float(torch.cuda.max_memory_allocated(self.device))
        else:
            peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        return self.dist.all_reduce_max([peak])[0] if self.dist else peak

    def _resume(self, progress: Progress) -> Progress:
        ckpt = latest_checkpoint(self.model_dir)
        if ckpt is None:
            foreign = foreign_checkpoints(self.model_dir)
            if foreign:
                raise ValueError(
                    f"--resume: {self.model_dir} has no dynrec checkpoint (checkpoints/step_N "
                    f"with DONE) but TorchEasyRec checkpoints ({', '.join(p.name for p in foreign)})"
                    ", whose dense state (torch DCP) a resume cannot continue. Start from their "
                    f"dynamic tables with --fine-tune-checkpoint {foreign[-1]} (without --resume) "
                    "and a new --model-dir"
                )
            partial = sorted((self.model_dir / "checkpoints").glob("step_*"))
            if partial:
                log.warning("--resume: %s holds only incomplete checkpoints (no DONE): %s; "
                            "training starts at step 0", self.model_dir,
                            ", ".join(p.name for p in partial))  # fmt: skip
            else:
                log.info("--resume: no checkpoint in %s yet; training starts at step 0",
                         self.model_dir)  # fmt: skip
            return progress
        progress = load_checkpoint(
            ckpt, self.model, self.optimizers, rank=self.rank, world_size=self.world_size,
            dense_ema=self.dense_ema,
        )  # fmt: skip
        log.info("resumed from %s at step %d", ckpt, progress.step)
        size = self.loader.global_batch_size
        if progress.global_batch_size and progress.global_batch_size != size:
            skip = progress.batch_in_epoch * progress.global_batch_size // size
            log.warning(
                "the checkpoint was trained with global batches of %d rows, this run uses %d "
                "(batch_size x world_size): resuming epoch %d at batch %d of the new size",
                progress.global_batch_size,
                size,
                progress.epoch,
                skip,
            )
            progress.batch_in_epoch = skip
        return progress

    def _start_weights(self) -> None:
        """Load ``fine_tune_checkpoint``; without one, refuse a configured ``init_table``
        (training reads it only through an init checkpoint, never silently)."""
        if self.options.fine_tune_checkpoint is not None:
            load_weights(
                self.options.fine_tune_checkpoint,
                self.model,
                rank=self.rank,
                world_size=self.world_size,
                tables=self.options.fine_tune_tables,
            )
            return
        pending = {t.name: t.dynamic.init_table for t in self.fs.dynamic_tables if t.dynamic}
        pending = {name: path for name, path in pending.items() if path}
        if pending:
            raise ValueError(
                f"dynamicemb.init_table is set for {pending}, but training reads init tables "
                "only through an initial checkpoint: run `python -m train.tools init-ckpt "
                f"--config {self.options.config_path} --out DIR` and pass "
                "--fine_tune_checkpoint DIR"
            )

    def fit(self) -> TrainResult:
        """Train to ``max_steps`` or the configured epochs, then checkpoint, evaluate, summarize.

        Each step: train, then on its cadence log, checkpoint and evaluate (in that order)."""
        opts = self.options
        progress = self._start_progress()
        max_steps = opts.max_steps or self.config.train_config.num_steps or None
        user_counts = (
            UserCounts.from_samples(self.train_path) if "user_id" in self.fs.features else None
        )
        self.model.train()
        start = time.perf_counter()
        start_samples = progress.samples
        window = _LossWindow.open(progress.samples, self.device)
        bar = ProgressLine(
            "train",
            total=self._total_steps(progress, max_steps),
            unit="step",
            initial=progress.step,
            disable=not opts.progress_bar or self.rank != 0,
        )
        times = LoopTimes()
        batches = self._batches(progress, max_steps)
        while (item := times.timed("input_wait", lambda: next(batches, None))) is not None:
            batch, global_rows, upcoming = item
            window.add(self._step(batch, global_rows, progress))
            if upcoming is not None:  # CACHING tables: batch i+1's rows, once step i is issued
                times.timed("row_prefetch", functools.partial(self.model.sparse.prefetch, upcoming))
            bar.update(1)
            if progress.step % self.log_every == 0:
                times.timed("log", lambda: self._log_train(progress, window, bar, times))
            if self.checkpoint_every and progress.step % self.checkpoint_every == 0:
                times.timed("checkpoint", lambda: self._save_in_loop(progress))
            if opts.eval_every and progress.step % opts.eval_every == 0:
                times.timed("eval", lambda: self.run_eval(user_counts, progress.step))
            if max_steps and progress.step >= max_steps:
                break
        bar.close()
        seconds = time.perf_counter() - start
        ckpt = self._save(progress)  # after the pending background one
        final = self.run_eval(user_counts, progress.step)
        rate = (progress.samples - start_samples) / max(seconds, 1e-9)
        self._write_summary(progress, seconds, rate, times)
        if self.rank == 0:
            self.metrics.plot(self.model_dir / "curves.png")
        return TrainResult(progress, final, seconds, rate, ckpt, self.metrics.records, times)

    def _start_progress(self) -> Progress:
        """Where this run starts: the latest checkpoint (``resume``) or step 0 from the start
        weights (:meth:`_start_weights`)."""
        progress = Progress()
        if self.rank == 0:  # the .step_N.* temp dirs of killed runs
            remove_stale_temp_checkpoints(self.model_dir)
        if self.options.resume:
            progress = self._resume(progress)
        if progress.step == 0:  # not resumed
            self._start_weights()
        progress.global_batch_size = self.loader.global_batch_size
        return progress

    def _total_steps(self, progress: Progress, max_steps: int | None) -> int:
        """The step this run ends at: ``max_steps`` or the end of the last epoch, whichever
        comes first (each epoch's batch count follows from Parquet metadata, see Loader)."""
        num_epochs = self.config.train_config.num_epochs or 1
        left = sum(self.loader.num_batches(e) for e in range(progress.epoch, num_epochs))
        end = progress.step + left - progress.batch_in_epoch
        return max(min(end, max_steps), progress.step) if max_steps else end

    def _batches(
        self, progress: Progress, max_steps: int | None = None
    ) -> Iterator[tuple[Batch, int, Batch | None]]:
        """(batch on the device, global rows of its step, the next batch of the epoch when the
        model has CACHING tables to prefetch its rows, else None) from ``progress`` to the last
        epoch, none once ``progress.step`` reached ``max_steps`` (a resume of a finished run
        trains 0).

        An epoch read to its end advances ``progress`` to the next; a caller that stops early
        (``max_steps``) leaves it inside the epoch, where a resume continues."""
        num_epochs = self.config.train_config.num_epochs or 1
        while progress.epoch < num_epochs:
            if max_steps and progress.step >= max_steps:
                return
            rows = self.loader.batch_rows(progress.epoch)  # global rows of each batch
            batches = self._epoch_batches(progress)
            # on CUDA a feeder thread copies the next batches during this step (train.data.prefetch)
            on_device = prefetch_to_device(batches, self.device)
            if not self.model.sparse.tiered:  # HBM_ONLY: no look-ahead
                for batch in on_device:
                    yield batch, rows[progress.batch_in_epoch], None
            else:
                for batch, upcoming in with_next(on_device):
                    yield batch, rows[progress.batch_in_epoch], upcoming
            progress.epoch += 1
            progress.batch_in_epoch = 0

    def _epoch_batches(self, progress: Progress) -> Iterator[Batch]:
        """``progress.epoch``'s batches from ``progress.batch_in_epoch`` on: the loader started
        in ``__init__`` where it starts there, else a new one."""
        started, self._started = self._started, None
        if started is not None and started[0] == progress.epoch and progress.batch_in_epoch == 0:
            return started[1]
        return self.loader.epoch(progress.epoch, skip_batches=progress.batch_in_epoch)

    def _step(self, batch: Batch, global_rows: int, progress: Progress) -> torch.Tensor:
        """One optimizer step on ``batch``, counted in ``progress``; returns the loss (device)."""
        self.rates = set_learning_rates(
            self.model, self.optimizers, self.schedules, progress.step, progress.epoch
        )
        loss = train_step(
            self.model,
            self.optimizers,
            batch,
            progress.step,
            self.amp,
            sync=self.sync,
            global_rows=global_rows,
            graphs=self.graphs,
            ema=self.dense_ema,
        )
        progress.step += 1
        progress.batch_in_epoch += 1
        progress.samples += global_rows
        return loss

    def _log_train(
        self, progress: Progress, window: _LossWindow, bar: ProgressLine, times: LoopTimes
    ) -> None:
        """A ``train`` record (mean loss and throughput since the last one, and how much of that
        time the loop waited for input, checkpointed and evaluated) and the progress line's
        status; starts the next window."""
        now = time.perf_counter()
        rate = (progress.samples - window.samples) / max(now - window.since, 1e-9)
        loss_sum = float(window.loss_sum)  # one host sync per log interval
        if self.dist is not None:  # the ranks' shares add up to the global mean
            loss_sum = self.dist.all_reduce_sum([loss_sum])[0]
        loss = loss_sum / window.steps
        bar.set_status(f"{rate:,.0f} samples/s, loss {loss:.4f}")
        record = {
            "kind": "train",
            "step": progress.step,
            "epoch": progress.epoch,
            "loss": loss,
            "samples_per_s": rate,
            "samples": progress.samples,
            **{f"{k}_lr": v for k, v in self.rates.items()},
            **{f"{k}_seconds": v for k, v in window.loop_seconds(times.seconds).items()},
            "tables": self._table_stats(),
        }
        if self.comm is not None:
            record["world_size"] = self.world_size
            record["samples_per_s_per_rank"] = rate / self.world_size
            record["all_to_all"] = self.comm.take(window.steps, now - window.since)
        self.metrics.write(record)
        window.restart(now, progress.samples, times.seconds)

    def _write_summary(
        self, progress: Progress, seconds: float, rate: float, times: LoopTimes
    ) -> None:
        """The run's last record: time (and how much of it the loop spent waiting for input,
        checkpointing and evaluating), throughput, peak memory, tables, CUDA-graph counts."""
        self.metrics.write(
            {
                "kind": "summary",
                "step": progress.step,
                "train_seconds": seconds,
                **{f"{k}_seconds": v for k, v in times.seconds.items()},
                "samples_per_s": rate,
                "world_size": self.world_size,
                "samples_per_s_per_rank": rate / self.world_size,
                "peak_memory_bytes": self._peak_memory(),
                "tables": self._table_stats(),
                # replays, captures, eager calls by reason (absent: graphs off)
                **({"cuda_graphs": dict(self.graphs.stats)} if self.graphs is not None else {}),
                **(
                    {"sparse_graphs": self.model.sparse.dynamic.static_stats()}
                    if self.graphs is not None
                    else {}
                ),
            }
        )

    def _save(self, progress: Progress) -> Path:
        """Checkpoint ``progress.step`` now (after the pending background one, if any)."""
        if self._writer is not None:
            self._writer.wait()
        return save_checkpoint(
            self.model_dir,
            self.model,
            self.optimizers,
            progress,
            rank=self.rank,
            world_size=self.world_size,
            dense_ema=self.dense_ema,
        )

    def _save_in_loop(self, progress: Progress) -> None:
        """Checkpoint ``progress.step`` on the loop's cadence: written by a thread while training
        goes on in a single process, now when distributed."""
        if self._writer is not None:
            self._writer.save(self.model, self.optimizers, progress, self.dense_ema)
        else:
            self._save(progress)
