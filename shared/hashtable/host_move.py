"""Rows of the host tier moved by the host's cores, from native code (``host_move.c``).

Why: the device's reads of random host rows cost it a fixed amount per row (46M rows/s at 128 B
on the H100, in any page size; 262M in address order at 30M rows, about 35M again at 100M rows
where the rows lie far apart: ``bench_host_pages``, ``bench_tiers``), while the host's 16 cores
gather 200-400M rows/s of the same tier (``bench_host_rows``). A CUDA graph cannot call Python,
but it can run a host function (``cudaLaunchHostFunc`` is capturable): :func:`launch_on_stream`
queues :c:func:`hm_move` (the write-backs scattered into the tier, then the misses gathered out
of it, over staging rows that lie one after another, split over ``threads`` threads) on a CUDA
stream, and kernels before and after it fill and drain the staging rows through UVA, in address
order. The same function runs on the host directly (:meth:`HostMove.run`): the tests check it
there, against torch's indexing.

The library is built at first use with the host's C compiler (``cc``, or ``$CC``) into the
user's cache (``$XDG_CACHE_HOME/dynrec``, else ``~/.cache/dynrec``), named by the source's hash,
written to a temporary name and renamed (a concurrent build writes the same bytes).
:func:`unavailable_reason` says why it cannot be (no compiler, a failed build).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("host_move.c")


class Params(ctypes.Structure):
    """``hm_params`` of ``host_move.c``."""

    _fields_ = [
        ("host", ctypes.c_void_p),
        ("width", ctypes.c_int64),
        ("back", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("read", ctypes.c_void_p),
        ("into", ctypes.c_void_p),
        ("counts", ctypes.c_void_p),
        ("threads", ctypes.c_int64),
        ("spent", ctypes.c_void_p),
    ]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dynrec"


@functools.cache
def _build() -> tuple[ctypes.CDLL | None, str | None]:
    source = SOURCE.read_bytes()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler (cc, gcc or $CC) to build host_move.c"
    target = _cache_dir() / f"host_move-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [compiler, "-O3", "-shared", "-fPIC", "-pthread", "-o", tmp, str(SOURCE)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            os.unlink(tmp)
            return None, f"building host_move.c failed ({' '.join(cmd)}): {done.stderr[-500:]}"
        os.replace(tmp, target)
    lib = ctypes.CDLL(str(target))
    lib.hm_move.argtypes = [ctypes.c_void_p]
    lib.hm_move.restype = None
    return lib, None


def unavailable_reason() -> str | None:
    """Why the native mover cannot run here (None: it can)."""
    return _build()[1]


def _library() -> ctypes.CDLL:
    lib, why = _build()
    if lib is None:
        raise RuntimeError(f"host_move: {why}")
    return lib


class HostMove:
    """One move's arguments, held where native code reads them (its :class:`Params` and the
    tensors they point at stay alive with it; ``after``: the mover it replaces, whose
    :meth:`spent` it goes on from): the write-backs ``host[back[i]] = out[i]`` and
    the reads ``into[i] = host[read[i]]`` for ``i`` below ``counts[0]`` and ``counts[1]``
    (``counts`` [2] int64, read when the move runs). ``host`` [capacity, width] float32 and
    every other tensor contiguous on the host (pinned where a device writes them)."""

    def __init__(
        self,
        host: torch.Tensor,
        back: torch.Tensor,
        out: torch.Tensor,
        read: torch.Tensor,
        into: torch.Tensor,
        counts: torch.Tensor,
        *,
        threads: int,
        after: HostMove | None = None,
    ) -> None:
        width = host.shape[1] if host.dim() == 2 else -1
        for name, t, dtype in (("host", host, torch.float32), ("back", back, torch.int64),
                               ("out", out, torch.float32), ("read", read, torch.int64),
                               ("into", into, torch.float32), ("counts", counts, torch.int64)):  # fmt: skip
            if t.is_cuda or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(
                    f"HostMove: {name} must be a contiguous {dtype} tensor on the host, got "
                    f"{t.dtype} on {t.device}"
                )
        if width < 0 or out.shape[1:] != (width,) or into.shape[1:] != (width,):
            raise ValueError(
                f"HostMove: host must be [capacity, width] and out, into [n, width], got "
                f"{list(host.shape)}, {list(out.shape)}, {list(into.shape)}"
            )
        if counts.numel() != 2 or threads < 1:
            raise ValueError(f"HostMove: counts must hold 2 numbers and threads be >= 1, got "
                             f"{counts.numel()} and {threads}")  # fmt: skip
        self._keep = (host, back, out, read, into, counts)
        # [ns, moves] added to by every move (the native code writes it: not a torch tensor),
        # from where ``after``'s ended (the mover this one replaces: its owner's total goes on)
        start = (0, 0) if after is None else (int(after._spent[0]), int(after._spent[1]))
        self._spent: ctypes.Array[ctypes.c_int64] = (ctypes.c_int64 * 2)(*start)
        self.params = Params(host.data_ptr(), width, back.data_ptr(), out.data_ptr(),
                             read.data_ptr(), into.data_ptr(), counts.data_ptr(), threads,
                             ctypes.addressof(self._spent))  # fmt: skip
        self.capacity = int(host.shape[0])
        self.lengths = (back.numel(), read.numel())

    def spent(self) -> tuple[float, int]:
        """(seconds, moves): the wall time of this mover's moves so far and their count, as
        the native code measured each (on CUDA read them once the device is synchronized: a
        queued host function may still add to them)."""
        return self._spent[0] / 1e9, int(self._spent[1])

    def run(self) -> None:
        """The move, now, on this thread (and its helpers). The counts must be within the
        arrays and the row ids within the tier (checked here: the native code trusts them)."""
        nb, nr = (int(x) for x in self._keep[5].tolist())
        back, read = self._keep[1], self._keep[3]
        for what, n, ids, length in (("write-backs", nb, back, self.lengths[0]),
                                     ("reads", nr, read, self.lengths[1])):  # fmt: skip
            if not 0 <= n <= length:
                raise ValueError(f"HostMove: {n} {what} for arrays of {length}")
            if n and not (int(ids[:n].min()) >= 0 and int(ids[:n].max()) < self.capacity):
                raise ValueError(f"HostMove: {what}' rows must be in [0, {self.capacity})")
        _library().hm_move(ctypes.addressof(self.params))


def launch_on_stream(move: HostMove, stream: torch.cuda.Stream) -> None:
    """Queue ``move`` on ``stream`` as a host function (``cudaLaunchHostFunc``; capturable in
    a CUDA graph): it runs once the stream's work before it is done, and the work after it
    waits for it. The ids and counts are not checked then: the kernels that write them must
    keep them within the arrays and the tier."""
    err = _cudart().cudaLaunchHostFunc(
        ctypes.c_void_p(stream.cuda_stream),
        ctypes.cast(_library().hm_move, ctypes.c_void_p),
        ctypes.c_void_p(ctypes.addressof(move.params)),
    )
    if err != 0:
        raise RuntimeError(f"host_move: cudaLaunchHostFunc failed (cudaError {err})")


@functools.cache
def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (found among the process's mapped libraries)."""
    torch.cuda.init()
    mapped = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
              if "libcudart.so" in Path(line.split()[-1] if line.split() else "").name]  # fmt: skip
    # torch's own first; else by name (a torch linked with the runtime statically)
    for name in (*mapped[:1], "libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaLaunchHostFunc.argtypes = [ctypes.c_void_p] * 3
        lib.cudaLaunchHostFunc.restype = ctypes.c_int
        return lib
    raise RuntimeError("host_move: no CUDA runtime library (libcudart.so) to launch with")
