"""The two-tier row gather (cuda/tier_gather.cu): HBM lines and page-locked host rows read through
UVA give exactly the rows of one matrix, eagerly and replayed from a CUDA graph (GPU tests:
``python3 -m pytest -q -m gpu tests/shared/hashtable/test_cuda_tier_gather.py``); the launch
signatures are checked against the source on CPU too."""

from __future__ import annotations

import pytest
import torch

from shared.hashtable.cuda import runtime as rt
from shared.hashtable.cuda import tier_gather
from shared.hashtable.host_store import TensorHostStore

from .conftest import NEEDS_CUDA_KERNELS, run_on_cuda
from .test_cuda_keyed import _kernel_params, _signature


def test_signatures_match_the_source() -> None:
    params = _kernel_params(rt.SOURCE.with_name(tier_gather.SOURCE[0]))
    assert set(params) == set(tier_gather.SIGNATURES)
    for name, sig in tier_gather.SIGNATURES.items():
        assert _signature(params[name]) == sig, name


def _case(dim: int, rows: int = 1000, n: int = 4096, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, dim, generator=gen)  # every row, on the host
    hot = torch.randperm(rows, generator=gen)[: rows // 10].sort().values
    line_of_row = torch.full((rows,), -1, dtype=torch.int32)
    line_of_row[hot] = torch.arange(hot.numel(), dtype=torch.int32)
    idx = torch.randint(-1, rows, (n,), generator=gen)  # -1: no key
    want = torch.where((idx >= 0).unsqueeze(1), values[idx.clamp(min=0)], 0.0)
    return values, hot, line_of_row, idx, want


@pytest.mark.gpu
@NEEDS_CUDA_KERNELS
@pytest.mark.parametrize("dim", [16, 6, 128])  # float4 rows, scalar rows, wide rows
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_gather_equals_one_matrix(dim: int, graph: bool) -> None:
    values, hot, line_of_row, idx, want = _case(dim)
    store = TensorHostStore.holding(values.clone(), pin=True, mapped=True)
    dev = torch.device("cuda")
    hot_rows = values[hot].to(dev)
    lines, rows = line_of_row.to(dev), idx.to(dev)
    out = torch.full((idx.numel(), dim), float("nan"), device=dev)
    host_at = torch.tensor([store.device_pointer()], dtype=torch.int64, device=dev)

    def run() -> None:
        tier_gather.gather(hot_rows, host_at, rows, lines, out)

    run_on_cuda(run, graph=graph, out=out)
    assert torch.equal(out.cpu(), want)


@pytest.mark.gpu
@NEEDS_CUDA_KERNELS
def test_a_captured_gather_reads_the_rows_its_cell_names_at_replay() -> None:
    """serve.tiers' copy-on-write swaps a version's host rows by writing the address cell: a
    graph captured over the first rows reads the second ones at its next replay."""
    values, hot, line_of_row, idx, want = _case(16)
    first = TensorHostStore.holding(values.clone(), pin=True, mapped=True)
    second = TensorHostStore.holding(values + 1.0, pin=True, mapped=True)
    dev = torch.device("cuda")
    hot_rows = values[hot].to(dev)
    lines, rows = line_of_row.to(dev), idx.to(dev)
    out = torch.full((idx.numel(), 16), float("nan"), device=dev)
    host_at = torch.tensor([first.device_pointer()], dtype=torch.int64, device=dev)

    def run() -> None:
        tier_gather.gather(hot_rows, host_at, rows, lines, out)

    run()  # NVRTC compiles outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), want)
    host_at.fill_(second.device_pointer())  # the cell, not the capture, says which rows
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    cold = (idx >= 0) & (line_of_row[idx.clamp(min=0)] < 0)  # hot rows: from the HBM lines
    assert bool(cold.any())
    assert torch.equal(out.cpu(), torch.where(cold.unsqueeze(1), want + 1.0, want))
