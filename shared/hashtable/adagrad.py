"""Sparse Adagrad on hash-table rows, with torch.optim.Adagrad's exact arithmetic.

torch.optim.Adagrad (lr_decay 0, weight_decay 0) does, per element::

    state_sum.addcmul_(grad, grad, value=1)     # on CPU a fused multiply-add
    std = state_sum.sqrt().add_(eps)
    param.addcdiv_(grad, std, value=-lr)        # param + ((-lr) * grad) / std

:func:`adagrad_update` applies the same to the rows a batch touched (gradients of duplicate keys
already summed). The fused multiply-add is emulated exactly in float64 (:func:`fma_f32`) rather
than left to ``addcmul``, whose CPU kernel fuses in its vectorized loop but not in its scalar
tail, and whose CUDA kernel is compiled separately: this way the result is the correctly
rounded ``grad * grad + state_sum`` on every device, equal to torch's CPU Adagrad on its
vectorized path, and identical between CPU and CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass(frozen=True)
class AdagradConfig:
    """Adagrad's settings. ``rate``: where the CUDA kernels read ``-lr`` (a one-element float32
    tensor on the table's device, :meth:`on_device`), so that a CUDA graph captured with it
    sees a rate changed later (:meth:`with_lr`: a learning-rate schedule); None: they take
    ``lr`` as a launch argument. The CPU code reads ``lr``."""

    lr: float
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0
    rate: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.lr >= 0:
            raise ValueError(f"Adagrad: lr must be >= 0, got {self.lr}")
        if self.eps < 0 or self.initial_accumulator_value < 0:
            raise ValueError("Adagrad: eps and initial_accumulator_value must be >= 0")

    def on_device(self, device: torch.device) -> AdagradConfig:
        """These settings with their own ``rate`` tensor on ``device``."""
        return replace(self, rate=torch.full((1,), -self.lr, dtype=torch.float32, device=device))

    def with_lr(self, lr: float) -> AdagradConfig:
        """These settings at rate ``lr``: the same ``rate`` tensor, written in place (on the
        device's stream: no host sync)."""
        if lr == self.lr:
            return self
        out = replace(self, lr=lr)
        if self.rate is not None:
            self.rate.fill_(-lr)
        return out


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` for float32 tensors, rounded once to float32 (a true FMA), on any device.

    The product is exact in float64; the float64 sum is corrected with its TwoSum error where
    it sits exactly on a float32 rounding midpoint, the only case where rounding twice differs
    from rounding once (float32 subnormal results excepted).
    """
    p = a.double() * b.double()  # exact: 24-bit x 24-bit significands
    c64 = c.double()
    hi = p + c64
    bb = hi - p
    lo = (p - (hi - bb)) + (c64 - bb)  # hi + lo == p + c exactly
    bits = hi.view(torch.int64)
    midpoint = (bits & ((1 << 29) - 1)) == (1 << 28)  # bits below float32 precision: 100...0
    toward = torch.where(
        lo > 0, torch.full_like(hi, float("inf")), torch.full_like(hi, -float("inf"))
    )
    hi = torch.where(midpoint & (lo != 0), torch.nextafter(hi, toward), hi)
    return hi.to(torch.float32)


def adagrad_rows(
    values: torch.Tensor, accumulators: torch.Tensor, grads: torch.Tensor, config: AdagradConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(new values, new accumulators) of rows whose current ``values`` and ``accumulators``
    [n, dim] take the summed ``grads`` [n, dim]: the update :func:`adagrad_update` writes."""
    g = grads.to(torch.float32)
    state = fma_f32(g, g, accumulators)  # [n, dim]
    std = state.sqrt().add_(config.eps)
    return values + ((-config.lr) * g) / std, state


def adagrad_update(
    values: torch.Tensor,
    accumulators: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    config: AdagradConfig,
) -> None:
    """In place: for distinct ``rows`` [n] and their summed ``grads`` [n, dim] float32; an
    entry whose row is -1 is skipped (one host read: the CUDA kernel skips it on the device)."""
    if rows.numel() and bool((rows < 0).any()):
        keep = torch.nonzero(rows >= 0).squeeze(1)
        rows, grads = rows[keep], grads[keep]
    if rows.numel() == 0:
        return
    values[rows], accumulators[rows] = adagrad_rows(values[rows], accumulators[rows], grads, config)
