"""How fresh the served model is: the event time of the newest training row it holds.

Online training (``python -m train stream``) writes that time into each delta's manifest
(``event_time``, :mod:`shared.delta`) and into each full bundle's ``extra.event_time``. The
served model's is its last delta's, else its bundle's; None when neither says (a bundle of
batch training). The server reports it, and ``now - it``, in GetModelMetadata
(``event_time_unix``, ``freshness_seconds``) and Prometheus
(``dynrec_serving_model_event_time_seconds``, ``dynrec_serving_model_age_seconds``). Example::

    t = event_time(model)            # 1765000000.0, or None
    age = model_age(model)           # seconds since that row's event, or None
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any, Protocol


class _HasManifest(Protocol):
    @property
    def manifest(self) -> Mapping[str, Any]: ...


class _Model(Protocol):
    @property
    def bundle(self) -> _HasManifest: ...


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def event_time(model: _Model) -> float | None:
    """Unix seconds of the newest training row of ``model`` (module doc), or None."""
    manifest = model.bundle.manifest
    delta = manifest.get("delta")
    if isinstance(delta, Mapping) and (t := _number(delta.get("event_time"))) is not None:
        return t
    extra = manifest.get("extra")
    return _number(extra.get("event_time")) if isinstance(extra, Mapping) else None


def model_age(model: _Model | None, now: float | None = None) -> float | None:
    """``now`` (default: the clock) minus :func:`event_time`; None when unknown."""
    t = None if model is None else event_time(model)
    return None if t is None else (time.time() if now is None else now) - t
