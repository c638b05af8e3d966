"""Initial values of new embedding rows: a pure function of (seed, table name, key).

dynamicemb draws new rows from a curand stream, so a key's first value depends on the order
keys arrive in and on the device. Here element ``j`` of key ``k`` in table ``t`` is computed from
a counter-based hash::

    h = mix64(mix64(k ^ salt(seed, t)) + (j + 1) * GOLDEN)      # splitmix64, int64 arithmetic
    u = (2 * (h >>> 12) + 1) / 2**53                            # uniform in (0, 1), exact

and then transformed per :class:`InitializerSpec` in float64 with only +, -, *, /, sqrt and
frexp (Wichura's AS241 for the normal quantile, a series for the logarithm), rounded once to
float32. Those operations are correctly rounded in IEEE arithmetic on every device, so CPU and
CUDA give the same bits, and a key gets the same row on whatever rank inserts it.

Modes (tzrec/dynamicemb semantics): NORMAL(mean, std_dev); TRUNCATED_NORMAL(mean, std_dev)
conditioned on [lower, upper] (inverse CDF, like dynamicemb's kernel); UNIFORM[lower, upper);
CONSTANT(value). The code below is the torch backend's (any device) and the reference; the CUDA
backend's ``keyed_rows`` computes the same bits in one kernel (``cuda/keyed.cu``), every table
of a fused storage in one launch. Example::

    init = KeyedInitializer(InitializerSpec(InitMode.NORMAL, std_dev=0.05), seed=0, table="user_id_emb")
    init(torch.tensor([7, 42]), dim=16)   # [2, 16] float32, the same on every call and device
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from shared.features import InitializerSpec, InitMode
from shared.hashtable.hashing import GOLDEN, _srl, mix64, mix64_int, name_salt, to_signed

_LN2 = 0.6931471805599453
_SQRT_HALF = 0.7071067811865476
_LOG_SERIES = [1.0 / (2 * k + 1) for k in range(13)]  # atanh series: |z| <= 0.1716, z^26 < 1e-19

# Wichura (1988), AS241 PPND16 coefficients (as in CPython's statistics module), low order first
_A = [3.3871328727963666080e0, 1.3314166789178437745e2, 1.9715909503065514427e3,
      1.3731693765509461125e4, 4.5921953931549871457e4, 6.7265770927008700853e4,
      3.3430575583588128105e4, 2.5090809287301226727e3]  # fmt: skip
_B = [1.0, 4.2313330701600911252e1, 6.8718700749205790830e2, 5.3941960214247511077e3,
      2.1213794301586595867e4, 3.9307895800092710610e4, 2.8729085735721942674e4,
      5.2264952788528545610e3]  # fmt: skip
_C = [1.42343711074968357734e0, 4.63033784615654529590e0, 5.76949722146069140550e0,
      3.64784832476320460504e0, 1.27045825245236838258e0, 2.41780725177450611770e-1,
      2.27238449892691845833e-2, 7.74545014278341407640e-4]  # fmt: skip
_D = [1.0, 2.05319162663775882187e0, 1.67638483018380384940e0, 6.89767334985100004550e-1,
      1.48103976427480074590e-1, 1.51986665636164571966e-2, 5.47593808499534494600e-4,
      1.05075007164441684324e-9]  # fmt: skip
_E = [6.65790464350110377720e0, 5.46378491116411436990e0, 1.78482653991729133580e0,
      2.96560571828504891230e-1, 2.65321895265761230930e-2, 1.24266094738807843860e-3,
      2.71155556874348757815e-5, 2.01033439929228813265e-7]  # fmt: skip
_F = [1.0, 5.99832206555887937690e-1, 1.36929880922735805310e-1, 1.48753612908506148525e-2,
      7.86869131145613259100e-4, 1.84631831751005468180e-5, 1.42151175831644588870e-7,
      2.04426310338993978564e-15]  # fmt: skip


def _poly(coeffs: list[float], x: torch.Tensor) -> torch.Tensor:
    """Horner evaluation, one torch op per step (no fused multiply-add anywhere)."""
    acc = torch.full_like(x, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = acc * x + c
    return acc


def log_f64(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive float64 ``x`` from frexp and an atanh series (device-exact)."""
    m, e = torch.frexp(x)  # x = m * 2**e, m in [0.5, 1)
    small = m < _SQRT_HALF
    m = torch.where(small, m * 2.0, m)  # m in [sqrt(1/2), sqrt(2))
    e = (e - small.to(e.dtype)).to(torch.float64)
    z = (m - 1.0) / (m + 1.0)
    return e * _LN2 + 2.0 * z * _poly(_LOG_SERIES, z * z)


def inv_normal_cdf(p: torch.Tensor) -> torch.Tensor:
    """The standard normal quantile of float64 ``p`` in (0, 1) (AS241, ~1e-16 relative)."""
    q = p - 0.5
    r = 0.180625 - q * q
    central = q * _poly(_A, r) / _poly(_B, r)
    t = torch.sqrt(-log_f64(torch.where(q < 0, p, 1.0 - p)))
    near = _poly(_C, t - 1.6) / _poly(_D, t - 1.6)
    far = _poly(_E, t - 5.0) / _poly(_F, t - 5.0)
    tail = torch.where(t <= 5.0, near, far)
    tail = torch.where(q < 0, -tail, tail)
    return torch.where(q.abs() <= 0.425, central, tail)


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def key_uniforms(keys: torch.Tensor, dim: int, salt: int) -> torch.Tensor:
    """[N, dim] float64 uniforms in (0, 1), a pure function of (salt, key, column)."""
    h = mix64(keys.to(torch.int64) ^ to_signed(salt))  # [N]
    cols = torch.arange(1, dim + 1, dtype=torch.int64, device=keys.device) * to_signed(GOLDEN)
    h = mix64(h[:, None] + cols[None, :])  # [N, dim], wrapping add
    return (_srl(h, 12) * 2 + 1).to(torch.float64) * 2.0**-53


class KeyedInitializer:
    """Initial rows per :class:`InitializerSpec`, deterministic in (seed, table, key)."""

    def __init__(self, spec: InitializerSpec, *, seed: int, table: str) -> None:
        self.spec = spec
        self.salt = mix64_int(mix64_int(seed) ^ name_salt(table))
        if spec.mode in (InitMode.NORMAL, InitMode.TRUNCATED_NORMAL) and spec.std_dev < 0:
            raise ValueError(f"initializer of {table!r}: std_dev must be >= 0, got {spec.std_dev}")
        if spec.mode in (InitMode.UNIFORM, InitMode.TRUNCATED_NORMAL) and spec.lower > spec.upper:
            raise ValueError(f"initializer of {table!r}: lower {spec.lower} > upper {spec.upper}")

    @property
    def is_constant(self) -> bool:
        return self.spec.mode is InitMode.CONSTANT

    def cdf_bounds(self) -> tuple[float, float]:
        """TRUNCATED_NORMAL with std_dev > 0: the normal CDF at ``lower`` and ``upper``."""
        s = self.spec
        lo = _normal_cdf((s.lower - s.mean) / s.std_dev)
        hi = _normal_cdf((s.upper - s.mean) / s.std_dev)
        return lo, hi

    def __call__(self, keys: torch.Tensor, dim: int) -> torch.Tensor:
        """keys [N] int64 → [N, dim] float32 on the keys' device."""
        s = self.spec
        n = keys.numel()
        if s.mode is InitMode.CONSTANT:
            return torch.full((n, dim), s.value, dtype=torch.float32, device=keys.device)
        u = key_uniforms(keys, dim, self.salt)
        if s.mode is InitMode.UNIFORM:
            x = s.lower + (s.upper - s.lower) * u
        elif s.mode is InitMode.NORMAL:
            x = s.mean + s.std_dev * inv_normal_cdf(u)
        elif s.std_dev == 0.0:
            x = torch.full_like(u, min(max(s.mean, s.lower), s.upper))
        else:  # TRUNCATED_NORMAL: the normal conditioned on [lower, upper], by inverse CDF
            lo, hi = self.cdf_bounds()
            p = (lo + (hi - lo) * u).clamp(min=1e-300, max=1.0 - 2.0**-53)
            x = (s.mean + s.std_dev * inv_normal_cdf(p)).clamp(min=s.lower, max=s.upper)
        return x.to(torch.float32)


class NewRows(Protocol):
    """The initial rows of a list of initializers, made once per list by a backend
    (``Backend.keyed_rows``: the torch loop over the tables, or one CUDA kernel)."""

    def __call__(
        self, keys: torch.Tensor, table_ids: torch.Tensor | None, dim: int
    ) -> torch.Tensor:
        """[n, dim] float32: row i from initializer ``table_ids[i]`` (0 without table ids)."""
        ...
