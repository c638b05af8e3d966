"""shared/hashtable/host_move: the native mover's write-backs and reads equal torch's indexing,
for any width and thread count, only as far as the counts say; bad layouts and row ids are
refused before native code runs."""

from __future__ import annotations

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
