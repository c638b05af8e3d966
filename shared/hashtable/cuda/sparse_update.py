"""The sparse update of training on CUDA (``sparse_update.cu``; the CUDA backend's
``segment_sum_sorted``, ``adagrad_update`` and ``apply_sparse_gradients``): the same bits as the
torch code, in a few launches instead of a few dozen.

- :func:`segment_sum_sorted`: :func:`shared.hashtable.hashing.segment_sum_sorted`'s pairwise
  tree: its rounds step 1 .. ``LEAF / 2`` in registers (``su_leaf``, one launch), then one
  launch per later round (``su_tree_round``), and one gather;
- :func:`adagrad_update`: :func:`shared.hashtable.adagrad.adagrad_update` (its float64 FMA
  emulation included) in one launch;
- :func:`apply_sparse_gradients` (the static training step's backward): both, ``su_leaf``
  reading the gradients through the sort order and ``su_adagrad`` each run's sum where the tree
  left it, with no gather and no host read.

Why: the static step's backward (``max_count`` = P) was a gather of the gradients into sorted
order, ``ceil(log2 P)`` launches of a round kernel of a thread per element of every row (a
64-bit division and modulo each), a gather of the sums and Adagrad; in training on the H200
(400K occurrences of dim 16) 60 µs, 0.26 ms and 60 µs before Adagrad. Now, on one H200
(2026-12-04, a CUDA graph replayed 200 times, the same data and result bits): ``su_leaf``
38-42 µs, 15 rounds of 3.3 µs (a thread per row, most returning after one look at their
rank), ``su_adagrad`` 32-40 µs (a thread per float4); 0.13 ms in all.

``su_leaf`` leaves every row as the torch code's rounds step < ``LEAF`` do (a thread sums the
tree of the up to ``LEAF`` ranks from its row's, four rows at a time), so the later rounds and
any read of the result see the same bits. ``LEAF`` = 16: the rounds it saves cost a launch
each, and a thread's tree stays in 64 registers (four rows of float4 live); 32 would take more
registers or more spills for one launch less. The GPU tests compare everything with the torch
code on the device, bit for bit.
"""

from __future__ import annotations

import torch

from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.cuda import runtime as rt

SOURCE: rt.Source = ("sparse_update.cu", ("--fmad=false",))
MAX_GRID = 1 << 16  # blocks of a launch; the kernels loop over the rest
LEAF = 16  # SU_LEAF of sparse_update.cu: the ranks su_leaf sums in registers
SIGNATURES = {
    "su_leaf": "ppppppqq",
    "su_tree_round": "ppppqqq",
    "su_adagrad": "pppppqqpf",
}


def _threads(m: int, dim: int) -> int:
    """Threads of ``su_leaf`` or ``su_adagrad`` over ``m`` rows: one per float4 of a row when
    ``dim % 4 == 0`` (they also need 16-byte aligned arrays, else they take floats: the threads
    loop over the rest)."""
    return m * (dim // 4 if dim % 4 == 0 else dim)


def tree_sums(
    x: torch.Tensor,
    order: torch.Tensor | None,
    starts: torch.Tensor,
    counts: torch.Tensor,
    group: torch.Tensor,
    max_count: int,
) -> torch.Tensor:
    """[M, dim]: the torch code's ``x`` after the pairwise tree of
    :func:`shared.hashtable.hashing.segment_sum_sorted` on ``x[order]`` (``order`` None:
    ``x`` is sorted), run ``g``'s sum at row ``starts[g]``. ``x`` float32 [*, dim] on CUDA
    (dim > 0), M = ``group.numel()`` > 0; no host read (a capture-safe allocation)."""
    m, dim = group.numel(), x.shape[1]
    work = torch.empty(m, dim, dtype=torch.float32, device=x.device)  # [M, dim]
    idx = tuple(t.to(torch.int64).contiguous() for t in (group, starts, counts))
    src = None if order is None else order.to(torch.int64).contiguous()
    leaf_args = (work, x.contiguous(), src, *idx, rt.i64(m), rt.i64(dim))
    grid = min(rt.blocks(_threads(m, dim)), MAX_GRID)
    rt.launch("su_leaf", SIGNATURES["su_leaf"], grid, rt.BLOCK, leaf_args,
              device=x.device, source=SOURCE)  # fmt: skip
    step = LEAF
    while step < max_count:
        rt.launch(
            "su_tree_round",
            SIGNATURES["su_tree_round"],
            min(rt.blocks(m), MAX_GRID),
            rt.BLOCK,
            (work, *idx, rt.i64(m), rt.i64(dim), rt.i64(step)),
            device=x.device,
            source=SOURCE,
        )
        step *= 2
    return work


def segment_sum_sorted(
    x: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    group: torch.Tensor,
    max_count: int | None = None,
) -> torch.Tensor:
    """As :func:`shared.hashtable.hashing.segment_sum_sorted` (float32 ``x`` [M, dim] on CUDA)."""
    m = x.shape[0]
    if m == 0:
        return x.new_zeros((0, *x.shape[1:]))
    if max_count is None:
        max_count = int(counts.max())  # a host sync, as the torch code's
    if max_count == 1 or x.shape[1] == 0:
        return x[starts]
    return tree_sums(x, None, starts, counts, group, max_count)[starts]


def adagrad_update(
    values: torch.Tensor,
    accumulators: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    config: AdagradConfig,
    from_rows: torch.Tensor | None = None,
) -> None:
    """As :func:`shared.hashtable.adagrad.adagrad_update`, in place (contiguous float32
    ``values`` and ``accumulators`` [capacity, dim] on CUDA); entry i's gradient is ``grads``
    row ``from_rows[i]`` (None: row i)."""
    n = rows.numel()
    dim = values.shape[1]
    if n == 0 or dim == 0:
        return
    g = grads.to(torch.float32).contiguous()
    src = None if from_rows is None else from_rows.to(torch.int64).contiguous()
    rt.launch(
        "su_adagrad",
        SIGNATURES["su_adagrad"],
        min(rt.blocks(_threads(n, dim)), MAX_GRID),
        rt.BLOCK,
        (
            values,
            accumulators,
            rows.to(torch.int64).contiguous(),
            g,
            src,
            rt.i64(n),
            rt.i64(dim),
            _neg_lr(config, values.device),
            rt.f32(config.eps),
        ),
        device=values.device,
        source=SOURCE,
    )


def _neg_lr(config: AdagradConfig, device: torch.device) -> torch.Tensor:
    """[1] float32 ``-lr`` on ``device``, which the kernel reads: ``config.rate`` where it is
    there (a graph captured with it sees later rates), else made now."""
    if config.rate is not None and config.rate.device == device:
        return config.rate
    return torch.full((1,), -config.lr, dtype=torch.float32, device=device)


def apply_sparse_gradients(
    values: torch.Tensor,
    accumulators: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    order: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    group: torch.Tensor,
    max_count: int,
    config: AdagradConfig,
) -> None:
    """``Backend.apply_sparse_gradients`` (float32 ``grads`` [*, dim] on CUDA, ``values`` and
    ``accumulators`` as :func:`adagrad_update`'s; ``order`` non-empty): the tree on the rows
    read through ``order``, then Adagrad reading run j's sum at row ``starts[j]``."""
    if rows.numel() == 0 or values.shape[1] == 0:
        return
    work = tree_sums(grads, order, starts, counts, group, max_count)  # [M, dim]
    adagrad_update(values, accumulators, rows, work, config, from_rows=starts)
