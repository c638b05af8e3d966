"""bench/stream_processes.py: a trainer's records read back from its metrics (the line being
written skipped), waiting on a condition while the processes it needs live, a child's start
(its log) and stop (SIGTERM), and the server's command line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.bench_stream import parser
from bench.stream_processes import (
    records,
    server_command,
    start_process,
    stop,
    wait_until,
)
from serve.__main__ import parser as serve_parser


def test_records_give_the_kind_asked_and_skip_the_line_being_written(tmp_path: Path) -> None:
    assert records(tmp_path, "stream") == []  # no metrics yet: the trainer has not started
    (tmp_path / "model").mkdir()
    lines = [{"kind": "stream", "step": 1}, {"kind": "publish", "step": 1},
             {"kind": "stream", "step": 2}]  # fmt: skip
    text = "\n".join(json.dumps(r) for r in lines) + '\n{"kind": "stream", "st'
    (tmp_path / "model" / "metrics.jsonl").write_text(text)
    assert records(tmp_path, "stream") == [lines[0], lines[2]]
    assert records(tmp_path, "publish") == [lines[1]]
    assert records(tmp_path, "stream", "replay") == []  # another model dir


def test_wait_until_returns_the_value_or_says_which_process_ended(tmp_path: Path) -> None:
    calls = iter([0, None, "ready"])
    assert wait_until("three checks", lambda: next(calls), 10.0) == "ready"
    ended = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    ended.wait()
    with pytest.raises(SystemExit, match="the server: .* exited 3"):
        wait_until("the server", lambda: False, 10.0, ended)
    with pytest.raises(SystemExit, match="never: not within 0.2 s"):
        wait_until("never", lambda: False, 0.2)


def test_a_child_logs_to_its_file_and_stops_at_sigterm(tmp_path: Path) -> None:
    code = "import sys, time; print('started', flush=True); time.sleep(60)"
    child = start_process([sys.executable, "-c", code], tmp_path / "child.log")
    wait_until("the child's log", lambda: b"started" in (tmp_path / "child.log").read_bytes(), 30.0)
    stop(child, timeout=30.0)
    assert child.returncode == -signal.SIGTERM
    stop(child)  # already stopped: nothing to signal


def test_the_servers_command_ends_with_the_flags_passed_through(tmp_path: Path) -> None:
    """``--server-args``: one shell-quoted string, split into the server's flags, after the
    bench's own (argparse takes the last of a flag given twice); each is a real serve flag."""
    args = parser().parse_args(
        ["--out", "x.json", "--device", "cpu", "--frontends", "2",
         "--server-args", "--key-headroom 20 --torch-threads 2 --poll-interval-s 1"]
    )  # fmt: skip
    cmd = server_command(args, tmp_path, 5000)
    assert cmd[:3] == [sys.executable, "-m", "serve"]
    assert cmd[cmd.index("--frontends") + 1] == "2" and cmd[cmd.index("--port") + 1] == "5000"
    extra = ["--key-headroom", "20", "--torch-threads", "2", "--poll-interval-s", "1"]
    assert cmd[-len(extra) :] == extra
    assert server_command(parser().parse_args(["--out", "x.json"]), tmp_path, 1)[-2:] == [
        "--max-candidates",
        "1000",
    ]
    serve_parser().parse_args(cmd[3:])  # the server's own parser takes every flag
