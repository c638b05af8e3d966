"""The static sparse step (``shared.hashtable.static_step``) against the eager lookup, and where
its time goes, on a storage at its max capacity.

    python -m bench.bench_static_step --out out/bench_static_step.json [--device cuda]

Two DynamicEmbeddingCollections of the seed config's dynamic tables (one fused storage, LFU,
admission at 3; ``--scale`` shrinks their capacities) are filled alike: their storage first to
its max capacity (``--fill`` batches of new keys), then ``--warmup`` training steps of skewed
keys (``--keys`` a step; the counter fills). Then, on the same batches, the median
milliseconds of a training lookup + backward (a random gradient), up to a device sync:

- ``eager``: the eager lookup (its host reads; the CUDA backend's kernels);
- ``static``: the static step, replayed from CUDA graphs on CUDA (eagerly on CPU);
- ``sections``: the static step run without graphs, each section timed on its own (CUDA events
  on CUDA, the clock on CPU): unique, find, counter, insert, resolve (where each row's payload
  is: a no-op for HBM_ONLY, cache lines for CACHING), erase, values, backward. This is
  where the captured step's GPU time goes; the sum is above ``static``'s by the launches.

The JSON also records the ratio ``eager / static`` and both collections' table stats after the
timed steps, and whether they are equal (they should be: the same keys stay).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from shared.cli import Parser, check_device, plain, run_cli, write_result
from shared.cli import exit_code as _exit_code
from shared.config import load_config
from shared.features import TableSpec, build_feature_set
from shared.hashtable import static_step
from shared.hashtable.embedding import DynamicEmbeddingCollection

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config"
EXAMPLE = """examples:
  python -m bench.bench_static_step --out out/bench_static_step.json --device cuda
  python -m bench.bench_static_step --out out/bench_static_step_cpu.json --scale 0.01 --keys 20000"""


def seed_tables(scale: float) -> tuple[list[TableSpec], dict[str, tuple[str, ...]]]:
    """The seed config's dynamic tables (capacities times ``scale``) and fusion groups."""
    fs = build_feature_set(load_config(CONFIG))
    tables = []
    for t in fs.dynamic_tables:
        d = t.dynamic
        assert d is not None
        cap = max(d.bucket_capacity, int(d.max_capacity * scale))
        adm = d.admission
        if adm is not None:
            adm = replace(adm, counter_capacity=max(adm.counter_bucket_capacity, cap))
        small = replace(d, max_capacity=cap, init_capacity=min(d.init_capacity, cap), admission=adm)
        tables.append(replace(t, dynamic=small))
    return tables, dict(fs.fusion_groups)


def batch_keys(
    gen: torch.Generator, names: list[str], n: int, span: int
) -> dict[str, torch.Tensor]:
    """``n`` skewed keys a step, split over the tables (a power law over ``span`` ids each)."""
    share = n // len(names)
    return {name: (torch.rand(share, generator=gen) ** 3 * span).long() for name in names}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Batch = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]  # (keys, their gradients)


def batch_grads(keys: dict[str, torch.Tensor], dim: int, seed: int) -> dict[str, torch.Tensor]:
    """A fixed random gradient [n, dim] for each table's keys, on their device (made before any
    timing: the timed steps only compute)."""
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(k.numel(), dim, generator=gen).to(k.device) for n, k in keys.items()}


def step(dec: DynamicEmbeddingCollection, batch: Batch) -> None:
    """One training lookup of the batch's keys and its backward with their gradients."""
    keys, grads = batch
    rows = dec(keys)
    loss = sum((rows[n] * grads[n]).sum() for n in keys)
    loss.backward()  # type: ignore[union-attr]


def fill(dec: DynamicEmbeddingCollection, batches: int, n: int, seed: int) -> None:
    """Fill the storage to its max capacity: ``batches`` inserts of ``n`` new random keys."""
    (storage,) = dec._storages
    gen = torch.Generator().manual_seed(seed)
    for _ in range(batches):
        tids = torch.randint(0, len(storage.specs), (n,), generator=gen).to(dec.device)
        keys = torch.randint(1 << 40, 1 << 62, (n,), generator=gen).to(dec.device)
        init = storage._init_rows(keys, tids, storage.dim)
        storage.table.insert_or_assign(keys, init, torch.zeros_like(keys), table_ids=tids)


class Sections:
    """Times the sections of :func:`static_step.train_lookup` (``mark``) and the backward."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ms: dict[str, list[float]] = defaultdict(list)
        self._marks: list[tuple[str, Any]] = []

    def _now(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [("start", self._now())]

    def mark(self, section: str) -> None:
        self._marks.append((section, self._now()))

    def finish(self) -> None:
        _sync(self.device)
        for (_, a), (name, b) in zip(self._marks, self._marks[1:], strict=False):
            ms = a.elapsed_time(b) if self.device.type == "cuda" else (b - a) * 1e3
            self.ms[name].append(ms)


def timed_sections(
    dec: DynamicEmbeddingCollection, batches: list[Batch], device: torch.device
) -> dict[str, float]:
    """Median ms of each section of the static step, run without graphs, over ``batches``."""
    (storage,) = dec._storages
    step_ = static_step.StaticStep(storage, capture=False)
    timer = Sections(device)
    for i, (keys, grads) in enumerate(batches):
        parts = [(storage.names.index(n), k) for n, k in keys.items()]
        entry, n = step_.stage(parts, 1000 + i)
        grad = torch.cat([grads[name] for name in keys])
        _sync(device)
        timer.start()
        plan = static_step.train_lookup(storage, entry.keys, entry.tids, entry.n_real,
                                        entry.score, (step_.counts, step_.counter_counts),
                                        timer.mark)  # fmt: skip
        entry.grad[:n].copy_(grad)
        entry.grad[n:].zero_()
        static_step.apply_gradients(storage, plan, entry.grad)
        timer.mark("backward")
        timer.finish()
    return {name: statistics.median(v) for name, v in timer.ms.items()}


def timed_steps(
    dec: DynamicEmbeddingCollection, batches: list[Batch], device: torch.device
) -> float:
    """Median ms of a training lookup + backward over ``batches``, each up to a device sync."""
    out = []
    for i, batch in enumerate(batches):
        dec.set_step(1000 + i)
        _sync(device)
        t0 = time.perf_counter()
        step(dec, batch)
        _sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def run(args: Any) -> dict[str, Any]:
    check_device(args.device)
    device = torch.device(args.device)
    tables, groups = seed_tables(args.scale)
    decs = []
    for _ in range(2):
        dec = DynamicEmbeddingCollection(tables, groups, lr=0.001, device=device, seed=0)
        dec.train()
        fill(dec, args.fill, args.keys, seed=1)
        decs.append(dec)
    eager, static = decs
    names = list(eager.tables)
    gen = torch.Generator().manual_seed(2)
    warm = [batch_keys(gen, names, args.keys, args.span) for _ in range(args.warmup)]
    timed = [batch_keys(gen, names, args.keys, args.span) for _ in range(args.steps)]
    dim = eager._storages[0].dim
    dev_batches: list[Batch] = []
    for i, b in enumerate(warm + timed):
        keys = {n: k.to(device) for n, k in b.items()}
        dev_batches.append((keys, batch_grads(keys, dim, seed=i)))
    for dec in decs:
        for i, batch in enumerate(dev_batches[: args.warmup]):
            dec.set_step(1 + i)
            step(dec, batch)
    static.use_static_step(capture=device.type == "cuda")
    (storage,) = static._storages
    assert static_step.supports(storage) is None, static_step.supports(storage)
    timed_batches = dev_batches[args.warmup :]
    eager_ms = timed_steps(eager, timed_batches, device)
    static_ms = timed_steps(static, timed_batches, device)
    stats = {"eager": eager.stats(), "static": static.stats()}  # the same batches so far
    sections = timed_sections(static, timed_batches, device)
    return {
        "device": str(device),
        "torch": torch.__version__,
        "keys_per_step": args.keys,
        "padded": static_step.padded_size(args.keys - args.keys % len(names)),
        "capacity": storage.table.capacity,
        "counter_capacity": None if storage.counter is None else storage.counter.capacity,
        "eager_ms_median": eager_ms,
        "static_ms_median": static_ms,
        "eager_over_static": eager_ms / static_ms,
        "static_runs": static.static_stats(),
        "sections_ms_median": sections,
        "sections_ms_sum": sum(sections.values()),
        "same_table_stats": stats["eager"] == stats["static"],
        "stats": stats,
    }


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_static_step", description=plain(__doc__),
               epilog=EXAMPLE)  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--scale", type=float, default=1.0, help="table capacities times this")
    p.add_argument("--keys", type=int, default=655_360, help="keys a training step looks up")
    p.add_argument("--span", type=int, default=2_000_000, help="ids a table draws keys from")
    p.add_argument("--fill", type=int, default=4, help="batches of new keys that fill the storage")
    p.add_argument("--warmup", type=int, default=8, help="untimed training steps (fill counters)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result = run(args)
    write_result(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "stats"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
