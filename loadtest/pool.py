"""The request pool file: serialized requests built once, replayed by every locust user.

Building requests costs far more than sending them, so ``loadtest.requests`` serializes a few
thousand once and the locust processes only read bytes. Format (little-endian)::

    b"DYNRECPOOL1\\n"                    magic
    <json header>\\n                     {"count": R, "num_candidates": N, "model_version": ...}
    R x (uint32 length, length bytes)    one serialized request each

The header's ``protocol`` says what the requests are: ``predict`` (absent in pools of before
it), ``dynrec.serving.PredictRequest``; ``oip``, ``inference.ModelInferRequest`` (for the
header's ``model_name``).

Example::

    write_pool(path, RequestPool(payloads, num_candidates=100))
    pool = read_pool(path)          # pool.payloads[i] is ready for the wire
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"DYNRECPOOL1\n"
_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class RequestPool:
    """Serialized requests and what a correct response to each looks like."""

    payloads: list[bytes]
    num_candidates: int  # every request has this many candidates (= probabilities expected)
    info: dict[str, object] = field(default_factory=dict)  # free-form provenance (model version…)

    def __len__(self) -> int:
        return len(self.payloads)


def write_pool(path: str | Path, pool: RequestPool) -> Path:
    path = Path(path)
    header = {"count": len(pool.payloads), "num_candidates": pool.num_candidates, **pool.info}
    parts = [MAGIC, json.dumps(header).encode() + b"\n"]
    for p in pool.payloads:
        parts += [_LEN.pack(len(p)), p]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(parts))
    return path


def read_pool(path: str | Path) -> RequestPool:
    data = Path(path).read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError(
            f"{path} is not a request pool file (missing {MAGIC!r} header); pass the pool "
            "python -m loadtest writes into its --out directory"
        )
    end = data.index(b"\n", len(MAGIC))
    header = json.loads(data[len(MAGIC) : end])
    count, num_candidates = int(header.pop("count")), int(header.pop("num_candidates"))
    view, pos, payloads = memoryview(data), end + 1, []
    for _ in range(count):
        if pos + 4 > len(data):
            break
        (n,) = _LEN.unpack_from(view, pos)
        payloads.append(bytes(view[pos + 4 : pos + 4 + n]))
        pos += 4 + n
    if pos != len(data) or len(payloads) != count or not payloads:
        raise ValueError(
            f"{path}: truncated or empty request pool ({len(payloads)}/{count}); run python -m "
            "loadtest again to rebuild it"
        )
    return RequestPool(payloads, num_candidates, header)
