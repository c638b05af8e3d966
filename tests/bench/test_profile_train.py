"""bench.profile_train's device-busy union (the GPU-busy figure of bench_train)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.profile_train import device_busy_us


@dataclass
class _Range:
    start: float
    end: float


@dataclass
class _Event:
    time_range: _Range
    device_type: torch.autograd.DeviceType = torch.autograd.DeviceType.CUDA
    is_user_annotation: bool = False


def _ev(a: float, b: float, **kw: object) -> _Event:
    return _Event(_Range(a, b), **kw)  # type: ignore[arg-type]


def test_overlapping_kernels_count_once() -> None:
    assert device_busy_us([_ev(0, 10), _ev(5, 12), _ev(20, 25)]) == 17


def test_host_events_do_not_count() -> None:
    cpu = torch.autograd.DeviceType.CPU
    assert device_busy_us([_ev(0, 10), _ev(0, 100, device_type=cpu)]) == 10


def test_phase_annotations_are_not_work() -> None:
    # a record_function range's device span runs from its first kernel to its last, idle
    # gaps included: counting it would make the step look busy from end to end
    events = [_ev(0, 100, is_user_annotation=True), _ev(0, 10), _ev(90, 100)]
    assert device_busy_us(events) == 20
