"""Where ``bench.bench_stream``'s slow answers were: the server's and the publishing trainer's
events on the wall clock, and the load's answers split by the event they were sent during.

Issue #55's serving goal compares two phases' p99, and one number does not say what made it.
The candidates are the server's delta applies (read and merge, the tables written in place or
rebuilt, a program's graphs captured: :mod:`serve.delta`, whose log line gives each apply's
seconds per stage) and the trainer's publishes (a checkpoint and its export on the same card:
the ``publish`` records of its ``metrics.jsonl``). :func:`server_applies` and
:func:`trainer_publishes` read their intervals; :func:`attribution` sorts each answer of a window
by its send time: during an apply (or within ``after_s`` of its end: the old model's retire,
the memory the new one freed), else during a publish, else ``quiet``; and gives each class's
answers and p99, and the window's p99 without the apply answers. A goal missed only because of
the applies says the server's update path is the cost; one missed in the quiet seconds too says
it is the card shared with the trainer.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Any

import numpy as np

from bench.stream_load import PacedLoad
from bench.stream_processes import records

# serve.delta's lines: "<asctime> INFO serve.delta: delta <id> written in place into model <v>
# (batches paused <ms> ms; read <s> s, ..., total <s> s)" and "... delta <id>: new model ready
# (read <s> s, ..., total <s> s)"
_APPLY = re.compile(
    r"^(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO serve\.delta: delta (?P<id>\S+?):? "
    r"(?:written in place into model \S+ \(batches paused (?P<pause>[\d.]+) ms; "
    r"|new model ready \()(?P<stages>[^)]*total (?P<total>[\d.]+) s)\)$"
)
# serve.model's line for a full bundle's load (the watcher's, a new base): "<asctime> INFO
# serve.model: model <v> loaded from <path> on <device> in <s>s (read ..., total <ms>ms)"
_LOAD = re.compile(
    r"^(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO serve\.model: model (?P<id>\S+) "
    r"loaded from \S+ on \S+ in (?P<total>[\d.]+)s "
)
EVENT_CLASSES = ("apply", "publish", "quiet")


def server_applies(log: Path) -> list[dict[str, Any]]:
    """Each delta apply, and each full bundle's load, of a server's log: ``{"delta", "how",
    "start_unix", "end_unix", "pause_ms"}`` (how: ``in_place``, ``rebuild`` or ``load``, whose
    "delta" is the bundle's version; the start is the line's time less the apply's total, the
    log's local time read on this machine's clock)."""
    out = []
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        m = _APPLY.match(line) or _LOAD.match(line)
        if m is None:
            continue
        end = dt.datetime.strptime(m["at"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        pause = m["pause"] if m.re is _APPLY else None
        how = "load" if m.re is _LOAD else "in_place" if pause else "rebuild"
        out.append({
            "delta": m["id"], "how": how, "start_unix": end - float(m["total"]),
            "end_unix": end, "pause_ms": float(pause) if pause else None,
        })  # fmt: skip
    return out


def trainer_publishes(work: Path) -> list[dict[str, Any]]:
    """Each publish of the trainer in ``work``: ``{"version", "what", "start_unix",
    "end_unix"}`` (a record's ``at_unix`` is when the loop collected it, at or after the end)."""
    return [
        {"version": r["version"], "what": r["what"],
         "start_unix": r["at_unix"] - r["publish_seconds"], "end_unix": r["at_unix"]}
        for r in records(work, "publish")
    ]  # fmt: skip


def attribution(
    load: PacedLoad,
    window: tuple[float, float],
    applies: list[dict[str, Any]],
    publishes: list[dict[str, Any]],
    *,
    mono_to_unix: float,
    after_s: float = 2.5,
) -> dict[str, Any]:
    """The answered requests of ``window`` (monotonic) by class (module doc): per class the
    answers and their p99 ms, and ``p99_without_applies_ms``. ``mono_to_unix`` is added to a
    monotonic time to get the wall clock's; ``after_s`` (default: the server's 2-s retire and
    some) extends each apply."""
    start, end = window
    spans = {
        "apply": [(e["start_unix"], e["end_unix"] + after_s) for e in applies],
        "publish": [(e["start_unix"], e["end_unix"]) for e in publishes],
    }
    by: dict[str, list[float]] = {c: [] for c in EVENT_CLASSES}
    for t, x, ok in load.log:
        if not ok or not start <= t < end:
            continue
        u = t + mono_to_unix
        cls = next((c for c, s in spans.items() if any(a <= u < b for a, b in s)), "quiet")
        by[cls].append(x * 1e3)

    def p99(xs: list[float]) -> float | None:
        return float(np.percentile(xs, 99)) if xs else None

    lo, hi = start + mono_to_unix, end + mono_to_unix
    return {
        **{c: {"answers": len(xs), "p99_ms": p99(xs)} for c, xs in by.items()},
        "p99_without_applies_ms": p99(by["publish"] + by["quiet"]),
        "applies": [e for e in applies if e["start_unix"] < hi and e["end_unix"] > lo],
        "publishes": [e for e in publishes if e["start_unix"] < hi and e["end_unix"] > lo],
    }
