"""Where the time of one training step goes: step time, phases, host syncs, launches, profile.

The views of a config's step at ``--batch`` (default: the config's ``data_config.batch_size``)
on batches already on the device (:func:`profile_model`, which ``bench.bench_train`` runs for
each config it compares), the dense EMA included where the config has one:

- ``step_ms_median``: the step as the trainer runs it (no syncs inside);
- ``phases``: median milliseconds of each phase (lookups, dense forward, backward with the fused
  hash-table Adagrad, optimizer steps, the dense EMA), each ended by a device synchronize;
- ``syncs`` (CUDA only): every host synchronization in one step, counted by the line of this
  repository that caused it (``torch.cuda.set_sync_debug_mode``);
- ``profile``: torch.profiler over ``--steps`` steps: GPU launches per step and per phase, GPU
  busy time against the unprofiled step (below 1: the GPU idles, the step is host bound) and
  the top operators by self CPU and self device time, written as text beside the JSON;
- ``host``: cProfile over ``--steps`` steps: each Python function's own host time per step and
  the sums by file (what a host-bound step spends its milliseconds on), and the time blocked
  in the host reads (``tolist``, ``item``) that wait for the device.

    python -m bench.profile_train --samples DIR/samples --out out/profile_train.json [--device cuda]
"""

from __future__ import annotations

import collections
import json
import re
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.step_profile import device_busy_us
from shared.batch import Batch
from shared.cli import Parser, plain, run_cli
from shared.cli import exit_code as _exit_code
from shared.config import load_config
from shared.features import FeatureSet, build_feature_set
from train.data.loader import Loader
from train.dense_ema import DenseEMA
from train.model.graphed import DenseArchGraphs
from train.model.multi_tower_din import MultiTowerDIN
from train.trainer import _amp_context, build_optimizers, cuda_graphs_for, train_step

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config"
EXAMPLE = """examples:
  python -m bench.profile_train --samples out/small/samples --out out/profile_train.json
  python -m bench.profile_train --samples out/small/samples --device cuda --amp BF16 \\
    --out out/profile_train_bf16.json"""

PHASES = ("zero_grad", "sparse_forward", "dense_forward", "backward", "optimizer", "dense_ema")
# host calls that start work on the GPU (a graph replay counts once)
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")


def phased_step(
    model, optimizers, batch, step: int, amp: str, sync, graphs, ema: DenseEMA | None = None
) -> dict[str, float]:
    """One train_step split into :data:`PHASES` (``dense_ema`` with an ``ema``), each timed up
    to a device synchronization and marked ``record_function("phase:<name>")`` for
    :func:`launches_by_phase`."""
    times: dict[str, float] = {}

    def phase(name: str, body: Callable[[], Any]) -> Any:
        with torch.profiler.record_function(f"phase:{name}"):
            t0 = time.perf_counter()
            out = body()
            sync()
            times[name] = (time.perf_counter() - t0) * 1e3
        return out

    def zero_grad() -> None:
        model.sparse.dynamic.set_step(step)
        for opt in optimizers.values():
            opt.zero_grad(set_to_none=True)

    def dense_forward() -> torch.Tensor:
        inputs: dict[str, Any] = dict(model.assemble(batch, embedded))
        if batch.rows_are_users:
            inputs["user_index"] = None
        with _amp_context(amp, batch.user_index.device):
            logits = (graphs or model.dense)(**inputs)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), batch.labels)

    phase("zero_grad", zero_grad)
    cold = model.dense.takes_cold
    embedded = phase("sparse_forward", lambda: model.sparse(batch, cold=cold))
    loss = phase("dense_forward", dense_forward)
    phase("backward", loss.backward)
    phase("optimizer", lambda: [opt.step() for opt in optimizers.values()])
    if ema is not None:
        phase("dense_ema", ema.update)
    return times


def launch_sites(
    model, optimizers, batches, steps: int, amp: str, graphs, sync, ema: DenseEMA | None = None
) -> dict[str, float]:
    """GPU launches per step by the line of this repository that made them (the innermost
    frame under ``shared/`` or ``train/`` of the launching operator's Python stack), the 40
    largest: where the host time of a launch-bound step goes."""
    verbose = torch._C._profiler._ExperimentalConfig(verbose=True)  # Python frames in stacks
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        with_stack=True,
        experimental_config=verbose,
    ) as prof:
        for _ in range(steps):
            i, b = next(batches)
            train_step(model, optimizers, b, i, amp, graphs=graphs, ema=ema)
        sync()
    sites: collections.Counter[str] = collections.Counter()
    root = str(ROOT) + "/"
    for e in prof.events():
        if e.name not in LAUNCHES:
            continue
        if e.name == "cuLaunchKernel":  # the driver API: our CuPy kernels, launched from Python
            sites["shared/hashtable/cuda: CuPy kernels (driver launches)"] += 1
            continue  # outside any aten op, so no operator stack says where
        op = e.cpu_parent
        while op is not None and not op.stack:
            op = op.cpu_parent
        frames = [f.removeprefix(root) for f in (op.stack if op is not None else [])]
        mine = [f for f in frames if f.startswith(("shared/", "train/", "bench/"))]
        sites[mine[0] if mine else "(no frame of this repository)"] += 1
    return {site: n / steps for site, n in sites.most_common(40)}


def launches_by_phase(events: Sequence[Any]) -> dict[str, int]:
    """GPU launches (:data:`LAUNCHES`) inside each ``phase:`` range of a profile's events,
    summed over the profiled steps (a launch outside every range counts as ``other``)."""
    ranges = [
        (e.name.removeprefix("phase:"), e.time_range.start, e.time_range.end)
        for e in events
        if e.name.startswith("phase:")
    ]
    out: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.name in LAUNCHES:
            t = e.time_range.start
            out[next((n for n, a, b in ranges if a <= t <= b), "other")] += 1
    return dict(out)


def sync_sites(
    model, optimizers, batch, step: int, amp: str, graphs, ema: DenseEMA | None = None
) -> dict[str, int]:
    """Host synchronizations of one step, counted by the first frame inside this repository."""
    sites: collections.Counter[str] = collections.Counter()
    root = str(ROOT)

    def record(message, category, filename, lineno, file=None, line=None):  # noqa: ARG001
        if "called a synchronizing" not in str(message):
            return  # e.g. torch's "debug mode is a prototype" notice, not a sync
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
            train_step(model, optimizers, batch, step, amp, graphs=graphs, ema=ema)
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    return dict(sites.most_common())


def batches_needed(warmup: int, steps: int) -> int:
    """The batches :func:`profile_model` uses: ``warmup`` and seven passes of ``steps``."""
    return warmup + 7 * steps + 1


# host calls that wait for the device: their time under cProfile is the host blocked in a sync
# (``int(t)``/``bool(t)`` call no profiled function: their wait lands in the caller's own time)
_SYNC_CALLS = frozenset({"tolist", "item", "cpu", "_cuda_synchronize"})
# the name of a C function as cProfile shows it: "<method 'item' of '...' objects>",
# "<built-in method torch._C._cuda_synchronize>"
_BUILTIN = re.compile(r"^<(?:built-in )?method '?(?:[\w.]+\.)?(\w+)'?[ >]")


def is_sync_call(func: str) -> bool:
    """Whether cProfile's name ``func`` of a C function (file ``~``) is one of the host reads
    that wait for the device (:data:`_SYNC_CALLS`), by its exact name: ``dict.items`` is not."""
    m = _BUILTIN.match(func)
    return m is not None and m.group(1) in _SYNC_CALLS


def host_profile(
    model, optimizers, batches, steps: int, amp: str, graphs, sync, ema: DenseEMA | None = None
) -> dict[str, Any]:
    """Where the host time of ``steps`` training steps goes, as the trainer runs them (no phase
    syncs), by Python function (cProfile: each function's own time, ms per step) and by file:
    the view of a host-bound step that a GPU profile cannot give. cProfile's overhead
    lengthens Python-heavy code, so read shares, not absolute times (``overhead``: the profiled
    step over the unprofiled one)."""
    import cProfile
    import pstats

    root = str(ROOT) + "/"
    sync()
    t0 = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        i, b = next(batches)
        train_step(model, optimizers, b, i, amp, graphs=graphs, ema=ema)
    sync()
    prof.disable()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows, files = [], collections.Counter[str]()
    blocked = 0.0
    for (path, line, func), (_cc, calls, own, _cum, _callers) in stats.items():
        ms = own * 1e3 / steps
        where = path.removeprefix(root) if path.startswith(root) else Path(path).name
        name = f"{where}:{line}({func})" if line else func
        files[where if path.startswith(root) else ("torch" if "torch" in path else where)] += ms
        if path == "~" and is_sync_call(func):
            blocked += ms
        rows.append((ms, calls / steps, name))
    rows.sort(reverse=True)
    return {
        "profiled_ms_per_step": wall,
        "blocked_in_sync_calls_ms_per_step": blocked,
        "top_functions": [
            {"function": n, "own_ms_per_step": ms, "calls_per_step": c} for ms, c, n in rows[:40]
        ],
        "by_file_ms_per_step": dict(files.most_common(25)),
    }


def device_batches(
    samples: Path, fs: FeatureSet, batch: int, n: int, device: torch.device
) -> list[Batch]:
    """``n`` training batches of ``samples`` on ``device`` (the first of epoch 0, shuffled)."""
    loader = Loader(samples / "train", fs, batch_size=batch, num_workers=1, shuffle=True,
                    seed=0, drop_last=True, pin_memory=device.type == "cuda")  # fmt: skip
    out = []
    for b in loader.epoch(0):
        out.append(b.to(device, non_blocking=True))
        if len(out) == n:
            return out
    raise SystemExit(
        f"error: {samples}/train has {len(out)} batches of {batch} rows; this benchmark needs "
        f"{n}: pass a larger --size or fewer --steps"
    )


def timed_steps(
    model, optimizers, batches, steps: int, amp: str, graphs, sync, ema: DenseEMA | None = None
) -> list[float]:
    """Milliseconds of each of ``steps`` training steps as the trainer runs them, each up to a
    device synchronization."""
    walls = []
    for _ in range(steps):
        i, b = next(batches)
        t0 = time.perf_counter()
        train_step(model, optimizers, b, i, amp, graphs=graphs, ema=ema)
        sync()
        walls.append((time.perf_counter() - t0) * 1e3)
    return walls


def profile_model(
    model: MultiTowerDIN,
    optimizers: dict[str, torch.optim.Optimizer],
    batches: Sequence[Batch],
    *,
    warmup: int,
    steps: int,
    amp: str = "",
    graphs: DenseArchGraphs | None = None,
    ema: DenseEMA | None = None,
) -> tuple[dict[str, object], list[str]]:
    """The figures of ``model``'s training step on ``batches`` (on its device, at least
    :func:`batches_needed`), with ``ema`` updated after each step as the trainer does:
    median step ms without and with phase syncs, the phases,
    the host syncs of one step (CUDA), and a profile of ``steps`` steps (GPU launches per step
    and per phase, device-busy time and its share of the unprofiled step). Returns
    (figures, the profile's tables as text lines)."""
    device = batches[0].user_index.device

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    model.train()
    it = iter(enumerate(batches))
    for _ in range(warmup):
        i, b = next(it)
        train_step(model, optimizers, b, i, amp, graphs=graphs, ema=ema)
    sync()
    walls = timed_steps(model, optimizers, it, steps, amp, graphs, sync, ema)
    phases = collections.defaultdict(list)
    for _ in range(steps):
        i, b = next(it)
        for k, v in phased_step(model, optimizers, b, i, amp, sync, graphs, ema).items():
            phases[k].append(v)
    step_ms = statistics.median(walls)
    result: dict[str, object] = {
        "step_ms_median": step_ms,
        "phases_ms_median": {k: statistics.median(v) for k, v in phases.items()},
    }
    if device.type == "cuda":
        i, b = next(it)
        result["syncs"] = sites = sync_sites(model, optimizers, b, i, amp, graphs, ema)
        result["syncs_per_step"] = sum(sites.values())
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            i, b = next(it)
            phased_step(model, optimizers, b, i, amp, sync, graphs, ema)
        sync()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    events = prof.key_averages()
    device_ms = device_busy_us(prof.events()) / steps / 1e3
    by_phase = launches_by_phase(prof.events())
    cuda = device.type == "cuda"  # no GPU work to count elsewhere
    result["profile"] = {
        "profiled_wall_ms_per_step": wall,
        "device_busy_ms_per_step": device_ms if cuda else None,
        # the GPU's share of the step as the trainer runs it: the profiled steps' kernel time
        # over the unprofiled step (the profiled wall, with the profiler's host overhead and a
        # sync after each phase, is 3x longer on a host-bound step); capped at 1
        "device_busy_fraction": min(device_ms / step_ms, 1.0) if cuda else None,
        "device_busy_fraction_of_profiled_wall": device_ms / wall if cuda else None,
        "device_ms_over_step_ms": device_ms / step_ms if cuda else None,
        "launches_per_step": sum(by_phase.values()) / steps if cuda else None,
        "launches_per_step_by_phase": {k: v / steps for k, v in by_phase.items()},
    }
    if cuda:
        result["launches_by_site"] = launch_sites(
            model, optimizers, it, steps, amp, graphs, sync, ema
        )
    host = host_profile(model, optimizers, it, steps, amp, graphs, sync, ema)
    host["overhead"] = host["profiled_ms_per_step"] / step_ms
    result["host"] = host
    # the unprofiled step again, after the profilers: slower if they left overhead behind
    result["step_ms_median_after_profiles"] = statistics.median(
        timed_steps(model, optimizers, it, steps, amp, graphs, sync, ema)
    )
    text = [
        f"== {steps} steps on {device}",
        json.dumps(result["profile"]),
        "== by self CPU time",
        events.table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=70),
    ]
    if device.type == "cuda":
        text += [
            "== by self device time",
            events.table(sort_by="self_cuda_time_total", row_limit=35, max_name_column_width=70),
        ]
    return result, text


def _parser() -> Parser:
    p = Parser(prog="python -m bench.profile_train", description=plain(__doc__), epilog=EXAMPLE)
    p.add_argument("--config", type=Path, default=CONFIG, help="pipeline config (model, features)")
    p.add_argument("--samples", type=Path, required=True, help="samples dir with train/")
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="torch device to train on (default: cuda if this machine has one)",
    )
    p.add_argument("--batch", type=int, default=None,
                   help="rows per training batch (default: the config's data_config.batch_size)")  # fmt: skip
    p.add_argument("--steps", type=int, default=5, help="timed (and profiled) steps")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps before them")
    p.add_argument(
        "--amp",
        default="",
        choices=["", "BF16", "FP16"],
        help="autocast of the dense MLPs on CUDA, as train_config.mixed_precision (default: '', fp32)",
    )
    p.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=["auto", "on", "off"],
        help="dense part through CUDA graphs, as the trainer runs it (auto: on CUDA)",
    )
    p.add_argument(
        "--out", type=Path, required=True, help="JSON file to write (the tables: beside it, .txt)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    config = load_config(args.config)
    fs = build_feature_set(config)
    batch = args.batch or config.data_config.batch_size
    batches = device_batches(
        args.samples, fs, batch, batches_needed(args.warmup, args.steps), device
    )
    model = MultiTowerDIN.from_config(config, fs, device=device, seed=0)
    optimizers = build_optimizers(model, config.train_config)
    ema = DenseEMA.of_config(model.dense, config.train_config)
    use_graphs = args.cuda_graphs == "on" or (args.cuda_graphs == "auto" and device.type == "cuda")
    graphs = cuda_graphs_for(model) if use_graphs else None
    result: dict[str, object] = {"device": str(device), "torch": torch.__version__,
                                 "batch": batch, "amp": args.amp, "cuda_graphs": use_graphs,
                                 "dense_ema": ema is not None}  # fmt: skip
    found, text = profile_model(
        model, optimizers, batches, warmup=args.warmup, steps=args.steps, amp=args.amp,
        graphs=graphs, ema=ema,
    )  # fmt: skip
    result.update(found)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".txt").write_text("\n".join([f"== batch {batch}", *text]))
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "syncs"}, indent=2))
    if "syncs" in result:
        print(f"host syncs per step: {result['syncs_per_step']}")
        for site, n in list(result["syncs"].items())[:25]:  # type: ignore[union-attr]
            print(f"  {n:3d}  {site}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
