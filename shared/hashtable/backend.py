"""A hash table's backend: the object that runs its operations, chosen once per table.

A :class:`~shared.hashtable.table.HashTable` holds its arrays (a
:class:`~shared.hashtable.layout.TableLayout`) and one :class:`Backend`, set when the table is
made (``HashTable(..., backend=...)``, default :func:`backend_for` its device) or copied to a
device (``HashTable.to``); every find, insert, erase and bulk build goes through it, and no call
asks again which one it is. Two implementations, equal in every result:

- :class:`~shared.hashtable.torch_backend.TorchBackend`: vectorized torch on any device; the CPU
  path and the reference.
- :class:`~shared.hashtable.cuda.backend.CudaBackend`: the CuPy kernels of
  :mod:`shared.hashtable.cuda`, derived from the torch backend, whose algorithms it runs for the
  cases its kernels do not cover (listed in its module docstring).

Tests and benchmarks pick one by constructing it, e.g. ``HashTable(..., device="cuda",
backend=TorchBackend())`` for the reference on a GPU. The storages of training
(``FusedStorage``) take their table's backend for the admission counter and the new-row
initializers too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch

from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.cuda import runtime as cuda_kernels
from shared.hashtable.cuda.backend import CudaBackend
from shared.hashtable.initializers import KeyedInitializer, NewRows
from shared.hashtable.layout import InsertResult, SelectedInsert, TableLayout
from shared.hashtable.torch_backend import TorchBackend

L = TypeVar("L", bound=TableLayout)

__all__ = ["Backend", "CudaBackend", "NewRows", "TorchBackend", "backend_for"]


class Backend(Protocol):
    """The operations of a hash table on its :class:`TableLayout` (see the module docstring).

    ``find`` takes keys checked by ``TableLayout._prepare`` (``HashTable.find`` checks them);
    ``insert_or_assign`` and ``erase`` take the caller's tensors and check them themselves (the
    CUDA kernels check on the device, without a host sync). Results are those documented on
    :class:`~shared.hashtable.table.HashTable`.
    """

    name: str  # "torch", "cuda": what the table's repr shows

    def accepts(self, device: torch.device) -> bool:
        """Whether tables on ``device`` can use this backend."""
        ...

    def fingerprint(self, keys: torch.Tensor, table_ids: torch.Tensor | None) -> torch.Tensor:
        """:func:`shared.hashtable.hashing.fingerprint` of the keys (the same bits)."""
        ...

    def unique_pairs(
        self, keys: torch.Tensor, table_ids: torch.Tensor | None, *, reject_negative: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`shared.hashtable.hashing.unique_pairs` (the same tensors, values and dtypes;
        ``NegativeKeyError`` alike): what a storage's lookup deduplicates its keys with."""
        ...

    def keyed_rows(self, inits: Sequence[KeyedInitializer | None], device: torch.device) -> NewRows:
        """The new-row function of table ids ``0 .. len(inits) - 1`` on ``device`` (make it
        once per list: it may copy parameters to the device)."""
        ...

    def expand_rows(
        self,
        values: torch.Tensor,
        rows: torch.Tensor,
        inverse: torch.Tensor,
        keys: torch.Tensor,
        which: torch.Tensor,
        new_rows: NewRows,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A lookup's rows per occurrence: (out [N, dim] float32, stored [N] bool) for the
        occurrences of runs ``inverse`` [N] (indices into the runs' ``rows``, ``keys``,
        ``which`` [P]). With ``r = rows[inverse[i]]``: ``out[i] = values[r]`` where ``r >= 0``,
        else ``new_rows``' row of the run's key from initializer ``which`` (``new_rows`` made by
        :meth:`keyed_rows`); ``stored[i] = r >= 0``. The same bits as the gather per run, the
        initial rows of every run and the gather per occurrence of the torch backend; no host
        read (the static training step captures it)."""
        ...

    def segment_sum_sorted(
        self,
        x: torch.Tensor,
        starts: torch.Tensor,
        counts: torch.Tensor,
        group: torch.Tensor,
        max_count: int | None = None,
    ) -> torch.Tensor:
        """:func:`shared.hashtable.hashing.segment_sum_sorted` (the same bits)."""
        ...

    def adagrad_update(
        self,
        values: torch.Tensor,
        accumulators: torch.Tensor,
        rows: torch.Tensor,
        grads: torch.Tensor,
        config: AdagradConfig,
    ) -> None:
        """:func:`shared.hashtable.adagrad.adagrad_update` in place (the same bits)."""
        ...

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
        """Adagrad (``config``) in place on row ``rows[j]`` with run j's summed gradient, where
        run j holds the rows ``grads[order[starts[j] + k]]`` for ``k < counts[j]`` (``group[i]``:
        the run of sorted position i); rows of -1 are skipped. ``max_count``: the longest run,
        or any bound >= it (the static step passes its padded size). The same bits as
        ``adagrad_update(values, accumulators, rows, segment_sum_sorted(grads[order], starts,
        counts, group, max_count), config)``; the static step's backward, captured: no host read
        where the kernels run."""
        ...

    def find(
        self, t: TableLayout, keys: torch.Tensor, table_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

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
        """``exact=False``: evictions may come padded (see ``InsertResult``), the table's counts
        then settled later (``TableLayout._defer``)."""
        ...

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
        """A captured training step's insert of the selected absent keys at max capacity on this
        backend's kernels (:func:`shared.hashtable.cuda.insert.insert_selected`), or None where
        it has none for the call: :func:`shared.hashtable.static_insert.insert_absent` then
        merges with torch ops."""
        ...

    def reserve_selected(self, t: TableLayout) -> None:
        """Make now, outside any capture, what :meth:`insert_selected` keeps with ``t`` between
        calls (the CUDA kernels' scratch): a capture may not page-lock the host memory of a
        table whose row arrays are on the host (``RowArrays.HOST``)."""
        ...

    def erase(
        self,
        t: TableLayout,
        keys: torch.Tensor,
        table_ids: torch.Tensor | None = None,
        *,
        count: bool = True,
    ) -> int | None:
        """The number of pairs removed; ``count=False`` (valid keys promised, see
        ``HashTable.erase``): None is allowed, the size then settled later (``TableLayout._defer``)."""
        ...

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
        """The table ``sized(n, dim, with_accumulator)`` makes, filled with the distinct
        ``keys`` [n] and ``values`` [n, dim] (``HashTable.from_keys_values``)."""
        ...


TORCH = TorchBackend()


@functools.cache
def _cuda() -> CudaBackend:
    return CudaBackend()


def backend_for(device: torch.device | str) -> Backend:
    """The backend a table on ``device`` gets by default: the CUDA kernels on a CUDA device
    where CuPy is installed (one :class:`CudaBackend` for every CUDA table), else the torch
    backend. The one place the choice is made; the kernels are compiled for ``device`` here,
    before a table's first step."""
    device = torch.device(device)
    if device.type == "cuda" and cuda_kernels.available():
        backend = _cuda()
        backend.compile_for(device)
        return backend
    return TORCH
