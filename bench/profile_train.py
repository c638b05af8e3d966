"""Where the time of one training step goes: phases, host syncs and a torch.profiler table.

Three views of the seed config's step at ``--batch`` (8192) on batches already on the device:

- ``phases``: median milliseconds of each phase (lookups, dense forward, backward with the fused
  hash-table Adagrad, optimizer steps), each bracketed by a device synchronize;
- ``syncs`` (CUDA only): every host synchronization in one step, counted by the line of this
  repository that caused it (``torch.cuda.set_sync_debug_mode``);
- ``profile``: torch.profiler over ``--steps`` steps: GPU busy time against wall time (how much of
  the step the GPU idles, i.e. host bound) and the top operators by self CPU and self device time,
  written as text beside the JSON.

    python -m bench.profile_train --samples DIR/samples --out out/profile_train.json [--device cuda]
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

from shared.cli import Parser, run_cli
from shared.cli import exit_code as _exit_code
from shared.config import load_config
from shared.dense_inputs import assemble_dense_inputs
from shared.features import build_feature_set
from train.data.loader import Loader
from train.model.graphed import DenseArchGraphs
from train.model.multi_tower_din import MultiTowerDIN
from train.trainer import _amp_context, build_optimizers, train_step

ROOT = Path(__file__).resolve().parents[1]


def phased_step(model, optimizers, batch, step: int, amp: str, sync, graphs) -> dict[str, float]:
    """One train_step split into phases, each timed between device synchronizations."""
    times: dict[str, float] = {}
    t = time.perf_counter()

    def mark(name: str) -> None:
        nonlocal t
        sync()
        now = time.perf_counter()
        times[name] = (now - t) * 1e3
        t = now

    model.sparse.dynamic.set_step(step)
    for opt in optimizers.values():
        opt.zero_grad(set_to_none=True)
    mark("zero_grad")
    pooled, sequences = model.sparse(batch)
    mark("sparse_forward")
    inputs = dict(assemble_dense_inputs(model.fs, batch, pooled, sequences))
    if batch.rows_are_users:
        inputs["user_index"] = None
    with _amp_context(amp, batch.user_index.device):
        logits = (graphs or model.dense)(**inputs)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), batch.labels)
    mark("dense_forward")
    loss.backward()
    mark("backward")
    for opt in optimizers.values():
        opt.step()
    mark("optimizer")
    return times


def sync_sites(model, optimizers, batch, step: int, amp: str, graphs) -> dict[str, int]:
    """Host synchronizations of one step, counted by the first frame inside this repository."""
    sites: collections.Counter[str] = collections.Counter()
    root = str(ROOT)

    def record(message, category, filename, lineno, file=None, line=None):  # noqa: ARG001
        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if f.filename.startswith(root) and "profile_train" not in f.filename
        ]
        where = (
            f"{Path(frames[-1].filename).relative_to(root)}:{frames[-1].lineno}"
            if frames
            else filename
        )
        sites[f"{where} ({str(message)[:60]})"] += 1

    old = warnings.showwarning
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            train_step(model, optimizers, batch, step, amp, graphs=graphs)
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    return dict(sites.most_common())


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--config", type=Path, default=ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config"
    )
    p.add_argument("--samples", type=Path, required=True, help="samples dir with train/")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--amp", default="", choices=["", "BF16", "FP16"])
    p.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=["auto", "on", "off"],
        help="dense part through CUDA graphs, as the trainer runs it (auto: on CUDA)",
    )
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    config = load_config(args.config)
    fs = build_feature_set(config)
    loader = Loader(args.samples / "train", fs, batch_size=args.batch, num_workers=1,
                    shuffle=True, seed=0, drop_last=True, pin_memory=device.type == "cuda")  # fmt: skip
    need = args.warmup + 3 * args.steps + 1
    batches = []
    for b in loader.epoch(0):
        batches.append(b.to(device, non_blocking=True))
        if len(batches) == need:
            break
    if len(batches) < need:
        raise SystemExit(f"--samples has {len(batches)} batches of {args.batch}; need {need}")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    model = MultiTowerDIN.from_config(config, fs, device=device, seed=0)
    optimizers = build_optimizers(model, config.train_config)
    model.train()
    use_graphs = args.cuda_graphs == "on" or (args.cuda_graphs == "auto" and device.type == "cuda")
    graphs = DenseArchGraphs(model.dense) if use_graphs else None
    it = iter(enumerate(batches))
    for _ in range(args.warmup):
        i, b = next(it)
        train_step(model, optimizers, b, i, args.amp, graphs=graphs)
    sync()

    result: dict[str, object] = {"device": str(device), "torch": torch.__version__,
                                 "batch": args.batch, "amp": args.amp,
                                 "cuda_graphs": use_graphs}  # fmt: skip
    phases: dict[str, list[float]] = collections.defaultdict(list)
    walls = []
    for _ in range(args.steps):
        i, b = next(it)
        t0 = time.perf_counter()
        for k, v in phased_step(model, optimizers, b, i, args.amp, sync, graphs).items():
            phases[k].append(v)
        walls.append((time.perf_counter() - t0) * 1e3)
    result["phases_ms_median"] = {k: statistics.median(v) for k, v in phases.items()}
    result["phased_step_ms_median"] = statistics.median(walls)

    if device.type == "cuda":
        i, b = next(it)
        result["syncs"] = sites = sync_sites(model, optimizers, b, i, args.amp, graphs)
        result["sync_count"] = sum(sites.values())

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            i, b = next(it)
            train_step(model, optimizers, b, i, args.amp, graphs=graphs)
        sync()
    wall = (time.perf_counter() - t0) * 1e3 / args.steps
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) / args.steps
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel"))
    result["profile"] = {
        "wall_ms_per_step": wall,
        "device_busy_ms_per_step": device_us / 1e3,
        "device_busy_fraction": device_us / 1e3 / wall,
        "kernel_launches_per_step": launches / args.steps,
    }
    text = [
        f"== {args.steps} steps, batch {args.batch}, {device}",
        json.dumps(result["profile"]),
        "== by self CPU time",
        events.table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=70),
    ]
    if device.type == "cuda":
        text += [
            "== by self device time",
            events.table(sort_by="self_cuda_time_total", row_limit=35, max_name_column_width=70),
        ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".txt").write_text("\n".join(text))
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "syncs"}, indent=2))
    if "syncs" in result:
        print(f"host syncs per step: {result['sync_count']}")
        for site, n in list(result["syncs"].items())[:25]:  # type: ignore[union-attr]
            print(f"  {n:3d}  {site}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
