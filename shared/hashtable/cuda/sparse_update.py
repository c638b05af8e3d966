"""The sparse update of training on CUDA (``sparse_update.cu``; the CUDA backend's
``segment_sum_sorted`` and ``adagrad_update``): the same bits as the torch code, in a few
launches instead of a few dozen.

- :func:`segment_sum_sorted`: :func:`shared.hashtable.hashing.segment_sum_sorted`'s pairwise
  tree, one launch per round (the torch code takes about six ops a round) and one gather;
- :func:`adagrad_update`: :func:`shared.hashtable.adagrad.adagrad_update` (its float64 FMA
  emulation included) in one launch.

The GPU tests compare both with the torch code on the device, bit for bit.
"""

from __future__ import annotations

import torch

from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.cuda import runtime as rt

SOURCE: rt.Source = ("sparse_update.cu", ("--fmad=false",))
MAX_GRID = 1 << 16  # blocks of a launch; the kernels loop over the rest
SIGNATURES = {"su_tree_round": "ppppqqq", "su_adagrad": "ppppqqff"}


def segment_sum_sorted(
    x: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    group: torch.Tensor,
    max_count: int | None = None,
) -> torch.Tensor:
    """As :func:`shared.hashtable.hashing.segment_sum_sorted` (float32 ``x`` on CUDA)."""
    m = x.shape[0]
    if m == 0:
        return x.new_zeros((0, *x.shape[1:]))
    if max_count is None:
        max_count = int(counts.max())  # a host sync, as the torch code's
    if max_count == 1:
        return x[starts]
    work = x.to(torch.float32).contiguous().clone()  # summed in place
    dim = work.shape[1] if work.dim() == 2 else 1
    args = (work, group.contiguous(), starts.contiguous(), counts.contiguous())
    step = 1
    while step < max_count:
        rt.launch(
            "su_tree_round",
            SIGNATURES["su_tree_round"],
            min(rt.blocks(m * dim), MAX_GRID),
            rt.BLOCK,
            (*args, rt.i64(m), rt.i64(dim), rt.i64(step)),
            device=x.device,
            source=SOURCE,
        )
        step *= 2
    return work[starts]


def adagrad_update(
    values: torch.Tensor,
    accumulators: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    config: AdagradConfig,
) -> None:
    """As :func:`shared.hashtable.adagrad.adagrad_update`, in place (contiguous float32
    ``values`` and ``accumulators`` [capacity, dim] on CUDA)."""
    n = rows.numel()
    if n == 0:
        return
    dim = values.shape[1]
    g = grads.to(torch.float32).contiguous()
    rt.launch(
        "su_adagrad",
        SIGNATURES["su_adagrad"],
        min(rt.blocks(n * dim), MAX_GRID),
        rt.BLOCK,
        (
            values,
            accumulators,
            rows.to(torch.int64).contiguous(),
            g,
            rt.i64(n),
            rt.i64(dim),
            rt.f32(-config.lr),
            rt.f32(config.eps),
        ),
        device=values.device,
        source=SOURCE,
    )
