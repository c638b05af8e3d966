"""Latency of Predict while a delta is applied, beside a full hot swap of the same new tables.

Starts the server on a watched directory holding version 1 (``--keys`` random keys, the real
dense part), drives it with ``--clients`` closed-loop gRPC clients on 127.0.0.1, then

1. applies a delta (``ModelAdminService.ApplyDelta``) that updates ``--updated`` of the keys,
   adds ``--new`` and evicts ``--evicted`` (fractions of the keys) and changes dense rows;
2. installs version 2, a full bundle with exactly the tables of base + delta, and waits for the
   watcher's hot swap.

Reports p50/p99/max latency of the steady state before, during/after the delta, and during/after
the full swap, the time each took, the path the delta took (in place or rebuild), the bytes of
the delta vs the bundle, and errors (must be 0). Then, in this process and on the same device,
``--repeats`` applies of the delta written in place (each followed by an untimed no-op delta
that takes the tables back to the base) beside as many rebuilds of base + delta, median ms::

    python -m bench.bench_delta --out bench/results/delta_cpu.json --device cpu --keys 300000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import torch

from bench.bench_startup import export_program
from bench.synthetic_bundle import (
    keys_per_table,
    seed_feature_set,
    synthetic_request,
    write_synthetic_bundle,
)
from bench.traffic import (
    ClosedLoopClients,
    install_version,
    latency_stats,
    start_model_dir_server,
)
from protos import predict_pb2, predict_pb2_grpc
from serve.admin import AdminConfig
from serve.delta import ApplyPath, apply_delta
from serve.model import LoadedModel, default_device
from shared.bundle import read_bundle, write_bundle
from shared.cli import Parser, check_device, plain, run_cli
from shared.cli import exit_code as _exit_code
from shared.delta import diff_tables, write_delta


def _target_tables(
    bundle_dir: Path, a: argparse.Namespace
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The base tables with a fraction of keys updated, added and evicted, dense rows changed."""
    base = read_bundle(bundle_dir)
    g = torch.Generator().manual_seed(7)
    dense = {}
    for name, w in base.dense_tables.items():
        w = w.clone()
        rows = torch.randperm(w.shape[0], generator=g)[: max(1, w.shape[0] // 10)]
        w[rows] += 0.01
        dense[name] = w
    hashed = {}
    for name, (keys, values) in base.hash_tables.items():
        n = keys.numel()
        perm = torch.randperm(n, generator=g)
        n_evict, n_upd = int(n * a.evicted), int(n * a.updated)
        keep = torch.ones(n, dtype=torch.bool)
        keep[perm[:n_evict]] = False
        values = values.clone()
        values[perm[n_evict : n_evict + n_upd]] += 0.01
        new_keys = torch.arange(int(n * a.new), dtype=torch.int64) + int(keys.max()) + 1
        new_values = torch.randn(new_keys.numel(), values.shape[1], generator=g) * 0.05
        hashed[name] = (
            torch.cat([keys[keep], new_keys]),
            torch.cat([values[keep], new_values]),
        )
    return dense, hashed


def _in_place_vs_rebuild(
    bundle: Path, delta: Path, noop: Path, device: str, repeats: int
) -> dict[str, object]:
    """Median ms of applying ``delta`` to a model of ``bundle`` in place and by a rebuild."""
    model = LoadedModel.load(bundle, device=device)
    in_place, rebuild, pauses, stages = [], [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        applied = apply_delta(model, delta)
        in_place.append(time.perf_counter() - t0)
        if applied.path is not ApplyPath.IN_PLACE:
            raise RuntimeError(f"the delta was not written in place: {applied.reason}")
        stages.append(applied.model.startup.as_dict())
        pauses.append(applied.pause_seconds)
        model = apply_delta(applied.model, noop).model  # back to the base's rows, untimed
        t0 = time.perf_counter()
        apply_delta(model, delta, in_place=False)
        rebuild.append(time.perf_counter() - t0)

    def median_ms(xs: list[float]) -> float:
        return statistics.median(xs) * 1e3

    return {
        "repeats": repeats,
        "in_place_median_ms": median_ms(in_place),
        "rebuild_median_ms": median_ms(rebuild),
        "in_place_pause_median_ms": median_ms(pauses),
        "in_place_stages_median_ms": {
            k: median_ms([s[k] for s in stages]) for k in stages[0] if k != "graphs"
        },
    }


def _noop_delta(root: Path, bundle: Path) -> Path:
    """A delta that changes nothing: applied after another, it takes the tables back to base."""
    base = read_bundle(bundle)
    return write_delta(
        root / "noop",
        tables=diff_tables(
            base.dense_tables, base.hash_tables, base.dense_tables, base.hash_tables
        ),
        base_manifest=base.manifest,
        delta_id="noop",
        target_version="1",
        config_digest=base.config_digest,
    )


EXAMPLE = """examples:
  python -m bench.bench_delta --out bench/results/delta_cpu.json --device cpu --keys 300000
  python -m bench.bench_delta --out bench/results/delta_gpu.json --device cuda --clients 8"""


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_delta", description=plain(__doc__), epilog=EXAMPLE)
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=default_device(),
        help="where the server runs (default: cuda if this machine has one)",
    )
    p.add_argument("--keys", type=int, default=1_500_000, help="keys over the dynamic tables")
    for flag, default, what in (
        ("--updated", 0.02, "fraction of the keys the delta updates"),
        ("--new", 0.005, "fraction of the keys the delta adds (new keys)"),
        ("--evicted", 0.005, "fraction of the keys the delta evicts"),
    ):
        p.add_argument(flag, type=float, default=default, help=what)
    p.add_argument("--clients", type=int, default=4, help="closed-loop gRPC clients")
    p.add_argument("--candidates", type=int, default=100, help="candidate ads per request")
    p.add_argument("--phase-s", type=float, default=3.0, help="seconds of each measured phase")
    p.add_argument(
        "--repeats", type=int, default=5, help="in-place applies and rebuilds timed offline"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    check_device(a.device)

    fs = seed_feature_set()
    keys = keys_per_table(fs, a.keys)
    rng = np.random.default_rng(0)
    requests = [synthetic_request(fs, rng, candidates=a.candidates) for _ in range(64)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        program, _ = export_program(fs, root / "dense.pt2")
        models = root / "models"
        models.mkdir()
        v1 = write_synthetic_bundle(models / "1", fs, keys=keys, program_path=program, version="1")
        dense, hashed = _target_tables(v1, a)
        base = read_bundle(v1)
        tables = diff_tables(base.dense_tables, base.hash_tables, dense, hashed)
        delta = write_delta(
            root / "delta",
            tables=tables,
            base_manifest=base.manifest,
            delta_id="d1",
            target_version="2",
            config_digest=base.config_digest,
        )
        write_bundle(
            root / "v2",
            dense_tables=dense,
            hash_tables={n: [kv] for n, kv in hashed.items()},
            feature_set=fs,
            dense_program_path=program,
            config_digest=base.config_digest,
            version="2",
        )
        sizes = {
            "delta_bytes": sum(f.stat().st_size for f in delta.iterdir()),
            "bundle_bytes": sum(f.stat().st_size for f in (root / "v2").iterdir()),
        }
        admin = AdminConfig(address="127.0.0.1:0", delta_root=root)
        server = start_model_dir_server(models, a.device, ready_timeout_s=300, admin=admin)
        host = f"127.0.0.1:{server.port}"
        traffic = ClosedLoopClients(host, requests, a.clients, timeout_s=30).start()
        time.sleep(0.5)  # settle
        t0 = time.perf_counter()
        time.sleep(a.phase_s)
        t1 = time.perf_counter()
        with grpc.insecure_channel(f"127.0.0.1:{server.admin_port}") as channel:
            stub = predict_pb2_grpc.ModelAdminServiceStub(channel)
            applied = stub.ApplyDelta(predict_pb2.ApplyDeltaRequest(path=delta.name), timeout=300)
        t_applied = time.perf_counter()
        time.sleep(a.phase_s)
        t2 = time.perf_counter()
        install_version(root / "v2", models, "2")
        traffic.wait_for_version("2", timeout_s=300)
        t_swapped = time.perf_counter()
        time.sleep(a.phase_s)
        traffic.stop()
        full_load = server.manager.current.startup.as_dict() if server.manager.current else {}
        paths = {
            p.value: server.metrics.registry.get_sample_value(
                "dynrec_serving_delta_applies_total", {"path": p.value}
            )
            or 0
            for p in ApplyPath
        }
        server.stop(grace=0)
        offline = _in_place_vs_rebuild(v1, delta, _noop_delta(root, v1), a.device, a.repeats)

    report = {
        "benchmark": "Predict latency while a delta is applied vs a full hot swap (serve.delta)",
        "device": a.device,
        "keys_total": sum(keys.values()),
        "delta": {"updated": a.updated, "new": a.new, "evicted": a.evicted, **sizes},
        "clients": a.clients,
        "candidates": a.candidates,
        "before": latency_stats(traffic.latencies(t0, t1)),
        "delta_apply_and_after": latency_stats(traffic.latencies(t1, t2)),
        "full_swap_and_after": latency_stats(traffic.latencies(t2)),
        "delta_apply_seconds": t_applied - t1,
        "delta_apply_server_seconds": applied.apply_seconds,
        "delta_apply_paths": paths,
        "in_place_vs_rebuild": offline,
        "full_swap_seconds_after_install": t_swapped - t2,
        "full_load_startup_seconds": full_load,
        "errors": len(traffic.errors),
        "error_examples": traffic.errors[:5],
        "versions_seen": traffic.versions(),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    keys_shown = (
        "before",
        "delta_apply_and_after",
        "full_swap_and_after",
        "delta_apply_paths",
        "in_place_vs_rebuild",
        "errors",
    )
    print(json.dumps({k: report[k] for k in keys_shown}))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
