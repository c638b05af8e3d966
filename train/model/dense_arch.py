"""The dense part of MultiTowerDIN: everything after the embedding lookups; exported for serving.

Inputs are the looked-up embeddings, split by whom they belong to so that a user's part is given
once for all of its candidate rows (user tiling; in training U == B and user_index = arange(B))::

    user_deep   [U, Du]   concat of pooled DEEP-group USER-side embeddings (FeatureSet order)
    item_deep   [B, Di]   concat of pooled DEEP-group ITEM/CONTEXT-side embeddings (FeatureSet order)
    query       [B, Dq]   concat of the SEQUENCE group's query embeddings (group order)
    seq_values  [T, Dq]   concat of the sequence sub-feature embeddings (group order), jagged
    seq_lengths [U] int64 elements per user (sum = T)
    user_index  [B] int64 user row of each candidate row
    pair_segment [N] int64 candidate row of each (candidate, element) pair   (optional, both
    pair_element [N] int64 its row in seq_values                              or neither)
    -> logits   [B]

Training may pass ``user_index=None`` to the module (not to the exported program) to say that
every candidate row is its own user (U == B, ``user_index = arange(B)``): the same function,
computed without the DIN's host sync and pair expansion (:meth:`JaggedDIN.forward_own_users`).
Given the pairs (:func:`shared.dense_inputs.pair_index` of seq_lengths and user_index, which
the serving host computes), the module has no host sync and no data-dependent shape either.

:func:`shared.dense_inputs.dense_layout` says which features go where and their widths, and
:func:`shared.dense_inputs.assemble_dense_inputs` builds these inputs from looked-up embeddings.
:func:`export_dense_arch` turns the module into a ``torch.export`` program with dynamic U, B, T
and N (pure torch ops, so it loads without fbgemm), called with the inputs as keywords;
its example says whether it takes the pairs (``example_inputs(arch, pairs=True)``:
:data:`~shared.dense_inputs.PAIR_INPUT_NAMES`, bundle format 3, capturable in a CUDA graph) or
has the six inputs of format 1 and 2 programs (the default; the DIN then reads the pair count
back inside the program)::

    program = load_dense_program(bundle_dir, device="cuda").module()
    logits = program(**inputs)                                   # [B]

:func:`save_dense_program` / :func:`load_dense_program` store it as ``dense.pt2``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.export import Dim, ExportedProgram

from protos import pipeline_pb2
from shared.config import ConfigError
from shared.dense_inputs import (
    COLD_INPUT_NAMES,
    COLD_NAMES,
    INPUT_NAMES,
    PAIR_INPUT_NAMES,
    Signature,
    dense_layout,
    pair_index,
    signature_of,
)
from shared.features import FeatureSet, GroupType
from train.model.backoff import ColdBackoff, SpaceBackoff, backoff_spaces
from train.model.crosses import Cross, FeatureCrosses, crosses_of
from train.model.din import JaggedDIN
from train.model.mlp import MLP, MLPConfig

DENSE_PROGRAM_FILE = "dense.pt2"
FIELD_HINT = "model_config.multi_tower_din.cold_backoff turns it on"


# --------------------------------------------------------------------------- module


@dataclass(frozen=True)
class DenseArchConfig:
    """Everything needed to rebuild a :class:`DenseArch` (stored with checkpoints and bundles)."""

    user_deep_dim: int
    item_deep_dim: int
    seq_dim: int
    tower: MLPConfig
    attn: MLPConfig
    final: MLPConfig | None  # None: the output Linear reads concat(tower, din) directly
    backoff: tuple[SpaceBackoff, ...] = ()  # cold-id backoff (train.model.backoff); () off
    crosses: tuple[Cross, ...] = ()  # feature crosses (train.model.crosses); () off
    item_tower: MLPConfig | None = None  # the item-only tower's MLP (model_config); None off

    def to_dict(self) -> dict[str, object]:
        def mlp(c: MLPConfig | None) -> dict[str, object] | None:
            if c is None:
                return None
            return {
                "hidden_units": list(c.hidden_units),
                "dropout_ratio": list(c.dropout_ratio),
                "use_bn": c.use_bn,
            }

        return {
            "user_deep_dim": self.user_deep_dim,
            "item_deep_dim": self.item_deep_dim,
            "seq_dim": self.seq_dim,
            "tower": mlp(self.tower),
            "attn": mlp(self.attn),
            "final": mlp(self.final),
            "backoff": [s.to_dict() for s in self.backoff],
            "crosses": [c.to_dict() for c in self.crosses],
            "item_tower": mlp(self.item_tower),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DenseArchConfig:
        def mlp(v: Mapping[str, Any]) -> MLPConfig:
            return MLPConfig(
                tuple(v["hidden_units"]), tuple(v.get("dropout_ratio", ())), bool(v.get("use_bn"))
            )

        final, item_tower = d.get("final"), d.get("item_tower")
        return cls(
            int(d["user_deep_dim"]),
            int(d["item_deep_dim"]),
            int(d["seq_dim"]),
            mlp(d["tower"]),
            mlp(d["attn"]),
            None if final is None else mlp(final),
            tuple(SpaceBackoff.from_dict(s) for s in d.get("backoff", ())),
            tuple(Cross.from_dict(c) for c in d.get("crosses", ())),
            None if item_tower is None else mlp(item_tower),
        )


class DenseArch(nn.Module):
    """Deep tower + jagged DIN tower + final MLP → one logit per candidate row.

    Example::

        arch = DenseArch(144, 112, 48, [512, 256, 128], [256, 64], [64])
        logits = arch(user_deep, item_deep, query, seq_values, seq_lengths, user_index)  # [B]
    """

    def __init__(
        self,
        user_deep_dim: int,
        item_deep_dim: int,
        seq_dim: int,
        tower_units: MLPConfig | Sequence[int],
        attn_units: MLPConfig | Sequence[int],
        final_units: MLPConfig | Sequence[int] | None,
        backoff: Sequence[SpaceBackoff] = (),
        crosses: Sequence[Cross] = (),
        item_tower_units: MLPConfig | Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        final = MLPConfig.of(final_units) if final_units else None
        item_tower = MLPConfig.of(item_tower_units) if item_tower_units else None
        self.config = DenseArchConfig(
            user_deep_dim,
            item_deep_dim,
            seq_dim,
            MLPConfig.of(tower_units),
            MLPConfig.of(attn_units),
            final,
            tuple(backoff),
            tuple(crosses),
            item_tower,
        )
        self.tower = MLP(user_deep_dim + item_deep_dim, self.config.tower)
        self.din = JaggedDIN(seq_dim, self.config.attn)
        width = self.tower.out_features + self.din.out_features
        self.final = MLP(width, final) if final is not None else nn.Identity()
        self.output = nn.Linear(final.out_features if final is not None else width, 1)
        # last, and drawing nothing: the layers above keep their seeded initial values
        self.backoff = ColdBackoff(backoff) if backoff else None
        self.crosses = FeatureCrosses(crosses, user_deep_dim) if crosses else None
        # after every other layer, so those keep their seeded initial values; its output layer
        # starts at zero, so the model starts as the one without it
        self.item_tower = ItemTower(item_deep_dim, item_tower) if item_tower else None

    @property
    def takes_cold(self) -> bool:
        """Whether the module backs off cold ids (and so takes :data:`COLD_NAMES`)."""
        return self.backoff is not None

    @classmethod
    def from_arch_config(cls, config: DenseArchConfig) -> DenseArch:
        return cls(
            config.user_deep_dim,
            config.item_deep_dim,
            config.seq_dim,
            config.tower,
            config.attn,
            config.final,
            config.backoff,
            config.crosses,
            config.item_tower,
        )

    @classmethod
    def from_config(
        cls, feature_set: FeatureSet, model_config: pipeline_pb2.ModelConfig
    ) -> DenseArch:
        """Build from the ``multi_tower_din`` block: one DEEP tower, one DIN tower, optional final."""
        path = "model_config.multi_tower_din"

        def check(field: str, ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError("<config>", None, field, message)

        check(
            "model_config",
            model_config.WhichOneof("model") == "multi_tower_din",
            "expected a multi_tower_din model",
        )
        check(
            "model_config.num_class",
            model_config.num_class == 1,
            f"only binary CTR (num_class 1) is supported, got {model_config.num_class}",
        )
        mtd = model_config.multi_tower_din
        deep = feature_set.group(GroupType.DEEP).name
        seq = feature_set.group(GroupType.SEQUENCE).name
        towers = [t.input for t in mtd.towers]
        din_towers = [t.input for t in mtd.din_towers]
        check(
            f"{path}.towers",
            towers == [deep],
            f"need exactly one tower with input {deep!r} (the DEEP group), got {towers}",
        )
        check(
            f"{path}.din_towers",
            din_towers == [seq],
            f"need exactly one din_tower with input {seq!r} (the SEQUENCE group), got {din_towers}",
        )
        layout = dense_layout(feature_set)
        final = MLPConfig.from_proto(mtd.final, f"{path}.final") if mtd.HasField("final") else None
        item_tower = (
            MLPConfig.from_proto(mtd.item_tower, f"{path}.item_tower")
            if mtd.HasField("item_tower")
            else None
        )
        return cls(
            layout.user_deep_dim,
            layout.item_deep_dim,
            layout.seq_dim,
            MLPConfig.from_proto(mtd.towers[0].mlp, f"{path}.towers[0].mlp"),
            MLPConfig.from_proto(mtd.din_towers[0].attn_mlp, f"{path}.din_towers[0].attn_mlp"),
            final,
            backoff_spaces(feature_set, mtd.cold_backoff) if mtd.HasField("cold_backoff") else (),
            crosses_of(feature_set, mtd.crosses) if mtd.HasField("crosses") else (),
            item_tower,
        )

    def forward(
        self,
        user_deep: torch.Tensor,
        item_deep: torch.Tensor,
        query: torch.Tensor,
        seq_values: torch.Tensor,
        seq_lengths: torch.Tensor,
        user_index: torch.Tensor | None,
        pair_segment: torch.Tensor | None = None,
        pair_element: torch.Tensor | None = None,
        user_cold: torch.Tensor | None = None,
        item_cold: torch.Tensor | None = None,
        seq_cold: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # user_deep: [U, Du]; item_deep: [B, Di]; query: [B, Dq]; seq_values: [T, Dq]
        # seq_lengths: [U] int64; user_index: [B] int64, or None for arange(B) (training,
        # U == B: the DIN's fast path, no host sync; see JaggedDIN.forward_own_users)
        # pair_segment, pair_element: [N] int64, both or neither (see the module docstring)
        # user_cold [U, Ku], item_cold [B, Ki], seq_cold [T, Ks] bool: with a backoff only
        embedded = self.back_off(
            dict(user_deep=user_deep, item_deep=item_deep, query=query, seq_values=seq_values),
            dict(user_cold=user_cold, item_cold=item_cold, seq_cold=seq_cold),
        )
        return self.score(
            embedded["user_deep"],
            embedded["item_deep"],
            embedded["query"],
            embedded["seq_values"],
            seq_lengths,
            user_index,
            pair_segment,
            pair_element,
        )

    def back_off(
        self, embedded: dict[str, torch.Tensor], cold: Mapping[str, torch.Tensor | None]
    ) -> dict[str, torch.Tensor]:
        """``embedded`` (user_deep, item_deep, query, seq_values) with the cold rows' features
        replaced by their backoff (:mod:`train.model.backoff`); as given without a backoff."""
        given = [n for n, m in cold.items() if m is not None]
        if self.backoff is None:
            if given:
                raise ValueError(
                    f"{given} given, but this model has no cold-id backoff "
                    f"({FIELD_HINT}); pass no cold masks"
                )
            return embedded
        if len(given) != len(COLD_NAMES):
            raise ValueError(
                f"this model backs off cold ids: pass all of {list(COLD_NAMES)} "
                "(shared.dense_inputs.assemble_dense_inputs(..., cold=...)), got "
                f"{given or 'none'}"
            )
        return self.backoff({**embedded, **cast(Mapping[str, torch.Tensor], cold)})

    def score(
        self,
        user_deep: torch.Tensor,
        item_deep: torch.Tensor,
        query: torch.Tensor,
        seq_values: torch.Tensor,
        seq_lengths: torch.Tensor,
        user_index: torch.Tensor | None,
        pair_segment: torch.Tensor | None = None,
        pair_element: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The logits [B] of embeddings already backed off (:meth:`back_off`): towers, DIN,
        final MLP, and the item-only tower (:class:`ItemTower`) and feature crosses
        (:mod:`train.model.crosses`) when on. Same inputs as :meth:`forward` without the cold
        masks."""
        if (pair_segment is None) != (pair_element is None):
            raise ValueError(
                "pass both pair_segment and pair_element (shared.dense_inputs.pair_index) or "
                "neither"
            )
        pairs = (
            None if pair_segment is None or pair_element is None else (pair_segment, pair_element)
        )
        if user_index is None:
            if user_deep.shape[0] != item_deep.shape[0]:
                raise ValueError(
                    f"user_index=None means one user per candidate row, but there are "
                    f"{user_deep.shape[0]} user rows for {item_deep.shape[0]} candidate rows"
                )
            deep_in = torch.cat([user_deep, item_deep], dim=1)  # [B, Du + Di]
        else:
            deep_in = torch.cat([user_deep[user_index], item_deep], dim=1)  # [B, Du + Di]
        deep = self.tower(deep_in)  # [B, tower_out]
        din = self.din(query, seq_values, seq_lengths, user_index, pairs)  # [B, Dq]
        h = self.final(torch.cat([deep, din], dim=1))  # [B, final_out]
        logits = self.output(h).squeeze(1)  # [B]
        if self.item_tower is not None:
            logits = logits + self.item_tower(item_deep)
        return logits if self.crosses is None else logits + self.crosses(deep_in)


class ItemTower(nn.Module):
    """A logit term from the item side alone: ``MLP(item_deep) -> Linear(., 1)``, the Linear's
    weight and bias from zero (the model starts as the one without the tower).

    The main tower sees the item's embeddings beside the user's, so what it learns of an ad is
    mixed with who the user is; this tower has no user input, so an ad's own effect reaches cold
    users' rows (whose user embeddings are a backoff) as it reaches warm ones. It was built for
    issue #22 when the ad's bias looked half missing from cold users' logits; measured against
    what the data can tell of an ad (``bench/bench_tail_misses.py``), it is not, and the tower's
    gain (two CPU seeds: tail +0.0020 and +0.0007) lies elsewhere (docs/guide/training.md, #22).
    Example::

        tower = ItemTower(112, MLPConfig((64,)))
        term = tower(item_deep)  # [B, 112] -> [B]
    """

    def __init__(self, in_features: int, config: MLPConfig) -> None:
        super().__init__()
        self.mlp = MLP(in_features, config)
        self.output = nn.Linear(config.out_features, 1)
        nn.init.zeros_(self.output.weight)
        nn.init.zeros_(self.output.bias)

    def forward(self, item_deep: torch.Tensor) -> torch.Tensor:
        # item_deep: [B, Di]
        return self.output(self.mlp(item_deep)).squeeze(1)  # [B]


# --------------------------------------------------------------------------- export


def example_inputs(
    arch: DenseArch,
    lengths: Sequence[int] = (3, 0, 5),
    user_index: Sequence[int] = (0, 1, 2, 2),
    *,
    pairs: bool = False,
) -> dict[str, torch.Tensor]:
    """Random inputs of the right widths; the defaults suit :func:`export_dense_arch`.
    ``pairs``: with the pair inputs (:data:`~shared.dense_inputs.PAIR_INPUT_NAMES`, what
    :func:`train.export.export_bundle` exports), else the six inputs of programs of bundle
    formats 1 and 2. A model with a backoff also gets random cold masks
    (:data:`~shared.dense_inputs.COLD_NAMES`, bundle format 4), and needs ``pairs``."""
    c = arch.config
    if arch.takes_cold and not pairs:
        raise ValueError(
            "a model with a cold-id backoff exports with the pair inputs (bundle format 4, "
            "tzrec naming); pass pairs=True"
        )
    lens = torch.tensor(list(lengths), dtype=torch.int64)
    users = torch.tensor(list(user_index), dtype=torch.int64)
    u, b, t = len(lens), len(users), int(lens.sum())
    example = {
        "user_deep": torch.randn(u, c.user_deep_dim),
        "item_deep": torch.randn(b, c.item_deep_dim),
        "query": torch.randn(b, c.seq_dim),
        "seq_values": torch.randn(t, c.seq_dim),
        "seq_lengths": lens,
        "user_index": users,
    }
    if pairs:
        seg, elem = pair_index(lens.numpy(), users.numpy())
        example["pair_segment"] = torch.from_numpy(seg)
        example["pair_element"] = torch.from_numpy(elem)
    if arch.takes_cold:
        widths = {s.mask: s.mask_width for s in c.backoff}
        generator = torch.Generator().manual_seed(0)  # not the global one: seeded runs stay
        for name, rows in zip(COLD_NAMES, (u, b, t), strict=True):
            mask = torch.rand(rows, widths.get(name, 0), generator=generator) < 0.5
            example[name] = mask
    return example


def _check_example(example: dict[str, torch.Tensor]) -> tuple[str, ...]:
    """The example's input names (in program order) after checking its keys, dtypes and sizes."""
    names = tuple(n for n in COLD_INPUT_NAMES if n in example)
    if set(example) != set(names) or names not in [s.value for s in Signature]:
        raise ValueError(
            f"example has keys {sorted(example)}, expected exactly {list(INPUT_NAMES)}, with "
            f"the pairs {list(PAIR_INPUT_NAMES)}, or with the cold masks too "
            f"{list(COLD_INPUT_NAMES)} (example_inputs() gives one)"
        )
    for key in names[INPUT_NAMES.index("seq_lengths") : len(PAIR_INPUT_NAMES)]:
        if example[key].dtype != torch.int64:
            raise ValueError(f"example[{key!r}] must be int64, got {example[key].dtype}")
    sizes = {
        "U": example["user_deep"].shape[0],
        "B": example["item_deep"].shape[0],
        "T": example["seq_values"].shape[0],
    }
    if "pair_segment" in example:
        sizes["N"] = example["pair_segment"].shape[0]
    small = {k: v for k, v in sizes.items() if v < 2}
    if small:
        raise ValueError(
            f"example sizes {small} are < 2: torch.export would specialise the program to them; "
            "use an example with at least 2 users, 2 candidates, 2 sequence elements and 2 "
            "pairs (example_inputs() gives one)"
        )
    return names


def export_dense_arch(module: DenseArch, example: dict[str, torch.Tensor]) -> ExportedProgram:
    """Export in eval mode with dynamic U (users), B (candidates), T (sequence elements) and,
    with the pairs, N (pairs).

    ``example`` maps :data:`~shared.dense_inputs.PAIR_INPUT_NAMES` (or, for a program of bundle
    formats 1 and 2, :data:`~shared.dense_inputs.INPUT_NAMES`) to tensors with U, B, T, N >= 2.
    The program takes the inputs as keywords (``program.module()(**inputs)``; positional calls
    are refused) and accepts any U, B, T, N >= 0, including one user with many candidates and
    empty sequences. With the pairs it has no data-dependent shape and no host sync; without,
    the pair count inside the DIN is data dependent, carried as an unbacked symbol guarded by
    a runtime assertion (see :class:`~train.model.din.JaggedDIN`).
    """
    names = _check_example(example)
    users, batch, total = Dim("U", min=0), Dim("B", min=0), Dim("T", min=0)
    dynamic_shapes: dict[str, dict[int, Any]] = {
        "user_deep": {0: users},
        "item_deep": {0: batch},
        "query": {0: batch},
        "seq_values": {0: total},
        "seq_lengths": {0: users},
        "user_index": {0: batch},
    }
    signature = signature_of(names)
    if signature.takes_pairs:
        pairs = Dim("N", min=0)
        dynamic_shapes.update(pair_segment={0: pairs}, pair_element={0: pairs})
    if signature.takes_cold:
        dynamic_shapes.update(user_cold={0: users}, item_cold={0: batch}, seq_cold={0: total})
    kwargs = {name: example[name] for name in names}
    was_training = module.training
    module.eval()
    try:
        return torch.export.export(
            module, (), kwargs=kwargs, dynamic_shapes=dynamic_shapes, strict=False
        )
    finally:
        module.train(was_training)


def save_dense_program(program: ExportedProgram, directory: str | os.PathLike[str]) -> Path:
    """Write ``<directory>/dense.pt2`` atomically (temp file + rename); returns its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / DENSE_PROGRAM_FILE
    fd, tmp = tempfile.mkstemp(prefix=".dense.", suffix=".partial.pt2", dir=directory)
    os.close(fd)
    try:
        torch.export.save(program, tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def load_dense_program(
    path: str | os.PathLike[str], *, device: str | torch.device | None = None
) -> ExportedProgram:
    """Load ``dense.pt2`` (or the directory holding it), optionally moved to ``device``.

    The program records the device it was exported on (CPU, in training); ``device="cuda"``
    rewrites its parameters and the device of the tensors it creates.
    """
    path = Path(path)
    if path.is_dir():
        path = path / DENSE_PROGRAM_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no dense program at {path}; expected {DENSE_PROGRAM_FILE}")
    program = torch.export.load(path)
    if device is not None:
        from torch.export.passes import move_to_device_pass

        program = move_to_device_pass(program, torch.device(device))
    return program
