"""Small TableSpec builders and the CUDA markers shared by the hash-table tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from shared.features import (
    CONSTANT_ZERO,
    AdmissionSpec,
    DynamicTableSpec,
    InitializerSpec,
    InitMode,
    LfuDecaySpec,
    ScoreStrategy,
    TableSpec,
)
from shared.hashtable import cuda

NORMAL = InitializerSpec(InitMode.NORMAL, std_dev=0.05)
# the CUDA backend's kernels: skipped where they cannot run, with why
NEEDS_CUDA_KERNELS = pytest.mark.skipif(
    cuda.unavailable_reason() is not None,
    reason=f"needs CUDA and CuPy: {cuda.unavailable_reason()}",
)
CUDA_KERNELS = [pytest.mark.gpu, NEEDS_CUDA_KERNELS]  # a GPU test module's pytestmark


def dyn_table(
    name: str,
    *,
    dim: int = 4,
    max_capacity: int = 1024,
    init_capacity: int = 64,
    bucket_capacity: int = 16,
    strategy: ScoreStrategy = ScoreStrategy.STEP,
    initializer: InitializerSpec = NORMAL,
    eval_initializer: InitializerSpec = CONSTANT_ZERO,
    threshold: int | None = None,
    admission_initializer: InitializerSpec = CONSTANT_ZERO,
    counter_capacity: int = 256,
    lfu_decay: LfuDecaySpec | None = None,
) -> TableSpec:
    admission = (
        None
        if threshold is None
        else AdmissionSpec(threshold, admission_initializer, counter_capacity, 16)
    )
    dyn = DynamicTableSpec(
        max_capacity,
        init_capacity,
        bucket_capacity,
        strategy,
        initializer,
        eval_initializer,
        admission,
        None,
        lfu_decay=lfu_decay,
    )
    return TableSpec(name, dim, None, dyn, "sum")


def run_on_cuda(
    run: Callable[[], None],
    *,
    graph: bool,
    out: torch.Tensor | None,
    warm: Callable[[], None] | None = None,
) -> None:
    """``run()`` eagerly, or captured in a CUDA graph and replayed (run once eagerly first, so
    that NVRTC compiles outside the capture, or ``warm()`` instead where a run changes what the
    replay reads; ``out``, if given, filled with NaN before the capture, so the replay must
    write it); synchronized after."""
    if graph:
        (warm or run)()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        if out is not None:
            out.fill_(float("nan"))
        with torch.cuda.graph(g):
            run()
        g.replay()
    else:
        run()
    torch.cuda.synchronize()
