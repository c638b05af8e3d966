"""Print the headline figures of ``bench/run_gpu_suite.sh``'s JSON files (the end of a device
call's output is what comes back first).

    python -m bench.summarize_gpu_suite OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


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
        lines.append(
            "train: "
            + json.dumps({k: v for k, v in train.items() if k in ("step", "end_to_end", "graphs")})[
                :900
            ]
        )
    prof = _load(out, "profile_train.json")
    if prof:
        lines.append(
            f"profile: {json.dumps(prof.get('phases_ms_median'))} syncs {prof.get('sync_count')} {json.dumps(prof.get('profile'))}"
        )
    return lines


if __name__ == "__main__":
    print("\n".join(summarize(Path(sys.argv[1]))))
