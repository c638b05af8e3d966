"""Sample build time (``train.data.taobao.build_samples``) on one thread against several.

Generates ``--size`` synthetic raw data once (or reads ``--raw``), then builds the samples for
the seed config with ``threads=1`` and with ``--threads`` (default: the build's own default, the
CPUs up to 8), alternating ``--repeats`` times, and checks that every Parquet file of the two
builds is byte-identical (the files must not depend on the threads: results across sessions
compare runs on them). Reports each build's median seconds and the ratio; on the H200 machine the
full build is the largest part of the data a device call makes before it trains::

    python -m bench.bench_build_samples --size full --out bench/results/bench_build_samples.json
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shared.cli import Parser, plain, run_cli, write_result
from shared.cli import exit_code as _exit_code
from shared.config import load_config
from shared.features import build_feature_set
from train.data import synthetic, taobao

CONFIG = (
    Path(__file__).resolve().parents[1] / "configs" / "multi_tower_din_taobao_dynamicemb.config"
)
EXAMPLE = """examples:
  python -m bench.bench_build_samples --size small --out out/bench/bench_build_samples.json
  python -m bench.bench_build_samples --raw /tmp/full/raw --out out/bench/bench_build_samples.json"""


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.parquet"))}


def measure(raw: Path, work: Path, threads: int, repeats: int) -> dict[str, Any]:
    """Builds of ``raw`` on 1 and on ``threads`` threads, alternating, ``repeats`` each."""
    fs = build_feature_set(load_config(CONFIG))
    seconds: dict[int, list[float]] = {1: [], threads: []}
    for _ in range(repeats):
        for n in (1, threads):
            t0 = time.perf_counter()
            taobao.build_samples(raw, work / f"t{n}", fs, threads=n)
            seconds[n].append(time.perf_counter() - t0)
    one, many = _files(work / "t1"), _files(work / f"t{threads}")
    identical = one.keys() == many.keys() and all(one[k] == many[k] for k in one)
    med = {n: statistics.median(s) for n, s in seconds.items()}
    return {
        "threads": threads,
        "cpus": os.cpu_count(),
        "repeats": repeats,
        "seconds_one_thread": seconds[1],
        "seconds_threads": seconds[threads],
        "median_one_thread": med[1],
        "median_threads": med[threads],
        "speedup": med[1] / med[threads],
        "files": len(one),
        "identical_files": identical,
    }


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_build_samples", description=plain(__doc__),
               epilog=EXAMPLE)  # fmt: skip
    p.add_argument("--size", default="small", choices=list(synthetic.SIZES),
                   help="synthetic data to generate when --raw is not given")  # fmt: skip
    p.add_argument("--raw", type=Path, help="raw CSV files to build (default: generate --size)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads of the second build (default: the CPUs, at most 8)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1, help="builds of each kind")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    threads = args.threads or taobao.build_threads()
    if threads < 2 or args.repeats < 1:
        raise ValueError(
            f"--threads {threads} --repeats {args.repeats}: give 2+ threads, 1+ repeats"
        )
    with tempfile.TemporaryDirectory(prefix="bench_build_") as tmp:
        work = Path(tmp)
        raw = args.raw
        if raw is None:
            synthetic.generate(args.size, work / "gen", seed=0)
            raw = work / "gen" / "raw"
        size = None if args.raw else args.size  # --raw: whatever was generated there
        result = {"bench": "build_samples", "raw": str(args.raw), "size": size,
                  **measure(raw, work, threads, args.repeats)}  # fmt: skip
    write_result(args.out, result)
    print(f"build: 1 thread {result['median_one_thread']:.1f} s, {threads} threads "
          f"{result['median_threads']:.1f} s ({result['speedup']:.2f}x), identical files: "
          f"{result['identical_files']}", flush=True)  # fmt: skip
    if not result["identical_files"]:
        raise RuntimeError("the builds differ: the threaded build must write the same files")
    return result


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
