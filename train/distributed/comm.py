"""All-to-all with accounting: what the embedding exchange costs per step, in bytes and time.

Every exchange of :class:`~train.distributed.sharded_dynamic.ShardedDynamicEmbedding` goes through
:func:`all_to_all`, which records the bytes this rank sends to *other* ranks (what crosses NVLink
or the network; the part a rank keeps for itself is counted only in ``total``) and the time the
collective takes. On CPU (gloo) collectives are synchronous and timed with the wall clock; on
CUDA (NCCL) a pair of CUDA events brackets each call on the current stream, and the times are
read when :meth:`CommStats.take` is called (once per log interval, so no extra host sync per
step). The time includes waiting for the slowest rank, which is what the step pays.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

KINDS = ("splits", "keys", "rows", "grads", "hits")  # "hits": cold_backoff only


class CommStats:
    """Counters of the all-to-alls since the last :meth:`take`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.remote_bytes = dict.fromkeys(KINDS, 0)
        self.total_bytes = 0
        self.seconds = 0.0
        self.lookups = 0  # keys asked for, duplicates included
        self.unique = 0  # distinct keys per table after the local dedupe
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - t0

    def add(self, kind: str, send_bytes: list[int], rank: int) -> None:
        self.calls += 1
        self.remote_bytes[kind] += sum(b for r, b in enumerate(send_bytes) if r != rank)
        self.total_bytes += sum(send_bytes)

    def take(self, steps: int, wall_seconds: float) -> dict[str, Any]:
        """Per-step averages over ``steps`` steps that took ``wall_seconds``; then reset.

        ``share`` is all-to-all time / wall time. Keys: bytes (remote, all kinds), bytes_<kind>,
        total_bytes (self-sends included), seconds, share, calls, lookups, unique (per step).
        """
        if self._events:
            torch.cuda.synchronize(self.device)
            self.seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1e3
        n = max(steps, 1)
        out: dict[str, Any] = {
            "bytes": sum(self.remote_bytes.values()) / n,
            **{f"bytes_{k}": v / n for k, v in self.remote_bytes.items()},
            "total_bytes": self.total_bytes / n,
            "seconds": self.seconds / n,
            "share": self.seconds / wall_seconds if wall_seconds > 0 else 0.0,
            "calls": self.calls / n,
            "lookups": self.lookups / n,
            "unique": self.unique / n,
        }
        self.reset()
        return out


def all_to_all(
    x: torch.Tensor,
    send: list[int],
    recv: list[int],
    group: dist.ProcessGroup,
    stats: CommStats | None,
    kind: str,
    rank: int,
) -> torch.Tensor:
    """``x`` split along dim 0 into ``send[r]`` rows for rank ``r`` ⇒ the ``recv[r]`` rows each
    rank ``r`` sent here, concatenated in rank order."""
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    row_bytes = x.element_size() * math.prod(x.shape[1:])
    if stats is None:
        dist.all_to_all_single(out, x, recv, send, group=group)
        return out
    with stats.timed():
        dist.all_to_all_single(out, x, recv, send, group=group)
    stats.add(kind, [s * row_bytes for s in send], rank)
    return out


class AllToAllRows(torch.autograd.Function):
    """Embedding rows from owners to requesters; backward sends the gradients the other way.

    ``anchor`` (a zero-size tensor that requires grad) keeps this node in the graph on every
    rank even where ``rows`` needs no gradient, so every rank joins the backward all-to-all.
    """

    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        rows: torch.Tensor,
        send: list[int],
        recv: list[int],
        group: dist.ProcessGroup,
        stats: CommStats | None,
        rank: int,
    ) -> torch.Tensor:
        ctx.args = (send, recv, group, stats, rank)
        return all_to_all(rows, send, recv, group, stats, "rows", rank)  # [sum(recv)]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        send, recv, group, stats, rank = ctx.args
        back = all_to_all(grad, recv, send, group, stats, "grads", rank)  # [sum(send)]
        return None, back, None, None, None, None, None
