"""py-spy from the benchmarks: find the executable, record a process's stacks (those holding the
GIL, or every thread's wall-clock stacks), and split a recording by thread.

py-spy (a sampling profiler that reads another process's Python stacks from outside) is not a
dependency of the project: the GPU machine gets it as a wheel (``bench/run_serving_gpu.sh``),
and every benchmark runs without it, leaving its profile out.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


def find_py_spy(explicit: str | None) -> str | None:
    """``explicit``, else py-spy on PATH, beside this Python (a virtual environment's
    ``bin/``), or in a ``bin/`` beside an entry of ``sys.path`` (where ``pip install --target
    DIR`` puts scripts); None if there is none."""
    if explicit:
        return explicit
    found = shutil.which("py-spy")
    if found:
        return found
    dirs = [Path(sys.executable).parent, *(Path(e or ".") / "bin" for e in sys.path)]
    for d in dirs:
        cand = d / "py-spy"
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    return None


def record_stacks(
    py_spy: str,
    pid: int,
    seconds: int,
    rate: int,
    out: Path,
    *,
    after_s: float = 0.0,
    threads: bool = False,
    wall: bool = False,
) -> subprocess.Popen[bytes]:
    """py-spy recording ``pid``'s GIL-holding stacks (``--gil``; raw format, into ``out``) for
    ``seconds`` at ``rate`` Hz, starting ``after_s`` from now; stderr piped for its errors.
    ``threads``: each stack starts with its thread (what :func:`by_thread` splits on).
    ``wall``: every thread's stack at every sample, waiting or not (``--idle``, no ``--gil``):
    where each thread's wall-clock time goes."""
    mode = "--idle" if wall else "--gil"
    cmd = f"exec {py_spy} record --pid {pid} --duration {seconds} --rate {rate} {mode} "
    cmd += f"--nonblocking --format raw -o {out}" + (" --threads" if threads else "")
    if after_s:
        cmd = f"sleep {after_s}; {cmd}"
    return subprocess.Popen(["sh", "-c", cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _frame(frame: str) -> str:
    """A py-spy frame without its line number: ``func (path)``."""
    return re.sub(r":\d+\)$", ")", frame)


# frames of this repository's packages (py-spy shows paths relative to the working directory)
_OURS = re.compile(r"\((bench|serve|shared|train)/")


def by_thread(raw: str, rate: int, seconds: float) -> list[dict[str, Any]]:
    """A ``threads=True`` recording of :func:`record_stacks` split by thread, busiest first:
    ``fraction``, its samples over ``rate * seconds`` (the share of the time it held the GIL;
    with ``wall=True``, of the time it spent in each stack, waiting included); ``runs``, its
    outermost frame in this repository, else its outermost frame outside ``threading.py`` and
    ``runpy``; and its hottest leaf functions."""
    samples: collections.Counter[str] = collections.Counter()
    label: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        if not frames:
            continue
        n = int(count)
        samples[thread] += n
        mine = (
            [f for f in frames if _OURS.search(f)]
            or [f for f in frames if "(threading.py" not in f and "runpy>" not in f]
            or frames
        )
        label[thread][_frame(mine[0])] += n
        leaves[thread][_frame(frames[-1])] += n
    expected = rate * seconds
    return [
        {
            "thread": thread,
            "runs": label[thread].most_common(1)[0][0],
            "fraction": n / expected if expected else None,
            "top_leaf_functions": [
                {"frame": k, "share": v / n} for k, v in leaves[thread].most_common(12)
            ],
        }
        for thread, n in samples.most_common()
    ]
