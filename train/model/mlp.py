"""The MLP of the pipeline config's ``MLP`` message: Linear → [BatchNorm] → ReLU → [Dropout] per layer.

The layer order follows tzrec's ``Perceptron`` so a config means the same thing here. Only ReLU is
implemented; any other ``activation`` is an error rather than a silent substitution. Example::

    cfg = MLPConfig.from_proto(model_config.multi_tower_din.towers[0].mlp, "towers[0].mlp")
    mlp = MLP(in_features=256, config=cfg)       # [..., 256] -> [..., cfg.hidden_units[-1]]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from protos import pipeline_pb2
from shared.config import ConfigError

SUPPORTED_ACTIVATIONS = ("nn.ReLU",)


@dataclass(frozen=True)
class MLPConfig:
    """Typed form of the ``MLP`` message.

    ``dropout_ratio`` is empty (no dropout), one ratio for every layer, or one per layer.
    """

    hidden_units: tuple[int, ...]
    dropout_ratio: tuple[float, ...] = ()
    use_bn: bool = False

    def __post_init__(self) -> None:
        if not self.hidden_units or any(u < 1 for u in self.hidden_units):
            raise ValueError(
                f"hidden_units must be a non-empty list of positive sizes, got {list(self.hidden_units)}"
            )
        if len(self.dropout_ratio) not in (0, 1, len(self.hidden_units)):
            raise ValueError(
                f"dropout_ratio has {len(self.dropout_ratio)} entries for {len(self.hidden_units)} "
                "hidden layers; give none, one for all layers, or one per layer"
            )
        bad = [r for r in self.dropout_ratio if not 0.0 <= r < 1.0]
        if bad:
            raise ValueError(f"dropout_ratio values must be in [0, 1), got {bad}")

    @property
    def out_features(self) -> int:
        return self.hidden_units[-1]

    def dropout_of(self, layer: int) -> float:
        if not self.dropout_ratio:
            return 0.0
        return self.dropout_ratio[0] if len(self.dropout_ratio) == 1 else self.dropout_ratio[layer]

    @classmethod
    def of(cls, spec: MLPConfig | Sequence[int]) -> MLPConfig:
        """Accept either a config or plain hidden units (no dropout, no batch norm)."""
        return spec if isinstance(spec, MLPConfig) else cls(tuple(int(u) for u in spec))

    @classmethod
    def from_proto(cls, msg: pipeline_pb2.MLP, field: str) -> MLPConfig:
        """Parse and validate; ``field`` is the config path used in error messages."""
        if msg.activation not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(
                "<config>",
                None,
                f"{field}.activation",
                f"{msg.activation!r} is not supported; use one of {list(SUPPORTED_ACTIVATIONS)} "
                "(or omit the field)",
            )
        try:
            return cls(tuple(msg.hidden_units), tuple(msg.dropout_ratio), bool(msg.use_bn))
        except ValueError as err:
            raise ConfigError("<config>", None, field, str(err)) from None


class _BatchNormLastDim(nn.BatchNorm1d):
    """BatchNorm1d over the last dim of a tensor of any rank (statistics over all leading dims)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., C]
        flat = x.reshape(-1, x.shape[-1])  # [N, C]
        return super().forward(flat).reshape(x.shape)  # [..., C]


class MLP(nn.Module):
    """Stack of Linear → [BatchNorm] → ReLU → [Dropout]; works on inputs of any rank ``[..., in]``.

    Note: with ``use_bn`` the statistics are taken over every row given, so a padded input
    (tzrec's DIN) and a jagged input (ours) normalise over different rows in training mode.
    """

    def __init__(self, in_features: int, config: MLPConfig | Sequence[int]) -> None:
        super().__init__()
        self.config = MLPConfig.of(config)
        self.in_features = in_features
        layers: list[nn.Module] = []
        width = in_features
        for i, units in enumerate(self.config.hidden_units):
            layers.append(nn.Linear(width, units))
            if self.config.use_bn:
                layers.append(_BatchNormLastDim(units))
            layers.append(nn.ReLU())
            if self.config.dropout_of(i) > 0:
                layers.append(nn.Dropout(self.config.dropout_of(i)))
            width = units
        self.layers = nn.Sequential(*layers)

    @property
    def out_features(self) -> int:
        return self.config.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features]
        return self.layers(x)  # [..., out_features]
