"""The Parquet loader alone (no model): samples/s of ``Loader.epoch`` for several worker counts.

For each ``--num-workers`` value (lowered to the cores here, as the loader does), batches are
read over consecutive epochs: ``--warmup`` batches, then ``--windows`` timed windows of
``--window`` batches; the median window's samples/s is reported. Pinning is part of it on CUDA
(``--pin-memory``), and ``--to-device`` adds the copy to the device through
:func:`train.data.prefetch.prefetch_to_device` (synchronized at each window's end).

Beside the rate, the CPU it costs: ``main_cpu_ms_per_batch`` (the main process: receiving,
unpacking, pinning) and ``worker_cpu_ms_per_batch`` (all workers, read after they exit), and from
them the rate a machine with more cores could reach, ``estimate_samples_per_s`` for
``--estimate-cores``: min(workers on all cores but one × one worker's rate, the main process's
limit). On a machine shared with other work the CPU figures are the steadier ones::

    python -m bench.bench_loader --size small --num-workers 1,2 --out out/bench_loader.json
    python -m bench.bench_loader --samples data/full/samples --to-device --out $OUT/loader.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Generator
from pathlib import Path

import torch

from shared.batch import Batch
from shared.cli import Parser, plain, run_cli
from shared.cli import exit_code as _exit_code
from shared.config import load_config
from shared.features import build_feature_set
from train.data.loader import MESSAGE_ROWS, Loader, usable_workers
from train.data.prefetch import prefetch_to_device

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config"
EXAMPLE = """examples:
  python -m bench.bench_loader --size small --num-workers 1,2 --out out/bench_loader.json
  python -m bench.bench_loader --samples data/full/samples --to-device --out out/loader.json"""


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _stream(
    loader: Loader, device: torch.device | None, one_copy: bool
) -> Generator[Batch, None, None]:
    """Batches over epochs 0, 1, ... (on ``device`` when given)."""
    for epoch in itertools.count():
        batches = loader.epoch(epoch)
        if device is not None:
            batches = prefetch_to_device(batches, device, one_copy=one_copy)
        yield from batches


def measure(
    loader: Loader, args: argparse.Namespace, device: torch.device | None
) -> dict[str, object]:
    """Median samples/s of the timed windows and the CPU per batch (see the module doc)."""
    children0 = _children_cpu()
    stream = _stream(loader, device, args.copy == "one")
    for _ in range(args.warmup):
        next(stream)
    rates, main_cpu, batches = [], 0.0, 0
    for _ in range(args.windows):
        cpu0, t0, rows = time.process_time(), time.perf_counter(), 0
        for _ in range(args.window):
            rows += next(stream).batch_size
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        rates.append(rows / (time.perf_counter() - t0))
        main_cpu += time.process_time() - cpu0
        batches += args.window
    stream.close()  # the DataLoader's workers exit; their CPU time is then counted
    produced = args.warmup + batches
    worker_ms = (_children_cpu() - children0) / produced * 1e3
    main_ms = main_cpu / batches * 1e3
    return {
        "num_workers": loader.num_workers,
        "samples_per_s_median": statistics.median(rates),
        "samples_per_s_windows": rates,
        "main_cpu_ms_per_batch": main_ms,
        "worker_cpu_ms_per_batch": worker_ms if loader.num_workers else None,
    }


def estimate(row: dict[str, object], batch: int, cores: int) -> float | None:
    """Samples/s on ``cores`` cores from the CPU per batch: workers on ``cores - 1`` of them,
    bounded by the main process's own work per batch."""
    worker, main = row["worker_cpu_ms_per_batch"], row["main_cpu_ms_per_batch"]
    if not isinstance(worker, float) or not isinstance(main, float) or worker <= 0:
        return None
    return min(max(cores - 1, 1) * batch / worker * 1e3, batch / max(main, 1e-9) * 1e3)


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_loader", description=plain(__doc__), epilog=EXAMPLE)
    p.add_argument("--config", type=Path, default=CONFIG, help="pipeline config (features)")
    p.add_argument("--samples", type=Path, help="samples dir with train/; default: generate --size")
    p.add_argument(
        "--size",
        default="small",
        choices=["tiny", "small", "full"],
        help="synthetic data to generate when --samples is not given",
    )
    p.add_argument("--batch", type=int, default=8192, help="rows per batch")
    p.add_argument(
        "--num-workers",
        default="1,2,4,8,12,16",
        help="comma-separated worker counts (each lowered to the cores here)",
    )
    p.add_argument("--warmup", type=int, default=10, help="batches read before timing")
    p.add_argument("--window", type=int, default=20, help="batches per timed window")
    p.add_argument("--windows", type=int, default=5, help="timed windows (median reported)")
    p.add_argument(
        "--shuffle-rows",
        type=int,
        default=262_144,
        help="rows shuffled together; smaller gives more windows for workers to share",
    )
    p.add_argument(
        "--message-rows",
        type=int,
        default=MESSAGE_ROWS,
        help="rows of the batches a worker sends at once",
    )
    p.add_argument(
        "--pin-memory",
        choices=["auto", "on", "off"],
        default="auto",
        help="pin the batches (auto: when CUDA is available)",
    )
    p.add_argument(
        "--to-device",
        action="store_true",
        help="also copy each batch to --device through the prefetcher",
    )
    p.add_argument(
        "--copy",
        choices=["one", "per-tensor"],
        default="one",
        help="--to-device: one copy per batch (packed batches) or one per tensor (Batch.to)",
    )
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="device of --to-device (default: cuda if this machine has one)",
    )
    p.add_argument(
        "--estimate-cores",
        type=int,
        default=16,
        help="cores of the machine estimate_samples_per_s is for",
    )
    p.add_argument("--out", type=Path, required=True, help="JSON result file")
    return p


def _samples(args: argparse.Namespace) -> Path:
    if args.samples is not None:
        return args.samples / "train"
    tmp = tempfile.mkdtemp(prefix="bench_loader_")
    subprocess.run(
        [sys.executable, "-m", "train.data", "all", "--size", args.size, "--out", tmp,
         "--config", str(args.config)], check=True, cwd=ROOT,
    )  # fmt: skip
    return Path(tmp) / "samples" / "train"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        workers = sorted({usable_workers(int(w)) for w in args.num_workers.split(",")})
    except ValueError as e:
        raise ValueError(f"--num-workers {args.num_workers!r}: want e.g. 1,2,4 ({e})") from e
    pin = {"auto": torch.cuda.is_available(), "on": True, "off": False}[args.pin_memory]
    device = torch.device(args.device) if args.to_device else None
    fs = build_feature_set(load_config(args.config))
    train = _samples(args)
    rows = []
    for w in workers:
        loader = Loader(
            train,
            fs,
            batch_size=args.batch,
            num_workers=w,
            seed=0,
            pin_memory=pin,
            shuffle_rows=args.shuffle_rows,
            message_rows=args.message_rows,
        )
        row = measure(loader, args, device)
        row["estimate_samples_per_s"] = estimate(row, args.batch, args.estimate_cores)
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {
        "bench": "loader",
        "samples": str(train),
        "train_rows": loader.rows,
        "batch": args.batch,
        "pin_memory": pin,
        "to_device": str(device) if device is not None else None,
        "copy": args.copy,
        "message_rows": args.message_rows,
        "shuffle_rows": args.shuffle_rows,
        "estimate_cores": args.estimate_cores,
        "torch": torch.__version__,
        "runs": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
