"""Benchmark: scaling of distributed training (``torchrun -m train train``) over 1, 2, ... ranks.

    # CPU (gloo), tiny data generated on the fly: a smoke run
    python -m bench.bench_distributed --procs 1 2 --out bench/results/bench_distributed_cpu.json
    # GPU machine (NCCL), issue 11: full-scale data, batch 8192 per GPU
    python -m bench.bench_distributed --device cuda --procs 1 2 8 --data data/full/samples \\
        --batch-size 8192 --max-steps 400 --num-workers 4 --out bench/results/bench_distributed_gpu.json

Each world size is one ``torchrun --standalone`` launch of the real training CLI (one process:
the plain single-process trainer, the baseline). ``data_config.batch_size`` is per rank, so the
global batch grows with the ranks (weak scaling, as in TorchEasyRec). From each run's
``metrics.jsonl``: steady-state samples/s (log intervals after the first ``--warmup`` steps),
per rank and as efficiency against one process, the all-to-all bytes and time share per step
(rank 0's; compare with seed 000 §5.2: ~0.27 MB/GPU of embedding rows at 8 GPUs × 1024 rows,
<0.5 % of the step on NVLink), peak memory (max over ranks; CUDA: allocated tensors, CPU: RSS),
and the final eval AUC. On CPU each process runs ``--threads`` torch threads (default 1).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from shared.cli import Parser, plain, run_cli
from shared.cli import exit_code as _exit_code

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config"


def _records(model_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]


def run_world(procs: int, args: argparse.Namespace, data: Path, out: Path) -> dict[str, Any]:
    """One torchrun launch with ``procs`` ranks; the summary of its metrics."""
    model_dir = out / f"ranks_{procs}"
    log_every = max(1, args.max_steps // 10)  # stats() at each log costs a few ms
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", str(procs), "-m", "train", "train",
        "--config", str(args.config), "--train", str(data / "train"), "--eval", str(data / "eval"),
        "--model-dir", str(model_dir), "--device", args.device,
        "--batch-size", str(args.batch_size), "--num-workers", str(args.num_workers),
        "--max-steps", str(args.max_steps), "--log-every", str(log_every),
        "--checkpoint-every", str(10**9), "--no-progress",
    ]  # fmt: skip
    if args.eval_max_batches:  # the same eval rows at every world size (global batches grow)
        cmd += ["--eval-max-batches", str(max(1, args.eval_max_batches // procs))]
    env = dict(os.environ)
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = str(args.threads)
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{procs} ranks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    records = _records(model_dir)
    train = [r for r in records if r["kind"] == "train"]
    steady = [r for r in train if r["step"] - log_every >= args.warmup] or train[-1:]
    rate = statistics.median(r["samples_per_s"] for r in steady)
    (summary,) = [r for r in records if r["kind"] == "summary"]
    evals = [r for r in records if r["kind"] == "eval"]
    result: dict[str, Any] = {
        "procs": procs,
        "global_batch": args.batch_size * procs,
        "samples_per_s": rate,
        "samples_per_s_per_rank": rate / procs,
        "peak_memory_bytes": summary["peak_memory_bytes"],
        "eval_auc": evals[-1]["auc"] if evals else None,
        "eval_oracle_auc": evals[-1].get("oracle_auc") if evals else None,
        "final_loss": train[-1]["loss"] if train else None,
        "steps": summary["step"],
        "wall_seconds": wall,
    }
    a2a = [r["all_to_all"] for r in steady if "all_to_all" in r]
    if a2a:
        for k in ("share", "seconds", "bytes", "bytes_rows", "bytes_grads", "bytes_keys"):
            result[f"all_to_all_{k}"] = statistics.mean(x[k] for x in a2a)
        result["lookups_per_step"] = statistics.mean(x["lookups"] for x in a2a)
        result["unique_keys_per_step"] = statistics.mean(x["unique"] for x in a2a)
    else:
        result["all_to_all_share"] = 0.0
    return result


EXAMPLE = """examples:
  python -m bench.bench_distributed --procs 1 2 --out bench/results/bench_distributed_cpu.json
  python -m bench.bench_distributed --device cuda --procs 1 2 8 --data data/full/samples \\
      --batch-size 8192 --max-steps 400 --num-workers 4 \\
      --out bench/results/bench_distributed_gpu.json"""


def _parser() -> Parser:
    p = Parser(
        prog="python -m bench.bench_distributed",
        description=plain(__doc__.split("\n\n")[0]),
        epilog=EXAMPLE,
    )
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cpu (gloo) or cuda (NCCL)"
    )
    p.add_argument(
        "--procs", type=int, nargs="+", default=[1, 2], help="world sizes, one torchrun each"
    )
    p.add_argument(
        "--data",
        type=Path,
        help="samples dir with train/ and eval/ (default: tiny data, generated)",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=CONFIG,
        help="training config (default: configs/multi_tower_din_taobao_dynamicemb.config)",
    )
    p.add_argument("--batch-size", type=int, default=128, help="data_config.batch_size, per rank")
    p.add_argument("--max-steps", type=int, default=30, help="training steps of each run")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the rate")
    p.add_argument("--num-workers", type=int, default=0, help="data loader workers per rank")
    p.add_argument(
        "--eval-max-batches",
        type=int,
        help="eval on this many batches of one rank's size (default: all of eval/)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU: torch threads per process (OpenMP spin-waits badly on shared cores)",
    )
    p.add_argument("--work", type=Path, help="run directories (default: a temp dir)")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.device == "cuda" and max(args.procs) > torch.cuda.device_count():
        gpus = torch.cuda.device_count()
        p.error(f"--procs {max(args.procs)} but {gpus} GPUs are visible; give --procs up to {gpus}")
    with tempfile.TemporaryDirectory(prefix="bench_distributed.") as tmp:
        work = args.work or Path(tmp)
        data = args.data
        if data is None:
            data = work / "tiny" / "samples"
            subprocess.run(
                [sys.executable, "-m", "train.data", "all", "--size", "tiny", "--out",
                 str(work / "tiny"), "--config", str(args.config)],
                cwd=ROOT, check=True, capture_output=True,
            )  # fmt: skip
        runs = [run_world(n, args, data, work) for n in args.procs]
    base = next((r for r in runs if r["procs"] == 1), None)
    for r in runs:
        r["scaling_efficiency"] = (
            r["samples_per_s_per_rank"] / base["samples_per_s_per_rank"] if base else None
        )
    report = {
        "bench": "distributed training scaling (weak: batch per rank fixed)",
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": str(
            args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config
        ),
        "data": str(args.data or "tiny (generated)"),
        "batch_size_per_rank": args.batch_size,
        "max_steps": args.max_steps,
        "warmup_steps": args.warmup,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for r in runs:
        print(
            f"{r['procs']} ranks: {r['samples_per_s']:,.0f} samples/s "
            f"({r['samples_per_s_per_rank']:,.0f}/rank, efficiency "
            f"{(r['scaling_efficiency'] or 0):.2f}), all-to-all {r['all_to_all_share']:.1%} of "
            f"the step, peak {r['peak_memory_bytes'] / 2**20:,.0f} MiB, AUC {r['eval_auc']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
