"""bench.profile_train's device-busy union (the GPU-busy figure of bench_train)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.profile_train import device_busy_us, is_sync_call


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


def test_host_profile_splits_the_steps_host_time(tiny_samples, seed_fs) -> None:
    from bench.profile_train import device_batches, host_profile
    from shared.config import load_config
    from tests.conftest import SEED_CONFIG
    from train.model.multi_tower_din import MultiTowerDIN
    from train.trainer import build_optimizers

    config = load_config(SEED_CONFIG)
    cpu = torch.device("cpu")
    model = MultiTowerDIN.from_config(config, seed_fs, device=cpu, seed=0)
    optimizers = build_optimizers(model, config.train_config)
    batches = iter(enumerate(device_batches(tiny_samples, seed_fs, 256, 3, cpu)))
    host = host_profile(model, optimizers, batches, 3, "", None, lambda: None)
    rows = host["top_functions"]
    assert rows
    # own times partition the profiled time: they cannot add up to more than the wall
    assert 0 < sum(host["by_file_ms_per_step"].values()) <= host["profiled_ms_per_step"] * 1.05
    # the training step's hash-table code is among the files seen
    assert any(f.startswith("shared/hashtable/") for f in host["by_file_ms_per_step"])


def test_sync_calls_are_named_exactly() -> None:
    assert is_sync_call("<method 'item' of 'torch._C.TensorBase' objects>")
    assert is_sync_call("<method 'tolist' of 'torch._C.TensorBase' objects>")
    assert is_sync_call("<built-in method torch._C._cuda_synchronize>")
    # a name that merely contains one is not a host read of the device
    assert not is_sync_call("<method 'items' of 'dict' objects>")
    assert not is_sync_call("<built-in method torch.cumsum>")
