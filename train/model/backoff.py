"""Backoff for cold ids: a dynamic feature whose key has no row takes a projection of its row's
side features instead of the table's CONSTANT 0.

A *cold* feature of a row (:func:`shared.dense_inputs.cold_rows`): a dynamic (hash-table)
feature whose ids all have no row in the table: not admitted yet, evicted or refused in
training, absent from the bundle when serving. The lookups give it the table's admission or
eval initializer (zeros; a refused key in training gets its random initial value, which no
eval lookup sees). With ``model_config.multi_tower_din.cold_backoff`` on, the dense part
replaces the embedding of a feature that backs off, wherever it sits in the dense inputs, by::

    backoff_f = s_f * tanh(W_f · side_f + b_f)   # side_f: the row's side features, cold ones 0

one learned map per feature (``b_f`` alone gives its "unknown" vector when it has no side
features). The tanh and the learned per-column scale ``s_f`` (initially 1/sqrt(dim), tzrec's
embedding init bound) keep the backoff on the scale of the embeddings it stands in for. Side
features that are themselves cold count as zeros, so a refused key's random training value
never leaks into a projection.

Which features back off (:func:`backoff_spaces`):

- every dynamic USER feature, from the other USER features of the DEEP group (``user_id`` →
  the profile);
- an ITEM or sequence feature only when ``cold_backoff { sources { feature_name: ..
  side_features: .. } }`` names it. Its side features are those of the same row and side: the
  other ITEM features of the DEEP group (``adgroup_id`` → ``cate_id``, ``campaign_id``,
  ``customer``, ``brand``, ``price``), or the other sub-features of the same sequence element.
  The same ``sources`` entry overrides a user feature's side features.

Why items are opt-in: it was measured on small data with the table capacities scaled to the
full data's pressure (CPU, ``bench/bench_quality.py``, off: AUC 0.6839).

- Backing off the item ids in the deep tower's input gave AUC 0.652.
- Backing them off only in the DIN query gave 0.680; the sequence elements, 0.680.
- The user backoff alone gave 0.6846, 0.6836 and 0.6823 over three seeds, against 0.6839,
  0.6776 and 0.6810 off.

On full data on the H200, every feature backing off gave AUC 0.674 against 0.707. At a sparse
rate where the item embeddings learn (medium data, CPU, Adagrad lr 0.05 with two crosses, two
seeds), ``adgroup_id`` backing off too gave 0.697 and 0.699 against 0.723 and 0.723 with the
user backoff alone (``bench/results/bench_quality_medium_slr0.05_crosses_*_backoff_s16_cpu.json``).

Gradients reach ``W``, ``b`` and the side features' embeddings; the cold key gets none (it has
no row), as without the backoff. Eval mode changes nothing here: the lookups insert nothing.
``cold_backoff { id_dropout: p }`` also treats a share p of the warm keys of the features that
back off as cold in training, so that the maps learn on warm ids too
(:mod:`train.model.id_dropout`, applied to the hit flags by the sparse arch; this module only
sees the masks).

The backoff is part of :class:`~train.model.dense_arch.DenseArch`, hence of the exported
program. In bundle format 4 the masks are its ``user_cold``, ``item_cold`` and ``seq_cold``
inputs, one column per dynamic feature whether or not it backs off, which the serving lookups
fill on the device. The maps start at zero (``W = 0``, ``b = 0``, so ``backoff = 0``: the first
step scores as without the backoff). They are made without drawing from the global generator,
so every other seeded initial value is unchanged.

One row space (user rows, candidate rows, sequence elements) is one :class:`SpaceBackoff`:
one masked ``linear`` for the features of it that back off, then one ``where`` per input that
holds them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from protos import pipeline_pb2
from shared.config import ConfigError
from shared.dense_inputs import (
    COLD_NAMES,
    DenseLayout,
    cold_layout,
    column_starts,
    dense_layout,
    embedding_dim,
)
from shared.features import FeatureSet, Side

FIELD = "model_config.multi_tower_din.cold_backoff"

# (row space, the input holding its side features, the inputs where its features may sit)
SPACES = (
    ("user", "user_deep", ("user_deep",)),
    ("item", "item_deep", ("item_deep", "query")),
    ("sequence", "seq_values", ("seq_values",)),
)


@dataclass(frozen=True)
class FeatureBackoff:
    """One cold feature: its width, its side features' columns and where it sits."""

    name: str
    dim: int
    mask_column: int  # its column in the space's cold mask (shared.dense_inputs.cold_layout)
    sources: tuple[str, ...]  # side features, in the source input's order
    source_columns: tuple[tuple[int, int], ...]  # (start, width) of each in the source input
    columns: tuple[tuple[str, int], ...]  # (input name, start column) of each place it sits


@dataclass(frozen=True)
class SpaceBackoff:
    """The features of one row space that back off (of the ``mask_width`` columns of its mask
    input, one per dynamic feature: :func:`shared.dense_inputs.cold_layout`)."""

    space: str  # "user", "item" or "sequence"
    mask: str  # its cold-mask input (shared.dense_inputs.COLD_NAMES)
    mask_width: int  # its columns, whether or not their features back off
    source: str  # the input holding the side features (user_deep, item_deep, seq_values)
    widths: tuple[tuple[str, int], ...]  # (input name, width) of the source and every target
    features: tuple[FeatureBackoff, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "space": self.space,
            "mask": self.mask,
            "source": self.source,
            "mask_width": self.mask_width,
            "widths": [list(w) for w in self.widths],
            "features": [
                {
                    "name": f.name,
                    "dim": f.dim,
                    "mask_column": f.mask_column,
                    "sources": list(f.sources),
                    "source_columns": [list(c) for c in f.source_columns],
                    "columns": [list(c) for c in f.columns],
                }
                for f in self.features
            ],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpaceBackoff:
        return cls(
            str(d["space"]),
            str(d["mask"]),
            int(d["mask_width"]),
            str(d["source"]),
            tuple((str(n), int(w)) for n, w in d["widths"]),
            tuple(
                FeatureBackoff(
                    str(f["name"]),
                    int(f["dim"]),
                    int(f["mask_column"]),
                    tuple(f["sources"]),
                    tuple((int(a), int(b)) for a, b in f["source_columns"]),
                    tuple((str(n), int(c)) for n, c in f["columns"]),
                )
                for f in d["features"]
            ),
        )


def backoff_spaces(fs: FeatureSet, config: pipeline_pb2.ColdBackoff) -> tuple[SpaceBackoff, ...]:
    """The backoff of every cold feature of ``fs`` (see the module docstring), with the side
    features of ``config.sources`` where given; ConfigError naming the field otherwise."""
    lay = dense_layout(fs)
    cold = cold_layout(fs, lay)

    def dim(name: str) -> int:
        return embedding_dim(fs, name)

    inputs = {"user_deep": lay.user_deep, "item_deep": lay.item_deep}
    inputs |= {"query": lay.query, "seq_values": lay.sequence}
    column = {name: column_starts(fs, names) for name, names in inputs.items()}
    width = {name: sum(dim(n) for n in names) for name, names in inputs.items()}
    members = {"user": cold.user, "item": cold.item, "sequence": cold.sequence}
    side_of = _side_features(fs, lay)
    overrides = _overrides(config, members, side_of)
    spaces = []
    for (space, source, targets), mask in zip(SPACES, COLD_NAMES, strict=True):
        feats = []
        for i, f in enumerate(members[space]):
            if space != "user" and f not in overrides:
                continue  # item and sequence features back off only when named (module doc)
            sources = overrides.get(f, tuple(n for n in side_of[space] if n != f))
            feats.append(
                FeatureBackoff(
                    f,
                    dim(f),
                    i,
                    sources,
                    tuple((column[source][n], dim(n)) for n in sources),
                    tuple((t, column[t][f]) for t in targets if f in column[t]),
                )
            )
        if members[space]:  # its mask is an input of the program, backed off or not
            widths = tuple((t, width[t]) for t in (source, *targets[1:]))
            spaces.append(
                SpaceBackoff(space, mask, len(members[space]), source, widths, tuple(feats))
            )
    return tuple(spaces)


def _side_features(fs: FeatureSet, lay: DenseLayout) -> dict[str, tuple[str, ...]]:
    """Row space → the features that may back a feature of it (the feature itself excluded
    by the caller)."""
    return {
        "user": lay.user_deep,
        "item": tuple(n for n in lay.item_deep if fs.features[n].side is Side.ITEM),
        "sequence": lay.sequence,
    }


def backoff_sides(fs: FeatureSet, feature: str) -> tuple[str, ...]:
    """The side features ``feature`` (a dynamic feature of the dense inputs) may back off to:
    the derived ones, what a ``sources`` entry naming all of them gives."""
    lay = dense_layout(fs)
    cold = cold_layout(fs, lay)
    members = {"user": cold.user, "item": cold.item, "sequence": cold.sequence}
    space = next((sp for sp, names in members.items() if feature in names), None)
    if space is None:
        raise ValueError(f"{feature!r} is not a dynamic feature of the dense inputs")
    return tuple(n for n in _side_features(fs, lay)[space] if n != feature)


def _overrides(
    config: pipeline_pb2.ColdBackoff,
    members: Mapping[str, Sequence[str]],
    side_of: Mapping[str, Sequence[str]],
) -> dict[str, tuple[str, ...]]:
    """Feature → side features from ``config.sources``, checked against the feature set."""
    space_of = {f: space for space, names in members.items() for f in names}
    out: dict[str, tuple[str, ...]] = {}
    for i, entry in enumerate(config.sources):
        where = f"{FIELD}.sources[{i}]"
        f = entry.feature_name
        if f not in space_of:
            raise ConfigError(
                "<config>", None, f"{where}.feature_name",
                f"{f!r} is not a dynamic feature of the dense inputs; the features that back "
                f"off are {', '.join(space_of) or 'none'}",
            )  # fmt: skip
        if f in out:
            raise ConfigError(
                "<config>", None, f"{where}.feature_name", f"{f!r} has sources twice; keep one"
            )
        allowed = [n for n in side_of[space_of[f]] if n != f]
        bad = [n for n in entry.side_features if n not in allowed]
        if bad or len(set(entry.side_features)) != len(entry.side_features):
            raise ConfigError(
                "<config>", None, f"{where}.side_features",
                f"{bad or list(entry.side_features)} for {f!r}: side features must be distinct "
                f"features of the same row and side, one of {allowed}",
            )  # fmt: skip
        chosen = set(entry.side_features)
        out[f] = tuple(n for n in side_of[space_of[f]] if n in chosen)  # the input's order
    return out


class _Space(nn.Module):
    """One :class:`SpaceBackoff` as ops: a masked linear map and index tables (buffers not in
    the state_dict: they follow from the config)."""

    allowed: torch.Tensor  # [Σdim, W] 1 where a feature's output may read a source column

    def __init__(self, spec: SpaceBackoff) -> None:
        super().__init__()
        self.spec = spec
        widths = dict(spec.widths)
        source_width = widths[spec.source]
        out = sum(f.dim for f in spec.features)
        k = spec.mask_width
        # zeros, drawn from no generator (module docstring)
        self.weight = nn.Parameter(torch.zeros(out, source_width))  # [Σdim, W]
        self.bias = nn.Parameter(torch.zeros(out))  # [Σdim]
        scale = torch.cat([torch.full((f.dim,), f.dim**-0.5) for f in spec.features])
        self.scale = nn.Parameter(scale)  # [Σdim] the output's scale, learned
        allowed = torch.zeros(out, source_width)
        feature_at = {t: torch.full((w,), k, dtype=torch.int64) for t, w in spec.widths}
        output_at = {t: torch.full((w,), out, dtype=torch.int64) for t, w in spec.widths}
        row = 0
        for f in spec.features:
            for start, w in f.source_columns:
                allowed[row : row + f.dim, start : start + w] = 1.0
            for t, start in f.columns:
                feature_at[t][start : start + f.dim] = f.mask_column
                output_at[t][start : start + f.dim] = torch.arange(row, row + f.dim)
            row += f.dim
        self.register_buffer("allowed", allowed, persistent=False)
        self.targets = tuple(t for t, _ in spec.widths if (output_at[t] < out).any())
        for name, _ in spec.widths:
            self.register_buffer(f"feature_at_{name}", feature_at[name], persistent=False)
            self.register_buffer(f"output_at_{name}", output_at[name], persistent=False)

    def forward(self, inputs: dict[str, torch.Tensor], cold: torch.Tensor) -> None:
        # inputs: name → [R, W_t] (replaced in the dict); cold: [R, K] bool
        spec = self.spec
        flags = torch.nn.functional.pad(cold, (0, 1))  # [R, K + 1]: column K never cold
        x = inputs[spec.source]  # [R, W]
        x_cold = flags.index_select(1, getattr(self, f"feature_at_{spec.source}"))  # [R, W]
        side = torch.where(x_cold, torch.zeros_like(x), x)  # cold features count as zeros
        back = torch.nn.functional.linear(side, self.weight * self.allowed, self.bias)
        back = torch.tanh(back) * self.scale  # [R, Σdim] on the embeddings' scale
        back = torch.nn.functional.pad(back, (0, 1))  # [R, Σdim + 1]
        for t in self.targets:
            at_cold = flags.index_select(1, getattr(self, f"feature_at_{t}"))  # [R, W_t]
            value = back.index_select(1, getattr(self, f"output_at_{t}")).to(inputs[t].dtype)
            inputs[t] = torch.where(at_cold, value, inputs[t])  # [R, W_t]


class ColdBackoff(nn.Module):
    """The backoff of every row space (see the module docstring)::

    backoff = ColdBackoff(backoff_spaces(fs, config.model_config.multi_tower_din.cold_backoff))
    inputs = backoff(inputs)      # dense inputs with COLD_NAMES → the same, cold rows replaced
    """

    def __init__(self, spaces: Sequence[SpaceBackoff]) -> None:
        super().__init__()
        self.spaces = tuple(spaces)
        self.by_space = nn.ModuleDict({s.space: _Space(s) for s in self.spaces if s.features})

    def why_not(self, masks: Mapping[str, torch.Tensor]) -> str | None:
        """What is wrong with the cold masks of ``masks`` (a host check of dtypes and widths,
        no sync), None when each space's is bool [rows, its width]."""
        for spec in self.spaces:
            cold = masks.get(spec.mask)
            width = spec.mask_width
            if cold is None:
                return f"{spec.mask} is missing (pass every one of {list(COLD_NAMES)})"
            if cold.dim() != 2 or cold.shape[1] != width or cold.dtype != torch.bool:
                return (
                    f"{spec.mask} must be bool [rows, {width}] (one column per dynamic feature: "
                    f"shared.dense_inputs.cold_layout), got {cold.dtype} {list(cold.shape)}"
                )
        return None

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        wrong = self.why_not(inputs)
        if wrong is not None:
            raise ValueError(wrong)
        out = dict(inputs)
        for spec in self.spaces:
            if spec.features:
                self.by_space[spec.space](out, inputs[spec.mask])
        return out
