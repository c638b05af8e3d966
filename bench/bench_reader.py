"""The raw-file reader: build_samples rows/s and peak RSS at ``small`` scale, extrapolated to full.

Generates the synthetic raw files of ``small`` and of ``small`` × ``--scale`` (users, ads and
samples multiplied), then runs :func:`train.data.taobao.build_samples` on each in a fresh process
(``--repeats`` times for small), so that the process's peak RSS (``ru_maxrss``) is the build's;
the RSS after imports is subtracted. Peak memory grows linearly with the raw rows once they
exceed ``chunk_rows`` (the sorted columns), so the two sizes give a slope (bytes per raw row)
and an intercept, extrapolated to the full dataset's 26.6M rows. That extrapolation is an upper
bound (allocator caches and write buffers inflate the small-scale slope): ``--full-raw DIR``
(raw files from ``python -m train.data generate --size full --out X``, DIR = X/raw) also builds
the full data once and reports the measured figures (about 1.5 minutes on 2 cores)::

    python -m bench.bench_reader --out out/bench/bench_reader.json [--full-raw data/full/raw]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared.cli import Parser, plain, run_cli
from shared.cli import exit_code as _exit_code
from train.data import synthetic

CONFIG = (
    Path(__file__).resolve().parents[1] / "configs" / "multi_tower_din_taobao_dynamicemb.config"
)
FULL_ROWS = synthetic.SIZES["full"].samples


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def child(raw: str, out: str, config: str) -> None:
    """One build in this process; prints seconds, peak and after-import RSS (KiB) as JSON."""
    from shared.config import load_config
    from shared.features import build_feature_set
    from train.data.taobao import build_samples

    fs = build_feature_set(load_config(config))
    base = _rss_kb()
    start = time.perf_counter()
    report = build_samples(raw, out, fs)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps({"seconds": seconds, "peak_kb": peak, "base_kb": base, "rows": report.raw_rows})
    )


def _build(raw: Path, out: Path, config: Path) -> dict:
    cmd = [sys.executable, "-m", "bench.bench_reader", "--out", "-", "--child"]
    done = subprocess.run(
        [*cmd, str(raw), str(out), str(config)], check=True, capture_output=True, text=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def scaled(spec: synthetic.SizeSpec, k: int) -> synthetic.SizeSpec:
    return dataclasses.replace(
        spec,
        name=f"{spec.name}x{k}",
        users=spec.users * k,
        ads=spec.ads * k,
        samples=spec.samples * k,
        campaigns=spec.campaigns * k,
        customers=spec.customers * k,
        brands=spec.brands * k,
    )


EXAMPLE = """examples:
  python -m bench.bench_reader --out out/bench/bench_reader.json
  python -m bench.bench_reader --out out/bench/bench_reader.json --full-raw data/full/raw"""


def _parser() -> Parser:
    parser = Parser(
        prog="python -m bench.bench_reader",
        description=plain(__doc__.split("\n\n")[0]),
        epilog=EXAMPLE,
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--repeats", type=int, default=3, help="builds of the small size")
    parser.add_argument("--scale", type=int, default=4, help="second size: small x SCALE")
    parser.add_argument(
        "--config",
        type=Path,
        default=CONFIG,
        help="config of the build (default: configs/multi_tower_din_taobao_dynamicemb.config)",
    )
    parser.add_argument(
        "--full-raw", type=Path, help="also build these full-size raw files once (a raw/ dir)"
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    small = synthetic.SIZES["small"]
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        gen = synthetic.generate(small, Path(tmp, "small"), seed=0)
        gen_seconds = time.perf_counter() - start
        raw_mb = sum(f.stat().st_size for f in Path(tmp, "small", "raw").glob("*.csv")) / 2**20
        runs = [
            _build(Path(tmp, "small", "raw"), Path(tmp, f"s{i}"), args.config)
            for i in range(args.repeats)
        ]
        synthetic.generate(scaled(small, args.scale), Path(tmp, "big"), seed=0)
        big = _build(Path(tmp, "big", "raw"), Path(tmp, "sbig"), args.config)
        full = _build(args.full_raw, Path(tmp, "sfull"), args.config) if args.full_raw else None
    seconds = statistics.median(r["seconds"] for r in runs)
    own = statistics.median(r["peak_kb"] - r["base_kb"] for r in runs) * 1024
    own_big = (big["peak_kb"] - big["base_kb"]) * 1024
    rows, rows_big = runs[0]["rows"], big["rows"]
    slope = (own_big - own) / (rows_big - rows)
    intercept = own - slope * rows
    result = {
        "bench": "reader",
        "what": "build_samples (CSV read, sort, sequences, Parquet write), one process",
        "size": "small",
        "raw_rows": rows,
        "raw_csv_mb": raw_mb,
        "generated_ctr": gen.ctr,
        "generate_seconds": gen_seconds,
        "build_seconds_median": seconds,
        "build_rows_per_s_median": rows / seconds,
        "build_seconds_runs": [r["seconds"] for r in runs],
        "peak_rss_mb_median": statistics.median(r["peak_kb"] for r in runs) / 1024,
        "after_import_rss_mb": runs[0]["base_kb"] / 1024,
        "build_own_rss_mb_median": own / 2**20,
        f"x{args.scale}_raw_rows": rows_big,
        f"x{args.scale}_build_seconds": big["seconds"],
        f"x{args.scale}_build_own_rss_mb": own_big / 2**20,
        "bytes_per_raw_row": slope,
        "fixed_mb": intercept / 2**20,
        "full_rows": FULL_ROWS,
        "full_peak_rss_gb_extrapolated": (runs[0]["base_kb"] * 1024 + intercept + slope * FULL_ROWS)
        / 2**30,
        "full_build_seconds_extrapolated": big["seconds"] * FULL_ROWS / rows_big,
    }
    if full is not None:
        result |= {
            "full_measured_raw_rows": full["rows"],
            "full_measured_build_seconds": full["seconds"],
            "full_measured_rows_per_s": full["rows"] / full["seconds"],
            "full_measured_peak_rss_gb": full["peak_kb"] / 2**20,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
