"""Where one request's time goes (parse, validate, feature generation, predict), single-threaded.

For each request format (``columnar``: ``candidate_columns``; ``rows``: one ``Features`` per
candidate) and candidate count, the same random request is parsed from its wire bytes, checked
(:func:`serve.validation.request_inputs`) and turned into a Batch
(:func:`shared.fg_request.request_columns_to_batch`) ``--iters`` times; the medians per stage
(wall and thread CPU time, ms) are printed and written as JSON to ``--out``. ``--predict`` adds the model's
``predict`` of that batch (and of 8 of them) and a profile of it.
"""

from __future__ import annotations

import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench.bench_startup import export_program
from bench.synthetic_bundle import (
    as_columnar,
    keys_per_table,
    seed_feature_set,
    synthetic_request,
    write_synthetic_bundle,
)
from protos import predict_pb2
from serve.batcher import concat_batches
from serve.limits import Limits
from serve.model import LoadedModel, default_device
from serve.validation import request_inputs
from shared.batch import Batch
from shared.cli import Parser, plain, run_cli
from shared.cli import exit_code as _exit_code
from shared.features import FeatureSet
from shared.fg_request import request_columns_to_batch

EXAMPLE = """examples:
  python -m bench.profile_request --candidates 100 500 --out /tmp/profile.json
  python -m bench.profile_request --device cuda --keys 300000 --predict"""
FORMATS = ("columnar", "rows")
_Stage = Callable[[], object]


def _request(fs: FeatureSet, fmt: str, candidates: int) -> predict_pb2.PredictRequest:
    """The same random request (seed 0) in format ``fmt``."""
    req = synthetic_request(fs, np.random.default_rng(0), candidates=candidates)
    if fmt == "rows":
        return req
    return as_columnar(fs, req)


def _timed(stages: dict[str, _Stage], iters: int) -> dict[str, dict[str, float]]:
    """Median wall and thread-CPU milliseconds of each stage, run in order ``iters`` times."""
    wall: dict[str, list[float]] = {k: [] for k in stages}
    cpu: dict[str, list[float]] = {k: [] for k in stages}
    for _ in range(iters):
        for name, stage in stages.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            stage()
            t1, c1 = time.perf_counter(), time.thread_time()
            wall[name].append((t1 - t0) * 1e3)
            cpu[name].append((c1 - c0) * 1e3)
    return {
        k: {"wall_ms": statistics.median(wall[k]), "cpu_ms": statistics.median(cpu[k])}
        for k in stages
    }


def profile_host(
    fs: FeatureSet, fmt: str, candidates: int, iters: int, model: LoadedModel | None
) -> tuple[dict[str, dict[str, float]], Batch]:
    """Per-stage medians of one request of ``fmt`` with ``candidates`` candidates (and the batch)."""
    wire = _request(fs, fmt, candidates).SerializeToString()
    limits = Limits()
    request = predict_pb2.PredictRequest.FromString(wire)
    inputs = request_inputs(request, fs, limits)
    batch = request_columns_to_batch(fs, **vars(inputs))
    stages: dict[str, _Stage] = {
        "parse": lambda: predict_pb2.PredictRequest.FromString(wire),
        "validate": lambda: request_inputs(request, fs, limits),
        "fg": lambda: request_columns_to_batch(fs, **vars(inputs)),
    }
    if model is not None:
        x8 = concat_batches([batch] * 8)
        stages["predict"] = lambda: model.predict(batch)
        stages["predict_x8"] = lambda: model.predict(x8)
    return _timed(stages, iters), batch


def _load_model(fs: FeatureSet, device: str, keys: int, tmp: Path) -> LoadedModel:
    program, _ = export_program(fs, tmp / "dense.pt2")
    bundle = write_synthetic_bundle(
        tmp / "b", fs, keys=keys_per_table(fs, keys), program_path=program, version="1"
    )
    return LoadedModel.load(bundle, device=device)


def _profile_predict(model: LoadedModel, batch: Batch, device: str) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        model.predict(batch)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    if device == "cuda":
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as tp:
            model.predict(batch)
        print(tp.key_averages().table(sort_by="cpu_time_total", row_limit=20))


def _parser() -> Parser:
    p = Parser(prog="python -m bench.profile_request", description=plain(__doc__), epilog=EXAMPLE)
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=default_device(),
        help="where predict runs (default: cuda if this machine has one)",
    )
    p.add_argument("--keys", type=int, default=300_000, help="keys of the bundle (--predict)")
    p.add_argument(
        "--candidates", type=int, nargs="+", default=[100, 500], help="candidates per request"
    )
    p.add_argument(
        "--formats", choices=FORMATS, nargs="+", default=list(FORMATS), help="request formats"
    )
    p.add_argument("--iters", type=int, default=200, help="runs of each stage (medians)")
    p.add_argument("--predict", action="store_true", help="also time and profile predict()")
    p.add_argument("--out", type=Path, help="write the medians here as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    fs = seed_feature_set()
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = _load_model(fs, a.device, a.keys, Path(tmp)) if a.predict else None
        batch = None
        for fmt in a.formats:
            for n in a.candidates:
                results[f"{fmt}/{n}"], batch = profile_host(fs, fmt, n, a.iters, model)
                line = ", ".join(
                    f"{k} {v['wall_ms']:.3f} ms (cpu {v['cpu_ms']:.3f})"
                    for k, v in results[f"{fmt}/{n}"].items()
                )
                print(f"{fmt:8} {n:5} candidates: {line}")
        if model is not None and batch is not None:
            _profile_predict(model, batch, a.device)
    if a.out is not None:
        meta = {"device": a.device, "iters": a.iters, "predict": a.predict}
        a.out.write_text(json.dumps({"config": meta, "medians": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
