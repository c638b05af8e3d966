"""``python -m train.tools plan``: where the dynamic tables' rows will live, before any run.

The plan is :func:`shared.hashtable.placement.plan_placement`'s, the same the trainer logs at
start: per table the mode (HBM_ONLY or CACHING), the cache_load_factor and whether the config or
the budget chose it, and the bytes on the device and on the host. The budget is ``--hbm-gib``,
else the config's ``train_config.table_hbm_budget_gib``, else, with ``--device cuda``, the
device's free memory now; on the CPU without either there is none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.config import load_config
from shared.features import build_feature_set
from shared.hashtable.placement import GIB, describe, plan_placement


def _budget(
    config_budget: float | None, hbm_gib: float | None, device: str
) -> tuple[int | None, str]:
    """(bytes or None, where the budget came from)."""
    if hbm_gib is not None:
        return int(hbm_gib * GIB), "--hbm-gib"
    if config_budget is not None:
        return int(config_budget * GIB), "train_config.table_hbm_budget_gib"
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA device here; pass --hbm-gib instead")
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free), f"free memory of {device} now"
    return None, "no budget"


def plan_report(
    config_path: Path, *, device: str = "cpu", hbm_gib: float | None = None
) -> dict[str, Any]:
    """The plan as JSON-ready data (``text`` holds the log lines)."""
    config = load_config(config_path)
    tc = config.train_config
    config_budget = tc.table_hbm_budget_gib if tc.HasField("table_hbm_budget_gib") else None
    budget, source = _budget(config_budget, hbm_gib, device)
    plans = plan_placement(build_feature_set(config).dynamic_tables, hbm_budget=budget)
    return {
        "budget_bytes": budget,
        "budget_source": source,
        "tables": {
            p.table: {
                "mode": p.mode.value,
                "cache_load_factor": round(p.cache_load_factor, 4),
                "planned": p.planned,
                "slots": p.slots,
                "dim": p.dim,
                "hbm_bytes": p.hbm_bytes,
                "host_bytes": p.host_bytes,
                "row_arrays": p.row_arrays.value,
                "hbm_parts": p.device_parts(),
                "host_parts": p.host_parts(),
            }
            for p in plans
        },
        "hbm_bytes": sum(p.hbm_bytes for p in plans),
        "host_bytes": sum(p.host_bytes for p in plans),
        "text": describe(plans),
    }


def plan_text(report: dict[str, Any]) -> str:
    budget = report["budget_bytes"]
    head = "budget: none" if budget is None else f"budget: {budget / GIB:.3f}GiB"
    lines = [f"{head} ({report['budget_source']})", *report["text"]]
    return "\n".join(lines)
