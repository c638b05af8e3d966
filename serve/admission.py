"""Admission control: a bound on the Predicts admitted and not yet answered.

A request is admitted before its bytes are parsed and leaves when its answer is sent, so the
bound covers every stage that holds a server thread (parse, validation, feature generation,
the batcher's queue, the batch). Past the bound a request is refused at once
(RESOURCE_EXHAUSTED) instead of queueing: under overload the latency of admitted requests stays
bounded and the client can back off or go to another replica. The server sizes its thread pool
as the bound plus reserve threads (:class:`serve.server.ServerConfig`), so the bound is
reachable and health checks and metadata still find a thread. Example::

    admission = Admission(64)
    with admission.admit():    # raises OverloadedError when 64 are in flight
        ...
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class OverloadedError(RuntimeError):
    """The admission bound is reached (RESOURCE_EXHAUSTED)."""


def overloaded(pending: int, limit: int) -> OverloadedError:
    """The refusal of a request past the bound (its text is part of the serving contract)."""
    return OverloadedError(
        f"server overloaded: {pending} requests in flight (limit {limit}, serve --max-queue); "
        "retry with backoff or another replica"
    )


class Admission:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"admission limit must be >= 1, got {limit}")
        self.limit = limit
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Requests admitted and not yet answered."""
        return self._pending

    @contextmanager
    def admit(self) -> Iterator[None]:
        with self._lock:
            if self._pending >= self.limit:
                raise overloaded(self._pending, self.limit)
            self._pending += 1
        try:
            yield
        finally:
            with self._lock:
                self._pending -= 1
