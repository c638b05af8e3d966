"""The sparse-update kernels (cuda/sparse_update.cu) against the torch code, bit for bit, on the
GPU: the pairwise segment sum of duplicate keys' gradients and row-wise Adagrad."""

from __future__ import annotations

import pytest
import torch

from shared.hashtable.adagrad import AdagradConfig, adagrad_update
from shared.hashtable.hashing import segment_sum_sorted, unique_pairs

from .conftest import CUDA_KERNELS

pytestmark = CUDA_KERNELS
DEVICE = "cuda"


def _runs(run_lengths: list[int], dim: int, seed: int):
    """Gradients [M, dim] of keys with the given duplicate counts, as the storage sorts them."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.repeat_interleave(torch.arange(len(run_lengths)), torch.tensor(run_lengths))
    keys = keys[torch.randperm(keys.numel(), generator=gen)].to(DEVICE)
    # magnitudes over many binades, so that the order of the additions shows in the bits
    scale = torch.exp2(torch.randint(-20, 20, (keys.numel(), dim), generator=gen).float())
    grads = (torch.randn(keys.numel(), dim, generator=gen) * scale).to(DEVICE)
    order, starts, counts, _, group = unique_pairs(keys, None)
    return grads[order], starts, counts, group


@pytest.mark.parametrize("dim", [1, 16, 17])
@pytest.mark.parametrize(
    "run_lengths",
    [[1, 1, 1], [2, 3, 1, 7, 8, 9], [1] * 50 + [1000, 4097] + list(range(1, 40))],
    ids=["singles", "short", "long"],
)
def test_segment_sum_equals_the_torch_tree(run_lengths: list[int], dim: int) -> None:
    from shared.hashtable.cuda import sparse_update

    x, starts, counts, group = _runs(run_lengths, dim, seed=len(run_lengths) + dim)
    want = segment_sum_sorted(x.clone(), starts, counts, group)
    got = sparse_update.segment_sum_sorted(x, starts, counts, group, max(run_lengths))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    again = sparse_update.segment_sum_sorted(x, starts, counts, group)  # reads max_count itself
    assert torch.equal(again, got)
    assert torch.equal(x, _runs(run_lengths, dim, seed=len(run_lengths) + dim)[0])  # x untouched


def test_segment_sum_of_nothing() -> None:
    from shared.hashtable.cuda import sparse_update

    empty = torch.zeros(0, 16, device=DEVICE)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert sparse_update.segment_sum_sorted(empty, none, none, none).shape == (0, 16)


@pytest.mark.parametrize("initial", [0.0, 0.1])
def test_adagrad_equals_the_torch_update(initial: float) -> None:
    from shared.hashtable.cuda import sparse_update

    gen = torch.Generator().manual_seed(7)
    cap, dim, n = 1000, 16, 300
    config = AdagradConfig(lr=0.001, eps=1e-10, initial_accumulator_value=initial)
    values = torch.randn(cap, dim, generator=gen).to(DEVICE)
    accum = (torch.rand(cap, dim, generator=gen) * 3 + initial).to(DEVICE)
    rows = torch.randperm(cap, generator=gen)[:n].to(DEVICE)
    scale = torch.exp2(torch.randint(-30, 8, (n, dim), generator=gen).float())
    grads = (torch.randn(n, dim, generator=gen) * scale).to(DEVICE)
    grads[0] = 0.0  # an untouched row stays as it is
    want_v, want_a = values.clone(), accum.clone()
    adagrad_update(want_v, want_a, rows, grads, config)
    sparse_update.adagrad_update(values, accum, rows, grads, config)
    assert torch.equal(values.view(torch.int32), want_v.view(torch.int32))
    assert torch.equal(accum.view(torch.int32), want_a.view(torch.int32))


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
