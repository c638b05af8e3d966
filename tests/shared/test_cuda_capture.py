"""shared.cuda_capture: a capture replays what the body computes, keeps the caches the
process filled (torch.cuda.graph empties them), orders itself after earlier work, and a
failed body leaves the stream usable."""

from __future__ import annotations

import pytest
import torch

from shared.cuda_capture import capture, capture_stream, graph_pool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


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


def test_the_body_sees_work_queued_before_it() -> None:
    x = torch.zeros(1 << 20, device="cuda")
    x.add_(1)  # queued on the current stream, maybe not run yet
    graph = torch.cuda.CUDAGraph()
    with capture(graph):
        y = x + 1  # the capture stream waited for the add
    graph.replay()
    torch.testing.assert_close(y, torch.full_like(x, 2.0))


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
