"""Replicated parts of the model: dense layers under DDP, num_buckets tables all-reduced.

The rule that makes ``W`` ranks take the step one process takes on the global batch: each rank's
loss is its *share* of the global mean, ``sum(bce over its rows) / global_rows``, and every
gradient is *summed* over ranks (never averaged):

- dense layers: :class:`~torch.nn.parallel.DistributedDataParallel` with a comm hook that sums
  (DDP's default divides by ``W``, which would scale the dense gradients but not the embedding
  gradients that reach the owners through the all-to-all);
- num_buckets tables (:class:`~train.model.fused_tables.DenseTables`: small tables fused per dim
  into one parameter, large ones a parameter each), summed by :func:`all_reduce_row_sparse`
  after backward, two ways by the parameter's rows:

  * small ones (at most ``DENSE_MAX_ROWS`` rows; the seed config's ten tables are one fused
    parameter of 261 rows, 4 K floats): gradients densified, flattened into one buffer,
    one all-reduce. It costs rows × dim floats whatever the batch touched, which for these
    tables is less than the (index, value) pairs would be, and it is one collective;
  * large tables (the all-num_buckets baseline config: 1.1 M user rows, 200 MB of floats a step
    if densified): each rank's coalesced (row, value) pairs are all-gathered (sizes first, then
    the padded pairs) and summed, so the traffic follows the rows the batch touched.

  Either way each table gets back a gradient of the kind it had (small tables have dense
  gradients, see :func:`train.model.sparse_arch.uses_sparse_grad`; large ones row-sparse), so
  ``torch.optim.Adagrad`` takes the same path as in one process. Rows whose summed gradient is
  exactly zero may be left out of a row-sparse one: for Adagrad such a row's update is zero
  either way.

Replicas start equal (the model is built from the same seed on every rank; DDP also broadcasts
rank 0's dense weights, and :class:`GradSync` broadcasts the tables) and stay equal because
every rank applies the same summed gradients with the same optimizer state.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from train.distributed.env import DistEnv
from train.model.multi_tower_din import MultiTowerDIN

log = logging.getLogger(__name__)


def _sum_hook(state, bucket):
    """DDP comm hook: all-reduce SUM (the losses are already shares of the global mean).

    Unannotated on purpose: DDP checks the annotations at runtime and rejects the strings that
    ``from __future__ import annotations`` makes of them. (state: None, bucket: GradBucket)
    """
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    assert work is not None
    return work.get_future().then(lambda fut: fut.value()[0])


class GradSync:
    """The DDP-wrapped dense part and the gradient all-reduce of the num_buckets tables.

    ``dense`` replaces ``model.dense`` in the training forward (it wraps the same module, so
    checkpoints and exports see unchanged parameter names).
    """

    def __init__(self, model: MultiTowerDIN, env: DistEnv) -> None:
        self.env = env
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.dense.modules()):
            log.warning(
                "use_bn: batch norm statistics are per rank (batch_size rows), not over the "
                "global batch; results differ from one process with the global batch"
            )
        cuda = env.device.type == "cuda"
        self.dense = DistributedDataParallel(
            model.dense,
            device_ids=[env.device.index] if cuda else None,
            output_device=env.device.index if cuda else None,
        )
        self.dense.register_comm_hook(None, _sum_hook)
        # one parameter per fused dim (all its tables' gradients in one tensor), one per large table
        self.tables: list[torch.Tensor] = list(model.sparse.dense_parameters())
        with torch.no_grad():
            for w in self.tables:
                dist.broadcast(w, src=0)

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor, global_rows: int) -> torch.Tensor:
        """This rank's share of the global mean BCE; the shares of all ranks sum to it."""
        bce = nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        return bce / global_rows

    def all_reduce_table_grads(self) -> None:
        """Sum the num_buckets tables' gradients over ranks (see the module docstring)."""
        all_reduce_row_sparse(self.tables)


DENSE_MAX_ROWS = 4096  # tables up to this many rows are all-reduced densely


def all_reduce_row_sparse(
    weights: list[torch.Tensor], *, dense_max_rows: int = DENSE_MAX_ROWS
) -> None:
    """Replace each weight's (row-sparse or absent) gradient by its sum over all ranks, as a
    coalesced row-sparse gradient (None where no rank has one). A collective."""
    _sum_dense([w for w in weights if w.shape[0] <= dense_max_rows])
    _sum_gathered([w for w in weights if w.shape[0] > dense_max_rows])


def _sum_dense(weights: list[torch.Tensor]) -> None:
    if not weights:
        return
    dense = [
        (torch.zeros_like(w) if w.grad is None else w.grad.to_dense()).reshape(-1) for w in weights
    ]
    keep_dense = [w.grad is not None and not w.grad.is_sparse for w in weights]
    flat = torch.cat(dense)  # [Σ rows × dim]
    dist.all_reduce(flat)
    sizes = [w.numel() for w in weights]
    for w, g, as_dense in zip(weights, torch.split(flat, sizes), keep_dense, strict=True):
        g = g.view_as(w)  # [rows, dim]
        if as_dense:  # a dense-gradient table (train.model.sparse_arch.uses_sparse_grad)
            w.grad = g
            continue
        rows = torch.nonzero(g.ne(0).any(1)).squeeze(1)
        _set_grad(w, rows, g.index_select(0, rows))


def _sum_gathered(weights: list[torch.Tensor]) -> None:
    if not weights:
        return
    world = dist.get_world_size()
    dev = weights[0].device
    rows, values = [], []
    for w in weights:
        g = w.grad
        if g is None:
            rows.append(torch.zeros(0, dtype=torch.int64, device=dev))
            values.append(w.new_zeros(0))
            continue
        g = (g if g.is_sparse else g.to_sparse(1)).coalesce()
        rows.append(g.indices()[0])
        values.append(g.values().reshape(-1))
    dims = torch.tensor([w.shape[1] for w in weights])
    mine = torch.tensor([r.numel() for r in rows], dtype=torch.int64, device=dev)  # [L]
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    counts = torch.stack(every).cpu()  # [W, L] rows per rank and table
    n_max, f_max = int(counts.sum(1).max()), int((counts * dims).sum(1).max())
    got_rows = _gather_padded(torch.cat(rows), n_max, world)  # [W, n_max]
    got_values = _gather_padded(torch.cat(values), f_max, world)  # [W, f_max]
    row_at = torch.cumsum(counts, 1) - counts  # [W, L] offsets
    value_at = torch.cumsum(counts * dims, 1) - counts * dims
    for t, w in enumerate(weights):
        d = int(dims[t])
        r = torch.cat(
            [got_rows[k, row_at[k, t] : row_at[k, t] + counts[k, t]] for k in range(world)]
        )
        v = torch.cat(
            [
                got_values[k, value_at[k, t] : value_at[k, t] + counts[k, t] * d]
                for k in range(world)
            ]
        ).view(-1, d)
        summed = torch.sparse_coo_tensor(r.unsqueeze(0), v, w.shape).coalesce()
        _set_grad(w, summed.indices()[0], summed.values())


def _gather_padded(x: torch.Tensor, size: int, world: int) -> torch.Tensor:
    """[world, size]: every rank's 1-D ``x`` (at most ``size`` long), zero-padded."""
    padded = x.new_zeros(size)
    padded[: x.numel()] = x
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.stack(out)


def _set_grad(w: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``w.grad`` = the coalesced row-sparse (rows [n], values [n, dim]); None when n == 0, as a
    table no rank looked up has no gradient in one process either."""
    if rows.numel() == 0:
        w.grad = None
        return
    w.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), values, w.shape, is_coalesced=True)
