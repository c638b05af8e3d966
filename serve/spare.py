"""Hot swaps without graph captures: the next version written into a replaced one's tensors.

Capturing a version's CUDA graphs (:mod:`serve.graphs`) is most of a swap on the GPU: 42 graphs
in about 0.8 s on an H200, and the warm-up runs of the large buckets slow the batches served
meanwhile (``bench/bench_swap.py``'s timeline: a p99 1.8x the steady one while they run). Yet a
retrained version usually keeps its feature set and its dense program's graph: only the tables'
rows and the program's weights change. So a replaced model is kept as the *spare*
(:class:`Spare`) instead of being dropped, and the next version is written into its tensors,
then served through its graphs, which read those very tensors: no capture, no new memory::

    model = adopt(spare, path, verify_checksums=True, warmup_candidates=100)
    if model is None:                     # no spare, or the version does not fit it (logged)
        model = LoadedModel.load(path, ...)

What is written, off the serving path (the spare serves nobody):

- the tables, by :meth:`serve.lookup.EmbeddingTables.prepare_update`, the same writes as an
  in-place delta's (:mod:`serve.delta`): the dynamic tables' sorted keys and rows (they have
  ``--key-headroom`` free slots for new keys), the dense tables' changed rows;
- the program's weights, read from the new ``dense.pt2``
  (:func:`serve.program_cache.same_graph_weights`)
  into the spare's module.

A version fits the spare when its feature set has the same tables, its dynamic tables' keys fit
their free slots, and its ``dense.pt2`` has the same graph (the archive digest of
:mod:`serve.program_cache`, the weight payloads left out); else it loads in full and captures its
own graphs, as before (``dynrec_serving_model_load_paths_total{path=spare|full}`` counts which).
Before the new model serves, its graphs are checked (a replay equals the
eager run of the same inputs within :data:`serve.graphs.CHECK_ATOL`) and it is warmed up; a
failure after the writes drops the spare, and the version then loads in full.

When there is a spare: the server keeps one when it watches a model directory with CUDA graphs
on (:class:`serve.server.ServerConfig` ``reuse_graphs``; without graphs a full load captures
nothing, so a spare would only hold memory). A model becomes the spare when it retires
(:mod:`serve.versions`: ``RETIRE_AFTER_S`` after its swap, when the requests validated against it
have finished), if it shares no tensors with the serving model (a model an in-place delta's
successor replaced shares its tables with it; the last model of a chain of deltas does not,
and is kept: ``train stream``'s next full version is written into it). The
server also builds one at startup (a second copy of the first version), so that the first swap is
as cheap as the later ones. The writes happen under the spare's predict lock with the device idle
(:meth:`~serve.model.LoadedModel.between_batches`), and the spare is superseded by the new model:
a request still holding the old version is scored by the new one, never by a mix of the two.

Memory: a spare holds one more copy of the tables and of the graphs' memory pool for as long as
the server runs, which is what a swap needs at its peak anyway; ``--reuse-graphs off`` frees it
(and every swap captures). The host rows of CACHING tables are the exception while the spare
holds the served version's rows (the startup copy): one copy serves both, and the first version
written into the spare gets a copy of its own, copy-on-write (:mod:`serve.tiers`, "What a load
shares").
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import torch

from serve.graphs import CHECK_ATOL
from serve.lookup import InPlaceUnavailableError
from serve.model import (
    LoadedModel,
    StartupTimes,
    _side_stream,
    _sync,
    check_signature,
)
from serve.program_cache import refill, same_graph_weights
from shared.bundle import Bundle, read_bundle
from shared.bundle.layout import DENSE_PROGRAM

log = logging.getLogger(__name__)


class Spare:
    """At most one spare model (thread-safe): :meth:`offer` it on retirement, :meth:`take` it
    for a load; a model that cannot be one, or the spare it displaces, is retired."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._model: LoadedModel | None = None

    def offer(self, model: LoadedModel, serving: LoadedModel | None) -> bool:
        """Keep ``model`` (retired, or a copy built for this) as the spare if it can be one
        beside ``serving`` (module docstring); else retire it. Whether it was kept."""
        why = _unfit(model, serving)
        if why is not None:
            log.info("model %s retired (not kept as the spare: %s)", model.version, why)
            model.retire()
            return False
        with self._lock:
            old, self._model = self._model, model
        if old is not None:
            old.retire()
        log.info("model %s kept as the spare for the next version", model.version)
        return True

    @property
    def ready(self) -> bool:
        """Whether there is a spare now."""
        return self._model is not None

    def take(self) -> LoadedModel | None:
        with self._lock:
            model, self._model = self._model, None
        return model

    def clear(self) -> None:
        """Retire the spare, if any (the server stops)."""
        model = self.take()
        if model is not None:
            model.retire()


def _unfit(model: LoadedModel, serving: LoadedModel | None) -> str | None:
    if model.superseded:
        return "an in-place delta's successor serves its tables"
    if serving is not None and (
        serving.tables is model.tables
        or serving.program is model.program
        or serving.base_program is model.program
    ):
        return "it shares tensors with the serving model"
    return None


def adopt(
    spare: Spare, path: Path, *, verify_checksums: bool, warmup_candidates: int
) -> LoadedModel | None:
    """The bundle at ``path`` written into the spare model's tensors and served through its
    graphs (module docstring), or None when there is no spare or the version does not fit it
    (logged; the spare is then retired and the caller loads the version in full). A bundle that
    does not read is the caller's to refuse (:func:`~shared.bundle.read_bundle`'s errors
    propagate), and the spare is kept for the next one."""
    if not spare.ready:
        return None
    t0 = time.perf_counter()
    bundle = read_bundle(path, verify_checksums=verify_checksums)
    t1 = time.perf_counter()
    held = spare.take()
    if held is None:
        return None
    why = "it does not fit"
    try:
        model = _write(held, bundle, t0, t1, warmup_candidates)
    except Exception as err:  # noqa: BLE001 - any failure: the version loads in full
        model, why = None, f"{type(err).__name__}: {str(err)[:300]}"
    if model is None:
        log.info(
            "model %s: loading in full, not into the spare %s (%s)",
            bundle.version,
            held.version,
            why,
        )
        held.retire()
    return model


def _write(
    spare: LoadedModel, bundle: Bundle, t0: float, t1: float, warmup_candidates: int
) -> LoadedModel | None:
    """:func:`adopt` once the bundle is read: None (nothing written) when the version does not
    fit; raises (the spare is then dropped) when anything fails after the first write."""
    program, dev, graphs = spare.program, spare.device, spare.graphs
    if not isinstance(program.module, torch.nn.Module):
        return None
    # the program first: reading its weights is cheaper than preparing the tables' writes
    weights = same_graph_weights(bundle.path / DENSE_PROGRAM, program.module, program.digest)
    if weights is None:
        log.info(
            "model %s: its %s has another graph than the spare's, or weights that are not "
            "plain tensors",
            bundle.version,
            DENSE_PROGRAM,
        )
        return None
    check_signature(bundle, program)
    t2 = time.perf_counter()
    with _side_stream(dev):
        try:
            write = spare.tables.prepare_update(bundle)  # reads the spare's tables only
        except InPlaceUnavailableError as err:
            log.info("model %s does not fit the spare's tables: %s", bundle.version, err)
            return None
        model = spare.successor(bundle, program)  # the same tables, program, graphs and lock
        model.base_bundle, model.base_program, model.deltas = bundle, program, ()
        _sync(dev)
        with spare.between_batches():
            write()
            refill(program.module, weights)
            spare.supersede(model)
        t4 = time.perf_counter()
        if graphs is not None:
            graphs.rebind(model)  # the graphs are the new model's now, the spare's no more
            spare.graphs = None
            diff = graphs.verify()
            if not diff <= CHECK_ATOL:  # also NaN
                raise RuntimeError(f"a graph replay differs from eager by {diff} (> {CHECK_ATOL})")
        model.warmup(candidates=warmup_candidates)
        _sync(dev)
    t5 = time.perf_counter()
    tables_s, program_s = t4 - t2, t2 - t1  # the writes (weights too) counted with the tables
    model.startup = StartupTimes(t1 - t0, tables_s, program_s, t5 - t4, 0.0, t5 - t0)
    model.loaded_at = time.time()
    log.info(
        "model %s written into the spare %s in %.3fs (read %.1fms, tables %.1fms, weights "
        "%.1fms, check and warm-up %.1fms): %d CUDA graphs reused, none captured",
        model.version,
        spare.version,
        t5 - t0,
        (t1 - t0) * 1e3,
        tables_s * 1e3,
        program_s * 1e3,
        (t5 - t4) * 1e3,
        0 if graphs is None else len(graphs.graphs),
    )
    return model
