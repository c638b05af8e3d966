"""DIN target attention over jagged click sequences, and tzrec's padded version as a reference.

For every candidate row b with query q_b and the elements s_1..s_L of its user's sequence::

    a_i = Linear(MLP([q_b, s_i, q_b - s_i, q_b * s_i]))      # one score per element
    w   = softmax(a_1..a_L)                                  # within the row's own elements
    out = sum_i w_i * s_i                                    # [D]; an empty sequence gives 0

:class:`JaggedDIN` computes this over the real elements only: with mean length ~4 and a cap of
100 it does ~4 % of the padded work. Sequences are given once per *user* (``seq_lengths`` [U])
and ``user_index`` [B] maps each candidate row to its user, so serving one user with N candidate
ads stores the sequence once (user tiling). Everything is plain torch (no fbgemm), and the module
exports with :func:`torch.export.export` with dynamic B, U and T. The (candidate, element) pairs
(:func:`shared.dense_inputs.pair_index`) are either given (``pairs=``, N a dynamic input dim: no
host sync and no data-dependent shape, so the program can be captured in a CUDA graph; what
serving passes, which knows the lengths on the host) or computed here, their count read back
from the device (under export an unbacked symbol; see :meth:`JaggedDIN.forward`).

Training fast path: in training every candidate row is its own user (``U == B``,
``user_index = arange(B)``). Passing ``user_index=None`` says so, and the forward then needs no
candidate expansion and no host sync (the pairs are the T sequence elements, in order, so T,
a static shape, sizes everything). The attention input and the segment softmax + weighted sum
each run as one autograd node over contiguous segments, with hand-written backwards
(:class:`SortedPairFeatures`, :class:`SortedSegmentSoftmaxPool`). It computes the same function
with the same gradients as the general path given ``torch.arange(B)``. ``JaggedDIN.compile_fast_path = True`` additionally runs the fast path
through ``torch.compile`` (dynamic shapes, no CUDA graphs; meant for CUDA training, off by
default and never used by export, which always traces the general path).

:class:`PaddedDIN` is tzrec's ``DINEncoder`` on padded tensors, kept only for tests and
benchmarks. Both share :class:`DINAttention`'s parameters, so
``padded.load_state_dict(jagged.state_dict())`` gives the same function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

from shared.dense_inputs import Pairs, pair_index_torch
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
        return self.score_features(x)  # [...]

    def score_features(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., 4D] attention input [q, s, q-s, q*s] -> [...] one score each
        return self.attn_out(self.attn_mlp(x)).squeeze(-1)

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


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    # lengths: [B] -> [B + 1], offsets[i] = sum(lengths[:i]); no host sync
    return torch.nn.functional.pad(torch.cumsum(lengths, dim=0), (1, 0))


class SortedPairFeatures(torch.autograd.Function):
    """DIN's attention input ``[q[seg], s, q[seg] - s, q[seg] * s]`` [T, 4D] for sorted ``seg``.

    One autograd node instead of four (gather, sub, mul, cat) and their gradient sums; the
    query gradient is a :func:`torch.segment_reduce` sum over each candidate's contiguous
    elements (deterministic, no atomics)::

        d s     = g_s - g_d + g_p * q[seg]
        d q[b]  = sum over b's elements of (g_q + g_d + g_p * s)

    with ``g_q, g_s, g_d, g_p`` the four [T, D] blocks of the output gradient.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        query: torch.Tensor,
        values: torch.Tensor,
        seg: torch.Tensor,
        offsets: torch.Tensor,
    ) -> torch.Tensor:
        # query: [B, D]; values: [T, D]; seg: [T] int64 sorted; offsets: [B + 1] int64
        q = query.index_select(0, seg)  # [T, D]
        ctx.save_for_backward(q, values, offsets)
        return torch.cat([q, values, q - values, q * values], dim=1)  # [T, 4D]

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        # grad: [T, 4D]
        q, values, offsets = ctx.saved_tensors  # type: ignore[attr-defined]
        need_query, need_values = ctx.needs_input_grad[:2]  # type: ignore[attr-defined]
        g_q, g_s, g_d, g_p = grad.split(values.shape[1], dim=1)  # 4 x [T, D]
        g_query = g_values = None
        if need_query:
            if values.shape[0] == 0:  # static shape; segment_reduce wants data
                g_query = q.new_zeros(offsets.shape[0] - 1, q.shape[1])  # [B, D]
            else:
                per_pair = torch.addcmul(g_q, g_p, values).add_(g_d)  # [T, D]
                g_query = torch.segment_reduce(per_pair, "sum", offsets=offsets, unsafe=True)
        if need_values:
            g_values = torch.addcmul(g_s, g_p, q).sub_(g_d)  # [T, D]
        return g_query, g_values, None, None


class SortedSegmentSoftmaxPool(torch.autograd.Function):
    """``out[b] = sum_i softmax(scores[seg == b])_i * values[i]`` for contiguous segments.

    ``seg`` [T] is sorted (segment b holds rows ``offsets[b]:offsets[b+1]``), as in the training
    fast path. One autograd node instead of the ~12 of the per-op version; the segment max and
    sums use :func:`torch.segment_reduce` on ``offsets`` (no atomics, deterministic, no host
    sync). With ``w`` the softmax weights and ``g`` the output gradient the backward is::

        d values[i] = w_i * g[seg_i]
        gw_i        = <g[seg_i], values[i]>
        d scores[i] = w_i * gw_i - w_i * sum_{j in seg_i} w_j gw_j

    Empty segments give zero rows and T = 0 gives all zeros. The weights are computed in
    ``scores``' dtype (>= fp32) and cast to ``values``' dtype for the weighted sum, as in
    :class:`JaggedDIN`'s general path.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        scores: torch.Tensor,
        values: torch.Tensor,
        seg: torch.Tensor,
        offsets: torch.Tensor,
    ) -> torch.Tensor:
        # scores: [T] float; values: [T, D]; seg: [T] int64 sorted; offsets: [B + 1] int64
        if values.shape[0] == 0:  # static shape: no sync (segment_reduce wants data)
            ctx.save_for_backward(scores, values, seg, offsets)  # scores: [0], stands in for w
            return values.new_zeros(offsets.shape[0] - 1, values.shape[1])  # [B, D]
        seg_max = torch.segment_reduce(scores, "max", offsets=offsets, unsafe=True)  # [B]
        w = (scores - seg_max.index_select(0, seg)).exp_()  # [T]
        denom = torch.segment_reduce(w, "sum", offsets=offsets, unsafe=True)  # [B]
        w = w.div_(denom.index_select(0, seg))  # [T] softmax weights
        ctx.save_for_backward(w, values, seg, offsets)
        weighted = w.to(values.dtype).unsqueeze(1) * values  # [T, D]
        return torch.segment_reduce(weighted, "sum", offsets=offsets, unsafe=True)  # [B, D]

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        # grad: [B, D]
        w, values, seg, offsets = ctx.saved_tensors  # type: ignore[attr-defined]
        need_scores, need_values = ctx.needs_input_grad[:2]  # type: ignore[attr-defined]
        if values.shape[0] == 0:
            return (
                torch.zeros_like(w) if need_scores else None,
                torch.zeros_like(values) if need_values else None,
                None,
                None,
            )
        g = grad.index_select(0, seg)  # [T, D] output gradient of each element's segment
        g_values = g * w.to(values.dtype).unsqueeze(1) if need_values else None  # [T, D]
        g_scores = None
        if need_scores:
            wgw = torch.linalg.vecdot(g, values, dim=1).to(w.dtype).mul_(w)  # [T] w_i * gw_i
            seg_sum = torch.segment_reduce(wgw, "sum", offsets=offsets, unsafe=True)  # [B]
            g_scores = torch.addcmul(wgw, w, seg_sum.index_select(0, seg), value=-1)  # [T]
        return g_scores, g_values, None, None


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

    # Run the training fast path (user_index=None) through torch.compile; see the module doc.
    compile_fast_path: bool = False

    def forward(
        self,
        query: torch.Tensor,
        seq_values: torch.Tensor,
        seq_lengths: torch.Tensor,
        user_index: torch.Tensor | None,
        pairs: Pairs | None = None,
    ) -> torch.Tensor:
        # query: [B, D]; seq_values: [T, D]; seq_lengths: [U] int64, sum = T
        # user_index: [B] int64, or None for arange(B) (training: U == B)
        # pairs: (pair_segment [N], pair_element [N]) int64, pair_index of seq_lengths and
        # user_index; None: computed here (one host sync, an unbacked N under torch.export)
        if user_index is None:
            if pairs is not None:
                raise ValueError(
                    "pairs are for user_index given; with user_index=None (one user per "
                    "candidate row) the pairs are the sequence elements: pass pairs=None"
                )
            return self.forward_own_users(query, seq_values, seq_lengths)
        self._check(query, seq_values)
        seg, elem = pair_index_torch(seq_lengths, user_index) if pairs is None else pairs
        b, n = query.shape[0], seg.shape[0]

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

    def forward_own_users(
        self, query: torch.Tensor, seq_values: torch.Tensor, seq_lengths: torch.Tensor
    ) -> torch.Tensor:
        """Training fast path: candidate row b's sequence is user b's (``user_index = arange(B)``).

        The (candidate, element) pairs are then the T elements themselves in order, segment b
        being rows ``offsets[b]:offsets[b+1]`` of ``seq_values``: no pair expansion, no host
        sync. Same result and gradients as ``forward(..., torch.arange(B))``.
        """
        # query: [B, D]; seq_values: [T, D]; seq_lengths: [B] int64, sum = T
        self._check(query, seq_values)
        if seq_lengths.shape[0] != query.shape[0]:
            raise ValueError(
                f"user_index=None means one user per candidate row, but there are "
                f"{seq_lengths.shape[0]} sequences for {query.shape[0]} candidate rows"
            )
        if self.compile_fast_path and not torch.compiler.is_compiling():
            return _compiled_own_users()(self, query, seq_values, seq_lengths)
        seg = torch.repeat_interleave(seq_lengths, output_size=seq_values.shape[0])  # [T]
        offsets = _offsets(seq_lengths)  # [B + 1]
        x = SortedPairFeatures.apply(query, seq_values, seg, offsets)  # [T, 4D]
        scores = self.score_features(x)  # [T]
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))  # >= fp32 (autocast)
        pooled = SortedSegmentSoftmaxPool.apply(scores, seq_values, seg, offsets)
        return cast(torch.Tensor, pooled)  # [B, D]

    def _own_users_plain(
        self, query: torch.Tensor, seq_values: torch.Tensor, seq_lengths: torch.Tensor
    ) -> torch.Tensor:
        """The fast path in plain differentiable ops, for torch.compile to fuse (no custom node)."""
        # query: [B, D]; seq_values: [T, D]; seq_lengths: [B] int64, sum = T
        b = query.shape[0]
        seg = torch.repeat_interleave(seq_lengths, output_size=seq_values.shape[0])  # [T]
        scores = self.score(query[seg], seq_values)  # [T]
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        seg_max = torch.full((b,), float("-inf"), dtype=scores.dtype, device=scores.device)
        seg_max = seg_max.scatter_reduce(0, seg, scores.detach(), reduce="amax")  # [B]
        e = torch.exp(scores - seg_max[seg])  # [T]
        denom = torch.zeros(b, dtype=e.dtype, device=e.device).index_add(0, seg, e)  # [B]
        w = (e / denom[seg]).to(seq_values.dtype)  # [T]
        out = torch.zeros(b, seq_values.shape[1], dtype=seq_values.dtype, device=query.device)
        return out.index_add(0, seg, w.unsqueeze(1) * seq_values)  # [B, D]


@functools.cache
def _compiled_own_users() -> Callable[..., torch.Tensor]:
    """``JaggedDIN._own_users_plain`` under torch.compile (dynamic B and T, default mode: no CUDA
    graphs), built on first use; the module is an argument, so copies of a module never call
    into another one's parameters."""
    return cast(
        Callable[..., torch.Tensor], torch.compile(JaggedDIN._own_users_plain, dynamic=True)
    )


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
        user_index: torch.Tensor | None,
        pairs: Pairs | None = None,
    ) -> torch.Tensor:
        # query: [B, D]; seq_values: [T, D]; seq_lengths: [U]; user_index: [B] (None: arange(B))
        # pairs: JaggedDIN's signature (a model calls either with them); the padding already
        # lays out every (candidate, element) pair they list, so they are not needed here
        del pairs
        self._check(query, seq_values)
        if user_index is None:  # every row its own user (training), as JaggedDIN accepts
            user_index = torch.arange(query.shape[0], device=query.device)
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
