"""Id dropout for the cold-id backoff (DropoutNet-style): in training, a warm key of a feature
that backs off is treated as cold with probability ``p``, so the backoff also learns on warm ids.

Why: in training the cold population of a feature is every id's first sightings and the ids
admission refuses; in eval it is the rare ids. A backoff learned on the first alone did not help
(:mod:`train.model.backoff`); dropping a share of the warm lookups shows it ids of every kind.

Configured by ``model_config.multi_tower_din.cold_backoff { id_dropout: p }`` (0 <= p < 1; 0,
the default, is off: training is bit-identical to a config without the field). What a dropped
occurrence gets is what a cold one gets: its hit flag is cleared, so a bag whose ids are all
dropped or cold is a cold row (:func:`shared.dense_inputs.cold_rows`): it takes the backoff
value and counts as a zero side feature of the other features' backoffs. Its looked-up row is
replaced by 0 (the eval value of a key without a row; what a partly dropped bag pools), so its
id embedding gets no gradient from that occurrence. The table itself is untouched: the key is
still admitted, counted and re-scored as the lookup did, and the tables' stats count it as a
hit (their ``misses`` are the real cold lookups only).

The decision is per (table, key, step), not per occurrence: every occurrence of a key in a
step, in every feature of its table that backs off, is dropped or kept together, which is what
an id with no row looks like (all its lookups miss). Per occurrence, a key seen twice in a
batch (a user's other candidate rows, an item as candidate and in a sequence) could be cold in
one row and warm in the next, which no unseen id is.

The uniform is a hash of (seed, step, table, key), not a draw from a generator: the global RNG
is untouched, a resumed run drops the same occurrences (same seed and step), CPU and CUDA drop
the same ones (int64 arithmetic of :func:`shared.hashtable.hashing.mix64`, bit-identical on
both), and so do the ranks of a distributed run (the hash does not depend on the rank)::

    dropout = IdDropout.from_config(fs, config.model_config.multi_tower_din.cold_backoff, seed=0)
    drop = dropout.dropped("user_id_emb", keys, step=7)   # [N] bool, the same for the same step

Only :class:`~train.model.sparse_arch.SparseArch` applies it (:meth:`IdDropout.apply`), in
training mode only; eval, the exported program, bundles and serving are unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protos import pipeline_pb2
from shared.config import ConfigError
from shared.dense_inputs import FeaturePart
from shared.features import FeatureSet
from shared.hashtable.hashing import GOLDEN, MASK64, mix64, mix64_int, name_salt, to_signed
from train.model.backoff import backoff_spaces

FIELD = "model_config.multi_tower_din.cold_backoff.id_dropout"
UNIFORM_BITS = 53  # the uniform's resolution: p is rounded to a multiple of 2**-53


def check_id_dropout(config: pipeline_pb2.ColdBackoff) -> float:
    """``config.id_dropout``, checked: 0 <= p < 1 (ConfigError naming the field otherwise)."""
    p = float(config.id_dropout)
    if not (math.isfinite(p) and 0.0 <= p < 1.0):
        raise ConfigError(
            "<config>", None, FIELD,
            f"{config.id_dropout} is not a probability in [0, 1): give the share of warm "
            "lookups to treat as cold in training (0 or no field: off)",
        )  # fmt: skip
    return p


@dataclass(frozen=True)
class IdDropout:
    """Which features drop their warm keys, with which probability, under which seed."""

    p: float  # 0 < p < 1
    seed: int  # the model's seed
    features: frozenset[str]  # the features that back off (train.model.backoff)

    @classmethod
    def from_config(
        cls, fs: FeatureSet, config: pipeline_pb2.ColdBackoff, *, seed: int
    ) -> IdDropout | None:
        """The id dropout of a ``cold_backoff`` block; None when ``id_dropout`` is 0 (off)."""
        p = check_id_dropout(config)
        if p == 0.0:
            return None
        names = frozenset(f.name for s in backoff_spaces(fs, config) for f in s.features)
        if not names:
            raise ConfigError(
                "<config>", None, FIELD,
                f"{p} given, but no feature backs off (no dynamic user feature, no sources); "
                "remove id_dropout or name a feature in sources",
            )  # fmt: skip
        return cls(p, seed, names)

    @property
    def threshold(self) -> int:
        """A key is dropped when its 53-bit uniform is below this (p * 2**53, rounded)."""
        return round(self.p * (1 << UNIFORM_BITS))

    def salt(self, table: str, step: int) -> int:
        """The int64 salt of (seed, step, table): a new draw per step and table."""
        counter = (self.seed * GOLDEN + step) & MASK64
        return to_signed(mix64_int(name_salt(table) ^ mix64_int(counter)))

    def dropped(self, table: str, keys: torch.Tensor, step: int) -> torch.Tensor:
        """[N] bool: which of ``keys`` (int64 [N], a table's keys) are dropped at ``step``;
        equal keys get equal answers."""
        h = mix64(mix64(keys.to(torch.int64)) ^ self.salt(table, step))  # [N] int64
        uniform = (h >> (64 - UNIFORM_BITS)) & ((1 << UNIFORM_BITS) - 1)  # [N] in [0, 2**53)
        return uniform < self.threshold

    def apply(
        self,
        fs: FeatureSet,
        parts: Sequence[FeaturePart],
        rows: Sequence[torch.Tensor],
        hits: Sequence[torch.Tensor | None],
        step: int,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """A training lookup's ``rows`` ([n_i, dim] per part) and ``hits`` ([n_i] bool per
        dynamic part, else None) with the warm keys dropped at ``step`` cleared in ``hits`` and
        zeroed in ``rows`` (no gradient reaches them), at the parts whose feature backs off."""
        rows, hits = list(rows), list(hits)
        for i, (_which, name, keys, _lengths) in enumerate(parts):
            found = hits[i]
            if found is None or name not in self.features:
                continue
            drop = self.dropped(fs.features[name].table, keys, step) & found  # [n] warm, dropped
            hits[i] = found & ~drop  # [n]
            rows[i] = torch.where(drop.unsqueeze(1), torch.zeros_like(rows[i]), rows[i])
        return rows, hits
