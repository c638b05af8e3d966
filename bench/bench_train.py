"""Training throughput of the seed config: jagged DIN beside the padded reference, same run.

Two measurements, both at ``--batch`` (default 8192, the config's):

- ``step``: the training step alone (lookups + admission + forward + backward + fused Adagrad +
  Adam) on batches already on the device, median over ``--steps`` steps after ``--warmup``
  steps, for the jagged DIN eagerly (``jagged_*``), the jagged DIN with the dense
  forward+backward replayed from CUDA graphs (``jagged_graphed_*``, CUDA only, see
  :mod:`train.model.graphed`; a timed step that had to capture a new T bucket is left out of the
  median and counted in ``graphed_capture_steps``) and tzrec's padded DIN (pad to
  sequence_length 100) with the same weights;
- ``end_to_end``: samples/s of the real loop over the Parquet loader (jagged; with CUDA graphs
  when they are on, as the trainer runs by default).

    python -m bench.bench_train --samples data/small/samples --out out/bench_train.json
    python -m bench.bench_train --size full --device cuda --out $OUT/bench_train.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from shared.cli import Parser, run_cli
from shared.cli import exit_code as _exit_code
from shared.config import load_config
from shared.features import build_feature_set
from train.data.loader import Loader
from train.model.din import PaddedDIN
from train.model.graphed import DenseArchGraphs
from train.model.multi_tower_din import MultiTowerDIN
from train.trainer import build_optimizers, train_step

ROOT = Path(__file__).resolve().parents[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(model, optimizers, batches, device, amp: str, graphs=None) -> list[float]:
    """Seconds per step; with ``graphs``, NaN for a step that captured a new graph."""
    times = []
    for i, batch in enumerate(batches):
        captures = graphs.stats["captures"] if graphs is not None else 0
        _sync(device)
        t0 = time.perf_counter()
        train_step(model, optimizers, batch, i, amp, graphs=graphs)
        _sync(device)
        captured = graphs is not None and graphs.stats["captures"] != captures
        times.append(float("nan") if captured else time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--config", type=Path, default=ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config"
    )
    p.add_argument("--samples", type=Path, help="samples dir with train/; default: generate --size")
    p.add_argument("--size", default="small", choices=["tiny", "small", "full"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--padded-steps",
        type=int,
        default=None,
        help="default: --steps on CUDA, 3 on CPU (the padded reference is slow there)",
    )
    p.add_argument(
        "--cuda-graphs",
        choices=["auto", "on", "off"],
        default="auto",
        help="auto: on CUDA, time the step with the dense part through CUDA graphs too and run "
        "end_to_end with them (the trainer's default); on: also elsewhere (the wrapper then runs "
        "eagerly; checks the bench itself)",
    )
    p.add_argument("--end-to-end-steps", type=int, default=20)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--amp", default="", choices=["", "BF16", "FP16"])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    graphs_on = args.cuda_graphs == "on" or (args.cuda_graphs == "auto" and device.type == "cuda")
    if args.padded_steps is None:
        args.padded_steps = args.steps if device.type == "cuda" else 3
    config = load_config(args.config)
    fs = build_feature_set(config)
    tmp = None
    samples = args.samples
    if samples is None:
        tmp = tempfile.mkdtemp(prefix="bench_train_")
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "train.data", "all", "--size", args.size, "--out", tmp,
             "--config", str(args.config)], check=True, cwd=ROOT,
        )  # fmt: skip
        print(f"generated {args.size} in {time.perf_counter() - t0:.1f}s", flush=True)
        samples = Path(tmp) / "samples"

    loader = Loader(samples / "train", fs, batch_size=args.batch, num_workers=args.num_workers,
                    shuffle=True, seed=0, drop_last=True, pin_memory=device.type == "cuda")  # fmt: skip
    need = args.warmup + max(args.steps, args.padded_steps)
    batches = []
    for b in loader.epoch(0):
        batches.append(b.to(device, non_blocking=True))
        if len(batches) == need:
            break
    seq_len = batches[0].sequence.lengths().float()
    result: dict[str, object] = {
        "device": str(device),
        "torch": torch.__version__,
        "batch": args.batch,
        "amp": args.amp,
        "cuda_graphs": graphs_on,
        "mean_sequence_length": float(seq_len.mean()),
        "train_rows": loader.rows,
    }

    graph_stats: dict[str, int] = {}

    def run(padded: bool, steps: int, graphed: bool = False) -> list[float]:
        model = MultiTowerDIN.from_config(config, fs, device=device, seed=0)
        if padded:
            ref = PaddedDIN(model.dense.din.dim, model.dense.config.attn, max_length=100).to(device)
            ref.load_state_dict(model.dense.din.state_dict())
            model.dense.din = ref
        optimizers = build_optimizers(model, config.train_config)
        model.train()
        graphs = DenseArchGraphs(model.dense) if graphed else None
        time_steps(model, optimizers, batches[: args.warmup], device, args.amp, graphs)
        times = time_steps(
            model, optimizers, batches[args.warmup : args.warmup + steps], device, args.amp, graphs
        )
        if graphs is not None:
            graph_stats.update(graphs.stats)
        return times

    def median(times: list[float]) -> float:
        kept = [t for t in times if t == t]  # NaN: a step that captured a graph
        return statistics.median(kept) if kept else float("nan")

    jagged = run(False, args.steps)
    graphed = run(False, args.steps, graphed=True) if graphs_on else None
    padded = run(True, args.padded_steps)
    mj, mp = median(jagged), median(padded)
    step: dict[str, object] = {
        "jagged_ms_median": mj * 1e3,
        "padded_ms_median": mp * 1e3,
        "jagged_samples_per_s": args.batch / mj,
        "padded_samples_per_s": args.batch / mp,
        "padded_over_jagged": mp / mj,
    }
    if graphed is not None:
        mg = median(graphed)
        step.update(
            {
                "jagged_graphed_ms_median": mg * 1e3,
                "jagged_graphed_samples_per_s": args.batch / mg,
                "padded_over_jagged_graphed": mp / mg,
                "graphs_saved_ms": (mj - mg) * 1e3,
                "graphed_capture_steps": sum(1 for t in graphed if t != t),
                "graphs": graph_stats,
                "jagged_graphed_ms_all": [None if t != t else t * 1e3 for t in graphed],
            }
        )
    step["jagged_ms_all"] = [t * 1e3 for t in jagged]
    step["padded_ms_all"] = [t * 1e3 for t in padded]
    result["step"] = step
    print(json.dumps(result["step"]), flush=True)

    # end to end over the loader (includes feature generation in the workers)
    model = MultiTowerDIN.from_config(config, fs, device=device, seed=0)
    optimizers = build_optimizers(model, config.train_config)
    model.train()
    e2e_graphs = DenseArchGraphs(model.dense) if graphs_on else None
    n = 0
    t0 = None
    for i, batch in enumerate(loader.epoch(1)):
        batch = batch.to(device, non_blocking=True)
        if i == args.warmup:
            _sync(device)
            t0, n = time.perf_counter(), 0
        loss = train_step(model, optimizers, batch, i, args.amp, graphs=e2e_graphs)
        n += batch.batch_size
        if i >= args.warmup + args.end_to_end_steps:
            break
    _sync(device)
    float(loss)
    if t0 is not None:
        seconds = time.perf_counter() - t0
        result["end_to_end"] = {"samples_per_s": n / seconds, "steps": args.end_to_end_steps,
                                "num_workers": args.num_workers, "cuda_graphs": graphs_on}  # fmt: skip
    if device.type == "cuda":
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    result["tables"] = model.sparse.dynamic.stats()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "tables"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
