"""Bundle-to-SERVING time of the seed config at full scale, split by stage.

Writes one bundle with ``--keys`` keys over the seed config's six dynamic tables (split like the
full Taobao vocabularies, dim 16), the dense tables, and the real MultiTowerDIN dense program
(untrained weights: load and warm-up cost does not depend on them), then loads it ``--repeats``
times as the server does (:meth:`serve.model.LoadedModel.load`) and reports the median of each
stage: read (manifest, checksums, safetensors), table_build (hash tables + dense tables on the
device, host-to-device copy included), program_load, warmup, total. Both with and without
sha256 verification of the files, and once more with the program cache holding the same graph
(what a hot swap of a retrained version costs, :mod:`serve.program_cache`). Imports, CUDA context creation and the first-ever CUDA kernel
launches happen before the timed loads (one untimed load first)::

    python -m bench.bench_startup --out results/startup_cpu.json --device cpu
    python -m bench.bench_startup --out results/startup_gpu.json --device cuda --keys 1500000
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.synthetic_bundle import (
    export_seed_program,
    keys_per_table,
    seed_feature_set,
    write_synthetic_bundle,
)
from serve.model import STAGES, LoadedModel, default_device
from serve.program_cache import ProgramCache
from shared.bundle import read_bundle
from shared.cli import Parser, check_device, plain, run_cli
from shared.cli import exit_code as _exit_code
from shared.features import FeatureSet
from shared.hashtable.lookup import StaticLookupTable
from shared.hashtable.table import HashTable


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def export_program(fs: FeatureSet, path: Path) -> tuple[Path, str]:
    """The seed config's real dense part with the pair inputs (a format 3 bundle's program, what
    CUDA graphs replay: :func:`bench.synthetic_bundle.export_seed_program`) and its description."""
    export_seed_program(fs, path, pairs=True)
    return path, "MultiTowerDIN dense part (train.model.dense_arch, untrained, pair inputs)"


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def measure(
    bundle: Path, device: str, repeats: int, verify: bool, *, same_graph: bool = False
) -> dict[str, Any]:
    """``same_graph``: the program cache holds a program of the same graph (a retrained
    version's hot swap); otherwise dense.pt2 is deserialized every time (a cold start)."""
    runs: list[dict[str, float]] = []
    per_table: list[dict[str, float]] = []
    cache = ProgramCache() if same_graph else None
    if cache is not None:
        LoadedModel.load(bundle, device=device, program_cache=cache)  # fills the cache
    for _ in range(repeats):
        model = LoadedModel.load(
            bundle, device=device, verify_checksums=verify, program_cache=cache
        )
        runs.append(model.startup.as_dict())
        per_table.append(model.tables.build_seconds)
        del model
    return {
        "verify_checksums": verify,
        "program": "same graph cached (hot swap of a retrained version)" if same_graph else "cold",
        "median_seconds": {s: _median(runs, s) for s in STAGES},
        "median_table_build_seconds": {t: _median(per_table, t) for t in per_table[0]},
        "runs": runs,
    }


def measure_build_only(bundle: Path, device: str, repeats: int) -> dict[str, Any]:
    """The dynamic tables' build alone, keys and values already on the device: the serving
    structure (one fused StaticLookupTable, :mod:`serve.lookup`) and, for comparison, one
    ``HashTable.from_keys_values`` per table; plus the host-to-device copy of the tensors."""
    b = read_bundle(bundle, verify_checksums=False)
    dev = torch.device(device)
    names = list(b.hash_tables)
    shift = 63 - max(len(names), 1).bit_length()
    fused = torch.cat([(i << shift) | b.hash_tables[n][0] for i, n in enumerate(names)]).to(dev)
    values = torch.cat([b.hash_tables[n][1] for n in names]).to(dev)
    on_dev = {t: (k.to(dev), v.to(dev)) for t, (k, v) in b.hash_tables.items()}
    cap = {t.name: t.dynamic.bucket_capacity for t in b.feature_set.dynamic_tables if t.dynamic}

    def timed(fn: Any) -> float:
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        return time.perf_counter() - t0

    def hash_tables() -> None:
        for t, (k, v) in on_dev.items():
            HashTable.from_keys_values(k, v, bucket_capacity=cap[t], device=dev)

    def copies() -> None:
        for k, v in b.hash_tables.values():
            k.to(dev), v.to(dev)

    runs: dict[str, list[float]] = {"static_fused": [], "hash_tables": [], "host_to_device": []}
    for _ in range(repeats + 1):  # the first round is untimed (allocator, kernels)
        runs["static_fused"].append(
            timed(lambda: StaticLookupTable.from_keys_values(fused, values, device=dev))
        )
        runs["hash_tables"].append(timed(hash_tables))
        runs["host_to_device"].append(timed(copies))
    return {f"median_{k}_seconds": statistics.median(v[1:]) for k, v in runs.items()}


EXAMPLE = """examples:
  python -m bench.bench_startup --out results/startup_cpu.json --device cpu
  python -m bench.bench_startup --out results/startup_gpu.json --device cuda --keys 1500000"""


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_startup", description=plain(__doc__), epilog=EXAMPLE)
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=default_device(),
        help="where the model is loaded (default: cuda if this machine has one)",
    )
    p.add_argument("--keys", type=int, default=1_500_000, help="keys over the dynamic tables")
    p.add_argument(
        "--repeats", type=int, default=5, help="timed loads of each kind (the median is kept)"
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where to write the bundle, in a temp dir removed after (default: the system's)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    check_device(a.device)

    fs = seed_feature_set()
    keys = keys_per_table(fs, a.keys)
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        t0 = time.perf_counter()
        program, program_kind = export_program(fs, Path(tmp) / "dense.pt2")
        bundle = write_synthetic_bundle(
            Path(tmp) / "bundle", fs, keys=keys, program_path=program, version="bench", seed=0
        )
        write_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in bundle.iterdir())
        t0 = time.perf_counter()
        # untimed: CUDA context, first kernels, allocator
        LoadedModel.load(bundle, device=a.device, program_cache=None)
        first_load_s = time.perf_counter() - t0
        results = [measure(bundle, a.device, a.repeats, v) for v in (True, False)]
        results.append(measure(bundle, a.device, a.repeats, True, same_graph=True))
        build_only = measure_build_only(bundle, a.device, a.repeats)

    device_name = torch.cuda.get_device_name() if a.device == "cuda" else platform.processor()
    report = {
        "benchmark": "bundle-to-SERVING startup (serve.model.LoadedModel.load)",
        "device": a.device,
        "device_name": device_name or platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "keys_total": sum(keys.values()),
        "keys_per_table": keys,
        "dim": 16,
        "bundle_bytes": size,
        "dense_program": program_kind,
        "repeats": a.repeats,
        "bundle_write_seconds": write_s,
        "first_load_seconds_untimed": first_load_s,
        "results": results,
        "hash_table_build_only": build_only,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    for r in results:
        med = r["median_seconds"]
        print(
            f"{a.device} verify={r['verify_checksums']} program={r['program'].split()[0]}: "
            + ", ".join(f"{s} {med[s] * 1e3:.1f} ms" for s in STAGES)
        )
    print(
        "dynamic tables alone (device resident): "
        + ", ".join(f"{k[7:-8]} {v * 1e3:.1f} ms" for k, v in build_only.items())
    )
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
