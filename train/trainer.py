"""The training loop: sparse Adagrad for every embedding, Adam for dense layers, periodic eval,
atomic checkpoints, resume to the same result, a progress bar, JSON-lines metrics and a plot."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from protos import pipeline_pb2
from shared.batch import Batch
from shared.config import load_config
from shared.dense_inputs import assemble_dense_inputs
from shared.features import build_feature_set
from train.checkpoint import Progress, latest_checkpoint, load_checkpoint, save_checkpoint
from train.data.loader import Loader
from train.evaluate import EvalResult, UserCounts, evaluate
from train.metrics_log import MetricsLog
from train.model.multi_tower_din import MultiTowerDIN, sparse_adagrad

log = logging.getLogger(__name__)


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
    max_steps: int | None = None  # stop early (tests, smoke runs)
    eval_every: int | None = None  # steps between evaluations; None: at the end only
    eval_max_batches: int | None = None
    checkpoint_every: int | None = None  # default: train_config.save_checkpoints_steps
    log_every: int | None = None  # default: train_config.log_step_count_steps
    resume: bool = False
    seed: int = 0
    progress_bar: bool = True


@dataclass
class TrainResult:
    progress: Progress
    final_eval: EvalResult | None
    train_seconds: float
    samples_per_second: float
    checkpoint: Path
    history: list[dict] = field(default_factory=list)


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
    """Adam (dense layers) and Adagrad (num_buckets tables, row-sparse gradients). Dynamic tables
    are updated inside their backward by the hash-table core with the same Adagrad settings."""
    dense_cfg = config.dense_optimizer
    if dense_cfg.WhichOneof("optimizer") not in (None, "adam_optimizer"):
        raise ValueError("train_config.dense_optimizer: only adam_optimizer is implemented")
    adam = dense_cfg.adam_optimizer
    ada = sparse_adagrad(config)
    return {
        "dense": torch.optim.Adam(
            model.dense.parameters(),
            lr=adam.lr,
            betas=(adam.beta1, adam.beta2),
            eps=adam.eps,
            weight_decay=adam.weight_decay,
        ),
        "sparse": torch.optim.Adagrad(
            list(model.sparse.dense_parameters()),
            lr=ada.lr,
            eps=ada.eps,
            initial_accumulator_value=ada.initial_accumulator_value,
        ),
    }


def train_step(
    model: MultiTowerDIN,
    optimizers: dict[str, torch.optim.Optimizer],
    batch: Batch,
    step: int,
    amp: str = "",
) -> torch.Tensor:
    """One optimizer step; returns the loss as a device tensor (no host sync)."""
    device = batch.user_index.device
    model.sparse.dynamic.set_step(step)
    for opt in optimizers.values():
        opt.zero_grad(set_to_none=True)
    pooled, sequences = model.sparse(batch)  # fp32 embeddings
    inputs = assemble_dense_inputs(model.fs, batch, pooled, sequences)
    with _amp_context(amp, device):
        logits = model.dense(**inputs)  # [B]
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), batch.labels)
    loss.backward()  # dynamic tables: fused Adagrad happens here
    for opt in optimizers.values():
        opt.step()
    return loss.detach()


class Trainer:
    def __init__(self, options: TrainOptions) -> None:
        self.options = options
        self.config = load_config(options.config_path)
        self.fs = build_feature_set(self.config)
        cfg = self.config
        self.model_dir = Path(options.model_dir or cfg.model_dir or "experiments/run")
        self.train_path = Path(options.train_path or cfg.train_input_path)
        self.eval_path = Path(options.eval_path or cfg.eval_input_path)
        self.device = torch.device(options.device)
        self.batch_size = options.batch_size or cfg.data_config.batch_size
        workers = (
            cfg.data_config.num_workers if options.num_workers is None else options.num_workers
        )
        self.num_workers = workers
        tc = cfg.train_config
        self.checkpoint_every = options.checkpoint_every or tc.save_checkpoints_steps
        self.log_every = options.log_every or tc.log_step_count_steps
        self.amp = tc.mixed_precision
        self.model = MultiTowerDIN.from_config(cfg, self.fs, device=self.device, seed=options.seed)
        self.optimizers = build_optimizers(self.model, tc)
        self.loader = Loader(
            self.train_path,
            self.fs,
            batch_size=self.batch_size,
            shuffle=cfg.data_config.shuffle,
            seed=options.seed,
            num_workers=workers,
            pin_memory=self.device.type == "cuda",
            drop_last=cfg.data_config.drop_remainder,
        )
        self.metrics = MetricsLog(self.model_dir / "metrics.jsonl")

    def _eval_batches(self) -> Iterator[Batch]:
        loader = Loader(
            self.eval_path,
            self.fs,
            batch_size=self.batch_size,
            shuffle=False,
            seed=0,
            num_workers=min(self.num_workers, 1),
            pin_memory=False,
        )
        for i, batch in enumerate(loader.epoch(0)):
            if self.options.eval_max_batches is not None and i >= self.options.eval_max_batches:
                return
            yield batch

    def run_eval(self, user_counts: UserCounts | None, step: int) -> EvalResult:
        result = evaluate(
            self.model, self._eval_batches(), device=self.device, user_counts=user_counts
        )
        self.metrics.write({"kind": "eval", "step": step, **result.to_dict()})
        log.info("eval step %d: %s", step, json.dumps(result.to_dict()))
        return result

    def fit(self) -> TrainResult:
        opts = self.options
        progress = Progress()
        if opts.resume and (ckpt := latest_checkpoint(self.model_dir)) is not None:
            progress = load_checkpoint(ckpt, self.model, self.optimizers)
            log.info("resumed from %s at step %d", ckpt, progress.step)
        num_epochs = self.config.train_config.num_epochs or 1
        max_steps = opts.max_steps or self.config.train_config.num_steps or None
        user_counts = (
            UserCounts.from_samples(self.train_path) if "user_id" in self.fs.features else None
        )
        self.model.train()
        start = time.perf_counter()
        start_samples = progress.samples
        running = torch.zeros((), device=self.device)
        running_n = 0
        tick, tick_samples = time.perf_counter(), progress.samples
        bar = tqdm(
            desc="train",
            unit="batch",
            disable=not opts.progress_bar,
            initial=progress.step,
            total=max_steps,
        )
        done = False
        while progress.epoch < num_epochs and not done:
            for batch in self.loader.epoch(progress.epoch, skip_batches=progress.batch_in_epoch):
                batch = batch.to(self.device, non_blocking=True)
                running += train_step(self.model, self.optimizers, batch, progress.step, self.amp)
                running_n += 1
                progress.step += 1
                progress.batch_in_epoch += 1
                progress.samples += batch.batch_size
                bar.update(1)
                if progress.step % self.log_every == 0:
                    now = time.perf_counter()
                    rate = (progress.samples - tick_samples) / max(now - tick, 1e-9)
                    loss = float(running) / running_n  # one host sync per log interval
                    bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:,.0f}")
                    self.metrics.write(
                        {
                            "kind": "train",
                            "step": progress.step,
                            "epoch": progress.epoch,
                            "loss": loss,
                            "samples_per_s": rate,
                            "samples": progress.samples,
                            "tables": self.model.sparse.dynamic.stats(),
                        }
                    )
                    running.zero_()
                    running_n = 0
                    tick, tick_samples = now, progress.samples
                if self.checkpoint_every and progress.step % self.checkpoint_every == 0:
                    save_checkpoint(self.model_dir, self.model, self.optimizers, progress)
                if opts.eval_every and progress.step % opts.eval_every == 0:
                    self.run_eval(user_counts, progress.step)
                if max_steps and progress.step >= max_steps:
                    done = True
                    break
            else:
                progress.epoch += 1
                progress.batch_in_epoch = 0
        bar.close()
        seconds = time.perf_counter() - start
        ckpt = save_checkpoint(self.model_dir, self.model, self.optimizers, progress)
        final = self.run_eval(user_counts, progress.step)
        rate = (progress.samples - start_samples) / max(seconds, 1e-9)
        self.metrics.write(
            {
                "kind": "summary",
                "step": progress.step,
                "train_seconds": seconds,
                "samples_per_s": rate,
                "tables": self.model.sparse.dynamic.stats(),
            }
        )
        self.metrics.plot(self.model_dir / "curves.png")
        return TrainResult(progress, final, seconds, rate, ckpt, self.metrics.records)
