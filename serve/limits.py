"""What one request may cost: every limit of the serving contract, in one typed place.

The server enforces these before any per-value work (the raw message size before parsing, the
candidate count and string lengths before feature generation), the CLI sets them
(``python -m serve --max-candidates ...``) and ``GetModelMetadata`` reports them
(:meth:`Limits.sequence_cap` gives the enforced length of each sequence). Example::

    limits = Limits(max_candidates=500, max_string_bytes=64)
    limits.sequence_cap(50)        # 50: the config's sequence_length
    Limits(max_sequence_length=20).sequence_cap(50)   # 20: the flag caps it further
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """Per-request limits (see the module doc). Exceeding one is INVALID_ARGUMENT naming the
    field, apart from ``max_request_bytes`` and the admission bound, which are
    RESOURCE_EXHAUSTED."""

    max_candidates: int = 1000
    # None: each sequence's configured sequence_length; a number caps every sequence further
    max_sequence_length: int | None = None
    max_string_bytes: int = 256  # UTF-8 bytes of one string value (ids, pid)
    max_request_bytes: int = 4 << 20  # serialized PredictRequest, checked before parsing
    max_detail_bytes: int = 1024  # error details sent back (echoed input is cut to fit)
    max_pending: int = 64  # admitted Predicts not yet answered; beyond: RESOURCE_EXHAUSTED

    def __post_init__(self) -> None:
        for name in (
            "max_candidates",
            "max_string_bytes",
            "max_request_bytes",
            "max_detail_bytes",
            "max_pending",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"limits: {name} must be >= 1, got {getattr(self, name)}")
        if self.max_detail_bytes < 64:
            raise ValueError(
                f"limits: max_detail_bytes must be >= 64 (room for the field name), "
                f"got {self.max_detail_bytes}"
            )
        if self.max_sequence_length is not None and self.max_sequence_length < 0:
            raise ValueError(
                f"limits: max_sequence_length must be >= 0 or None (the config's), "
                f"got {self.max_sequence_length}"
            )

    @property
    def transport_bytes(self) -> int:
        """gRPC's own receive limit: above ``max_request_bytes`` so that the server sees, counts
        and refuses oversize requests itself; only a message past twice the limit is refused by
        the transport before the server sees it."""
        return 2 * self.max_request_bytes + (64 << 10)

    def sequence_cap(self, configured: int | None) -> int:
        """The enforced element limit of a sequence whose config says ``configured``."""
        caps = [c for c in (configured, self.max_sequence_length) if c is not None]
        if not caps:
            raise ValueError("a sequence needs a sequence_length in its config or a limit")
        return min(caps)


def truncate(text: str, max_bytes: int) -> str:
    """``text`` cut to at most ``max_bytes`` UTF-8 bytes, marked with how much was cut."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= max_bytes:
        return text
    marker = f"... [{len(raw)} bytes, cut]"
    keep = max(max_bytes - len(marker.encode()), 0)
    return raw[:keep].decode("utf-8", "ignore") + marker


def shown(value: object, max_chars: int = 48) -> str:
    """``repr(value)`` short enough to echo in an error message."""
    text = repr(value)
    if len(text) <= max_chars:
        return text
    tail = f"...({len(text)} chars)"
    return text[: max(max_chars - len(tail), 8)] + tail
