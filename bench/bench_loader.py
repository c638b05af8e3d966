"""The Parquet loader alone (no model): samples/s of ``Loader.epoch`` for several worker counts.

For each ``--num-workers`` value (lowered to the cores here, as the loader does), batches are
read over consecutive epochs: ``--warmup`` batches, then ``--windows`` timed windows of
``--window`` batches. Reported: ``samples_per_s_sustained`` (all timed samples over all timed
time: what a consumer gets on average) beside the median window's (a loader that buffers gives
bursty windows, and their median overstates it). Pinning is part of it on CUDA (``--pin-memory``),
and ``--to-device`` adds the copy to the device through
:func:`train.data.prefetch.prefetch_to_device` (synchronized at each window's end).

The CPU it costs, per batch: ``main_cpu_ms_per_batch`` (the main process: receiving, unpacking,
pinning) and ``worker_cpu_ms_per_batch``: all workers' CPU during the timed windows only (read
from ``/proc`` at their first and last batch), so without their start-up. It is steady when the
timed batches span ``window_cycle_batches`` several times (every worker reads a shuffle window
of ``--shuffle-rows`` rows once per cycle, as one burst); ``worker_cpu_ms_per_batch_with_startup``
is the older figure (the workers' CPU from their start to their exit over the batches taken: it
also counts start-up and the batches prefetched but never taken).

``worker_steady``: one worker's work timed in this process over ``--worker-batches`` batches
(torch and Arrow on one thread, as in a worker): Parquet read and shuffle, feature generation
(split by feature: ``fg_parts``), packing into shared memory. It needs no long run and is the
figure ``estimate_samples_per_s`` uses for ``--estimate-cores`` (falling back to the timed
windows' figure): min(workers on all cores but one x one worker's rate, the main process's
limit). On a machine shared with other work the CPU figures are the steadier ones::

    python -m bench.bench_loader --size small --num-workers 1,2 --out out/bench_loader.json
    python -m bench.bench_loader --samples data/full/samples --to-device --out $OUT/loader.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Generator
from pathlib import Path

import pyarrow as pa
import torch

from shared.batch import Batch
from shared.cli import Parser, plain, run_cli
from shared.cli import exit_code as _exit_code
from shared.config import load_config
from shared.features import FeatureSet, FeatureSpec, build_feature_set
from shared.fg import FgStats, plain_array, scalar_ids, sequence_ids, table_to_batch
from shared.fg_plan import feature_plan
from train.data.loader import MESSAGE_ROWS, Loader, Window, usable_workers
from train.data.memory import keep_freed_memory, shared_buffer
from train.data.messages import Packed
from train.data.prefetch import prefetch_to_device
from train.data.streams import Batches
from train.data.synthetic import SIZES

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config"
EXAMPLE = """examples:
  python -m bench.bench_loader --size small --num-workers 1,2 --out out/bench_loader.json
  python -m bench.bench_loader --samples data/full/samples --to-device --out out/loader.json"""


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _workers_cpu() -> float | None:
    """CPU seconds of this process's children so far: the exited ones (waited for) and the live
    ones (``/proc/<pid>/stat``); None without ``/proc``."""
    total = _children_cpu()
    try:
        pids = {
            int(p)
            for task in Path("/proc/self/task").iterdir()
            for p in (task / "children").read_text().split()
        }
    except OSError:
        return None
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:  # exited (and waited for: counted above) since the listing
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    return total


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
    """Samples/s of the timed windows and the CPU per batch (see the module doc)."""
    children0 = _children_cpu()
    stream = _stream(loader, device, args.copy == "one")
    for _ in range(args.warmup):
        next(stream)
    rates, main_cpu, batches, rows, seconds = [], 0.0, 0, 0, 0.0
    workers0 = _workers_cpu()
    for _ in range(args.windows):
        cpu0, t0, window_rows = time.process_time(), time.perf_counter(), 0
        for _ in range(args.window):
            window_rows += next(stream).batch_size
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        rates.append(window_rows / elapsed)
        rows, seconds = rows + window_rows, seconds + elapsed
        main_cpu += time.process_time() - cpu0
        batches += args.window
    workers1 = _workers_cpu()
    stream.close()  # the DataLoader's workers exit; their CPU time is then counted
    steady = None if workers0 is None or workers1 is None else (workers1 - workers0) / batches
    batch_rows = loader.global_batch_size
    return {
        "num_workers": loader.num_workers,
        "samples_per_s_sustained": rows / seconds,
        "samples_per_s_median": statistics.median(rates),
        "samples_per_s_windows": rates,
        "timed_batches": batches,
        "window_cycle_batches": loader.num_workers * -(-loader.shuffle_rows // batch_rows),
        "main_cpu_ms_per_batch": main_cpu / batches * 1e3,
        "worker_cpu_ms_per_batch": steady * 1e3 if loader.num_workers and steady else None,
        "worker_cpu_ms_per_batch_with_startup": (
            (_children_cpu() - children0) / (args.warmup + batches) * 1e3
            if loader.num_workers
            else None
        ),
    }


class _TimedBatches(Batches):
    """A worker's stream with the CPU of its steps counted (:func:`worker_steady`)."""

    cpu: dict[str, float]
    tables: list[pa.Table]  # the batches' rows, for :func:`fg_parts`

    def _read(self, window: Window) -> pa.Table:
        cpu0 = time.process_time()
        table = super()._read(window)
        self.cpu["read"] += time.process_time() - cpu0
        return table

    def _batch(self, table: pa.Table) -> tuple[Batch, FgStats]:
        cpu0 = time.process_time()
        out = super()._batch(table)
        self.cpu["fg"] += time.process_time() - cpu0
        if len(self.tables) < _FG_PARTS_BATCHES:
            self.tables.append(table)
        return out


_FG_PARTS_BATCHES = 32


def worker_steady(loader: Loader, batches: int) -> dict[str, object]:
    """CPU ms per batch of one worker's work (stream 0 of ``loader``'s plan, over epochs 0, 1,
    ... until ``batches``), in this process on one thread as in a worker, split into its steps:
    read (Parquet decode and shuffle), fg (:func:`~shared.fg.table_to_batch`), pack (into shared
    memory), other (cutting the windows into batches)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    keep_freed_memory()  # as worker_init
    cpu = dict.fromkeys(("read", "fg", "pack"), 0.0)
    tables: list[pa.Table] = []
    done, cpu0 = 0, time.process_time()
    try:
        for epoch in itertools.count():
            dataset = _worker_dataset(loader, epoch)
            dataset.cpu, dataset.tables = cpu, tables
            played = dataset._play(dataset.streams[0], 0)
            while done < batches and (
                chunk := list(itertools.islice(played, dataset.message_batches))
            ):
                pack0 = time.process_time()
                Packed.of([b for b, _ in chunk], shared_buffer)
                cpu["pack"] += time.process_time() - pack0
                done += len(chunk)
            if done >= batches:
                break
    finally:
        torch.set_num_threads(threads)
    total = time.process_time() - cpu0
    out: dict[str, object] = {"batches": done, "cpu_ms_per_batch": total / done * 1e3}
    out |= {name: t / done * 1e3 for name, t in cpu.items()}
    out["other"] = (total - sum(cpu.values())) / done * 1e3
    out["fg_parts"] = fg_parts(loader.fs, tables)
    return out


def _worker_dataset(loader: Loader, epoch: int) -> _TimedBatches:
    """Stream 0 of ``epoch`` as the loader's workers play it, its steps timed."""
    dataset = loader.dataset(epoch, loader._streams(epoch), [0], [0], cls=_TimedBatches)
    assert isinstance(dataset, _TimedBatches)
    return dataset


def fg_parts(fs: FeatureSet, tables: list[pa.Table]) -> dict[str, float]:
    """CPU ms per batch of each step of feature generation over ``tables``: the columns made
    plain, each scalar feature, each sequence, and the rest of :func:`table_to_batch` (labels,
    KeyedJaggedTensors)."""
    plan = feature_plan(fs)
    parts: dict[str, float] = {}

    def timed(name: str, fn: Callable[[pa.Table], object]) -> None:
        cpu0 = time.process_time()
        for table in tables:
            fn(table)
        parts[name] = (time.process_time() - cpu0) / max(len(tables), 1) * 1e3

    timed("table_to_batch", functools.partial(table_to_batch, fs))
    timed("columns", lambda t: [plain_array(t.column(n)) for n in fs.features])
    for spec in (*plan.user, *plan.item_kjt):
        timed(f"{spec.name} ({spec.transform.value})", functools.partial(_scalar, spec))
    for specs in plan.sequences:
        timed(specs[0].sequence_name or specs[0].name, functools.partial(_sequence, specs))
    parts["rest"] = parts["table_to_batch"] - sum(
        v for k, v in parts.items() if k != "table_to_batch"
    )
    return parts


def _scalar(spec: FeatureSpec, table: pa.Table) -> object:
    return scalar_ids(spec, table.column(spec.name))


def _sequence(specs: tuple[FeatureSpec, ...], table: pa.Table) -> object:
    return sequence_ids(specs, [table.column(s.name) for s in specs], truncate=True)


def estimate(
    row: dict[str, object], batch: int, cores: int, worker_ms: float | None = None
) -> float | None:
    """Samples/s on ``cores`` cores from the CPU per batch: workers on ``cores - 1`` of them
    (``worker_ms`` per batch each, default the row's timed-window figure), bounded by the main
    process's own work per batch."""
    worker = worker_ms if worker_ms is not None else row["worker_cpu_ms_per_batch"]
    main = row["main_cpu_ms_per_batch"]
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
        choices=list(SIZES),
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
    p.add_argument("--windows", type=int, default=5, help="timed windows")
    p.add_argument(
        "--worker-batches",
        type=int,
        default=96,
        help="batches of the in-process worker_steady measurement (0: none)",
    )
    p.add_argument(
        "--shuffle-rows",
        type=int,
        default=262_144,
        help="rows shuffled together; smaller gives more windows for workers to share",
    )
    p.add_argument(
        "--shuffle",
        choices=["on", "off"],
        default="on",
        help="off: the files in order (the unshuffled epoch, its rows read in slices by the "
        "workers in turn); worker_steady still times the shuffled path's worker",
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
    steady: dict[str, object] | None = None
    for w in workers:
        loader = Loader(
            train,
            fs,
            batch_size=args.batch,
            num_workers=w,
            seed=0,
            shuffle=args.shuffle == "on",
            pin_memory=pin,
            shuffle_rows=args.shuffle_rows,
            message_rows=args.message_rows,
        )
        row = measure(loader, args, device)
        rows.append(row)
    if args.worker_batches > 0:  # after the runs: it sets this process's malloc as a worker's
        steady = worker_steady(loader, args.worker_batches)
        print(json.dumps({"worker_steady": steady}), flush=True)
    worker_ms = steady["cpu_ms_per_batch"] if steady is not None else None
    for row in rows:
        row["estimate_samples_per_s"] = estimate(
            row,
            args.batch,
            args.estimate_cores,
            worker_ms if isinstance(worker_ms, float) else None,
        )
        print(json.dumps(row), flush=True)
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
        "shuffle": args.shuffle,
        "estimate_cores": args.estimate_cores,
        "torch": torch.__version__,
        "runs": rows,
        "worker_steady": steady,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
