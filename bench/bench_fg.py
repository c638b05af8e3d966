"""Feature-generation throughput per core: sample Parquet rows → Batch (sequence splitting included).

Generates and builds the ``small`` synthetic data (or reads ``--samples``), loads the train split
into memory, and times :func:`shared.fg.table_to_batch` over all of it in ``--batch-size``
slices, single process with numpy/pyarrow/torch limited to one thread (= per core); ``--repeats``
passes, median reported. Also times :func:`shared.fg_request.request_to_batch` for one user with
100 candidates (the serving path). Goal: >= 1M rows/s per core::

    python -m bench.bench_fg --out out/bench/bench_fg.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from shared.cli import Parser, plain, run_cli
from shared.cli import exit_code as _exit_code
from shared.config import load_config
from shared.features import FeatureSet, Side, build_feature_set
from shared.fg import FgStats, table_to_batch
from shared.fg_request import request_to_batch
from train.data import synthetic, taobao

CONFIG = (
    Path(__file__).resolve().parents[1] / "configs" / "multi_tower_din_taobao_dynamicemb.config"
)
GOAL = 1_000_000
EXAMPLE = """examples:
  python -m bench.bench_fg --out out/bench/bench_fg.json
  python -m bench.bench_fg --samples out/small/samples --repeats 3 --out out/bench/bench_fg.json"""


def _samples(args: argparse.Namespace, fs: FeatureSet, tmp: Path) -> Path:
    if args.samples:
        return Path(args.samples)
    synthetic.generate(args.size, tmp, seed=0)
    taobao.build_samples(tmp / "raw", tmp / "samples", fs)
    return tmp / "samples"


def _request(fs: FeatureSet, row: dict, n: int) -> dict:
    sides = {name: spec.side for name, spec in fs.features.items() if not spec.is_sequence}
    seqs = {}
    for name, spec in fs.features.items():
        if spec.is_sequence:
            seqs[name] = [int(t) if t else None for t in row[name].split("|")] if row[name] else []
    if not any(seqs.values()):
        seqs = {k: [] for k in seqs}
    item = {k: row[k] for k, s in sides.items() if s is Side.ITEM}
    return {
        "user": {k: row[k] for k, s in sides.items() if s is Side.USER},
        "context": {k: row[k] for k, s in sides.items() if s is Side.CONTEXT},
        "candidates": [dict(item, adgroup_id=item["adgroup_id"] + i) for i in range(n)],
        "sequences": seqs,
    }


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_fg", description=plain(__doc__), epilog=EXAMPLE)
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument(
        "--size",
        default="small",
        choices=sorted(synthetic.SIZES),
        help="synthetic data size to generate when --samples is not given",
    )
    p.add_argument("--samples", help="an existing samples dir (skips generate + build)")
    p.add_argument("--batch-size", type=int, default=8192, help="rows per table_to_batch call")
    p.add_argument("--repeats", type=int, default=5, help="timed passes (median reported)")
    p.add_argument("--config", type=Path, default=CONFIG, help="pipeline config (features)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    torch.set_num_threads(1)
    pa.set_cpu_count(1)
    fs = build_feature_set(load_config(args.config))
    with tempfile.TemporaryDirectory() as tmp:
        samples = _samples(args, fs, Path(tmp))
        table = pq.read_table(samples / "train", columns=[*fs.columns(), "_oracle_p"])
    table = table.combine_chunks()
    slices = [table.slice(i, args.batch_size) for i in range(0, table.num_rows, args.batch_size)]
    seq = next(name for name, spec in fs.features.items() if spec.is_sequence)
    stats = FgStats()
    tokens = 0
    for s in slices:  # warm-up; counts the sequence elements and the defaults applied
        tokens += int(table_to_batch(fs, s, stats=stats).sequence[seq].lengths().sum())
    runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for s in slices:
            table_to_batch(fs, s)
        runs.append(table.num_rows / (time.perf_counter() - start))
    row = table.slice(0, 200).to_pylist()
    row = max(row, key=lambda r: len(r[seq]))  # a user with history
    req = _request(fs, row, 100)
    request_to_batch(fs, **req)
    lat = []
    for _ in range(200):
        start = time.perf_counter()
        request_to_batch(fs, **req)
        lat.append((time.perf_counter() - start) * 1e3)
    median = statistics.median(runs)
    result = {
        "bench": "fg",
        "what": "table_to_batch rows/s, single process and thread (= per core), sequence splitting included",
        "rows": table.num_rows,
        "batch_size": args.batch_size,
        "sequence_elements_per_row": tokens / table.num_rows,
        "sequence_columns": sum(spec.is_sequence for spec in fs.features.values()),
        "features": len(fs.features),
        "rows_per_s_median": median,
        "rows_per_s_runs": runs,
        "goal_rows_per_s": GOAL,
        "meets_goal": median >= GOAL,
        "request_100_candidates_ms_median": statistics.median(lat),
        "request_sequence_length": len(req["sequences"][seq]),
        "fg_stats": stats.as_dict(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": platform.processor() or platform.machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
