"""The CUDA backend's unique of (table id, key) pairs (cuda/unique.cu) against the torch code,
and a fused storage's training lookup and backward under both backends, bit for bit, on the GPU.

Run on the GPU machine: ``python3 -m pytest -q -m gpu tests/shared/hashtable/test_cuda_unique.py``.
The CPU test checks which tensors the kernels take.
"""

from __future__ import annotations

import pytest
import torch

from shared.features import ScoreStrategy
from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.backend import Backend
from shared.hashtable.cuda import unique
from shared.hashtable.hashing import NegativeKeyError
from shared.hashtable.storage import FusedStorage, LookupPlan
from shared.hashtable.torch_backend import TorchBackend

from .conftest import NEEDS_CUDA_KERNELS, dyn_table

gpu = pytest.mark.gpu
needs_cuda = NEEDS_CUDA_KERNELS
DEVICE = "cuda"
TORCH = TorchBackend()
PLAN_TENSORS = ("keys", "table_ids", "rows", "order", "starts", "counts", "group", "inverse")
PLAN_TENSORS += ("out",)


def test_the_kernels_take_int64_keys_on_cuda_only():
    keys = torch.arange(4)
    assert not unique.supports(keys, None)  # on the CPU: the torch code
    assert not unique.supports(keys[:0], None)


def _cases() -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    g = torch.Generator().manual_seed(3)
    big = torch.randint(0, 1 << 62, (1_000_000,), generator=g)
    big[::7] = big[::7] % 5000  # duplicates among the large keys
    skew = torch.randint(0, 3000, (200_000,), generator=g) ** 2 // 3000
    cases: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {
        "one": (torch.tensor([7]), None),
        "one_fused": (torch.tensor([7]), torch.tensor([2])),
        "two_equal": (torch.tensor([5, 5]), None),
        "all_equal": (torch.full((5000,), 9), None),
        "all_equal_fused": (torch.full((5000,), 9), torch.zeros(5000, dtype=torch.int64)),
        "same_key_other_tables": (torch.full((300,), 4), torch.arange(300) % 3),
        "distinct": (torch.randperm(10_000, generator=g), None),
        "extremes": (torch.tensor([2**63 - 1, 0, 2**63 - 1, 1, 0]), torch.tensor([1, 0, 1, 1, 0])),
        "block_edges": (torch.randint(0, 300, (257 * 256 + 3,), generator=g), None),
        "skewed": (skew, None),
        "skewed_fused": (skew, torch.randint(0, 6, (skew.numel(),), generator=g)),
        "large": (big, None),
        "large_fused": (big, torch.randint(0, 4, (big.numel(),), generator=g)),
        "large_table_ids": (skew, torch.randint(0, 2**31 - 1, (skew.numel(),), generator=g)),
        "negative": (torch.tensor([3, -1, 3, -(2**63), 0]), None),
        "negative_fused": (torch.tensor([3, -1, 3, -(2**63), 0]), torch.tensor([1, 0, 1, 0, 0])),
    }
    return cases


CASES = _cases()


def _both(
    keys: torch.Tensor, tids: torch.Tensor | None, *, reject_negative: bool
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    from shared.hashtable.cuda.backend import CudaBackend

    k = keys.to(DEVICE)
    t = None if tids is None else tids.to(DEVICE)
    want = TORCH.unique_pairs(k, t, reject_negative=reject_negative)
    got = CudaBackend().unique_pairs(k, t, reject_negative=reject_negative)
    return want, got


@gpu
@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
def test_unique_pairs_gives_the_torch_tensors(case: str):
    keys, tids = CASES[case]
    assert unique.supports(keys.to(DEVICE), None if tids is None else tids.to(DEVICE))
    want, got = _both(keys, tids, reject_negative=False)
    for name, w, x in zip(
        ("order", "starts", "counts", "inverse", "group"), want, got, strict=True
    ):
        assert x.dtype == w.dtype and x.device == w.device, name
        assert torch.equal(x, w), (case, name)
    if keys.min() >= 0:
        want, got = _both(keys, tids, reject_negative=True)
        assert all(torch.equal(x, w) for w, x in zip(want, got, strict=True))


@gpu
@needs_cuda
@pytest.mark.parametrize("case", ["negative", "negative_fused"])
def test_unique_pairs_refuses_negative_keys_as_the_torch_code(case: str):
    from shared.hashtable.cuda.backend import CudaBackend

    keys, tids = CASES[case]
    k, t = keys.to(DEVICE), None if tids is None else tids.to(DEVICE)
    for backend in (TORCH, CudaBackend()):
        with pytest.raises(NegativeKeyError):
            backend.unique_pairs(k, t, reject_negative=True)


@gpu
@needs_cuda
def test_unique_pairs_of_what_the_kernels_do_not_take():
    """No keys, int32 keys or int32 table ids: the torch code, the same tensors."""
    g = torch.Generator().manual_seed(5)
    keys = torch.randint(0, 50, (1000,), generator=g)
    tids = torch.randint(0, 3, (1000,), generator=g)
    cases = [(keys[:0], None), (keys[:0], tids[:0]), (keys.int(), None), (keys, tids.int())]
    for k, t in cases:
        assert not unique.supports(k.to(DEVICE), None if t is None else t.to(DEVICE))
        want, got = _both(k, t, reject_negative=True)
        assert all(torch.equal(x, w) for w, x in zip(want, got, strict=True))


def _storage(backend: Backend) -> FusedStorage:
    specs = [
        dyn_table(f"t{i}", dim=8, max_capacity=2048, init_capacity=512,
                  bucket_capacity=64, strategy=ScoreStrategy.LFU, threshold=2 if i else None,
                  counter_capacity=4096)
        for i in range(3)
    ]  # fmt: skip
    return FusedStorage(
        "g",
        specs,
        adagrad=AdagradConfig(0.05),
        seed=1,
        device=torch.device(DEVICE),
        backend=backend,
    )


def _script(backend: Backend) -> tuple[list[LookupPlan], FusedStorage]:
    """Training lookups and backward (growth, admission, eviction), then an eval lookup."""
    s = _storage(backend)
    plans = []
    for step in range(10):
        g = torch.Generator().manual_seed(step)
        sizes = [3000 + 100 * step, 2000, 1500 - 50 * step]  # a new part layout every step
        parts = [
            (t, (torch.randint(0, 4000, (n,), generator=g) ** 2 // 4000 + 97 * step).to(DEVICE))
            for t, n in enumerate(sizes)
        ]
        plan = s.lookup(parts, train=True, score_now=step)
        grad = torch.randn(sum(sizes), s.dim, generator=g).to(DEVICE)
        s.apply_gradients(plan, grad)
        plans.append(plan)
    parts = [(1, torch.arange(5000, device=DEVICE)), (0, torch.arange(100, device=DEVICE))]
    plans.append(s.lookup(parts, train=False, score_now=0))
    return plans, s


@gpu
@needs_cuda
def test_a_fused_storage_trains_the_same_under_both_backends():
    from shared.hashtable.cuda.backend import CudaBackend

    want_plans, want = _script(TORCH)
    got_plans, got = _script(CudaBackend())
    assert got.backend.name == "cuda" and want.backend.name == "torch"
    for w, x in zip(want_plans, got_plans, strict=True):
        for f in PLAN_TENSORS:
            assert torch.equal(getattr(x, f), getattr(w, f)), f
        assert (x.updated, x.max_count, x.generation) == (w.updated, w.max_count, w.generation)
    assert got.table.evictions > 0 and got.table.generation > 0  # the script grows and evicts
    for tid in range(3):
        assert got.stats()[tid] == want.stats()[tid]
        a, b = got.states()[tid], want.states()[tid]
        for f in ("keys", "values", "scores", "accumulators", "counter_keys", "counter_counts"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None and y is None) or torch.equal(x, y), (tid, f)
