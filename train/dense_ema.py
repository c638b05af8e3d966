"""Dense EMA: an exponential moving average of the dense part's parameters, which evaluation and
export can use instead of the last step's values, as TorchEasyRec's.

``train_config.dense_optimizer.ema { decay: 0.999 }`` turns it on; after every optimizer step::

    average = decay * average + (1 - decay) * parameter   # the first step copies

over the parameters of the dense part (the towers, the DIN, the backoff and crosses: what the
dense Adam updates; the embedding tables are not averaged, as tzrec averages no fused table).
``eval_config.use_dense_ema`` and ``export_config.use_dense_ema`` choose the averaged values for
evaluation and for the exported bundle; unset, both follow whether ``ema`` is there
(:func:`use_dense_ema`, tzrec's ``config_util.use_dense_ema``). Checkpoints keep the average,
so a resumed run continues it.

The update is torch's EMA (``tzrec/optim/ema.py`` at alibaba/TorchEasyRec 54cac3165a2a uses
:class:`torch.optim.swa_utils.AveragedModel` with ``get_ema_multi_avg_fn``): the same
``torch._foreach_lerp_(average, parameter, 1 - decay)``, so the same bits, and the same first
step's copy. What differs is how it is issued: ``AveragedModel.update_parameters`` reads its
step count from the device twice a step (``bool(n_averaged == 0)``, ``n_averaged > 0``: a host
sync each, which on CUDA stops the loop from running ahead of the GPU) and groups the tensors
again every step. Here the count lives on the host (the checkpoint still holds it as the
``n_averaged`` tensor, so checkpoints of either form load into the other), and a step is one
fused multi-tensor launch, no read from the device (issue #53).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from protos import pipeline_pb2

FIELD = "train_config.dense_optimizer.ema"


def use_dense_ema(
    config: pipeline_pb2.EvalConfig | pipeline_pb2.ExportConfig | None,
    train_config: pipeline_pb2.TrainConfig,
) -> bool:
    """Whether evaluation (``eval_config``) or export (``export_config``) takes the averaged
    parameters: the config's ``use_dense_ema`` where set, else whether the EMA is on."""
    if config is not None and config.HasField("use_dense_ema"):
        return bool(config.use_dense_ema)
    return train_config.dense_optimizer.HasField("ema")


class DenseEMA:
    """The moving average of ``module``'s parameters (see the module docstring)."""

    def __init__(self, module: nn.Module, decay: float) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"{FIELD}.decay: {decay} is not in [0, 1]")
        named = dict(module.named_parameters())
        self.names = list(named)
        self.decay = decay
        self._weight = 1.0 - decay  # lerp's weight, as get_ema_multi_avg_fn(decay) computes it
        self._source: list[torch.Tensor] = list(named.values())  # the module's own parameters
        with torch.no_grad():  # overwritten by the first update (it copies)
            self._average = [p.detach().clone() for p in self._source]
        self._updates = 0  # on the host: the update reads nothing from the device

    @classmethod
    def of_config(
        cls, module: nn.Module, train_config: pipeline_pb2.TrainConfig
    ) -> DenseEMA | None:
        """The EMA ``train_config`` asks for, None without ``dense_optimizer.ema``."""
        dense = train_config.dense_optimizer
        return cls(module, dense.ema.decay) if dense.HasField("ema") else None

    @property
    def updates(self) -> int:
        """Optimizer steps in the average."""
        return self._updates

    def update(self) -> None:
        """Take the parameters' current values into the average (after an optimizer step): a
        copy at the first, then ``average += (1 - decay) * (parameter - average)`` for every
        parameter in one fused launch (CUDA), with no host sync."""
        if not self._average:
            self._updates += 1
            return
        with torch.no_grad():
            if self._updates == 0:
                torch._foreach_copy_(self._average, self._source)
            else:
                torch._foreach_lerp_(self._average, self._source, self._weight)
        self._updates += 1

    def averaged(self) -> dict[str, torch.Tensor]:
        """Parameter name → its average (the tensors themselves)."""
        return dict(zip(self.names, self._average, strict=True))

    def state_dict(self) -> dict[str, Any]:
        """``params`` (name → average) and ``n_averaged`` (a 0-d int64 tensor on the
        parameters' device): the form ``AveragedModel`` gave, which checkpoints keep."""
        device = self._average[0].device if self._average else torch.device("cpu")
        count = torch.tensor(self._updates, dtype=torch.int64, device=device)
        return {"params": self.averaged(), "n_averaged": count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        params = state["params"]
        if list(params) != self.names:
            raise ValueError(
                f"{FIELD}: the saved average has the parameters {sorted(params)}, this model "
                f"{sorted(self.names)}; it was saved by another model config"
            )
        with torch.no_grad():
            for name, average in self.averaged().items():
                average.copy_(params[name])
        self._updates = int(state["n_averaged"])  # a tensor (or an int): read once, at load

    @contextmanager
    def average_parameters(self) -> Iterator[None]:
        """The averages in the module's parameters, in place (captured CUDA graphs stay
        valid), and the trained values back on exit."""
        with torch.no_grad():
            for source, average in zip(self._source, self._average, strict=True):
                _swap(source, average)
        try:
            yield
        finally:
            with torch.no_grad():
                for source, average in zip(self._source, self._average, strict=True):
                    _swap(source, average)


def _swap(a: torch.Tensor, b: torch.Tensor) -> None:
    kept = a.detach().clone()
    a.copy_(b)
    b.copy_(kept)
