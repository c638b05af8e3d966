"""Keyed initial rows, a lookup's rows per occurrence and fingerprints on CUDA (``keyed.cu``; the
CUDA backend's ``keyed_rows``, ``expand_rows`` and ``fingerprint``): one launch each.

The torch versions (:class:`~shared.hashtable.initializers.KeyedInitializer`, and
:func:`~shared.hashtable.hashing.fingerprint`) are hundreds of elementwise ops a call: splitmix64
in int64 and an inverse normal CDF whose polynomials take one op per Horner step. The kernels
compute the same bits in one thread per element (the GPU tests compare them with the torch code
on the device), and an initializer kernel takes a table id per key, so a fused storage fills the
new rows of all its member tables in one launch, without selecting each table's keys
(:class:`KernelRows`). :func:`expand_rows` gives the static training step its rows per
occurrence in one pass (a stored row copied, an initial row computed only where there is none)
instead of a gather per run, the initializer for every run and a gather per occurrence.

The per-table parameters live in two small device arrays (:class:`InitParams`), built once per
list of initializers (:class:`KernelRows`, made by the storage). Launches go through
``runtime.Launcher`` (``cuLaunchKernel``, the tensors as data pointers).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shared.features import InitMode
from shared.hashtable.cuda import runtime as rt
from shared.hashtable.hashing import to_signed

if TYPE_CHECKING:
    from shared.hashtable.initializers import KeyedInitializer

SOURCE: rt.Source = ("keyed.cu", ("--fmad=false",))  # no FMA contraction anywhere
MAX_GRID = 1 << 16  # blocks of a launch; the kernels loop over the rest
# parameter types for runtime.Kernel (direct launches; checked against keyed.cu by the tests)
SIGNATURES = {
    "kd_initial_rows": "ppiqqqppp",
    "kd_expand_rows": "pppppiqqqpppp",
    "kd_fingerprint": "ppiqp",
}

# keyed.cu KD_* modes and parameter layout
MODE_CONSTANT, MODE_UNIFORM, MODE_NORMAL, MODE_TRUNCATED_NORMAL, MODE_NONE = range(5)
MODES = {
    InitMode.CONSTANT: MODE_CONSTANT,
    InitMode.UNIFORM: MODE_UNIFORM,
    InitMode.NORMAL: MODE_NORMAL,
    InitMode.TRUNCATED_NORMAL: MODE_TRUNCATED_NORMAL,
}
NPARAMS = 8  # mean, std_dev, lower, upper, value, upper - lower, cdf lo, cdf hi - lo


@dataclass(frozen=True)
class InitParams:
    """The parameters of a list of initializers (``None``: no initializer) on one device."""

    prm: torch.Tensor  # [T, NPARAMS] float64
    iprm: torch.Tensor  # [T, 2] int64: salt (the bits of the unsigned salt), mode

    @property
    def num_tables(self) -> int:
        return self.prm.shape[0]


def _row(init: KeyedInitializer | None) -> tuple[list[float], list[int]]:
    if init is None:
        return [0.0] * NPARAMS, [0, MODE_NONE]
    s = init.spec
    mode, value = MODES[s.mode], s.value
    lo = width = 0.0
    if s.mode is InitMode.TRUNCATED_NORMAL:
        if s.std_dev == 0.0:  # KeyedInitializer: a constant, the mean clamped (Python min/max)
            mode, value = MODE_CONSTANT, min(max(s.mean, s.lower), s.upper)
        else:
            lo, hi = init.cdf_bounds()
            width = hi - lo
    # Python float arithmetic, as the torch code's scalars: (upper - lower), (hi - lo)
    # the constant travels as its float32 bits (an exact integer in float64): the kernel
    # reinterprets them, so subnormal constants survive (a double→float conversion on the
    # device flushed them to zero on the H200)
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    prm = [s.mean, s.std_dev, s.lower, s.upper, bits, s.upper - s.lower, lo, width]
    return [float(x) for x in prm], [to_signed(init.salt), mode]


def init_params(inits: Sequence[KeyedInitializer | None], device: torch.device | str) -> InitParams:
    """The kernel's parameter arrays for table ids ``0 .. len(inits) - 1`` (one copy to the
    device: build them once per list)."""
    rows = [_row(i) for i in inits]
    return InitParams(
        torch.tensor([r[0] for r in rows], dtype=torch.float64, device=device).reshape(-1, NPARAMS),
        torch.tensor([r[1] for r in rows], dtype=torch.int64, device=device).reshape(-1, 2),
    )


class KernelRows:
    """New rows from a list of initializers in one launch: row i from ``inits[table_ids[i]]``
    (table id 0 without ``table_ids``; NaN rows for a table without one). The parameters are
    copied to ``device`` once, here."""

    def __init__(self, inits: Sequence[KeyedInitializer | None], device: torch.device) -> None:
        self.params = init_params(inits, device)

    def __call__(
        self, keys: torch.Tensor, table_ids: torch.Tensor | None, dim: int
    ) -> torch.Tensor:
        """[n, dim] float32 rows of ``keys`` [n] int64 on the parameters' device."""
        return initial_rows(self.params, keys, table_ids, dim)


def initial_rows(
    params: InitParams, keys: torch.Tensor, tids: torch.Tensor | None, dim: int
) -> torch.Tensor:
    """[N, dim] float32: row i is what initializer ``tids[i]`` (0 without ``tids``) gives key
    ``keys[i]`` (NaN for a table without one); ``keys``/``tids`` [N] int on ``params``' device."""
    dev, n = keys.device, keys.numel()
    out = torch.empty(n, dim, dtype=torch.float32, device=dev)
    if n == 0 or dim == 0:
        return out
    keys = keys.to(torch.int64).contiguous()
    t = rt.dummy(dev, torch.int64) if tids is None else tids.to(torch.int64).contiguous()
    rt.launch(
        "kd_initial_rows",
        SIGNATURES["kd_initial_rows"],
        min(rt.blocks(n * dim), MAX_GRID),
        rt.BLOCK,
        (
            keys,
            t,
            rt.i32(tids is not None),
            rt.i64(n),
            rt.i64(dim),
            rt.i64(params.num_tables),
            params.prm,
            params.iprm,
            out,
        ),
        device=dev,
        source=SOURCE,
    )
    return out


def expand_rows(
    params: InitParams,
    values: torch.Tensor,
    rows: torch.Tensor,
    inverse: torch.Tensor,
    keys: torch.Tensor,
    which: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Backend.expand_rows`` in one launch: (out [N, dim] float32, stored [N] bool) for the
    occurrences ``inverse`` [N] of runs ``rows``/``keys``/``which`` [P]: ``values[r]`` with
    ``r = rows[inverse[i]] >= 0``, else the initial row of the run's key from initializer
    ``which`` (the same bits as :func:`initial_rows`, computed only for those occurrences).
    ``values`` [*, dim] contiguous float32 (dim > 0), everything on ``params``' device; indices
    in range (unchecked). No host read."""
    dev, n, dim = values.device, inverse.numel(), values.shape[1]
    out = torch.empty(n, dim, dtype=torch.float32, device=dev)
    stored = torch.empty(n, dtype=torch.bool, device=dev)
    if n == 0:
        return out, stored
    # float4 copies: a thread per 4 columns of an occurrence (16-byte loads of the gathered
    # rows, a quarter of the threads and index arithmetic); else a thread per column
    vec4 = dim % 4 == 0 and values.data_ptr() % 16 == 0
    units = n * (dim // 4 if vec4 else dim)
    rt.launch(
        "kd_expand_rows",
        SIGNATURES["kd_expand_rows"],
        min(rt.blocks(units), MAX_GRID),
        rt.BLOCK,
        (
            values,
            rows.to(torch.int64).contiguous(),
            inverse.to(torch.int64).contiguous(),
            keys.to(torch.int64).contiguous(),
            which.to(torch.int64).contiguous(),
            rt.i32(vec4),
            rt.i64(n),
            rt.i64(dim),
            rt.i64(params.num_tables),
            params.prm,
            params.iprm,
            out,
            stored,
        ),
        device=dev,
        source=SOURCE,
    )
    return out, stored


def fingerprint(keys: torch.Tensor, table_ids: torch.Tensor | None) -> torch.Tensor:
    """:func:`shared.hashtable.hashing.fingerprint` of int64 ``keys`` (any shape; ``table_ids``
    of the same shape or None) in one launch."""
    dev, n = keys.device, keys.numel()
    out = torch.empty(keys.shape, dtype=torch.int64, device=dev)
    if n == 0:
        return out
    k = keys.contiguous()
    t = rt.dummy(dev, torch.int64) if table_ids is None else table_ids.to(torch.int64).contiguous()
    rt.launch(
        "kd_fingerprint",
        SIGNATURES["kd_fingerprint"],
        min(rt.blocks(n), MAX_GRID),
        rt.BLOCK,
        (k, t, rt.i32(table_ids is not None), rt.i64(n), out),
        device=dev,
        source=SOURCE,
    )
    return out
