"""bench/stream_events.py: the server's applies read from its log, the trainer's publishes from
its records, and a window's answers split by the event they were sent during."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import numpy as np

from bench.stream_events import attribution, server_applies, trainer_publishes
from bench.stream_load import PacedLoad

# serve.delta's lines as the server logs them (format of serve/__main__.py; the messages'
# form is asserted in tests/serve/test_delta_in_place.py), among others
LOG = """\
2026-12-07 12:56:58,184 INFO serve.model: model step-17 loaded from /w/pub/full/step-17 on \
cuda:0 in 0.777s (read 48.3ms, table_build 8.0ms, program_load 732.1ms, warmup 44.1ms, \
graphs 0.0ms, total 776.7ms)
2026-12-07 12:56:58,184 INFO serve.versions: serving model step-17 from /w/pub/full/step-17 \
(previous: None)
2026-12-07 12:57:05,543 INFO serve.delta: delta step-18 written in place into model step-17 \
(batches paused 18.95 ms; read 0.412 s, table_build 0.051 s, program_load 0.020 s, \
warmup 0.001 s, graphs 0.000 s, total 0.500 s)
2026-12-07 12:57:05,543 INFO serve.versions: serving model step-17+step-18 (replaced step-17 \
without a restart)
2026-12-07 12:57:16,441 INFO serve.delta: delta step-1385: new tables built (tables \
user_id_emb: 955008 keys after the delta, room for 50083)
2026-12-07 12:57:17,300 INFO serve.model: model step-17+step-1385: 42 CUDA graphs captured
2026-12-07 12:57:17,301 INFO serve.delta: delta step-1385: new model ready (read 0.300 s, \
table_build 0.200 s, program_load 0.000 s, warmup 0.010 s, graphs 0.790 s, total 1.301 s)
"""


def _unix(at: str) -> float:
    return dt.datetime.strptime(at, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_server_applies_reads_each_applys_interval_from_the_log(tmp_path: Path) -> None:
    (tmp_path / "server.log").write_text(LOG)
    applies = server_applies(tmp_path / "server.log")
    end0, end1 = _unix("2026-12-07 12:57:05,543"), _unix("2026-12-07 12:57:17,301")
    assert [(a["delta"], a["how"], a["pause_ms"]) for a in applies] == [
        ("step-17", "load", None),
        ("step-18", "in_place", 18.95),
        ("step-1385", "rebuild", None),
    ]
    assert np.isclose(applies[0]["start_unix"], _unix("2026-12-07 12:56:58,184") - 0.777)
    assert np.isclose(applies[1]["end_unix"], end0) and np.isclose(
        applies[1]["start_unix"], end0 - 0.5
    )
    assert np.isclose(applies[2]["start_unix"], end1 - 1.301)
    assert server_applies(tmp_path / "missing.log") == []


def test_trainer_publishes_ends_at_the_records_collection_time(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    rows = [
        {"kind": "stream", "at_unix": 5.0},
        {"kind": "publish", "at_unix": 100.0, "publish_seconds": 1.5, "what": "delta",
         "version": "step-1+step-9"},
    ]  # fmt: skip
    lines = "\n".join(json.dumps(r) for r in rows) + '\n{"kind": "publ'  # a line being written
    (tmp_path / "model" / "metrics.jsonl").write_text(lines)
    assert trainer_publishes(tmp_path) == [
        {"version": "step-1+step-9", "what": "delta", "start_unix": 98.5, "end_unix": 100.0}
    ]


def test_attribution_sorts_each_answer_by_the_event_it_was_sent_during() -> None:
    load = PacedLoad("127.0.0.1:1", [], per_s=1.0, threads=0)
    # a window of 10 s (monotonic 0..10, unix 1000..1010), one answer each 0.01 s: 5 ms, but
    # 50 ms in [2, 3) (an apply ending at 2.5, + 0.5 s after it) and 20 ms in [6, 7) (a publish)
    for i in range(1000):
        t = i * 0.01
        x = 50.0 if 2 <= t < 3 else 20.0 if 6 <= t < 7 else 5.0
        load.log.append((t, x / 1e3, True))
    load.log.append((4.0, 0.001, False))  # an error: not an answer
    load.log.append((11.0, 1.0, True))  # outside the window
    applies = [{"delta": "d", "how": "in_place", "start_unix": 1002.0, "end_unix": 1002.5,
                "pause_ms": 1.0}, {"delta": "late", "how": "rebuild", "start_unix": 1020.0,
                "end_unix": 1021.0, "pause_ms": None}]  # fmt: skip
    publishes = [{"version": "v", "what": "delta", "start_unix": 1006.0, "end_unix": 1007.0}]
    out = attribution(load, (0.0, 10.0), applies, publishes, mono_to_unix=1000.0, after_s=0.5)
    assert out["apply"]["answers"] == 100 and np.isclose(out["apply"]["p99_ms"], 50.0)
    assert out["publish"]["answers"] == 100 and np.isclose(out["publish"]["p99_ms"], 20.0)
    assert out["quiet"]["answers"] == 800 and np.isclose(out["quiet"]["p99_ms"], 5.0)
    without = [20.0] * 100 + [5.0] * 800
    assert np.isclose(out["p99_without_applies_ms"], np.percentile(without, 99))
    assert [a["delta"] for a in out["applies"]] == ["d"]  # the window's own
    assert out["publishes"] == publishes
