"""python -m train {train,stream,evaluate,export}: train a model (once, or online on arriving
data), evaluate a checkpoint, export a bundle.

examples:
  python -m train train --config configs/multi_tower_din_taobao_dynamicemb.config \\
      --train data/small/samples/train --eval data/small/samples/eval --model-dir runs/dyn
  python -m train train ... --resume            # continue from the newest checkpoint
  python -m train train ... --fine-tune-checkpoint runs/init   # start from these weights
  python -m train train ... --no-cuda-graphs    # dense part eagerly (default on CUDA: graphs)
  python -m train stream --config ... --source data/incoming --model-dir runs/online \\
      --publish-root runs/online/publish --publish-every-s 10   # online training
  python -m train evaluate --config ... --model-dir runs/dyn
  python -m train export --config ... --model-dir runs/dyn --out runs/dyn/bundle
  torchrun --nproc_per_node 2 -m train train ...   # distributed: gloo on cpu, NCCL on cuda;
                                                  # batch_size is per rank
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from shared.cli import Parser, check_device, run_cli
from shared.hashtable import host_memory

CONFIG = "configs/multi_tower_din_taobao_dynamicemb.config"
EXAMPLES = {
    "train": f"example:\n  python -m train train --config {CONFIG} \\\n"
    "      --train data/small/samples/train --eval data/small/samples/eval --model-dir runs/dyn",
    "stream": f"example:\n  python -m train stream --config {CONFIG} --source data/incoming \\\n"
    "      --model-dir runs/online --publish-root runs/online/publish --publish-every-s 10",
    "evaluate": f"example:\n  python -m train evaluate --config {CONFIG} --model-dir runs/dyn",
    "export": f"example:\n  python -m train export --config {CONFIG} --model-dir runs/dyn \\\n"
    "      --out runs/dyn/bundle",
}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", type=Path, required=True, help="pipeline config (text proto, tzrec's schema)"
    )
    p.add_argument(
        "--model-dir", type=Path, help="checkpoints and logs; default: the config's model_dir"
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="where the model runs (default: cuda if this machine has one, else cpu)",
    )
    p.add_argument("--batch-size", type=int, help="rows per batch; default: data_config.batch_size")
    p.add_argument(
        "--num-workers", type=int, help="data loader processes; default: data_config.num_workers"
    )


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m train",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser(
        "train",
        help="train (and evaluate at the end)",
        description="train (and evaluate at the end)",
        epilog=EXAMPLES["train"],
    )
    _common(t)
    t.add_argument("--train", type=Path, help="train samples dir; default: train_input_path")
    t.add_argument("--eval", type=Path, help="eval samples dir; default: eval_input_path")
    t.add_argument(
        "--max-steps", type=int, help="stop after this many steps; default: the config's epochs"
    )
    t.add_argument("--eval-every", type=int, help="steps between evaluations")
    t.add_argument("--eval-max-batches", type=int, help="evaluate on the first N batches only")
    t.add_argument("--checkpoint-every", type=int, help="steps between checkpoints")
    t.add_argument("--log-every", type=int, help="steps between log lines")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    t.add_argument(
        "--fine-tune-checkpoint",
        "--fine_tune_checkpoint",
        dest="fine_tune_checkpoint",
        type=Path,
        help="not resuming: start from these weights (checkpoint, model dir or init-ckpt dir; "
        "also TorchEasyRec's model.ckpt-N: its dynamicemb/ tables)",
    )
    t.add_argument(
        "--fine-tune-tables",
        "--fine_tune_tables",
        dest="fine_tune_tables",
        type=lambda s: tuple(n.strip() for n in s.split(",") if n.strip()),
        metavar="T1,T2",
        help="the dynamic tables to take from --fine-tune-checkpoint (default: every dynamic "
        "table of the config, or those an init checkpoint lists); the others start empty",
    )
    t.add_argument("--seed", type=int, default=0, help="seed of the initial weights and shuffling")
    t.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    t.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="dense forward+backward through CUDA graphs (default: on for single-process CUDA "
        "training; never on CPU or distributed)",
    )
    t.add_argument(
        "--hbm-budget-gib",
        type=float,
        help="device memory (GiB) the dynamic tables may use; default: the config's "
        "train_config.table_hbm_budget_gib, else none (see python -m train.tools plan)",
    )
    t.add_argument(
        "--static-prefetch",
        action="store_true",
        help="with CUDA graphs and cached tables (cache_load_factor < 1): prefetch the next "
        "batch's rows into the cache beside the step (default: the step reads its misses itself)",
    )
    t.add_argument(
        "--host-memory",
        choices=host_memory.KINDS,
        default="register",
        help="on CUDA, how cached tables' host tiers are made: page-locked by cudaHostRegister "
        "(default) or the CUDA driver's cuMemCreate host memory (driver)",
    )
    t.add_argument(
        "--cache-row-threads",
        type=int,
        metavar="N",
        help="with CUDA graphs and cached tables: N host threads move their rows between HBM "
        "and the host tier (a host node reads the misses, the write-backs go beside the step); "
        "default: the device's own reads and writes. Needs a C compiler",
    )

    _stream_parser(sub)
    e = sub.add_parser(
        "evaluate",
        help="evaluate a checkpoint",
        description="evaluate a checkpoint",
        epilog=EXAMPLES["evaluate"],
    )
    _common(e)
    e.add_argument("--train", type=Path, help="train samples (for head/tail user counts)")
    e.add_argument("--eval", type=Path, help="eval samples dir; default: eval_input_path")
    e.add_argument("--checkpoint", type=Path, help="checkpoint dir; default: newest in --model-dir")
    e.add_argument(
        "--predictions",
        type=Path,
        help="also write every eval row's prediction to this Parquet file (row, user_id, label, "
        "probability, tail), in the eval samples' order",
    )

    x = sub.add_parser(
        "export",
        help="export a checkpoint as a serving bundle",
        description="export a checkpoint as a serving bundle",
        epilog=EXAMPLES["export"],
    )
    _common(x)
    x.add_argument("--checkpoint", type=Path, help="checkpoint dir; default: newest in --model-dir")
    x.add_argument("--out", type=Path, required=True, help="the bundle directory to write")
    x.add_argument("--version", help="model version string; default: step-<N> of the checkpoint")
    x.add_argument("--overwrite", action="store_true", help="replace a bundle already at --out")
    x.add_argument(
        "--naming",
        choices=["tzrec", "dynrec"],
        default="tzrec",
        help="file and tensor names: tzrec = TorchEasyRec's RTP export (model-000000-of-000001, "
        "<collection>.<table>.values/part_R_W) with a dense program that takes the DIN's pairs "
        "as inputs (bundle format 3, CUDA-graph ready), dynrec = bundle format 1 for servers "
        "that predate formats 2 and 3 (default: %(default)s)",
    )
    return parser


def _stream_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "stream",
        help="train online on Parquet partitions as they land; publish deltas",
        description="train online: follow the complete partitions (sub-directories with "
        "_SUCCESS) under --source in name order, checkpoint the position (a restart resumes "
        "exactly there), publish deltas and full bundles; SIGTERM stops cleanly",
        epilog=EXAMPLES["stream"],
    )
    _common(s)
    s.add_argument("--source", type=Path, required=True, help="directory partitions land in")
    s.add_argument("--checkpoint-every", type=int, help="steps between checkpoints")
    s.add_argument("--poll-s", type=float, default=1.0, help="wait between looks at the source")
    s.add_argument(
        "--idle-exit-s", type=float, help="stop after this long without new rows (default: never)"
    )
    s.add_argument("--log-every-s", type=float, default=10.0, help="seconds between stream logs")
    s.add_argument("--publish-root", type=Path, help="publish full bundles and deltas here")
    s.add_argument("--publish-every-s", type=float, help="seconds between publishes")
    s.add_argument("--publish-every-steps", type=int, help="steps between publishes")
    s.add_argument(
        "--full-every", type=int, default=10, help="a full bundle after this many deltas"
    )
    s.add_argument(
        "--row-log", type=Path, help="log the rows of each committed step here (JSON lines)"
    )
    s.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    s.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CUDA: the dense step and the tables' static step as CUDA graphs "
        "(default: %(default)s)",
    )


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.device is None:  # resolved here, not in the parser, so that --help is the same anywhere
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    check_device(args.device)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for name in ("train", "shared"):  # ours at INFO; third-party (fbgemm's loader) stays quiet
        logging.getLogger(name).setLevel(logging.INFO)
    commands = {"train": _train, "stream": _stream, "evaluate": _evaluate, "export": _export}
    command = commands[args.cmd]
    command(args)
    return 0


def _train(args: argparse.Namespace) -> None:
    """Train one config (``--config``), on one process or as a torchrun rank.

    The config is parsed before :mod:`train.trainer` is imported (torchrec, torchmetrics:
    about 2.5 s of a 2-core machine): a missing or mistyped config is told at once; the
    trainer parses it again (milliseconds)."""
    from shared.config import load_config

    load_config(args.config)
    from train.distributed.env import init_from_env, shutdown
    from train.trainer import Trainer, TrainOptions

    env = init_from_env(args.device)  # None unless torchrun started > 1 process
    if env is not None and not env.is_main:
        for name in ("train", "shared"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        result = Trainer(
            TrainOptions(
                config_path=args.config,
                model_dir=args.model_dir,
                train_path=args.train,
                eval_path=args.eval,
                device=args.device,
                batch_size=args.batch_size,
                num_workers=args.num_workers,
                max_steps=args.max_steps,
                eval_every=args.eval_every,
                eval_max_batches=args.eval_max_batches,
                checkpoint_every=args.checkpoint_every,
                log_every=args.log_every,
                resume=args.resume,
                fine_tune_checkpoint=args.fine_tune_checkpoint,
                fine_tune_tables=args.fine_tune_tables,
                seed=args.seed,
                progress_bar=not args.no_progress,
                dist=env,
                cuda_graphs=args.cuda_graphs,
                hbm_budget_gib=args.hbm_budget_gib,
                static_prefetch=args.static_prefetch,
                host_memory=args.host_memory,
                cache_row_threads=args.cache_row_threads,
            )
        ).fit()
    finally:
        shutdown(env)
    if env is not None and not env.is_main:
        return
    summary = {
        "step": result.progress.step,
        "train_seconds": result.train_seconds,
        "samples_per_s": result.samples_per_second,
        "eval": result.final_eval.to_dict() if result.final_eval else None,
    }
    print(json.dumps(summary))


def _stream(args: argparse.Namespace) -> None:
    from shared.config import load_config
    from train.stream.publish import PublishOptions
    from train.stream.trainer import StreamOptions, StreamTrainer

    publish = None
    if args.publish_root is not None:
        publish = PublishOptions(
            root=args.publish_root,
            every_s=args.publish_every_s,
            every_steps=args.publish_every_steps,
            full_every=args.full_every,
        )
    elif args.publish_every_s is not None or args.publish_every_steps is not None:
        raise ValueError("--publish-every-s/--publish-every-steps need --publish-root DIR")
    model_dir = args.model_dir or Path(load_config(args.config).model_dir or "")
    if not str(model_dir) or str(model_dir) == ".":
        raise ValueError("train stream needs --model-dir (its checkpoints hold the position)")
    result = StreamTrainer(
        StreamOptions(
            config_path=args.config,
            source=args.source,
            model_dir=model_dir,
            device=args.device,
            batch_size=args.batch_size,
            num_workers=args.num_workers,
            checkpoint_every=args.checkpoint_every,
            poll_s=args.poll_s,
            idle_exit_s=args.idle_exit_s,
            log_every_s=args.log_every_s,
            publish=publish,
            row_log=args.row_log,
            seed=args.seed,
            cuda_graphs=args.cuda_graphs,
        )
    ).run()
    p = result.progress
    print(json.dumps({"step": p.step, "samples": p.samples, "publishes": result.publishes,
                      "partition": p.source_partition, "row": p.source_row,
                      "stall_seconds": result.stall_seconds}))  # fmt: skip


def _evaluate(args: argparse.Namespace) -> None:
    from train.export import evaluate_checkpoint

    evaluated = evaluate_checkpoint(
        args.config,
        model_dir=args.model_dir,
        checkpoint=args.checkpoint,
        train_path=args.train,
        eval_path=args.eval,
        device=args.device,
        batch_size=args.batch_size,
        predictions=args.predictions,
    )
    print(json.dumps(evaluated.to_dict()))


def _export(args: argparse.Namespace) -> None:
    from shared.bundle.naming import NAMINGS
    from train.export import export_bundle

    out = export_bundle(
        args.config,
        out_dir=args.out,
        model_dir=args.model_dir,
        checkpoint=args.checkpoint,
        version=args.version,
        overwrite=args.overwrite,
        naming=NAMINGS[args.naming],
    )
    print(out)


if __name__ == "__main__":
    sys.exit(main())
