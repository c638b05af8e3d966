"""Where one request's time goes (validate, feature generation, predict), single-threaded.

python -m bench.profile_request --device cuda --keys 300000
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.bench_startup import export_program
from bench.synthetic_bundle import (
    keys_per_table,
    seed_feature_set,
    synthetic_request,
    write_synthetic_bundle,
)
from serve.batcher import concat_batches
from serve.limits import Limits
from serve.model import LoadedModel, default_device
from serve.validation import request_inputs
from shared.cli import Parser, run_cli
from shared.cli import exit_code as _exit_code
from shared.fg import request_columns_to_batch


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m bench.profile_request")
    p.add_argument("--device", choices=["cpu", "cuda"], default=default_device())
    p.add_argument("--keys", type=int, default=300_000)
    p.add_argument("--candidates", type=int, default=100)
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args(argv)
    fs = seed_feature_set()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        program, _ = export_program(fs, Path(tmp) / "dense.pt2")
        bundle = write_synthetic_bundle(
            Path(tmp) / "b", fs, keys=keys_per_table(fs, a.keys), program_path=program, version="1"
        )
        model = LoadedModel.load(bundle, device=a.device)
    req = synthetic_request(fs, rng, candidates=a.candidates)
    times: dict[str, list[float]] = {"validate": [], "fg": [], "predict": [], "predict_x8": []}
    batch = None
    for _ in range(a.iters):
        t0 = time.perf_counter()
        inputs = request_inputs(req, fs, Limits())
        t1 = time.perf_counter()
        batch = request_columns_to_batch(fs, **vars(inputs))
        t2 = time.perf_counter()
        model.predict(batch)
        t3 = time.perf_counter()
        model.predict(concat_batches([batch] * 8))
        t4 = time.perf_counter()
        for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[k].append(dt)
    for k, v in times.items():
        print(f"{k}: median {statistics.median(v) * 1e3:.2f} ms")
    assert batch is not None
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        model.predict(batch)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    if a.device == "cuda":
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as tp:
            model.predict(batch)
        print(tp.key_averages().table(sort_by="cpu_time_total", row_limit=20))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
