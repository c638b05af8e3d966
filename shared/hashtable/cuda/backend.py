"""The CUDA backend of a hash table: the CuPy kernels of this folder, the torch backend's
algorithms where the kernels stop.

A table gets it once, when it is made on a CUDA device with CuPy installed
(:func:`shared.hashtable.backend.backend_for`), or by passing ``CudaBackend()``. It derives from
:class:`~shared.hashtable.torch_backend.TorchBackend` and overrides what the kernels do; the
inherited torch algorithms (``super()``) run, on the same arrays, for the cases the kernels do
not cover. Those cases are decided here, and nowhere else:

- ``find``: always the kernel (``find.py``).
- ``insert_or_assign``: ``insert.py``'s kernels, full buckets at max capacity included
  (``ht_ins2_over``: eviction by score, NO_EVICTION refusals, as the inherited
  ``insert_overflow``, which takes them only for buckets too large for a block; with
  ``exact=False`` without a host read, the evictions padded, the counts settled later). The torch algorithms
  take the whole call (the kernels leave the table untouched) when the table must grow, when a
  bucket receives more than twice its capacity of new occurrences, for invalid keys (the torch
  code raises its error), for no keys or 2**31 keys or more, and when a bucket's shared memory
  exceeds what the device allows.
- ``erase``: ``insert.py``'s erase kernels (with ``count=False`` without a host sync: the count is
  copied to pinned memory and added to the size when it is next read); the torch algorithms for
  2**31 keys or more or buckets too large for shared memory.
- ``build`` (``HashTable.from_keys_values``): ``build.py``; the torch algorithms for no keys,
  2**31 keys or more, buckets of more than 3072 slots (48 KiB of shared memory), and duplicate
  keys (the torch code names the key in its error).
- ``fingerprint``: ``keyed.cu``'s kernel for int64 keys on CUDA (with table ids of the same
  shape); the inherited algorithms hash with it too (growth, eviction).
- ``keyed_rows``: ``keyed.cu``'s initializer kernel, all the tables of a list in one launch.
- ``expand_rows`` (the static training step's rows per occurrence): ``keyed.cu``'s
  ``kd_expand_rows`` for new rows of :meth:`CudaBackend.keyed_rows` and contiguous float32 values
  (dim > 0) on CUDA, every tensor on the values' device.
- ``unique_pairs`` (a storage's deduplication of its lookup): torch's sorts, then ``unique.cu``'s
  kernels, for 1-D int64 keys on CUDA (at least one) with int64 table ids or none.
- ``segment_sum_sorted`` and ``adagrad_update`` (training's sparse update): ``sparse_update.cu``
  for float32 tensors on CUDA: the tree's rounds below 16 in one launch, one launch per later
  round, one for Adagrad.
- ``apply_sparse_gradients`` (the static training step's backward): the same kernels, the
  gradients read through the sort order and the runs' sums where the tree left them, no
  gathers (on the H200, 0.13 ms a step of 400K keys of dim 16, Adagrad included; the two
  gathers and 17 rounds it replaces took about 0.4 ms: see ``sparse_update.py``), for
  contiguous float32 values and accumulators and float32 gradients of their dim on CUDA.

:attr:`CudaBackend.paths` counts what the calls did (``insert.fast``, ``insert.slow``,
``insert.overflow``: the kernels stored the call; ``insert.abort``, ``insert.unsupported``: the
torch algorithms did, see ``insert.PATHS``; ``erase.kernel``, ``erase.deferred`` (the kernels,
``count=False``: the size settled later) / ``erase.torch``,
``build.kernel`` / ``build.torch``): what tests and benchmarks read to see which path ran.
Every result equals the torch backend's (the GPU tests compare them on the device).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from shared.hashtable.cuda import build as cuda_build
from shared.hashtable.cuda import find as cuda_find
from shared.hashtable.cuda import insert as cuda_insert
from shared.hashtable.cuda import keyed, sparse_update, unique
from shared.hashtable.cuda import runtime as rt
from shared.hashtable.hashing import fingerprint
from shared.hashtable.layout import InsertResult, SelectedInsert, TableLayout
from shared.hashtable.torch_backend import TorchBackend

if TYPE_CHECKING:
    from shared.hashtable.adagrad import AdagradConfig
    from shared.hashtable.initializers import KeyedInitializer, NewRows

L = TypeVar("L", bound=TableLayout)


class CudaBackend(TorchBackend):
    """The kernels of :mod:`shared.hashtable.cuda` (see the module docstring); CUDA tables only.

    Construction needs CUDA and CuPy (``runtime.unavailable_reason()`` says what is missing)
    and imports CuPy; nothing is imported or decided per call after that.
    """

    name = "cuda"

    def __init__(self) -> None:
        reason = rt.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"CudaBackend: the CUDA kernels cannot run here: {reason}")
        rt.load()
        self.paths: Counter[str] = Counter()

    def __repr__(self) -> str:
        return "CudaBackend()"

    def accepts(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def compile_for(self, device: torch.device) -> None:
        """Compile every kernel module for ``device`` (``runtime.compile_modules``)."""
        rt.compile_modules(device, (keyed.SOURCE, sparse_update.SOURCE, unique.SOURCE))

    # ------------------------------------------------------------------ hashing, new rows

    def fingerprint(self, keys: torch.Tensor, table_ids: torch.Tensor | None) -> torch.Tensor:
        if (
            keys.is_cuda
            and keys.dtype == torch.int64
            and (table_ids is None or table_ids.shape == keys.shape)
        ):
            return keyed.fingerprint(keys, table_ids)
        return fingerprint(keys, table_ids)

    def unique_pairs(
        self, keys: torch.Tensor, table_ids: torch.Tensor | None, *, reject_negative: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if unique.supports(keys, table_ids):
            return unique.unique_pairs(keys, table_ids, reject_negative=reject_negative)
        return super().unique_pairs(keys, table_ids, reject_negative=reject_negative)

    def keyed_rows(self, inits: Sequence[KeyedInitializer | None], device: torch.device) -> NewRows:
        return keyed.KernelRows(inits, device)

    def expand_rows(
        self,
        values: torch.Tensor,
        rows: torch.Tensor,
        inverse: torch.Tensor,
        keys: torch.Tensor,
        which: torch.Tensor,
        new_rows: NewRows,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dev = values.device
        if (
            isinstance(new_rows, keyed.KernelRows)
            and new_rows.params.prm.device == dev
            and values.is_cuda
            and values.dtype == torch.float32
            and values.dim() == 2
            and values.shape[1] > 0
            and values.is_contiguous()
            and all(t.device == dev for t in (rows, inverse, keys, which))
        ):
            return keyed.expand_rows(new_rows.params, values, rows, inverse, keys, which)
        return super().expand_rows(values, rows, inverse, keys, which, new_rows)

    # ------------------------------------------------------------------ sparse update

    def segment_sum_sorted(
        self,
        x: torch.Tensor,
        starts: torch.Tensor,
        counts: torch.Tensor,
        group: torch.Tensor,
        max_count: int | None = None,
    ) -> torch.Tensor:
        if x.is_cuda and x.dtype == torch.float32 and x.dim() == 2:
            return sparse_update.segment_sum_sorted(x, starts, counts, group, max_count)
        return super().segment_sum_sorted(x, starts, counts, group, max_count)

    def adagrad_update(
        self,
        values: torch.Tensor,
        accumulators: torch.Tensor,
        rows: torch.Tensor,
        grads: torch.Tensor,
        config: AdagradConfig,
    ) -> None:
        fast = all(t.is_cuda and t.dtype == torch.float32 and t.is_contiguous()
                   for t in (values, accumulators))  # fmt: skip
        if fast and values.dim() == 2:
            sparse_update.adagrad_update(values, accumulators, rows, grads, config)
        else:
            super().adagrad_update(values, accumulators, rows, grads, config)

    def apply_sparse_gradients(
        self,
        values: torch.Tensor,
        accumulators: torch.Tensor,
        rows: torch.Tensor,
        grads: torch.Tensor,
        order: torch.Tensor,
        starts: torch.Tensor,
        counts: torch.Tensor,
        group: torch.Tensor,
        max_count: int,
        config: AdagradConfig,
    ) -> None:
        fast = (
            all(t.is_cuda and t.dtype == torch.float32 for t in (values, accumulators, grads))
            and values.is_contiguous()
            and accumulators.is_contiguous()
            and values.dim() == grads.dim() == 2
            and grads.shape[1] == values.shape[1]
            and order.numel() > 0
        )
        if fast:
            sparse_update.apply_sparse_gradients(
                values, accumulators, rows, grads, order, starts, counts, group, max_count, config
            )
        else:
            super().apply_sparse_gradients(
                values, accumulators, rows, grads, order, starts, counts, group, max_count, config
            )

    # ------------------------------------------------------------------ operations

    def find(
        self, t: TableLayout, keys: torch.Tensor, table_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return cuda_find.find(t, keys, table_ids)

    def insert_or_assign(
        self,
        t: TableLayout,
        keys: torch.Tensor,
        values: torch.Tensor,
        scores: torch.Tensor,
        *,
        table_ids: torch.Tensor | None = None,
        accumulators: torch.Tensor | None = None,
        pinned_rows: torch.Tensor | None = None,
        exact: bool = True,
    ) -> InsertResult:
        extra = {"table_ids": table_ids, "accumulators": accumulators, "pinned_rows": pinned_rows}
        result, path = cuda_insert.insert_or_assign(
            t, self, keys, values, scores, exact=exact, **extra
        )
        self.paths[f"insert.{path}"] += 1
        if result is not None:
            return result
        return super().insert_or_assign(
            t, keys, values, scores, table_ids=table_ids, accumulators=accumulators,
            pinned_rows=pinned_rows,
        )  # fmt: skip

    def insert_selected(
        self,
        t: TableLayout,
        keys: torch.Tensor,
        table_ids: torch.Tensor | None,
        values: torch.Tensor,
        scores: torch.Tensor,
        mask: torch.Tensor,
        pinned: torch.Tensor | None,
    ) -> SelectedInsert | None:
        return cuda_insert.insert_selected(t, keys, table_ids, values, scores, mask, pinned)

    def reserve_selected(self, t: TableLayout) -> None:
        cuda_insert.reserve_scratch(t)

    def erase(
        self,
        t: TableLayout,
        keys: torch.Tensor,
        table_ids: torch.Tensor | None = None,
        *,
        count: bool = True,
    ) -> int | None:
        # one host sync; none with count=False (the size is settled later: insert.erase)
        done, erased = cuda_insert.erase(t, keys, table_ids, count=count)
        if done:
            self.paths["erase.kernel" if count else "erase.deferred"] += 1
            return erased
        self.paths["erase.torch"] += 1
        return super().erase(t, keys, table_ids)

    def build(
        self,
        sized: Callable[[int, int, bool], L],
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        device: torch.device,
        scores: torch.Tensor | None = None,
        table_ids: torch.Tensor | None = None,
        accumulators: torch.Tensor | None = None,
    ) -> L:
        extra = {"scores": scores, "table_ids": table_ids, "accumulators": accumulators}
        table = cuda_build.build(sized, keys, values, device=device, **extra)
        if table is not None:
            self.paths["build.kernel"] += 1
            return table
        self.paths["build.torch"] += 1
        return super().build(sized, keys, values, device=device, **extra)
