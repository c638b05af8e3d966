"""Print the headline figures of ``bench/run_gpu_suite.sh``'s JSON files (the end of a device
call's output is what comes back first).

    python -m bench.summarize_gpu_suite OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from shared.cli import Parser, plain, run_cli

EXAMPLE = """example:
  python -m bench.summarize_gpu_suite /tmp/gpu_suite   # the OUT_DIR of run_gpu_suite.sh"""


def _load(out: Path, name: str) -> dict | None:
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None


def summarize(out: Path) -> list[str]:
    lines = []
    ht = _load(out, "bench_gpu_hashtable.json")
    if ht:
        for lf, v in ht.get("load_factors", {}).items():
            find = v.get("find", {}).get("kernel_api", {})
            ins = v.get("insert", {}).get("one_call", {})
            lines.append(
                f"hash lf {lf}: find API {find.get('per_call_keys_per_s', 0) / 1e9:.2f} G keys/s, "
                f"insert {ins.get('kernel_keys_per_s', 0) / 1e9:.2f} G keys/s"
            )
    din = _load(out, "bench_din.json")
    if din:
        f = din["din_forward_backward"]
        times = [
            f"{k} {v['median_ms']:.2f}"
            for k, v in f.items()
            if isinstance(v, dict) and "median_ms" in v
        ]
        ratios = [
            f"{k} {v:.1f}"
            for k, v in f.items()
            if k.startswith("padded_over") and isinstance(v, float)
        ]
        lines.append("DIN fwd+bwd ms: " + ", ".join(times))
        lines.append("DIN padded/jagged: " + ", ".join(ratios))
    train = _load(out, "bench_train.json")
    if train:
        lines += _train_lines(train)
    prof = _load(out, "profile_train.json")
    if prof:
        lines.append(
            f"profile: step {prof.get('step_ms_median', 0):.2f} ms, "
            f"phases {json.dumps(prof.get('phases_ms_median'))}, "
            f"syncs {prof.get('syncs_per_step')}, {json.dumps(prof.get('profile'))}"
        )
    return lines


def _train_lines(train: dict) -> list[str]:
    """One line per config of ``bench_train.json`` and one with its ratios and goals."""
    lines = []
    for name, entry in train.get("configs", {}).items():
        step, e2e = entry.get("step", {}), entry.get("end_to_end") or {}
        prof = step.get("profile", {})
        auc = (e2e.get("eval") or {}).get("auc")
        lines.append(
            f"train {name}: step {step.get('step_ms_median', 0):.2f} ms, "
            f"{prof.get('launches_per_step')} launches, {step.get('syncs_per_step')} syncs, "
            f"busy {prof.get('device_busy_fraction')}, end to end "
            f"{e2e.get('samples_per_s', 0) / 1e3:.0f}K samples/s, auc {auc}"
        )
    rest = {k: v for k, v in train.items() if k not in ("configs", "samples")}
    lines.append("train: " + json.dumps(rest)[:900])
    return lines


def _parser() -> Parser:
    p = Parser(
        prog="python -m bench.summarize_gpu_suite", description=plain(__doc__), epilog=EXAMPLE
    )
    p.add_argument("out_dir", type=Path, help="the directory run_gpu_suite.sh wrote its JSON to")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.out_dir.is_dir():
        raise NotADirectoryError(
            f"{args.out_dir} is not a directory; give the OUT_DIR of bench/run_gpu_suite.sh"
        )
    print("\n".join(summarize(args.out_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
