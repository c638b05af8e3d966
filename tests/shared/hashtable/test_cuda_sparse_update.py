"""The sparse-update kernels (cuda/sparse_update.cu) against the torch code, bit for bit, on the
GPU: the pairwise segment sum of duplicate keys' gradients, row-wise Adagrad, and both in one
call (``apply_sparse_gradients``, the static step's backward). On CPU: a Python model of
``su_leaf`` + ``su_tree_round`` against the torch tree, and the torch backend's
``apply_sparse_gradients``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.hashtable.adagrad import AdagradConfig, adagrad_update
from shared.hashtable.cuda import sparse_update
from shared.hashtable.hashing import segment_sum_sorted, unique_pairs
from shared.hashtable.static_step import unique_runs
from shared.hashtable.torch_backend import TorchBackend

from .conftest import NEEDS_CUDA_KERNELS

gpu = pytest.mark.gpu
needs_cuda = NEEDS_CUDA_KERNELS
DEVICE = "cuda"
LEAF = sparse_update.LEAF
MIXES = {
    "singles": [1] * 20,
    "short": [2, 3, 1, 7, 8, 9],
    "long": [1000, 4097, 33, 17, 16, 15, 1] + [1] * 40 + list(range(1, 20)),
}


def _scaled(gen: torch.Generator, m: int, dim: int) -> torch.Tensor:
    # magnitudes over many binades, so that the order of the additions shows in the bits
    scale = torch.exp2(torch.randint(-20, 20, (m, dim), generator=gen).float())
    return torch.randn(m, dim, generator=gen) * scale


def _runs(run_lengths: list[int], dim: int, seed: int):
    """Gradients [M, dim] of keys with the given duplicate counts, as the storage sorts them."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.repeat_interleave(torch.arange(len(run_lengths)), torch.tensor(run_lengths))
    keys = keys[torch.randperm(keys.numel(), generator=gen)].to(DEVICE)
    grads = _scaled(gen, keys.numel(), dim).to(DEVICE)
    order, starts, counts, _, group = unique_pairs(keys, None)
    return grads[order], starts, counts, group


def _plan(run_lengths: list[int], dim: int, seed: int, device: str, pad: int = 5):
    """A static step's backward inputs: (grads [P, dim] unsorted, order (no identity), starts,
    counts, group) of shuffled keys with the given duplicate counts and ``pad`` padding keys
    (static_step.unique_runs: a run of count 0 last, starts clamped past it), and rows [P]:
    distinct, -1 for every 5th run and past the real runs."""
    gen = torch.Generator().manual_seed(seed)
    real = torch.repeat_interleave(torch.arange(len(run_lengths)), torch.tensor(run_lengths))
    real = real[torch.randperm(real.numel(), generator=gen)]
    keys = torch.cat([real, torch.zeros(pad, dtype=torch.int64)])
    p = keys.numel()
    runs = unique_runs(keys, torch.zeros_like(keys), torch.tensor(real.numel()), 1)
    rows = torch.randperm(2 * p, generator=gen)[:p]
    skip = ~runs.valid | (torch.arange(p) % 5 == 3)
    rows = torch.where(skip, -1, rows)
    grads = _scaled(gen, p, dim)
    grads[real.numel() :] = 0.0  # the static step zeroes the padding's gradients
    out = (grads, runs.order, runs.starts, runs.counts, runs.group, rows)
    return tuple(t.to(device) for t in out)


def _torch_rows(x, starts, counts, group, max_count) -> torch.Tensor:
    """[M, dim]: every row of hashing.segment_sum_sorted's ``x`` after its rounds (the rows at
    ``starts`` are its result; the others show what the kernels leave there)."""
    every = torch.cat([starts, torch.arange(x.shape[0], device=x.device)])
    return segment_sum_sorted(x, every, counts, group, max_count)[starts.numel() :]


# ---------------------------------------------------------------- CPU


def _tree4(rows: list[np.ndarray], n: int) -> np.ndarray:
    """su_tree4: rounds step 1, 2 on the first min(n, 4) of ``rows``."""
    v = rows[:4]
    if n > 1:
        v[0] = v[0] + v[1]  # float32 + float32, rounded once (as __fadd_rn)
    if n > 3:
        v[2] = v[2] + v[3]
    if n > 2:
        v[0] = v[0] + v[2]
    return v[0]


def _leaf_model(x: torch.Tensor, order, starts, counts, group) -> torch.Tensor:
    """su_leaf in Python, as the kernel adds: row i (rank r) gets the tree (rounds step
    1 .. LEAF / 2, cut at the run's end) of the ranks r .. r + b - 1 of ``x[order]``, b = the
    largest power of two dividing r (LEAF for r = 0), at most LEAF, four rows at a time; a row
    past its run's end is copied."""
    xs = x[order].numpy()
    out = np.empty_like(xs)
    for i in range(xs.shape[0]):
        g = int(group[i])
        r = i - int(starts[g])
        left = int(counts[g]) - r
        low = r & -r
        b = LEAF if r == 0 or low > LEAF else low
        n = 1 if left < 1 else min(left, b)
        rows = [xs[i + k] for k in range(n)] + [xs[i]] * (LEAF - n)  # the tail is never added
        s = _tree4(rows[0:4], n)
        if n > 4:
            s = s + _tree4(rows[4:8], n - 4)
        if n > 8:
            t = _tree4(rows[8:12], n - 8)
            if n > 12:
                t = t + _tree4(rows[12:16], n - 12)
            s = s + t
        out[i] = s
    return torch.from_numpy(out)


def _rounds_model(work: torch.Tensor, starts, counts, group, max_count: int) -> torch.Tensor:
    """su_tree_round's launches, step = LEAF, 2 LEAF, ... < max_count."""
    rank = torch.arange(work.shape[0]) - starts[group]
    step = LEAF
    while step < max_count:
        add = (rank % (2 * step) == 0) & (rank + step < counts[group])
        work = torch.where(add[:, None], work + torch.roll(work, -step, 0), work)
        step *= 2
    return work


@pytest.mark.parametrize("dim", [1, 3])
def test_the_kernels_tree_leaves_every_row_as_the_torch_tree(dim: int) -> None:
    """su_leaf, then rounds from LEAF on, equal the torch tree on every row, for runs of
    1 .. 70 (and padding: a run of count 0), with the longest run or P as the bound."""
    grads, order, starts, counts, group, _ = _plan(list(range(1, 71)), dim, seed=dim, device="cpu")
    p = grads.shape[0]
    work = _leaf_model(grads, order, starts, counts, group)
    for max_count in (70, p):
        want = _torch_rows(grads[order], starts, counts, group, max_count)
        got = _rounds_model(work, starts, counts, group, max_count)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), max_count


def test_the_torch_backend_applies_the_sum_then_adagrad() -> None:
    grads, order, starts, counts, group, rows = _plan(MIXES["long"], 5, seed=2, device="cpu")
    config = AdagradConfig(lr=0.01)
    gen = torch.Generator().manual_seed(4)
    values = torch.randn(2 * grads.shape[0], 5, generator=gen)
    accum = torch.rand(2 * grads.shape[0], 5, generator=gen)
    want_v, want_a, before = values.clone(), accum.clone(), values.clone()
    g = segment_sum_sorted(grads[order], starts, counts, group, grads.shape[0])
    adagrad_update(want_v, want_a, rows, g, config)
    TorchBackend().apply_sparse_gradients(
        values, accum, rows, grads, order, starts, counts, group, grads.shape[0], config
    )
    assert torch.equal(values, want_v) and torch.equal(accum, want_a)
    assert not torch.equal(values, before)


# ---------------------------------------------------------------- GPU


def _misaligned(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``x`` whose data starts 4 bytes past a 16-byte boundary (the
    kernels' per-float path)."""
    buf = torch.zeros(x.numel() + 1, dtype=x.dtype, device=x.device)
    buf[1:] = x.flatten()
    return buf[1:].view(x.shape)


@gpu
@needs_cuda
@pytest.mark.parametrize("dim", [1, 16, 17])
@pytest.mark.parametrize("mix", list(MIXES))
def test_segment_sum_equals_the_torch_tree(mix: str, dim: int) -> None:
    run_lengths = MIXES[mix]
    x, starts, counts, group = _runs(run_lengths, dim, seed=len(run_lengths) + dim)
    want = segment_sum_sorted(x.clone(), starts, counts, group)
    got = sparse_update.segment_sum_sorted(x, starts, counts, group, max(run_lengths))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    again = sparse_update.segment_sum_sorted(x, starts, counts, group)  # reads max_count itself
    assert torch.equal(again, got)
    loose = sparse_update.segment_sum_sorted(x, starts, counts, group, x.shape[0])
    assert torch.equal(loose, got)
    assert torch.equal(x, _runs(run_lengths, dim, seed=len(run_lengths) + dim)[0])  # x untouched


@gpu
@needs_cuda
def test_segment_sum_of_nothing() -> None:
    empty = torch.zeros(0, 16, device=DEVICE)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert sparse_update.segment_sum_sorted(empty, none, none, none).shape == (0, 16)


@gpu
@needs_cuda
@pytest.mark.parametrize("aligned", [True, False], ids=["float4", "unaligned"])
@pytest.mark.parametrize("dim", [1, 16, 17])
def test_tree_sums_leave_every_row_as_the_torch_tree(dim: int, aligned: bool) -> None:
    """tree_sums through ``order`` equals the torch tree on ``grads[order]`` on every row (the
    float4 path for dim 16, floats for 1, 17 and a gradient array 4 bytes off 16-byte
    alignment)."""
    grads, order, starts, counts, group, _ = _plan(MIXES["long"], dim, seed=dim, device=DEVICE)
    if not aligned:
        grads = _misaligned(grads)
    for max_count in (max(MIXES["long"]), grads.shape[0]):
        want = _torch_rows(grads[order], starts, counts, group, max_count)
        got = sparse_update.tree_sums(grads, order, starts, counts, group, max_count)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), max_count


def _tables(p: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(dim)
    values = torch.randn(2 * p, dim, generator=gen).to(DEVICE)
    accum = (torch.rand(2 * p, dim, generator=gen) * 3).to(DEVICE)
    return values, accum


@gpu
@needs_cuda
@pytest.mark.parametrize("exact", [True, False], ids=["longest", "padded_size"])
@pytest.mark.parametrize("dim", [1, 16, 17])
@pytest.mark.parametrize("mix", list(MIXES))
def test_apply_sparse_gradients_equals_the_torch_composition(
    mix: str, dim: int, exact: bool
) -> None:
    grads, order, starts, counts, group, rows = _plan(MIXES[mix], dim, seed=dim, device=DEVICE)
    p = grads.shape[0]
    max_count = max(MIXES[mix]) if exact else p
    config = AdagradConfig(lr=0.01, eps=1e-10)
    values, accum = _tables(p, dim)
    want_v, want_a = values.clone(), accum.clone()
    g = segment_sum_sorted(grads[order], starts, counts, group, max_count)
    adagrad_update(want_v, want_a, rows, g, config)
    before = values.clone()
    sparse_update.apply_sparse_gradients(
        values, accum, rows, grads, order, starts, counts, group, max_count, config
    )
    assert torch.equal(values.view(torch.int32), want_v.view(torch.int32))
    assert torch.equal(accum.view(torch.int32), want_a.view(torch.int32))
    assert not torch.equal(values, before)


@gpu
@needs_cuda
def test_the_cuda_backend_runs_the_kernels_and_the_torch_code_elsewhere() -> None:
    from shared.hashtable.cuda.backend import CudaBackend

    backend = CudaBackend()
    x, starts, counts, group = _runs([3, 1, 5], 16, seed=1)
    want = segment_sum_sorted(x, starts, counts, group)
    assert torch.equal(backend.segment_sum_sorted(x, starts, counts, group, 5), want)
    x64 = x.double()  # not float32: the torch code
    assert torch.equal(
        backend.segment_sum_sorted(x64, starts, counts, group),
        segment_sum_sorted(x64, starts, counts, group),
    )
    grads, order, starts, counts, group, rows = _plan([3, 1, 40], 16, seed=1, device=DEVICE)
    p, config = grads.shape[0], AdagradConfig(lr=0.1)
    for g in (grads, grads.double()):  # the kernels; the torch code
        values, accum = _tables(p, 16)
        want_v, want_a = values.clone(), accum.clone()
        s = segment_sum_sorted(g[order], starts, counts, group, p)
        adagrad_update(want_v, want_a, rows, s, config)
        backend.apply_sparse_gradients(
            values, accum, rows, g, order, starts, counts, group, p, config
        )
        assert torch.equal(values, want_v) and torch.equal(accum, want_a)


@gpu
@needs_cuda
@pytest.mark.parametrize("aligned", [True, False], ids=["float4", "unaligned"])
@pytest.mark.parametrize("initial", [0.0, 0.1])
def test_adagrad_equals_the_torch_update(initial: float, aligned: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    cap, dim, n = 1000, 16, 300
    config = AdagradConfig(lr=0.001, eps=1e-10, initial_accumulator_value=initial)
    values = torch.randn(cap, dim, generator=gen).to(DEVICE)
    accum = (torch.rand(cap, dim, generator=gen) * 3 + initial).to(DEVICE)
    rows = torch.randperm(cap, generator=gen)[:n].to(DEVICE)
    scale = torch.exp2(torch.randint(-30, 8, (n, dim), generator=gen).float())
    grads = (torch.randn(n, dim, generator=gen) * scale).to(DEVICE)
    grads[0] = 0.0  # an untouched row stays as it is
    if not aligned:  # su_adagrad takes floats
        grads = _misaligned(grads)
    want_v, want_a = values.clone(), accum.clone()
    adagrad_update(want_v, want_a, rows, grads, config)
    sparse_update.adagrad_update(values, accum, rows, grads, config)
    assert torch.equal(values.view(torch.int32), want_v.view(torch.int32))
    assert torch.equal(accum.view(torch.int32), want_a.view(torch.int32))


@gpu
@needs_cuda
def test_the_kernel_reads_the_rate_from_the_device() -> None:
    """A config's ``rate`` tensor, rewritten by ``with_lr``, is what the kernel applies: the
    same bits as the torch code at the new rate."""
    grads, order, starts, counts, group, rows = _plan([3, 1, 40], 16, seed=5, device=DEVICE)
    p = grads.shape[0]
    config = AdagradConfig(lr=0.1).on_device(torch.device(DEVICE))
    moved = config.with_lr(0.003)
    assert moved.rate is config.rate and float(moved.rate) == pytest.approx(-0.003)
    values, accum = _tables(p, 16)
    want_v, want_a = values.clone(), accum.clone()
    g = segment_sum_sorted(grads[order], starts, counts, group, p)
    adagrad_update(want_v, want_a, rows, g, AdagradConfig(lr=0.003))
    # the stale lr on the config the kernel gets: only the device rate may decide
    sparse_update.apply_sparse_gradients(
        values, accum, rows, grads, order, starts, counts, group, p, config
    )
    assert torch.equal(values.view(torch.int32), want_v.view(torch.int32))
    assert torch.equal(accum.view(torch.int32), want_a.view(torch.int32))
