"""shared/hashtable/host_move: the native mover's write-backs and reads equal torch's indexing,
for any width and thread count, only as far as the counts say; bad layouts and row ids are
refused before native code runs."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from shared.hashtable import host_move

NEEDS_CC = pytest.mark.skipif(
    host_move.unavailable_reason() is not None,
    reason=f"the native mover cannot be built here: {host_move.unavailable_reason()}",
)


def _case(width: int, capacity: int, nb: int, nr: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    host = torch.randn(capacity, width, generator=gen)
    perm = torch.randperm(capacity, generator=gen)
    back, read = perm[:nb].contiguous(), perm[nb : nb + nr].contiguous()  # disjoint rows
    out = torch.randn(nb, width, generator=gen)
    into = torch.full((nr, width), float("nan"))
    return host, back, out, read, into


@NEEDS_CC
@pytest.mark.parametrize("width", [32, 256, 3])
@pytest.mark.parametrize("threads", [1, 4, 17])
def test_the_move_writes_back_then_reads_as_torch_indexing_does(width: int, threads: int) -> None:
    """21K rows: up to 6 threads' worth (a thread takes at least 4096 rows)."""
    host, back, out, read, into = _case(width, capacity=30_000, nb=9_000, nr=12_000)
    want_host = host.clone()
    want_host[back] = out
    want_into = want_host[read]
    counts = torch.tensor([9_000, 12_000])
    host_move.HostMove(host, back, out, read, into, counts, threads=threads).run()
    assert torch.equal(host, want_host) and torch.equal(into, want_into)


@NEEDS_CC
def test_only_the_counted_rows_move() -> None:
    """The arrays are the largest a step may need; ``counts`` says how many rows move now."""
    host, back, out, read, into = _case(8, capacity=1000, nb=100, nr=100)
    want_host = host.clone()
    want_host[back[:30]] = out[:30]
    counts = torch.tensor([30, 40])
    host_move.HostMove(host, back, out, read, into, counts, threads=3).run()
    assert torch.equal(host, want_host)
    assert torch.equal(into[:40], want_host[read[:40]]) and bool(into[40:].isnan().all())
    counts.zero_()  # read when the move runs: nothing moves now
    before = host.clone()
    host_move.HostMove(host, back, out, read, into, counts, threads=3).run()
    assert torch.equal(host, before)


@NEEDS_CC
def test_a_mover_counts_its_moves_and_their_time() -> None:
    """``spent()``: the native code's wall time of each move, summed, and their count (a
    host function's time, which no device profile shows)."""
    host, back, out, read, into = _case(32, capacity=30_000, nb=9_000, nr=12_000)
    move = host_move.HostMove(host, back, out, read, into, torch.tensor([9_000, 12_000]),
                              threads=2)  # fmt: skip
    assert move.spent() == (0.0, 0)
    t0 = time.perf_counter()
    move.run()
    move.run()
    wall = time.perf_counter() - t0
    seconds, moves = move.spent()
    assert moves == 2 and 0.0 < seconds <= wall
    # a mover made again (the tier moved, the arrays grew) goes on from the one it replaces
    again = host_move.HostMove(host, back, out, read, into, torch.tensor([9_000, 12_000]),
                               threads=2, after=move)  # fmt: skip
    assert again.spent() == (seconds, 2)
    again.run()
    assert again.spent()[1] == 3 and again.spent()[0] > seconds


@NEEDS_CC
def test_row_ids_and_counts_outside_the_arrays_are_refused() -> None:
    host, back, out, read, into = _case(4, capacity=100, nb=10, nr=10)
    with pytest.raises(ValueError, match="11 write-backs for arrays of 10"):
        host_move.HostMove(host, back, out, read, into, torch.tensor([11, 0]), threads=1).run()
    read[3] = 100
    with pytest.raises(ValueError, match=r"reads' rows must be in \[0, 100\)"):
        host_move.HostMove(host, back, out, read, into, torch.tensor([0, 10]), threads=1).run()


def test_layouts_the_native_code_cannot_take_are_refused() -> None:
    host, back, out, read, into = _case(4, capacity=100, nb=10, nr=10)
    counts = torch.tensor([10, 10])
    with pytest.raises(ValueError, match="back must be a contiguous torch.int64"):
        host_move.HostMove(host, back.int(), out, read, into, counts, threads=1)
    with pytest.raises(ValueError, match=r"out, into \[n, width\]"):
        host_move.HostMove(host, back, out[:, :3].contiguous(), read, into, counts, threads=1)
    with pytest.raises(ValueError, match="threads be >= 1"):
        host_move.HostMove(host, back, out, read, into, counts, threads=0)


def _expected(
    host: torch.Tensor, back: torch.Tensor, out: torch.Tensor, read: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    want_host = host.clone()
    want_host[back] = out
    return want_host, want_host[read]


@NEEDS_CC
def test_moves_reuse_the_helpers_and_callers_on_several_threads_take_turns() -> None:
    """The helper threads are started once and kept (a move of 21K rows on 6 threads, then
    more, then fewer); moves called from several threads at once each equal torch's indexing
    (ctypes lets go of the GIL, so they do reach the native code together)."""
    cases = [_case(16, capacity=30_000, nb=9_000, nr=12_000, seed=s) for s in range(8)]
    wants = [_expected(h, b, o, r) for h, b, o, r, _ in cases]
    counts = torch.tensor([9_000, 12_000])

    def move(k: int, threads: int) -> None:
        host, back, out, read, into = cases[k]
        host_move.HostMove(host, back, out, read, into, counts, threads=threads).run()

    for threads in (6, 17, 2):  # one job at a time: the pool grows, then takes fewer parts
        move(0, threads)
        assert torch.equal(cases[0][0], wants[0][0]) and torch.equal(cases[0][4], wants[0][1])
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(move, range(1, 8), [3, 6, 17, 4, 6, 2, 5]))
    for (host, *_, into), (want_host, want_into) in zip(cases[1:], wants[1:], strict=True):
        assert torch.equal(host, want_host) and torch.equal(into, want_into)


@NEEDS_CC
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")
def test_a_forked_child_moves_with_helpers_of_its_own() -> None:
    """A fork's child has none of the parent's helper threads: it starts its own instead of
    waiting on threads that are not there (the child's exit code says whether its move was
    right; a hang fails the test after 60 s). The child keeps torch to one thread, as data
    loader workers do: the parent's OpenMP threads are not in it either."""
    host, back, out, read, into = _case(16, capacity=30_000, nb=9_000, nr=12_000)
    want_host, want_into = _expected(host, back, out, read)
    counts = torch.tensor([9_000, 12_000])
    host_move.HostMove(host.clone(), back, out, read, into.clone(), counts, threads=6).run()
    pid = os.fork()
    if pid == 0:  # the child: no pytest from here, only an exit code
        ok = False
        try:
            torch.set_num_threads(1)  # torch's own OpenMP pool is not the child's to use
            host_move.HostMove(host, back, out, read, into, counts, threads=6).run()
            ok = torch.equal(host, want_host) and torch.equal(into, want_into)
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's move did not finish in 60 s (waiting on the parent's helpers)")
