"""DIN target attention over jagged click sequences, and tzrec's padded version as a reference.

For every candidate row b with query q_b and the elements s_1..s_L of its user's sequence::

    a_i = Linear(MLP([q_b, s_i, q_b - s_i, q_b * s_i]))      # one score per element
    w   = softmax(a_1..a_L)                                  # within the row's own elements
    out = sum_i w_i * s_i                                    # [D]; an empty sequence gives 0

:class:`JaggedDIN` computes this over the real elements only: with mean length ~4 and a cap of
100 it does ~4 % of the padded work. Sequences are given once per *user* (``seq_lengths`` [U])
and ``user_index`` [B] maps each candidate row to its user, so serving one user with N candidate
ads stores the sequence once (user tiling). Everything is plain torch (no fbgemm), and the module
exports with :func:`torch.export.export` with dynamic B, U and T: the element count of the
candidate/element expansion is data dependent and is carried as an unbacked symbol (see
:meth:`JaggedDIN.forward`).

:class:`PaddedDIN` is tzrec's ``DINEncoder`` on padded tensors, kept only for tests and
benchmarks. Both share :class:`DINAttention`'s parameters, so
``padded.load_state_dict(jagged.state_dict())`` gives the same function.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from train.model.mlp import MLP, MLPConfig

# tzrec masks padded positions with a large negative score before the softmax.
PAD_SCORE = float(-(2**31) + 1)


class DINAttention(nn.Module):
    """Parameters and scoring shared by the jagged and padded DIN.

    ``attn_mlp`` maps the attention input [q, s, q-s, q*s] (4·dim) to hidden units, ``attn_out``
    to one score.
    """

    def __init__(self, dim: int, attn_mlp: MLPConfig | Sequence[int]) -> None:
        super().__init__()
        self.dim = dim
        self.attn_mlp = MLP(4 * dim, attn_mlp)
        self.attn_out = nn.Linear(self.attn_mlp.out_features, 1)

    @property
    def out_features(self) -> int:
        return self.dim

    def score(self, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        # q, s: [..., D] (aligned pairs)
        x = torch.cat([q, s, q - s, q * s], dim=-1)  # [..., 4D]
        return self.attn_out(self.attn_mlp(x)).squeeze(-1)  # [...]

    def pair_scores(
        self,
        query: torch.Tensor,
        seq_values: torch.Tensor,
        seg: torch.Tensor,
        elem: torch.Tensor,
        s: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`score` of the pairs (query[seg], seq_values[elem]) without building [N, 4D].

        The first attention layer is linear, so on [q, s, q-s, q*s] it splits into
        ``(Wq+Wd)·q`` (once per candidate), ``(Ws-Wd)·s`` (once per element) and ``Wp·(q*s)``
        (per pair): a D→H product per pair instead of 4D→H. Same parameters as :meth:`score`.
        """
        first = self.attn_mlp.layers[0]
        if not isinstance(first, nn.Linear):  # pragma: no cover - MLP always starts linear
            return self.score(query[seg], s)
        d = self.dim
        wq, ws, wd, wp = first.weight.split(d, dim=1)  # 4 x [H, D]
        per_cand = torch.nn.functional.linear(query, wq + wd, first.bias)  # [B, H]
        per_elem = torch.nn.functional.linear(seq_values, ws - wd)  # [T, H]
        h = (
            per_cand[seg] + per_elem[elem] + torch.nn.functional.linear(query[seg] * s, wp)
        )  # [N, H]
        return self.attn_out(self.attn_mlp.layers[1:](h)).squeeze(-1)  # [N]

    def _check(self, query: torch.Tensor, seq_values: torch.Tensor) -> None:
        if query.shape[-1] != self.dim or seq_values.shape[-1] != self.dim:
            raise ValueError(
                f"DIN built for dim {self.dim} got query [.., {query.shape[-1]}] and sequence "
                f"[.., {seq_values.shape[-1]}]; query and sequence embeddings must both be {self.dim}"
            )


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    # x: [N] -> [N], out[i] = sum(x[:i])
    return torch.cumsum(x, dim=0) - x


class JaggedDIN(DINAttention):
    """DIN over jagged sequences, one sequence per user, shared by that user's candidate rows.

    Example (two users, three candidates; user 1 has an empty sequence)::

        din = JaggedDIN(48, [256, 64])
        out = din(q,                       # [3, 48]
                  s,                       # [5, 48]: user 0's 5 clicks
                  torch.tensor([5, 0]),    # lengths [U]
                  torch.tensor([0, 1, 0])) # user of each candidate
        out[1]                             # zeros
    """

    def forward(
        self,
        query: torch.Tensor,
        seq_values: torch.Tensor,
        seq_lengths: torch.Tensor,
        user_index: torch.Tensor,
    ) -> torch.Tensor:
        # query: [B, D]; seq_values: [T, D]; seq_lengths: [U] int64, sum = T; user_index: [B] int64
        self._check(query, seq_values)
        b = query.shape[0]
        user_start = _exclusive_cumsum(seq_lengths)  # [U] first element of each user
        cand_len = seq_lengths[user_index]  # [B] elements of each candidate's user
        # N = total (candidate, element) pairs: data dependent. Under torch.export this is an
        # unbacked symbol; the check records that it is a valid size, and output_size lets
        # repeat_interleave build [N] without a second pass over cand_len.
        n = cast(int, cand_len.sum().item())
        torch._check(n >= 0)
        cand = torch.arange(b, device=query.device)  # [B]
        seg = torch.repeat_interleave(cand, cand_len, output_size=n)  # [N] candidate of each pair
        # element of pair j: user_start[u] + (j - first pair of its candidate)
        shift = user_start[user_index] - _exclusive_cumsum(cand_len)  # [B]
        elem = torch.arange(n, device=query.device) + shift[seg]  # [N] row in seq_values

        s = seq_values[elem]  # [N, D]
        # Split first layer when pairs outnumber candidates + elements (serving: one user's
        # sequence shared by N candidates); the exported program always takes it. In training
        # (one candidate per user) N == T and the plain concatenation is as cheap.
        split = torch.compiler.is_compiling() or n >= 2 * (b + seq_values.shape[0])
        if split:
            scores = self.pair_scores(query, seq_values, seg, elem, s)  # [N]
        else:
            scores = self.score(query[seg], s)  # [N]
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))  # >= fp32 (autocast)

        # segment softmax: subtract each candidate's max (a constant per segment: no gradient)
        seg_max = torch.full((b,), float("-inf"), dtype=scores.dtype, device=scores.device)
        seg_max = seg_max.scatter_reduce(0, seg, scores.detach(), reduce="amax")  # [B]
        e = torch.exp(scores - seg_max[seg])  # [N]
        denom = torch.zeros(b, dtype=e.dtype, device=e.device).index_add(0, seg, e)  # [B]
        w = (e / denom[seg]).to(s.dtype)  # [N]

        out = torch.zeros(b, s.shape[1], dtype=s.dtype, device=s.device)  # [B, D]
        return out.index_add(0, seg, w.unsqueeze(1) * s)  # [B, D]; empty rows stay 0


class PaddedDIN(DINAttention):
    """tzrec's DIN: pad every sequence to ``max_length``, mask, softmax, batched matmul.

    Only for tests and benchmarks. Takes the same jagged inputs as :class:`JaggedDIN` and pads
    them itself (to ``max_length`` if given, as tzrec pads to the configured sequence length,
    else to the longest sequence in the batch), then gathers each candidate's user row.

    Empty rows: tzrec's masked softmax over an all-padding row gives uniform weights over the
    zero padding, i.e. zeros in fp32, but the mask value −2³¹+1 overflows to −inf in fp16,
    where an all-masked row becomes NaN. This version sets empty rows to zero explicitly, so
    it agrees with :class:`JaggedDIN` in every dtype.
    """

    def __init__(
        self, dim: int, attn_mlp: MLPConfig | Sequence[int], max_length: int | None = None
    ) -> None:
        super().__init__(dim, attn_mlp)
        self.max_length = max_length

    def pad(self, seq_values: torch.Tensor, seq_lengths: torch.Tensor) -> torch.Tensor:
        # seq_values: [T, D]; seq_lengths: [U] -> [U, L, D] zero padded
        u, t = seq_lengths.shape[0], seq_values.shape[0]
        longest = int(seq_lengths.max()) if u > 0 else 0
        length = longest if self.max_length is None else self.max_length
        if longest > length:
            raise ValueError(f"a sequence has {longest} elements, more than max_length {length}")
        users = torch.arange(u, device=seq_values.device)
        row = torch.repeat_interleave(users, seq_lengths, output_size=t)  # [T]
        pos = torch.arange(t, device=seq_values.device) - _exclusive_cumsum(seq_lengths)[row]
        padded = seq_values.new_zeros(u, length, seq_values.shape[1])  # [U, L, D]
        return padded.index_put((row, pos), seq_values)  # [U, L, D]

    def forward(
        self,
        query: torch.Tensor,
        seq_values: torch.Tensor,
        seq_lengths: torch.Tensor,
        user_index: torch.Tensor,
    ) -> torch.Tensor:
        # query: [B, D]; seq_values: [T, D]; seq_lengths: [U]; user_index: [B]
        self._check(query, seq_values)
        seq = self.pad(seq_values, seq_lengths)[user_index]  # [B, L, D]
        lengths = seq_lengths[user_index]  # [B]
        length = seq.shape[1]
        mask = torch.arange(length, device=seq.device).unsqueeze(0) < lengths.unsqueeze(1)  # [B, L]
        queries = query.unsqueeze(1).expand(-1, length, -1)  # [B, L, D]
        scores = self.score(queries, seq).unsqueeze(1)  # [B, 1, L]
        scores = torch.where(mask.unsqueeze(1), scores, torch.full_like(scores, PAD_SCORE))
        w = torch.softmax(scores, dim=-1)  # [B, 1, L]
        out = torch.matmul(w, seq).squeeze(1)  # [B, D]
        return torch.where((lengths > 0).unsqueeze(1), out, torch.zeros_like(out))  # [B, D]
