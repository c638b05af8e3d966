"""The child processes of ``bench.bench_stream``: ``python -m train stream`` trainers and a
``python -m serve --watch-deltas`` server, each a process of its own with its log in the work
dir (``PYTHONFAULTHANDLER``: a process that aborts writes every thread's stack there), started,
waited on and stopped (SIGTERM: a trainer finishes its step and commits a checkpoint); and a
trainer's records read back from its ``metrics.jsonl``, which is how the bench follows a
trainer.

A module of its own because the phases (``bench.bench_stream``), the reports
(``bench.stream_reports``) and the AUC phase's replay (``bench.stream_auc``) all start
trainers or read their records, and none of them should import another for it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_process(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "wb")  # noqa: SIM115 - the child's log, open while it runs
    # faulthandler: a process that aborts writes every thread's stack into its log
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)


def start_trainer(
    args: argparse.Namespace, home: Path, *, publish: bool
) -> subprocess.Popen[bytes]:
    """``python -m train stream`` on ``home/src`` into ``home/model`` (row log
    ``home/rows.jsonl``, log ``home/trainer.log``); ``publish``: to ``home/pub`` every
    ``--publish-every-s``, else no publishing (no ``--publish-root``: the trainer's only way)."""
    publishing = ["--publish-root", str(home / "pub"), "--publish-every-s",
                  str(args.publish_every_s), "--full-every", str(args.full_every)]  # fmt: skip
    cmd = [sys.executable, "-m", "train", "stream", "--config", str(args.config),
           "--source", str(home / "src"), "--model-dir", str(home / "model"),
           "--device", args.device, "--poll-s", "0.05", "--log-every-s", "1",
           *(publishing if publish else []), "--row-log", str(home / "rows.jsonl"),
           *(["--batch-size", str(args.batch_size)] if args.batch_size else []),
           *(["--num-workers", str(args.num_workers)] if args.num_workers is not None else [])]  # fmt: skip
    return start_process(cmd, home / "trainer.log")


def stop(process: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    """SIGTERM ``process`` (a trainer finishes its step and commits a checkpoint) and wait."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    process.wait(timeout)


def start_server(args: argparse.Namespace, work: Path, port: int) -> subprocess.Popen[bytes]:
    return start_process(server_command(args, work, port), work / "server.log")


def server_command(args: argparse.Namespace, work: Path, port: int) -> list[str]:
    """``python -m serve`` following ``work``'s publish root, with ``args.server_args`` last
    (so they may override the bench's own flags, as argparse takes the last)."""
    return [sys.executable, "-m", "serve", "--model-dir", str(work / "pub" / "full"),
           "--watch-deltas", str(work / "pub" / "deltas"), "--poll-interval-s",
           str(args.poll_s), "--device", args.device, "--port", str(port),
           "--max-candidates", str(max(args.candidates, 1000)),
           *(["--frontends", str(args.frontends)] if args.frontends else []),
           *args.server_args]  # fmt: skip


def wait_until(
    what: str, check: Callable[[], Any], timeout: float, *procs: subprocess.Popen
) -> Any:
    """``check()``'s first truthy value, polled every 0.1 s; the bench ends (SystemExit naming
    ``what``) after ``timeout`` s, or as soon as one of ``procs`` has exited: its log says why."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"{what}: {p.args!r:.160} exited {p.returncode} (see its log)")
        time.sleep(0.1)
    raise SystemExit(f"{what}: not within {timeout} s")


def records(work: Path, kind: str, model: str = "model") -> list[dict[str, Any]]:
    """The ``kind`` records of ``work/model/metrics.jsonl`` (a trainer's)."""
    path = work / model / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # the line the trainer is writing now
            continue
        if record.get("kind") == kind:
            out.append(record)
    return out
