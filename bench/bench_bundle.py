"""Bundle write/read time at seed scale: 5 dynamic tables × 300K keys (+ cate_id 5K), dim 16.

    python -m bench.bench_bundle [--keys 300000] [--world 1] [--out /tmp/bundle-bench]

Each read runs in a fresh process (as a server start would) with the page cache warm from the
write; ``touch`` adds summing every tensor, which faults in the memory-mapped pages.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from shared.bundle import write_bundle
from shared.cli import Parser, plain, run_cli
from shared.cli import exit_code as _exit_code
from shared.config import config_digest, load_config
from shared.features import build_feature_set

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config"

_READ = """
import json, sys, time
from shared.bundle import read_bundle
t0 = time.perf_counter()
b = read_bundle(sys.argv[1], verify_checksums=sys.argv[2] == "1")
t1 = time.perf_counter()
total = sum(float(v.sum()) for _, v in b.hash_tables.values())
total += sum(float(w.sum()) for w in b.dense_tables.values())
t2 = time.perf_counter()
keys = sum(k.numel() for k, _ in b.hash_tables.values())
print(json.dumps({"read_s": t1 - t0, "touch_s": t2 - t1, "keys": keys}))
"""


class _Toy(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


EXAMPLE = """example:
  python -m bench.bench_bundle --keys 300000 --world 2 --out /tmp/bundle-bench"""


def _parser() -> Parser:
    p = Parser(prog="python -m bench.bench_bundle", description=plain(__doc__), epilog=EXAMPLE)
    p.add_argument(
        "--keys", type=int, default=300_000, help="keys per big dynamic table (cate_id: at most 5K)"
    )
    p.add_argument("--world", type=int, default=1, help="parts (ranks) per dynamic table")
    p.add_argument(
        "--out", type=Path, default=None, help="bundle dir, kept (default: a temp dir, removed)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    config = load_config(CONFIG)
    fs = build_feature_set(config)
    g = torch.Generator().manual_seed(0)
    dense = {t.name: torch.randn(t.num_rows or 0, t.dim, generator=g) for t in fs.dense_tables}
    hashes = {}
    for t in fs.dynamic_tables:
        cap = t.dynamic.max_capacity if t.dynamic else 0
        n = args.keys if cap >= 100_000 else min(args.keys, cap)  # cate_id_emb: 5K
        keys = torch.randperm(4 * n, generator=g)[:n].to(torch.int64)
        values = torch.randn(n, t.dim, generator=g)
        owner = keys % args.world
        hashes[t.name] = [(keys[owner == r], values[owner == r]) for r in range(args.world)]
    work = Path(tempfile.mkdtemp(prefix="bundle-bench-"))
    program = work / "dense.pt2"
    torch.export.save(torch.export.export(_Toy(), (torch.ones(2),)), program)
    out = args.out or work / "bundle"

    t0 = time.perf_counter()
    write_bundle(
        out,
        dense_tables=dense,
        hash_tables=hashes,
        feature_set=fs,
        dense_program_path=program,
        config_digest=config_digest(config),
        overwrite=True,
    )
    write_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in out.iterdir())
    result = {"write_s": round(write_s, 3), "bundle_mb": round(size / 2**20, 1)}
    for verify in ("1", "0"):
        runs = [
            json.loads(
                subprocess.run(
                    [sys.executable, "-c", _READ, str(out), verify],
                    check=True,
                    capture_output=True,
                    text=True,
                    cwd=ROOT,
                ).stdout
            )
            for _ in range(3)
        ]
        best = min(runs, key=lambda r: r["read_s"])
        tag = "verify" if verify == "1" else "no_verify"
        result[f"read_s_{tag}"] = round(best["read_s"], 3)
        result[f"touch_s_{tag}"] = round(best["touch_s"], 3)
        result["keys"] = best["keys"]
    print(json.dumps(result))
    if args.out is None:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda argv: _exit_code(main(argv))))
