"""``inspect``: per-table statistics of a checkpoint or of a running server, as a table or JSON.

Both give one report per table: ``name, is_hashmap, dim, size, capacity, load_factor``, the
admission backlog (``admission_threshold``, ``admission_pending`` keys counted but not admitted,
``admission_pending_by_count``), the ``score_histogram`` and the ``top_keys`` by score.

- A checkpoint (a ``step_N`` dir, a model dir, or an init-ckpt dir) is read file by file, no
  config needed; only its dynamic tables are listed. ``capacity`` there is the bound the table
  can grow to, ``max_capacity`` x the saving world size, and ``load_factor`` is size / that.
- A server answers ``ModelAdminService.InspectTables`` on its admin address (``HOST:PORT`` or
  ``unix:/path``, with its token and TLS files: :mod:`train.tools.admin_client`): every table
  it serves, ``capacity`` / ``load_factor`` of its serving hash table, ``hits`` / ``misses`` of
  lookups since the version was loaded, and the training-side columns as of the export or delta
  it serves (bundles carry them in ``manifest.json`` ``extra.table_summaries``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.hashtable.summary import checkpoint_summaries
from train.checkpoint import DYNAMIC_MODULE
from train.fine_tune import resolve_checkpoint
from train.tools.admin_client import AdminTarget


def inspect_checkpoint(path: str | Path, *, top_k: int = 10) -> dict[str, Any]:
    ckpt = resolve_checkpoint(path)
    tables = []
    for name, s in checkpoint_summaries(ckpt, DYNAMIC_MODULE, top_k=top_k).items():
        capacity = s["max_capacity"] * s["world_size"]
        adm = s.get("admission") or {}
        tables.append(
            {
                "name": name,
                "is_hashmap": True,
                "dim": s["dim"],
                "size": s["size"],
                "capacity": capacity,
                "load_factor": s["size"] / capacity if capacity else 0.0,
                "world_size": s["world_size"],
                "score_strategy": s["score_strategy"],
                "score_histogram": s["score_histogram"],
                "top_keys": s["top_keys"],
                "admission_threshold": adm.get("threshold", 0),
                "admission_pending": adm.get("pending", 0),
                "admission_pending_by_count": adm.get("pending_by_count", {}),
            }
        )
    return {"source": "checkpoint", "where": str(ckpt), "tables": tables}


def inspect_server(
    target: AdminTarget | str, *, top_k: int = 10, timeout: float = 10.0
) -> dict[str, Any]:
    """``InspectTables`` of the server whose admin service listens at ``target`` (an address,
    or an :class:`AdminTarget` with its token and TLS files)."""
    from protos import predict_pb2, predict_pb2_grpc

    admin = AdminTarget(target) if isinstance(target, str) else target
    with admin.channel() as channel:
        stub = predict_pb2_grpc.ModelAdminServiceStub(channel)
        resp = stub.InspectTables(
            predict_pb2.InspectRequest(top_k=top_k), metadata=admin.metadata(), timeout=timeout
        )
    tables = []
    for t in resp.tables:
        tables.append(
            {
                "name": t.name,
                "is_hashmap": t.is_hashmap,
                "dim": t.dim,
                "size": t.size,
                "capacity": t.capacity,
                "load_factor": t.load_factor,
                "hits": t.hits,
                "misses": t.misses,
                "score_strategy": t.score_strategy,
                "score_histogram": [
                    {"lower": b.lower, "upper": b.upper, "count": b.count}
                    for b in t.score_histogram
                ],
                "top_keys": [{"key": k.key, "score": k.score} for k in t.top_keys],
                "admission_threshold": t.admission_threshold,
                "admission_pending": t.admission_pending,
                "admission_pending_by_count": dict(sorted(t.admission_pending_by_count.items())),
            }
        )
    return {
        "source": "server",
        "where": admin.address,
        "model_version": resp.model_version,
        "base_version": resp.base_version,
        "deltas": list(resp.deltas),
        "tables": tables,
    }


def _cell(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def grid(head: list[str], rows: list[list[Any]]) -> list[str]:
    """Fixed-width text columns (floats with 3 decimals)."""
    cells = [[_cell(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(head)]
    return [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [head, *cells]
    ]


def format_report(report: dict[str, Any], *, top_k: int = 10) -> str:
    """A fixed-width table, then per dynamic table its score histogram and top keys."""
    server = report["source"] == "server"
    head = ["table", "kind", "dim", "size", "capacity", "load", "adm.thr", "adm.pending"]
    if server:
        head += ["hits", "misses"]
    rows = []
    for t in report["tables"]:
        row = [
            t["name"],
            "hash" if t["is_hashmap"] else "dense",
            t["dim"],
            t["size"],
            t["capacity"],
            t["load_factor"],
            t["admission_threshold"] or "-",
            t["admission_pending"] if t["admission_threshold"] else "-",
        ]
        if server:
            row += [t["hits"], t["misses"]] if t["is_hashmap"] else ["-", "-"]
        rows.append(row)
    lines = [f"{report['source']} {report['where']}"]
    if server:
        deltas = ", ".join(report["deltas"]) or "none"
        lines.append(
            f"model_version {report['model_version']}  (base {report['base_version']}; "
            f"deltas applied: {deltas})"
        )
    lines += grid(head, rows)
    for t in report["tables"]:
        if not t["is_hashmap"] or not t["score_histogram"]:
            continue
        bins = " ".join(f"[{b['lower']},{b['upper']}):{b['count']}" for b in t["score_histogram"])
        keys = " ".join(f"{k['key']}:{k['score']}" for k in t["top_keys"][:top_k])
        lines.append(f"{t['name']} scores ({t['score_strategy']}): {bins}")
        lines.append(f"{t['name']} top {min(top_k, len(t['top_keys']))} key:score: {keys}")
        if t["admission_pending_by_count"]:
            pend = " ".join(f"{c}x:{n}" for c, n in t["admission_pending_by_count"].items())
            lines.append(f"{t['name']} pending admission by count: {pend}")
    return "\n".join(lines)
