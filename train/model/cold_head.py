"""A logit term for rows whose user is cold, learned from those rows alone (issue #22).

With ``model_config.multi_tower_din.cold_backoff { cold_head { hidden_units: [64] } }`` the
dense part adds, to the logit of a candidate row whose user has a cold dynamic USER feature
(``user_cold`` of :mod:`train.model.backoff`: no row in the table)::

    logit += head(concat(user_deep, item_deep))    # user_deep backed off; warm rows: + 0

``head`` is an MLP (the ``cold_head`` message: ReLU layers, optional dropout and batch norm)
and a Linear to one output. The term is multiplied by the row's cold flag, so gradients reach
it from cold rows only, and a warm row's score is as without it.

Why: a cold user's score must be the response averaged over what is not known of the user,
which the model can learn only from rows that are cold. Every way tried of training the cold
path on warm rows as well cost tail AUC on full data (id dropout, a residual backoff:
``bench/results/bench_quality_full_s17_h200.json``). With a head of ``[64]``, medium data on
CPU (sparse lr 0.05, the two crosses, the user backoff, ``--capacity-scale 0.125``) gave tail
AUC +0.0028, +0.0035, +0.0046 and +0.0016 over seeds 0-3 against the same runs without it,
overall AUC -0.0002, -0.0002, -0.0005 and +0.0006
(``bench/results/bench_quality_medium_slr0.05_crosses_user_backoff_cold_head_s17_cpu.json``);
at sparse lr 0.03, seeds 0 and 1, tail +0.0041 and +0.0043, overall -0.0002 and +0.0003
(``bench_quality_medium_slr0.03_crosses_user_backoff_*_s17_cpu.json``). Not yet measured on
full data.

The head is part of the exported dense program (``user_cold`` is an input of bundle format 4),
so serving needs nothing new. Its hidden layers are initialised from a fixed seed without
drawing from the global generator (every other seeded value is as without it), and its output
layer starts at zero, so the first step scores as without it.
"""

from __future__ import annotations

import torch
from torch import nn

from train.model.mlp import MLP, MLPConfig

INIT_SEED = 22  # the hidden layers' initial values (drawn from a generator of their own)


class ColdHead(nn.Module):
    """The term (see the module docstring) of rows of ``in_features`` deep inputs."""

    def __init__(self, in_features: int, config: MLPConfig) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(INIT_SEED)
            self.mlp = MLP(in_features, config)
        self.output = nn.Linear(config.out_features, 1)
        nn.init.zeros_(self.output.weight)
        nn.init.zeros_(self.output.bias)

    def forward(self, deep_in: torch.Tensor, cold: torch.Tensor) -> torch.Tensor:
        # deep_in: [B, Du + Di] (backed off); cold: [B] bool, the row's user is cold
        term = self.output(self.mlp(deep_in)).squeeze(1)  # [B]
        return term * cold.to(term.dtype)  # [B]: 0 on warm rows, and no gradient from them
