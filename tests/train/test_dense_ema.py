"""train.dense_ema: the average is tzrec's EMA recursion, bit for bit torch's AveragedModel's
(what tzrec uses) with no host read a step, its swap in and out is exact, checkpoints of
AveragedModel's form load, the config's switches resolve as tzrec's, and errors name the
field."""

from __future__ import annotations

import pytest
import torch
from google.protobuf import text_format

from protos import pipeline_pb2
from shared.config import parse_config
from tests.conftest import DEVICES, SEED_CONFIG
from train.dense_ema import DenseEMA, use_dense_ema

# host reads of a device value: each one a sync on CUDA
HOST_READS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero"}


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def test_the_average_is_the_ema_recursion_and_the_first_update_copies() -> None:
    module = _module()
    ema = DenseEMA(module, decay=0.75)
    want = None
    for step in range(5):
        with torch.no_grad():  # stand-in for an optimizer step
            for p in module.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
        now = {n: p.detach().clone() for n, p in module.named_parameters()}
        want = now if want is None else {n: 0.75 * want[n] + 0.25 * now[n] for n in now}
        for name, avg in ema.averaged().items():
            torch.testing.assert_close(avg, want[name], msg=f"step {step} {name}")
    assert ema.updates == 5 and list(ema.averaged()) == [n for n, _ in module.named_parameters()]


@pytest.mark.parametrize("device", DEVICES)
def test_the_average_is_torchs_averaged_model_bit_for_bit(device: str) -> None:
    """The fused update gives AveragedModel(get_ema_multi_avg_fn)'s bits, at the config's
    decay (a float32 from the proto), over steps that start with its copy (on CUDA: one
    multi-tensor kernel for both, and the update makes no host sync)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    decay = float(torch.tensor(0.999, dtype=torch.float32))  # as the config hands it over
    module = _module().to(device)
    ema = DenseEMA(module, decay)
    source = torch.nn.ParameterList(module.parameters())
    reference = AveragedModel(source, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=False)
    generator = torch.Generator().manual_seed(1)
    for step in range(6):
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn(p.shape, generator=generator).to(device))
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")  # a host sync in the update raises
        try:
            ema.update()
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        reference.update_parameters(source)
        for (name, got), want in zip(
            ema.averaged().items(), reference.module.parameters(), strict=True
        ):
            assert torch.equal(got, want), f"step {step} {name}"
    assert ema.updates == int(reference.n_averaged) == 6


def test_an_update_reads_nothing_from_the_device() -> None:
    """No host read in an update (AveragedModel makes two: bool(n_averaged == 0) and
    n_averaged > 0), so on CUDA the loop runs ahead of the GPU through it."""
    module = _module()
    ema = DenseEMA(module, decay=0.9)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            ema.update()
    names = {e.name for e in prof.events()}
    assert not names & HOST_READS, names & HOST_READS
    assert "aten::_foreach_lerp_" in names and "aten::_foreach_copy_" in names


def test_a_checkpoint_of_averaged_models_form_loads_and_the_form_is_kept() -> None:
    """The checkpoint entry is AveragedModel's form: ``params`` and a 0-d int64
    ``n_averaged`` tensor; one written by the AveragedModel-based code loads and goes on."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    module = _module()
    source = torch.nn.ParameterList(module.parameters())
    old = AveragedModel(source, multi_avg_fn=get_ema_multi_avg_fn(0.5), use_buffers=False)
    for _ in range(2):
        old.update_parameters(source)
    names = [n for n, _ in module.named_parameters()]
    saved = {
        "params": dict(zip(names, old.module.parameters(), strict=True)),
        "n_averaged": old.n_averaged,
    }
    ema = DenseEMA(module, decay=0.5)
    ema.load_state_dict(saved)
    assert ema.updates == 2
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(2.0)
    ema.update()
    old.update_parameters(source)
    for got, want in zip(ema.averaged().values(), old.module.parameters(), strict=True):
        assert torch.equal(got, want)
    state = ema.state_dict()
    assert list(state) == ["params", "n_averaged"] and list(state["params"]) == names
    count = state["n_averaged"]
    assert count.dtype == torch.int64 and count.dim() == 0 and int(count) == 3


def test_average_parameters_swaps_in_place_and_back_exactly() -> None:
    module = _module()
    ema = DenseEMA(module, decay=0.5)
    ema.update()
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(3.0)
    ema.update()
    trained = {n: p.detach().clone() for n, p in module.named_parameters()}
    storage = {n: p.data_ptr() for n, p in module.named_parameters()}
    averages = {n: a.clone() for n, a in ema.averaged().items()}
    with ema.average_parameters():
        for n, p in module.named_parameters():
            assert torch.equal(p, averages[n]) and p.data_ptr() == storage[n]
    for n, p in module.named_parameters():
        assert torch.equal(p, trained[n]) and torch.equal(ema.averaged()[n], averages[n])


def test_state_round_trips_and_another_model_is_refused() -> None:
    module = _module()
    ema = DenseEMA(module, decay=0.9)
    for _ in range(3):
        ema.update()
    again = DenseEMA(_module(), decay=0.9)
    again.load_state_dict({k: v for k, v in ema.state_dict().items()})
    assert again.updates == 3
    for n, a in again.averaged().items():
        assert torch.equal(a, ema.averaged()[n])
    other = DenseEMA(torch.nn.Linear(3, 1), decay=0.9)
    with pytest.raises(ValueError, match=r"train_config\.dense_optimizer\.ema: the saved average"):
        other.load_state_dict(ema.state_dict())


@pytest.mark.parametrize("decay", [-0.1, 1.5])
def test_a_decay_outside_zero_one_names_the_field(decay: float) -> None:
    with pytest.raises(ValueError, match=r"train_config\.dense_optimizer\.ema\.decay"):
        DenseEMA(_module(), decay)


def test_use_dense_ema_follows_the_ema_unless_set() -> None:
    train = text_format.Parse("dense_optimizer { ema { decay: 0.99 } }", pipeline_pb2.TrainConfig())
    plain = pipeline_pb2.TrainConfig()
    unset, on, off = (
        pipeline_pb2.EvalConfig(),
        pipeline_pb2.EvalConfig(use_dense_ema=True),
        pipeline_pb2.ExportConfig(use_dense_ema=False),
    )
    assert use_dense_ema(None, train) and use_dense_ema(unset, train)
    assert not use_dense_ema(None, plain) and not use_dense_ema(off, train)
    assert use_dense_ema(on, plain)  # asked for: the checkpoint must then hold one
    assert DenseEMA.of_config(_module(), plain) is None


def test_a_tzrec_config_with_dense_ema_parses() -> None:
    text = SEED_CONFIG.read_text().replace(
        "adam_optimizer { lr: 0.001 }", "adam_optimizer { lr: 0.001 }\nema { decay: 0.99 }", 1
    )
    text += "\neval_config { use_dense_ema: true }\nexport_config { use_dense_ema: false }\n"
    config = parse_config(text, "tzrec_ema.config")
    assert config.train_config.dense_optimizer.ema.decay == pytest.approx(0.99)
    assert config.eval_config.use_dense_ema and not config.export_config.use_dense_ema
