"""``python -m train {train,evaluate,export}``: thin CLI over train.trainer / train.export.

Examples::

    python -m train train --config configs/multi_tower_din_taobao_dynamicemb.config \\
        --train data/small/samples/train --eval data/small/samples/eval --model-dir runs/dyn
    python -m train train ... --resume            # continue from the newest checkpoint
    python -m train train ... --fine_tune_checkpoint runs/init   # start from these weights
    python -m train train ... --no-cuda-graphs    # dense part eagerly (default on CUDA: graphs)
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


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, required=True, help="pipeline config (text proto)")
    p.add_argument("--model-dir", type=Path, help="default: the config's model_dir")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, help="default: data_config.batch_size")
    p.add_argument("--num-workers", type=int, help="default: data_config.num_workers")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="train (and evaluate at the end)")
    _common(t)
    t.add_argument("--train", type=Path, help="train samples dir; default: train_input_path")
    t.add_argument("--eval", type=Path, help="eval samples dir; default: eval_input_path")
    t.add_argument("--max-steps", type=int)
    t.add_argument("--eval-every", type=int, help="steps between evaluations")
    t.add_argument("--eval-max-batches", type=int, help="evaluate on the first N batches only")
    t.add_argument("--checkpoint-every", type=int)
    t.add_argument("--log-every", type=int)
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
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--no-progress", action="store_true")
    t.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="dense forward+backward through CUDA graphs (default: on for single-process CUDA "
        "training; never on CPU or distributed)",
    )

    e = sub.add_parser("evaluate", help="evaluate a checkpoint")
    _common(e)
    e.add_argument("--train", type=Path, help="train samples (for head/tail user counts)")
    e.add_argument("--eval", type=Path)
    e.add_argument("--checkpoint", type=Path, help="default: newest in model-dir")

    x = sub.add_parser("export", help="export a checkpoint as a serving bundle")
    _common(x)
    x.add_argument("--checkpoint", type=Path, help="default: newest in model-dir")
    x.add_argument("--out", type=Path, required=True)
    x.add_argument("--version", help="model version string; default: step-based")
    x.add_argument("--overwrite", action="store_true")
    x.add_argument(
        "--naming",
        choices=["tzrec", "dynrec"],
        default="tzrec",
        help="file and tensor names: tzrec = TorchEasyRec's RTP export (model-000000-of-000001, "
        "<collection>.<table>.values/part_R_W; bundle format 2), dynrec = bundle format 1 for "
        "servers that predate format 2 (default: tzrec)",
    )

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for name in ("train", "shared"):  # ours at INFO; third-party (fbgemm's loader) stays quiet
        logging.getLogger(name).setLevel(logging.INFO)

    if args.cmd == "train":
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
                )
            ).fit()
        finally:
            shutdown(env)
        if env is not None and not env.is_main:
            return 0
        print(
            json.dumps(
                {
                    "step": result.progress.step,
                    "train_seconds": result.train_seconds,
                    "samples_per_s": result.samples_per_second,
                    "eval": result.final_eval.to_dict() if result.final_eval else None,
                }
            )
        )
    elif args.cmd == "evaluate":
        from train.export import evaluate_checkpoint

        result = evaluate_checkpoint(
            args.config,
            model_dir=args.model_dir,
            checkpoint=args.checkpoint,
            train_path=args.train,
            eval_path=args.eval,
            device=args.device,
            batch_size=args.batch_size,
        )
        print(json.dumps(result.to_dict()))
    elif args.cmd == "export":
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
