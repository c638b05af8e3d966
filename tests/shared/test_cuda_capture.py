"""shared.cuda_capture: a capture replays what the body computes, keeps the caches the
process filled (torch.cuda.graph empties them), orders itself after earlier work, and a
failed body leaves the stream usable; live sets of graphs get capture streams apart
(CaptureStreams: its rules on CPU, with integers for streams, then on CUDA)."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch

from shared.cuda_capture import CaptureStreams, capture, capture_stream, capture_streams, graph_pool


class _Owner:
    """A set of graphs (anything a weak reference can follow)."""


def _streams(made: list[int], reserved: set[int] | None = None) -> CaptureStreams[int]:
    """Integers for streams: ``made`` lists what each new one is (torch's pool may give an
    old one again)."""
    it = iter(made)
    return CaptureStreams(lambda: next(it), lambda s: s, lambda: reserved or set())


def test_live_owners_get_streams_apart_and_a_gone_owners_comes_back() -> None:
    streams = _streams([1, 2, 3])
    a, b = _Owner(), _Owner()
    sa, sb = streams.take(a), streams.take(b)
    assert sa != sb
    del a
    gc.collect()
    c = _Owner()
    assert streams.take(c) == sa  # a's stream, a gone: no new stream made
    assert len(streams) == 2 and streams.take(_Owner()) == 3  # b and c live: a new one


def test_a_new_stream_equal_to_a_held_or_reserved_one_is_skipped() -> None:
    """torch hands streams out of a pool, round robin: a new one may be a live owner's, or the
    shared capture stream (reserved)."""
    streams = _streams([7, 7, 9, 4], reserved={9})
    keep = [_Owner(), _Owner()]
    assert [streams.take(o) for o in keep] == [7, 4]


def test_no_stream_apart_is_an_error_that_says_why() -> None:
    streams = _streams(list(itertools.repeat(5, 300)))
    keep = _Owner()
    streams.take(keep)
    with pytest.raises(RuntimeError, match="no capture stream free"):
        streams.take(_Owner())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_capture_streams_are_apart_from_each_other_and_the_shared_one() -> None:
    dev = torch.device("cuda")
    owners = [_Owner() for _ in range(3)]
    got = [capture_streams(dev).take(o) for o in owners]
    keys = {int(s.cuda_stream) for s in got}
    assert len(keys) == 3 and int(capture_stream(dev).cuda_stream) not in keys
    assert capture_streams(dev) is capture_streams(torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replay_equals_eager_on_new_inputs() -> None:
    x = torch.randn(1000, 16, device="cuda")
    w = torch.randn(16, 4, device="cuda")
    body = lambda: torch.relu(x @ w).sum(0)  # noqa: E731
    body()  # lazy library init before the capture
    graph = torch.cuda.CUDAGraph()
    with capture(graph):
        out = body()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, body())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_capture_keeps_the_allocator_cache() -> None:
    block = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del block  # back to the caching allocator
    reserved = torch.cuda.memory_reserved()
    x = torch.ones(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with capture(graph):
        y = x * 2
    graph.replay()
    assert torch.cuda.memory_reserved() >= reserved  # torch.cuda.graph would have emptied it
    torch.testing.assert_close(y, torch.full((8,), 2.0, device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_body_sees_work_queued_before_it() -> None:
    x = torch.zeros(1 << 20, device="cuda")
    x.add_(1)  # queued on the current stream, maybe not run yet
    graph = torch.cuda.CUDAGraph()
    with capture(graph):
        y = x + 1  # the capture stream waited for the add
    graph.replay()
    torch.testing.assert_close(y, torch.full_like(x, 2.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_failed_body_ends_the_capture_and_a_later_one_works() -> None:
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="boom"), capture(graph):
        torch.ones(4, device="cuda").mul_(3)
        raise RuntimeError("boom")
    assert not torch.cuda.is_current_stream_capturing()
    graph = torch.cuda.CUDAGraph()
    with capture(graph):
        z = torch.ones(4, device="cuda") * 5
    graph.replay()
    torch.testing.assert_close(z, torch.full((4,), 5.0, device="cuda"))
    assert capture_stream(torch.device("cuda")) is capture_stream(torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_graph_pool_outlives_every_graph_captured_into_it() -> None:
    """The static step's case (H100, 2026-12-07): every graph of a pool dropped while a tensor
    made in it lives on, then another capture into the same pool: it works, and replays."""
    pool = graph_pool(torch.device("cuda"))
    x = torch.ones(1024, device="cuda")
    first = torch.cuda.CUDAGraph()
    with capture(first, pool=pool.id):
        kept = x * 2  # allocated in the pool, outlives its graph
    first.replay()
    del first  # the pool's only graph
    second = torch.cuda.CUDAGraph()
    with capture(second, pool=pool.id):
        y = kept + x
    second.replay()
    torch.testing.assert_close(y, torch.full((1024,), 3.0, device="cuda"))
