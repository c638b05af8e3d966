"""``inspect``: per-table statistics of a checkpoint or of a running server, as a table or JSON.

Both give one report per table: ``name, is_hashmap, dim, size, capacity, load_factor``, the
admission backlog (``admission_threshold``, ``admission_pending`` keys counted but not admitted,
``admission_pending_by_count``), the ``score_histogram`` and the ``top_keys`` by score.

- A checkpoint (a ``step_N`` dir, a model dir, an init-ckpt dir, or TorchEasyRec's
  ``model.ckpt-N`` or model dir) is read file by file in whichever layout it has, no config
  needed; only its dynamic tables are listed, each with its ``collection`` directory.
  ``capacity`` there is the bound the table can grow to, ``max_capacity`` x the saving world
  size, and ``load_factor`` is size / that; both are None where the files do not say
  (TorchEasyRec's have no capacity). A checkpoint without dynamic tables gives no rows and a
  ``note`` saying what was looked for.
- A bundle directory (either naming, :mod:`shared.bundle.naming`) is read and checked as serving
  reads it: every table, ``size`` its keys (rows of a dense table), the path its tensors are
  named under (``prefix``: TorchEasyRec's collection path, or empty), and the training-side
  columns the export recorded in ``manifest.json`` ``extra.table_summaries``.
- A server answers ``ModelAdminService.InspectTables`` on its admin address (``HOST:PORT`` or
  ``unix:/path``, with its token and TLS files: :mod:`train.tools.admin_client`): every table
  it serves, ``capacity`` / ``load_factor`` of its serving hash table, ``hits`` / ``misses`` of
  lookups since the version was loaded, and the training-side columns as of the export or delta
  it serves (bundles carry them in ``manifest.json`` ``extra.table_summaries``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.bundle import read_bundle
from shared.delta_reader import check_summaries
from shared.hashtable.checkpoint import open_checkpoint
from shared.hashtable.summary import checkpoint_summaries
from train.fine_tune import resolve_checkpoint
from train.tools.admin_client import AdminTarget


def inspect_checkpoint(path: str | Path, *, top_k: int = 10) -> dict[str, Any]:
    ckpt = resolve_checkpoint(path)
    tables = []
    for name, s in checkpoint_summaries(ckpt, top_k=top_k).items():
        cap = s["max_capacity"] * s["world_size"] if s["max_capacity"] is not None else None
        adm = s.get("admission") or {}
        tables.append(
            {
                "name": name,
                "is_hashmap": True,
                "collection": s["collection"],
                "dim": s["dim"],
                "size": s["size"],
                "capacity": cap,
                "load_factor": s["size"] / cap if cap else None,
                "world_size": s["world_size"],
                "score_strategy": s["score_strategy"],
                "score_histogram": s["score_histogram"],
                "top_keys": s["top_keys"],
                "admission_threshold": adm.get("threshold", 0),
                "admission_pending": adm.get("pending", 0),
                "admission_pending_by_count": adm.get("pending_by_count", {}),
            }
        )
    report: dict[str, Any] = {
        "source": "checkpoint",
        "where": str(ckpt),
        "layout": open_checkpoint(ckpt).layout,
        "tables": tables,
    }
    if not tables:
        report["note"] = (
            f"no dynamic tables: nothing under {ckpt / 'dynamicemb'}/<collection>/ "
            "(<table>_emb_keys.rank_R.world_size_W or dynrec's first layout)"
        )
    return report


def inspect_bundle(path: str | Path) -> dict[str, Any]:
    """The tables of the bundle at ``path`` as serving loads them (BundleError if it is bad)."""
    bundle = read_bundle(path)
    where = f"{bundle.path}/manifest.json: extra.table_summaries"
    summaries = check_summaries(bundle.manifest["extra"].get("table_summaries", {}), where)
    tables = []
    for name, spec in bundle.feature_set.tables.items():
        s = summaries.get(name, {})
        if spec.is_dynamic:
            size = int(bundle.hash_tables[name][0].numel())
            capacity = int(s.get("max_capacity") or 0) * int(s.get("world_size") or 0) or size
        else:
            size = capacity = int(bundle.dense_tables[name].shape[0])
        adm = s.get("admission") or {}
        tables.append(
            {
                "name": name,
                "is_hashmap": spec.is_dynamic,
                "dim": spec.dim,
                "size": size,
                "capacity": capacity,
                "load_factor": size / capacity if capacity else 0.0,
                "parts": bundle.manifest["tables"][name]["parts"],
                "prefix": bundle.table_prefixes[name],
                "score_strategy": s.get("score_strategy", ""),
                "score_histogram": s.get("score_histogram", []),
                "top_keys": s.get("top_keys", []),
                "admission_threshold": adm.get("threshold", 0),
                "admission_pending": adm.get("pending", 0),
                "admission_pending_by_count": adm.get("pending_by_count", {}),
            }
        )
    return {
        "source": "bundle",
        "where": str(bundle.path),
        "version": bundle.version,
        "naming": bundle.naming.id,
        "format_version": bundle.format_version,
        "tables": tables,
    }


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
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def grid(head: list[str], rows: list[list[Any]]) -> list[str]:
    """Fixed-width text columns (floats with 3 decimals, None as ``-``); just the head
    without rows."""
    cells = [[_cell(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(head)]
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
            t["admission_pending"] if t["admission_threshold"] or t["admission_pending"] else "-",
        ]
        if server:
            row += [t["hits"], t["misses"]] if t["is_hashmap"] else ["-", "-"]
        rows.append(row)
    lines = [f"{report['source']} {report['where']}"]
    if "layout" in report:
        lines[0] += f" ({report['layout']} layout)"
    if report["source"] == "bundle":
        prefixes = sorted({t["prefix"] for t in report["tables"]} - {""})
        lines.append(
            f"version {report['version']}  ({report['naming']} naming, format_version "
            f"{report['format_version']}{'; under ' + ', '.join(prefixes) if prefixes else ''})"
        )
    if server:
        deltas = ", ".join(report["deltas"]) or "none"
        lines.append(
            f"model_version {report['model_version']}  (base {report['base_version']}; "
            f"deltas applied: {deltas})"
        )
    lines += grid(head, rows)
    if report.get("note"):
        lines.append(report["note"])
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
