"""Dense EMA: an exponential moving average of the dense part's parameters, which evaluation and
export can use instead of the last step's values, as TorchEasyRec's.

``train_config.dense_optimizer.ema { decay: 0.999 }`` turns it on; after every optimizer step::

    average = decay * average + (1 - decay) * parameter   # the first step copies

over the parameters of the dense part (the towers, the DIN, the backoff and crosses: what the
dense Adam updates; the embedding tables are not averaged, as tzrec averages no fused table).
``eval_config.use_dense_ema`` and ``export_config.use_dense_ema`` choose the averaged values for
evaluation and for the exported bundle; unset, both follow whether ``ema`` is there
(:func:`use_dense_ema`, tzrec's ``config_util.use_dense_ema``). Checkpoints keep the average,
so a resumed run continues it. The average is torch's own
(:class:`torch.optim.swa_utils.AveragedModel` with ``get_ema_multi_avg_fn``), as in
``tzrec/optim/ema.py`` at alibaba/TorchEasyRec 54cac3165a2a.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

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
        self._source = nn.ParameterList(named.values())  # the module's own parameters
        self._average = AveragedModel(
            self._source, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=False
        )
        self._average.requires_grad_(False)

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
        return int(self._average.n_averaged)

    def update(self) -> None:
        """Take the parameters' current values into the average (after an optimizer step)."""
        self._average.update_parameters(self._source)

    def averaged(self) -> dict[str, torch.Tensor]:
        """Parameter name → its average (the tensors themselves)."""
        return dict(zip(self.names, self._average.module.parameters(), strict=True))

    def state_dict(self) -> dict[str, Any]:
        return {"params": self.averaged(), "n_averaged": self._average.n_averaged}

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
            self._average.n_averaged.copy_(state["n_averaged"])

    @contextmanager
    def average_parameters(self) -> Iterator[None]:
        """The averages in the module's parameters, in place (captured CUDA graphs stay
        valid), and the trained values back on exit."""
        with torch.no_grad():
            for source, average in zip(self._source, self.averaged().values(), strict=True):
                _swap(source, average)
        try:
            yield
        finally:
            with torch.no_grad():
                for source, average in zip(self._source, self.averaged().values(), strict=True):
                    _swap(source, average)


def _swap(a: torch.Tensor, b: torch.Tensor) -> None:
    kept = a.detach().clone()
    a.copy_(b)
    b.copy_(kept)
