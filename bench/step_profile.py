"""torch.profiler over a few calls of a step: what a bench's step runs, counted and ranked.

:func:`profile_steps` runs ``step(i)`` for ``steps`` calls under torch.profiler (device work
included on CUDA, each allocation recorded) and returns the figures a bench's JSON keeps per
step and the text tables it writes beside the JSON:

- on CUDA: kernels a step (every kernel and copy the device ran, a CUDA graph's replayed
  kernels included) and device-busy milliseconds a step (the union of their intervals:
  :func:`device_busy_us`), the top kernels by self device time;
- everywhere: operators a step (``aten::`` calls, nested ones included: on CPU every op runs
  eagerly, so this is the step's op count), host milliseconds a step, bytes allocated a step (the
  operators' own allocations: on CPU a measure of the bytes a step's temporaries write; a
  replayed CUDA graph allocates nothing), the top operators by self CPU time.

A profiler leaves overhead on every later launch in its process (``bench.bench_train``'s doc:
+20 % to +26 % a step on the H200), so a bench profiles after its timed runs, never before.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

TOP = 30  # rows of each table


def device_busy_us(events: Sequence[Any]) -> float:
    """Microseconds in which at least one kernel or copy ran on the GPU: the union of the
    device events' intervals (summing the operators' device times would count a kernel under
    its operator and again on its own). The device-side spans of ``record_function`` ranges
    (``gpu_user_annotation``: the phases) are not work: they run from a range's first kernel
    to its last, idle gaps included, and would cover the whole step."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation
    )
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if a > end:
            busy, end = busy + (b - a), b
        elif b > end:
            busy, end = busy + (b - end), b
    return busy


def profile_steps(
    step: Callable[[int], None], steps: int, device: torch.device
) -> tuple[dict[str, Any], str]:
    """(figures a step, text tables) of ``step(0)`` .. ``step(steps - 1)`` under torch.profiler,
    each step ended by a device sync (see the module doc)."""
    if steps < 1:
        raise ValueError(f"profile_steps: steps must be >= 1, got {steps}")
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    _sync(device)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        for i in range(steps):
            step(i)
            _sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    events = prof.events()
    ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    figures: dict[str, Any] = {
        "profiled_steps": steps,
        "profiled_wall_ms_per_step": round(wall_ms, 3),
        "ops_per_step": sum(e.name.startswith("aten::") for e in ops) / steps,
        "host_self_ms_per_step": round(sum(e.self_cpu_time_total for e in ops) / steps / 1e3, 3),
        # each operator's own allocations (an op's total counts its children's again)
        "allocated_bytes_per_step": sum(
            max(0, e.self_cpu_memory_usage) + max(0, e.self_device_memory_usage) for e in ops
        )
        // steps,
    }
    averages = prof.key_averages()
    text = [f"== {steps} steps on {device}: {figures}", "== operators by self CPU time"]
    text.append(averages.table(sort_by="self_cpu_time_total", row_limit=TOP))
    if cuda:
        kernels = [
            e
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation
        ]
        figures["kernels_per_step"] = len(kernels) / steps
        figures["device_ms_per_step"] = round(device_busy_us(events) / steps / 1e3, 3)
        text += ["== kernels by self device time"]
        text.append(averages.table(sort_by="self_cuda_time_total", row_limit=TOP))
    return figures, "\n".join(text) + "\n"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
