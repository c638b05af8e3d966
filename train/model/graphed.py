"""CUDA graphs for the dense part of the training step (DenseArch, or the DIN alone).

On the GPU machine every torch op costs ~20-30 µs of host time, so the dense forward+backward
(~100+ small ops) is host-bound. :class:`DenseArchGraphs` captures it once per static shape as
two CUDA graphs (forward; backward down to the dense inputs and every parameter) and replays
them: a handful of host calls per step instead of one per op::

    graphs = DenseArchGraphs(model.dense)            # not a submodule: state_dict, export unchanged
    logits = graphs(**dense_inputs)                  # [B], same signature as DenseArch.forward
    loss(logits).backward()                          # replays the backward graph

Static shapes. B (candidate rows) is exact per graph; T (sequence elements) is rounded up to a
bucket (:func:`bucket_rows`: 8 sizes per octave above ``min_bucket``, ~6 % padding on average,
under 12.5 %). A
graph runs on B + 1 rows: the extra last row is a dummy candidate (zero ``user_deep``,
``item_deep`` and ``query`` rows, and no cold flag: the backoff, inside the graph, leaves it
alone) that owns the ``T_pad - T`` padding elements of the sequence
(``seq_lengths`` gets one more entry, computed on the device). Padding elements are masked to
zero inside the graph, whatever the static buffer holds. The dummy row's output is dropped and
its output gradient is zero, so the B real rows get the same outputs and the same input and
parameter gradients as the eager ``DenseArch(..., user_index=None)``: every op is row-wise or
per segment (the DIN's segment reductions are deterministic, no atomics), and the padding's
contributions to the weight gradients are exact zeros; only the weight-gradient GEMMs over
B + 1 (T_pad) instead of B (T) rows may pick another cuBLAS kernel, i.e. another summation
order, so fp32 results agree to rounding (float64 on CPU: to 1e-10 in the tests). Graphs are
cached by (B, T_pad, input widths, dtypes, requires_grad, autocast state), at most
``max_graphs`` of them, least recently used evicted; all share one memory pool.

What runs eagerly instead (same results, no graph): a module not on CUDA (unless ``emulate``),
``user_index`` given, grad mode off, eval mode, a BatchNorm in the module (padding rows would
enter its batch statistics), an empty batch, a forward while an earlier replay's backward is
still pending (two forwards before one backward), a failed capture, new shapes after
``max_captures`` captures, and a shape's first ``capture_after - 1`` calls (the trainer
captures a shape at its second call: an epoch's partial last batches are each seen once).
:attr:`JaggedGraphs.stats` counts replays, captures and eager calls by reason.

Contract of the outputs (as with ``torch.cuda.make_graphed_callables``): the returned output and
the gradients handed to autograd live in buffers owned by the graph and are overwritten by the
next replay of the same graph. Training consumes them within the step, so nothing is copied;
gradients stored in ``.grad`` of a parameter or of a leaf input are detected and copied out
before a later backward overwrites them (``zero_grad(set_to_none=False)`` and gradient
accumulation stay correct). The parameters are not inputs of the replay's autograd node: its
backward puts their gradients into ``.grad`` itself, as AccumulateGrad would (the buffer where
``.grad`` is None, else added in place), which saves an autograd node a parameter (issue #53);
so ``torch.autograd.grad`` with respect to a parameter, and a parameter's gradient hooks, do not
see them (run the module itself for those). Everything that escapes a graph (output, gradients) lives
outside the shared pool, so graphs of other shapes never overwrite it. A second backward through
an old output after a newer forward replay raises (its saved activations are gone).

Autocast: the capture runs under the caller's autocast state with the autocast weight cache off
(a cached cast would be frozen into the graph while the optimizer updates the weights); the
state is part of the cache key. Dropout works (CUDA graphs advance the RNG offset per replay)
but draws other masks than an eager run. Parameters are captured by address: optimizers update
them in place, which the graphs see; replacing a parameter's storage (``.to()``, ``p.data =``)
drops every graph; replacing a submodule needs :meth:`JaggedGraphs.reset`.

``emulate=True`` runs the very same buffer, padding and gradient logic on any device without
capturing (the "graphs" are plain calls): the CPU tests use it to check the padding and the
gradient plumbing.
"""

from __future__ import annotations

import collections
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from shared.cuda_capture import GraphPool, capture, capture_stream, graph_pool
from shared.dense_inputs import COLD_NAMES

log = logging.getLogger(__name__)

DEFAULT_MAX_GRAPHS = 8
DEFAULT_MIN_BUCKET = 1024

# body(rows [B+1, d_i]..., seq [T_pad, D], lengths [B+1], elements [T_pad, k_j]...)
#   -> output [B+1, ...]
Body = Callable[
    [Sequence[torch.Tensor], torch.Tensor, torch.Tensor, Sequence[torch.Tensor]], torch.Tensor
]


def bucket_rows(t: int, min_rows: int = DEFAULT_MIN_BUCKET) -> int:
    """The padded element count for ``t`` elements: ``min_rows`` or more, else for ``t`` in
    (2^(k-1), 2^k] the next multiple of 2^(k-4) (8 buckets per octave; 31000 -> 32768)."""
    if t <= min_rows:
        return min_rows
    step = 1 << max((t - 1).bit_length() - 4, 0)
    return -(-t // step) * step


def pad_to_bucket(
    rows: Sequence[torch.Tensor],
    seq: torch.Tensor,
    lengths: torch.Tensor,
    elements: Sequence[torch.Tensor] = (),
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The inputs of a graph: B real rows + one dummy row owning the padding elements.

    ``rows``: [B, d_i] each -> [B + 1, d_i] with a zero (False) last row. ``seq``: [T_pad, D],
    of which the first ``lengths.sum()`` rows are real -> the rest set to zero (whatever they
    held); ``elements`` ([T_pad, k_j] each, e.g. the sequence's cold masks) the same.
    ``lengths``: [B] -> [B + 1], the last entry ``T_pad - lengths.sum()``. No host sync; the
    graphs run exactly this (the CPU tests compare it with the unpadded computation).
    """
    t_pad = seq.shape[0]
    real = lengths.sum(0, keepdim=True)  # [1] on the device
    padded_rows = [nn.functional.pad(r, (0, 0, 0, 1)) for r in rows]  # [B + 1, d_i]
    keep = (torch.arange(t_pad, device=seq.device) < real).unsqueeze(1)  # [T_pad, 1]
    padded_seq = torch.where(keep, seq, 0)  # [T_pad, D]
    padded_elements = [torch.where(keep, e, torch.zeros_like(e)) for e in elements]  # [T_pad, k]
    padded_lengths = torch.cat([lengths, real.neg().add_(t_pad)])  # [B + 1]
    return padded_rows, padded_seq, padded_lengths, padded_elements


class _Token:
    """Alive while a replayed forward's autograd node is; ``done`` once its backward ran."""

    __slots__ = ("__weakref__", "done")

    def __init__(self) -> None:
        self.done = False


class _Entry:
    """Static buffers and the forward/backward graphs of one shape."""

    def __init__(
        self,
        owner: JaggedGraphs,
        rows: Sequence[torch.Tensor],
        seq: torch.Tensor,
        lengths: torch.Tensor,
        elements: Sequence[torch.Tensor],
        t_pad: int,
        amp: tuple[bool, torch.dtype | None],
    ) -> None:
        self.owner = owner
        self.b, self.t_pad = rows[0].shape[0], t_pad
        self.amp_enabled, self.amp_dtype = amp
        self.device = seq.device
        # static leaves the graphs read; rows beyond the real T of a call are masked in-graph
        self.rows = [
            torch.zeros_like(r, memory_format=torch.contiguous_format).requires_grad_(
                r.requires_grad
            )
            for r in rows
        ]  # [B, d_i]
        self.seq = seq.new_zeros(t_pad, seq.shape[1]).requires_grad_(seq.requires_grad)
        self.lengths = torch.zeros_like(lengths, memory_format=torch.contiguous_format)  # [B]
        # per-element inputs without gradients (masks): [T_pad, k_j]
        self.elements = [e.new_zeros(t_pad, e.shape[1]) for e in elements]
        self.params: list[torch.Tensor] = [p for p in owner.params if p.requires_grad]
        # what the backward differentiates: leaves that require grad, then parameters
        self.inputs_grad = [x.requires_grad for x in (*self.rows, self.seq)]
        self.targets = [x for x in (*self.rows, self.seq) if x.requires_grad] + self.params
        self.ready = False
        self.fwd_graph: Any = None
        self.bwd_graph: Any = None
        self.static_out: torch.Tensor | None = None
        self.out: torch.Tensor | None = None  # [B, ...] outside the pool
        self.gout: torch.Tensor | None = None  # output gradient, [B, ...]
        self.grads: list[torch.Tensor | None] = []  # per target, outside the pool
        self.grad_ptrs: frozenset[int] = frozenset()

    # ----------------------------------------------------------------- per call

    def load(
        self,
        rows: Sequence[torch.Tensor],
        seq: torch.Tensor,
        lengths: torch.Tensor,
        elements: Sequence[torch.Tensor],
    ) -> None:
        for static, x in zip(self.rows, rows, strict=True):
            static.copy_(x)
        self.seq[: seq.shape[0]].copy_(seq)
        self.lengths.copy_(lengths)
        for static, x in zip(self.elements, elements, strict=True):
            static[: x.shape[0]].copy_(x)

    def replay_forward(self) -> None:
        if self.owner.emulate:
            self._forward_body()
        else:
            self.fwd_graph.replay()

    def replay_backward(self) -> None:
        if self.owner.emulate:
            self._backward_body()
        else:
            self.bwd_graph.replay()

    # ----------------------------------------------------------------- capture

    def _run(self) -> torch.Tensor:
        with (
            torch.enable_grad(),
            torch.autocast(
                self.device.type,
                dtype=self.amp_dtype,
                enabled=self.amp_enabled,
                cache_enabled=False,
            ),
        ):
            rows, seq, lengths, elements = pad_to_bucket(
                self.rows, self.seq, self.lengths, self.elements
            )
            return self.owner.body(rows, seq, lengths, elements)[: self.b]  # [B, ...]

    def _grad(self, out: torch.Tensor, gout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # emulated: keep the graph for a second backward, as a replayed backward graph allows
        retain = self.owner.emulate
        return torch.autograd.grad(out, self.targets, gout, allow_unused=True, retain_graph=retain)

    def _forward_body(self) -> None:
        self.static_out = self._run()
        assert self.out is not None
        self.out.copy_(self.static_out.detach())

    def _backward_body(self) -> None:
        assert self.static_out is not None and self.gout is not None
        grads = self._grad(self.static_out, self.gout)
        pairs = [(b, g) for b, g in zip(self.grads, grads, strict=True) if b is not None]
        if pairs:
            bufs, gs = zip(*pairs, strict=True)
            torch._foreach_copy_(list(bufs), list(cast(tuple[torch.Tensor, ...], gs)))

    def capture(self, pool: Any) -> None:
        """Warm up on the loaded inputs, allocate the escaping buffers, capture both graphs."""
        emulate = self.owner.emulate
        if emulate:
            out = self._run()
            grads = self._grad(out, torch.zeros_like(out))
        else:
            side = capture_stream(self.device)  # the stream the capture then runs on
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # lazy library init off the capture stream
                for _ in range(self.owner.warmup_iters):
                    out = self._run()
                    grads = self._grad(out, torch.zeros_like(out))
            torch.cuda.current_stream(self.device).wait_stream(side)
        # outside the pool: what the caller keeps never aliases another graph's scratch memory
        self.out = torch.empty_like(out.detach(), memory_format=torch.contiguous_format)
        self.gout = torch.zeros_like(self.out)
        self.grads = [
            None if g is None else torch.empty_like(t, memory_format=torch.contiguous_format)
            for g, t in zip(grads, self.targets, strict=True)
        ]
        self.grad_ptrs = frozenset(g.data_ptr() for g in self.grads if g is not None)
        del out, grads
        if not emulate:
            # not torch.cuda.graph(): it empties the caches at each capture (shared.cuda_capture)
            self.fwd_graph = torch.cuda.CUDAGraph()
            with capture(self.fwd_graph, pool=pool, device=self.device):
                self._forward_body()
            self.bwd_graph = torch.cuda.CUDAGraph()
            with capture(self.bwd_graph, pool=pool, device=self.device):
                self._backward_body()
        self.ready = True

    # ----------------------------------------------------------------- gradients

    def input_grads(self, t: int) -> list[torch.Tensor | None]:
        """Gradients of the row inputs and of the T real sequence elements (None if not needed)."""
        out: list[torch.Tensor | None] = []
        it = iter(self.grads)
        for i, needed in enumerate(self.inputs_grad):
            g = next(it) if needed else None
            if g is not None and i == len(self.rows):
                g = g[:t]  # [T, D]
            out.append(None if g is None else g.detach())
        return out

    def param_grads(self) -> list[torch.Tensor | None]:
        n = len(self.params)
        tail = self.grads[len(self.grads) - n :] if n else []
        return [None if g is None else g.detach() for g in tail]

    def accumulate_param_grads(self) -> None:
        """The replayed backward's parameter gradients into ``.grad``, as autograd's
        AccumulateGrad would: the buffer itself (a detached alias, as AccumulateGrad steals it;
        :meth:`unalias` copies it out before a later replay) where ``.grad`` is None, else
        added in place. One attribute write a parameter, where an AccumulateGrad node a
        parameter cost ~15 µs of host a step on the H100 (26 nodes for the cold-ids config,
        issue #53)."""
        for p, g in zip(self.params, self.param_grads(), strict=True):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)

    def unalias(self, leaves: Sequence[torch.Tensor]) -> None:
        """Copy out ``.grad`` tensors that autograd stole from this entry's buffers earlier."""
        for x in (*self.params, *leaves):
            g = x.grad
            if g is not None and g.data_ptr() in self.grad_ptrs:
                x.grad = g.clone()


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        entry: _Entry,
        n_rows: int,
        elements: tuple[torch.Tensor, ...],
        *tensors: torch.Tensor,
    ) -> torch.Tensor:
        # tensors: rows (n_rows), seq [T, D], lengths [B], then the owner's anchor (a leaf that
        # requires grad, so the output does whenever grad mode is on: the parameters are not
        # inputs, their gradients go to .grad in backward); elements ([T, k_j], no gradient)
        # ride outside them, as autograd need not see them
        rows, seq, lengths = tensors[:n_rows], tensors[n_rows], tensors[n_rows + 1]
        owner = entry.owner
        entry.load(rows, seq, lengths, elements)
        entry.replay_forward()
        token = _Token()
        owner._pending = weakref.ref(token)
        owner._generation += 1
        ctx.token, ctx.generation, ctx.entry, ctx.t = token, owner._generation, entry, seq.shape[0]
        ctx.leaves = [x for x in (*rows, seq) if x.requires_grad and x.is_leaf]
        assert entry.out is not None
        return entry.out.detach()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        entry: _Entry = ctx.entry
        if ctx.generation != entry.owner._generation:
            raise RuntimeError(
                "CUDA-graphed dense: backward through an output whose graph was replayed again "
                "since (a second backward after a newer forward); its activations are gone"
            )
        entry.unalias(ctx.leaves)
        assert entry.gout is not None
        entry.gout.copy_(grad)
        entry.replay_backward()
        ctx.token.done = True
        entry.accumulate_param_grads()
        return (None, None, None, *entry.input_grads(ctx.t), None, None)


class JaggedGraphs:
    """Graphs of ``body(rows, seq, lengths)`` for jagged batches; see the module docstring.

    ``module`` owns the parameters (``module.parameters()``, taken now); ``body`` computes the
    output of B + 1 rows from padded inputs (:func:`pad_to_bucket`).
    """

    def __init__(
        self,
        module: nn.Module,
        body: Body,
        *,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        max_captures: int | None = None,
        min_bucket: int = DEFAULT_MIN_BUCKET,
        warmup_iters: int = 2,
        capture_after: int = 1,
        emulate: bool = False,
    ) -> None:
        if max_graphs < 1 or warmup_iters < 1 or capture_after < 1:
            raise ValueError(
                "need max_graphs >= 1, warmup_iters >= 1 and capture_after >= 1, got "
                f"{max_graphs}, {warmup_iters}, {capture_after}"
            )
        # a shape is captured at its capture_after-th call (the calls before run eagerly): a
        # capture costs its warm-up runs and the capture, ~3 eager calls, which a shape seen
        # once (an epoch's partial last batches) never repays
        self.capture_after = capture_after
        self._sightings: collections.Counter[tuple] = collections.Counter()
        self.module = module
        self.body = body
        self.max_graphs = max_graphs
        self.max_captures = 4 * max_graphs if max_captures is None else max_captures
        self.min_bucket = min_bucket
        self.warmup_iters = warmup_iters
        self.emulate = emulate
        self.stats: collections.Counter[str] = collections.Counter()
        self._entries: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()
        self._failed: set[tuple] = set()
        self._pool: GraphPool | None = None
        self._pending: weakref.ref[_Token] | None = None
        self._generation = 0
        self._logged: set[str] = set()
        self._anchors: dict[torch.device, torch.Tensor] = {}  # see _Replay.forward
        self.reset()

    def reset(self) -> None:
        """Drop every graph and re-read the module's parameters."""
        self._entries.clear()
        self._failed.clear()
        self.params = list(self.module.parameters())
        self._param_sig = self._signature()
        self._any_param_grad = any(p.requires_grad for p in self.params)
        self._has_batch_norm = any(
            isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.module.modules()
        )

    def _signature(self) -> tuple:
        return tuple((p.data_ptr(), p.requires_grad) for p in self.params)

    @property
    def num_graphs(self) -> int:
        return len(self._entries)

    def _eager(self, reason: str) -> None:
        self.stats["eager"] += 1
        self.stats[f"eager:{reason}"] += 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.info("CUDA-graphed dense: running eagerly (%s)", reason)

    def _why_eager(self, rows: Sequence[torch.Tensor], seq: torch.Tensor) -> str | None:
        if not self.emulate and seq.device.type != "cuda":
            return "not on CUDA"
        if not torch.is_grad_enabled():
            return "grad mode off"
        if not self.module.training:
            return "eval mode"
        if self._has_batch_norm:
            return "batch norm: padding rows would enter its statistics"
        if rows[0].shape[0] == 0:
            return "empty batch"
        pending = self._pending() if self._pending is not None else None
        if pending is not None and not pending.done:
            return "a replay's backward is pending"
        return None

    def run(
        self,
        rows: Sequence[torch.Tensor],
        seq: torch.Tensor,
        lengths: torch.Tensor,
        eager: Callable[[], torch.Tensor],
        elements: Sequence[torch.Tensor] = (),
    ) -> torch.Tensor:
        """``body`` on the real rows through a graph (or ``eager()`` when it cannot be)."""
        # rows: [B, d_i] (bool masks too); seq: [T, D]; lengths: [B] int64 with sum T;
        # elements: [T, k_j] each, no gradient (the sequence's cold masks)
        reason = self._why_eager(rows, seq)
        if reason is not None:
            self._eager(reason)
            return eager()
        sig = self._signature()
        if sig != self._param_sig:
            log.info("CUDA-graphed dense: parameters moved or changed requires_grad; recapturing")
            self.reset()
        dev = seq.device.type
        amp_on = torch.is_autocast_enabled(dev)
        amp = (amp_on, torch.get_autocast_dtype(dev) if amp_on else None)
        t_pad = bucket_rows(seq.shape[0], self.min_bucket)
        key = (
            rows[0].shape[0],
            t_pad,
            tuple((r.shape[1], r.dtype, r.requires_grad) for r in rows),
            (seq.shape[1], seq.dtype, seq.requires_grad, lengths.dtype),
            tuple((e.shape[1], e.dtype) for e in elements),
            amp,
            seq.device,
        )
        if not (self._any_param_grad or seq.requires_grad or any(r.requires_grad for r in rows)):
            self._eager("nothing requires grad")
            return eager()
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        else:
            if key in self._failed:
                self._eager("capture failed for this shape")
                return eager()
            if self.stats["captures"] >= self.max_captures:
                self._eager("capture budget spent")
                return eager()
            self._sightings[key] += 1
            if self._sightings[key] < self.capture_after:
                self._eager("shape not seen often enough yet")
                return eager()
            entry = self._capture(key, rows, seq, lengths, elements, t_pad, amp)
            if entry is None:
                return eager()
        self.stats["replays"] += 1
        anchor = self._anchors.get(seq.device)
        if anchor is None:
            anchor = self._anchors[seq.device] = torch.zeros(0, device=seq.device).requires_grad_()
        return cast(
            torch.Tensor,
            _Replay.apply(entry, len(rows), tuple(elements), *rows, seq, lengths, anchor),
        )

    def _capture(
        self,
        key: tuple,
        rows: Sequence[torch.Tensor],
        seq: torch.Tensor,
        lengths: torch.Tensor,
        elements: Sequence[torch.Tensor],
        t_pad: int,
        amp: tuple[bool, torch.dtype | None],
    ) -> _Entry | None:
        while len(self._entries) >= self.max_graphs:
            self._entries.popitem(last=False)  # least recently used
            self.stats["evictions"] += 1
        if self._pool is None and not self.emulate:
            self._pool = graph_pool(seq.device)
        start = time.perf_counter()
        entry = _Entry(self, rows, seq, lengths, elements, t_pad, amp)
        try:
            with torch.no_grad():
                entry.load(rows, seq, lengths, elements)
            entry.capture(None if self._pool is None else self._pool.id)
        except Exception as err:  # noqa: BLE001 - fall back to eager for this shape
            self._failed.add(key)
            self.stats["capture_failures"] += 1
            log.warning(
                "CUDA-graphed dense: capture failed for B=%d T_pad=%d: %r; running "
                "this shape eagerly",
                key[0],
                t_pad,
                err,
            )
            self._eager("capture failed for this shape")
            return None
        self.stats["captures"] += 1
        self._entries[key] = entry
        log.info(
            "CUDA-graphed dense: captured B=%d T_pad=%d amp=%s in %.0f ms (%d graphs)",
            key[0],
            t_pad,
            amp,
            (time.perf_counter() - start) * 1e3,
            len(self._entries),
        )
        return entry


class DenseArchGraphs(JaggedGraphs):
    """:class:`~train.model.dense_arch.DenseArch` forward+backward through CUDA graphs.

    Called like the module (keywords of :data:`shared.dense_inputs.INPUT_NAMES`, and the cold
    masks of a module with a backoff); only the training layout (``user_index=None``) is
    graphed. A module's cold-id backoff (:mod:`train.model.backoff`) runs inside the graphs,
    before the towers: the masks are graph inputs beside the embeddings (``user_cold`` and
    ``item_cold`` as rows, False in the dummy row; ``seq_cold`` per element, False in the
    padding), so the backoff's forward and backward cost no launch of their own (issue #53;
    until then its ~30 ops a step ran eagerly around the graphs). Not an ``nn.Module``: keep it
    beside the model (the trainer does), never inside it.
    """

    def __init__(self, dense: nn.Module, **kw: Any) -> None:
        arch: Any = dense  # a DenseArch (not imported: graphs work on any such module)

        def body(
            rows: Sequence[torch.Tensor],
            seq: torch.Tensor,
            lengths: torch.Tensor,
            elements: Sequence[torch.Tensor],
        ) -> torch.Tensor:
            # rows: user_deep, item_deep, query [B + 1, d], then user_cold, item_cold [B + 1, K]
            # with a backoff; elements: seq_cold [T_pad, Ks] with a backoff
            embedded = dict(user_deep=rows[0], item_deep=rows[1], query=rows[2], seq_values=seq)
            if len(rows) > 3:
                cold = dict(user_cold=rows[3], item_cold=rows[4], seq_cold=elements[0])
                embedded = arch.back_off(embedded, cold)
            return arch.score(
                embedded["user_deep"], embedded["item_deep"], embedded["query"],
                embedded["seq_values"], lengths, None,
            )  # fmt: skip  # [B + 1]

        super().__init__(dense, body, **kw)

    def __call__(
        self,
        user_deep: torch.Tensor,
        item_deep: torch.Tensor,
        query: torch.Tensor,
        seq_values: torch.Tensor,
        seq_lengths: torch.Tensor,
        user_index: torch.Tensor | None,
        **cold: torch.Tensor,
    ) -> torch.Tensor:
        def eager() -> torch.Tensor:
            return cast(
                torch.Tensor,
                self.module(
                    user_deep, item_deep, query, seq_values, seq_lengths, user_index, **cold
                ),
            )

        if user_index is not None:
            self._eager("user_index given")
            return eager()
        if user_deep.shape[0] != item_deep.shape[0] or seq_lengths.shape[0] != query.shape[0]:
            return eager()  # the module raises its own error
        rows = [user_deep, item_deep, query]
        elements: list[torch.Tensor] = []
        if cold or cast(Any, self.module).takes_cold:
            masks = self._cold_masks(user_deep, seq_values, cold)
            if masks is None:
                return eager()  # the module raises its own error
            rows += masks[:2]
            elements.append(masks[2])
        return self.run(rows, seq_values, seq_lengths, eager, elements)  # [B]

    def _cold_masks(
        self, user_deep: torch.Tensor, seq_values: torch.Tensor, cold: dict[str, torch.Tensor]
    ) -> list[torch.Tensor] | None:
        """user_cold, item_cold [B, K], seq_cold [T, K] as the module's backoff takes them (a
        host check: shapes and dtypes), else None (the module's own call then says why)."""
        backoff = getattr(self.module, "backoff", None)
        masks = [cold.get(name) for name in COLD_NAMES]
        if backoff is None or set(cold) != set(COLD_NAMES):
            return None
        rows = {"user_cold": user_deep.shape[0], "item_cold": user_deep.shape[0],
                "seq_cold": seq_values.shape[0]}  # fmt: skip
        if backoff.why_not(cold) is not None or any(
            cold[name].shape[0] != n for name, n in rows.items()
        ):
            return None
        return cast(list[torch.Tensor], masks)


class DINGraphs(JaggedGraphs):
    """:class:`~train.model.din.JaggedDIN`'s training fast path through CUDA graphs."""

    def __init__(self, din: nn.Module, **kw: Any) -> None:
        def body(
            rows: Sequence[torch.Tensor],
            seq: torch.Tensor,
            lengths: torch.Tensor,
            elements: Sequence[torch.Tensor],
        ) -> torch.Tensor:
            return cast(torch.Tensor, din(rows[0], seq, lengths, None))  # [B + 1, D]

        super().__init__(din, body, **kw)

    def __call__(
        self,
        query: torch.Tensor,
        seq_values: torch.Tensor,
        seq_lengths: torch.Tensor,
        user_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        def eager() -> torch.Tensor:
            return cast(torch.Tensor, self.module(query, seq_values, seq_lengths, user_index))

        if user_index is not None:
            self._eager("user_index given")
            return eager()
        if seq_lengths.shape[0] != query.shape[0]:
            return eager()
        return self.run((query,), seq_values, seq_lengths, eager)  # [B, D]
