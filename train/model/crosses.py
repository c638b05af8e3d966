"""Feature crosses: the second-order terms of a factorization machine, added to the logit.

With ``model_config.multi_tower_din.crosses`` on, the dense part adds, for each pair ``p`` of a
USER feature and an ITEM/CONTEXT feature of the DEEP group (embeddings of equal width)::

    logit += w_p * <e_user, e_item>        # w_p learned, initially 1

The embeddings are the ones the deep tower reads (after the cold-id backoff, when it is on), so
the term is part of :class:`~train.model.dense_arch.DenseArch` and of the exported program, and
needs nothing new from the lookups or the bundle format. ``crosses {}`` takes every USER ×
ITEM/CONTEXT pair of equal width; ``crosses { pairs { user_feature: .. item_feature: .. } }``
names them.

Why: an interaction such as a demographic's taste for a category is one dot product here, where
the tower has to find it among ~250 inputs. Measured on full synthetic data on the H200, one
epoch (``bench/bench_quality.py``, ``bench/results/bench_quality_full_*_s8_h200.json``), with
the two pairs ``cms_group_id`` × ``cate_id`` and ``cms_group_id`` × ``adgroup_id``:

- with the sparse learning rate raised to 0.05, tail AUC 0.6262 against 0.6182 without (overall
  0.7493 against 0.7482); with the user's cold-id backoff on as well, 0.6303 and 0.6280 over two
  seeds (overall 0.7400 and 0.7350);
- at the seed's rate (Adagrad 0.001, where the embeddings barely move in one epoch), nothing:
  0.6108 against 0.6118;
- every user × item pair (``crosses {}``, 63 pairs) at 0.05: tail 0.6192, no better than none.

A pair is a :class:`Cross` of column offsets into ``[user_deep[user_index], item_deep]`` (the
tower's input). :class:`FeatureCrosses` computes all pairs at once: one gather of each side's
columns, a product, and a weighted sum, with shapes fixed by the config (capturable in a CUDA
graph, exportable with dynamic B).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from protos import pipeline_pb2
from shared.config import ConfigError
from shared.dense_inputs import column_starts, dense_layout, embedding_dim
from shared.features import FeatureSet

FIELD = "model_config.multi_tower_din.crosses"


@dataclass(frozen=True)
class Cross:
    """One pair: its features, and where their embeddings sit in the tower's input."""

    user_feature: str
    item_feature: str
    user_column: int  # first column in user_deep (and so in the tower's input)
    item_column: int  # first column in item_deep (the tower's input: + user_deep_dim)
    dim: int

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Cross:
        return cls(
            str(d["user_feature"]),
            str(d["item_feature"]),
            int(d["user_column"]),
            int(d["item_column"]),
            int(d["dim"]),
        )


def crosses_of(fs: FeatureSet, config: pipeline_pb2.FeatureCrosses) -> tuple[Cross, ...]:
    """The pairs ``config`` asks for (all USER × ITEM/CONTEXT pairs of equal width when it
    names none), or ConfigError naming the field."""
    lay = dense_layout(fs)

    def dim(name: str) -> int:
        return embedding_dim(fs, name)

    user, item = column_starts(fs, lay.user_deep), column_starts(fs, lay.item_deep)
    if not config.pairs:
        pairs = [(u, i) for u in user for i in item if dim(u) == dim(i)]
        if not pairs:
            raise ConfigError(
                "<config>", None, FIELD, "no USER and ITEM/CONTEXT features of equal width"
            )
    else:
        pairs = [(p.user_feature, p.item_feature) for p in config.pairs]
    for k, (u, i) in enumerate(pairs):
        field = f"{FIELD}.pairs[{k}]"
        if u not in user:
            raise ConfigError(
                "<config>", None, f"{field}.user_feature",
                f"{u!r} is not a USER feature of the DEEP group (those are {list(user)})",
            )  # fmt: skip
        if i not in item:
            raise ConfigError(
                "<config>", None, f"{field}.item_feature",
                f"{i!r} is not an ITEM or CONTEXT feature of the DEEP group "
                f"(those are {list(item)})",
            )  # fmt: skip
        if dim(u) != dim(i):
            raise ConfigError(
                "<config>", None, field,
                f"{u!r} has embedding_dim {dim(u)} and {i!r} {dim(i)}: a cross needs equal widths",
            )  # fmt: skip
    if len(set(pairs)) != len(pairs):
        raise ConfigError("<config>", None, f"{FIELD}.pairs", "a pair is named twice")
    return tuple(Cross(u, i, user[u], item[i], dim(u)) for u, i in pairs)


class FeatureCrosses(nn.Module):
    """``sum_p w_p * <x[:, user cols of p], x[:, item cols of p]>`` of the tower's input ``x``
    ([B, Du + Di]) → [B]. ``w`` starts at 1; it draws nothing from the global generator."""

    user_columns: torch.Tensor  # [C] int64, C = sum of the pairs' dims
    item_columns: torch.Tensor  # [C] int64
    pair_of_column: torch.Tensor  # [C] int64

    def __init__(self, crosses: Sequence[Cross], user_deep_dim: int) -> None:
        super().__init__()
        if not crosses:
            raise ValueError("FeatureCrosses needs at least one pair")
        user = [c.user_column + j for c in crosses for j in range(c.dim)]
        item = [user_deep_dim + c.item_column + j for c in crosses for j in range(c.dim)]
        pair = [p for p, c in enumerate(crosses) for _ in range(c.dim)]
        self.register_buffer("user_columns", torch.tensor(user, dtype=torch.int64), False)
        self.register_buffer("item_columns", torch.tensor(item, dtype=torch.int64), False)
        self.register_buffer("pair_of_column", torch.tensor(pair, dtype=torch.int64), False)
        self.weight = nn.Parameter(torch.ones(len(crosses)))

    def forward(self, deep_in: torch.Tensor) -> torch.Tensor:
        # deep_in: [B, Du + Di] -> [B]
        products = deep_in[:, self.user_columns] * deep_in[:, self.item_columns]  # [B, C]
        return products @ self.weight[self.pair_of_column]
