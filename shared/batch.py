"""The tensors of one batch, as feature generation produces them and the model consumes them.

Rows are split by who they belong to, so that serving can send a user's part once for N
candidate ads (user tiling) and training uses the same structure with one user row per sample:

- ``user``: KJT of the USER-side id/bucketized features, stride U (one bag per user row).
- ``item``: KJT of the ITEM- and CONTEXT-side id/bucketized features, stride B (one bag per
  candidate row). Scalar features have 0 (missing → zero embedding) or 1 value per bag.
- ``sequence``: KJT of the sequence sub-features, stride U; the sub-features of one sequence have
  equal lengths (element i of ``click_50_seq__adgroup_id`` and of ``click_50_seq__brand`` is the
  same clicked ad). Values are jagged: no padding.
- ``user_index``: [B] int64, the user row of each candidate row (``arange(B)`` in training).
- ``labels``: [B] float32 (None when serving); ``oracle``: [B] float32 true click probability
  (synthetic data only, for evaluation).
- ``rows_are_users``: a host-side promise that ``user_index`` is ``arange(B)`` (U == B), set by
  training feature generation; the training step then takes the DIN's sync-free path
  (``JaggedDIN.forward(user_index=None)``) without reading the tensor back.
Keys follow the FeatureSet's feature order. Ids are already transformed (mod / hash / bucket /
raw dynamic id), so the model only looks them up.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclass
class Batch:
    user: KeyedJaggedTensor  # stride U
    item: KeyedJaggedTensor  # stride B
    sequence: KeyedJaggedTensor  # stride U
    user_index: torch.Tensor  # [B] int64 in [0, U)
    labels: torch.Tensor | None = None  # [B] float32
    oracle: torch.Tensor | None = None  # [B] float32
    rows_are_users: bool = False  # user_index is arange(B): see the module docstring

    @property
    def batch_size(self) -> int:
        return int(self.user_index.numel())

    @property
    def num_users(self) -> int:
        return int(self.user.stride())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return replace(
            self,
            user=self.user.to(device, non_blocking=non_blocking),
            item=self.item.to(device, non_blocking=non_blocking),
            sequence=self.sequence.to(device, non_blocking=non_blocking),
            user_index=self.user_index.to(device, non_blocking=non_blocking),
            labels=move(self.labels),
            oracle=move(self.oracle),
        )

    def pin_memory(self) -> Batch:
        def pin(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory()

        return replace(
            self,
            user=self.user.pin_memory(),
            item=self.item.pin_memory(),
            sequence=self.sequence.pin_memory(),
            user_index=self.user_index.pin_memory(),
            labels=pin(self.labels),
            oracle=pin(self.oracle),
        )
