"""Processes that a module fixture starts together and its tests wait for, one each.

On the 2-core machines the suite runs on, a long CLI run (the pipeline, a benchmark) mostly keeps
one core busy: each of its stages is a process that spends seconds importing torch and torchrec.
Two such runs started at once take about the time of the longer. Their output goes to files, not
pipes: nobody reads a pipe while another test runs, and a full one would stall the process.

    runs = {"a": start(cmd_a, tmp / "a"), "b": start(cmd_b, tmp / "b")}
    yield runs
    stop(runs.values())   # in the fixture's teardown: whatever a failed test left running
    ...
    printed = runs["a"].wait()   # in the test: its stdout, once it exited 0
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import ROOT


@dataclass(frozen=True)
class Background:
    """A process started by :func:`start`: its command, folder and output files."""

    cmd: list[str]
    folder: Path
    proc: subprocess.Popen[bytes]

    @property
    def stdout(self) -> Path:
        return self.folder / "stdout.txt"

    @property
    def stderr(self) -> Path:
        return self.folder / "stderr.txt"

    def wait(self, timeout_s: float = 600) -> str:
        """Its stdout once it exits 0 (else the test fails with its stderr's tail)."""
        rc = self.proc.wait(timeout=timeout_s)
        assert rc == 0, f"{self.cmd} exited {rc}:\n" + self.stderr.read_text()[-4000:]
        return self.stdout.read_text()


def start(cmd: list[str], folder: Path) -> Background:
    """Start ``cmd`` in the repository root (one BLAS thread), its output under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "stdout.txt").open("wb") as out, (folder / "stderr.txt").open("wb") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    return Background(cmd, folder, proc)


def stop(runs: Iterable[Background]) -> None:
    """Kill those still running (a test failed before it waited)."""
    for run in runs:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
