"""Replay a batch's lookups + dense program + sigmoid as one CUDA graph per shape bucket.

Run eagerly, one batch is ~120 kernel launches: 2.4 ms of host launching for 0.66 ms of GPU work.
A CUDA graph launches them all at once, but it replays fixed shapes from fixed buffers. So the
host pads each batch up to a *bucket*, copies it into the bucket's input buffer and replays the
bucket's graph, whose output holds a score for each padded row; the real rows' scores are kept.

A :class:`Bucket` holds up to ``candidates`` real candidate rows (and as many users), each KJT key
up to one id per row (``elements`` per sequence feature) and ``pairs`` (candidate, element) pairs
(:func:`shared.dense_inputs.pair_index`). The host fills the ids, lengths, ``user_index`` and the
number of real rows; the graph builds the pairs from them on the device
(:func:`shared.dense_inputs.padded_pair_index`: a serving batch has ~50 pairs a candidate, which
the host would write and copy as 16 bytes each). Padding never changes a real score::

    rows    real candidates 0..B-1, then dummies; every dummy candidate's user is the dummy user U
    users   real users 0..U-1, then the dummy user U (and rows with no bags after it)
    values  each key's real ids, then PAD_ID (0, a valid row of every table) up to the key's
            capacity, all in a bag of the first dummy row (user U, candidate B)
    pairs   the real pairs (pair_segment < B, pair_element < T), then pairs of the last dummy
            candidate (row ``candidates``, always a dummy) with element 0 (built in the graph)

Real bags, real sequence rows (first in each key) and real pairs are where they were, so the
pooled embeddings, the DIN's softmax over each real candidate's pairs and every real score are
the eager ones (up to float reassociation in kernels of other sizes). The padding ids' lookups are
left out of the table statistics (:meth:`serve.lookup.EmbeddingTables.discount_padding`).
:meth:`BucketGraph.fill` takes a :class:`~serve.host_batch.HostBatch` (requests handed off by
frontends, merged without KJTs) or a :class:`~shared.batch.Batch`, and pads again only what the
bucket's last fill wrote beyond this batch's data (the rest of its slots already holds padding),
so its cost follows the batch, not the bucket.

Graphs are captured off the serving path, when a model is loaded (:meth:`CudaGraphs.capture`, for
the buckets of :func:`default_buckets` or a configured list), each checked against the eager
result of its capture batch. A batch runs eagerly when no captured bucket fits it, when its keys
or tensors are not those the graphs were captured for, or when a bucket's capture failed; each
reason is counted in :attr:`CudaGraphs.stats` and logged once::

    graphs = CudaGraphs.capture(model, default_buckets(1024))
    probs = graphs.predict(batch)        # [B] float32 on the CPU, or None: run it eagerly
    pending = graphs.start(batch)        # the same, not waiting: PendingScores (or None)

:meth:`CudaGraphs.start` returns once the copy in, the replay and the copy of the scores back to
(pinned) host memory are enqueued, with an event recorded after the last: the caller (the
batcher's completion thread, :mod:`serve.batcher`) waits for it, while the host pads the next
batch. A bucket's host slots are refilled only once its last copy in has read them
(:meth:`BucketGraph.fill` waits for that copy's event).

Memory: all graphs of one model are captured into **one** memory pool
(:func:`shared.cuda_capture.graph_pool`), so their intermediates share blocks and the pool is about
the largest graph's activations, not the sum over the buckets. Sharing is safe because no two of
them ever run at once: replays are issued on one stream, by one thread at a time (under the
model's lock, :meth:`serve.model.LoadedModel.start`), and each replay recomputes every
intermediate from its input buffers before reading it; what outlives a replay is only its
output, which stays allocated (a block in use is never handed to another capture) and whose copy
to the host is enqueued right after the replay, on the same stream, before any later replay
(whose intermediates may use the blocks of an earlier capture's output). Another model version (the next one, loading while this one
serves) captures into a pool of its own, so the two never share memory, and on a capture stream
of its own (:func:`shared.cuda_capture.capture_streams`): torch keys the cuBLAS workspace a
captured GEMM writes by (thread, stream), so two models' graphs captured on one stream would
share it, and the next version's check and warm-up replays, on the load stream beside the
served version's, would overwrite the served version's GEMM partial sums (pytorch#193402; on the
H200 on 2026-12-07 three answers just before a swap had neither version's scores). The capture time and
the memory the graphs took (allocated and reserved, around the captures) are in
:attr:`CudaGraphs.stats`, the log and the model's startup stage ``graphs``. Buckets are captured
cheapest first, and capturing stops once less than :data:`MIN_FREE_MEMORY_FRACTION` of the GPU is
free (the rest are skipped, with why, and their batches run eagerly), so several processes or a
small GPU degrade to eager batches instead of running out of memory.

Graphs read the tensors they were captured with: the model's tables and dense program. They
are only valid for the :class:`~serve.lookup.EmbeddingTables` and program object they were
captured on; a model whose tables or program was replaced runs eagerly (counted as
``"tables or program replaced"``) until its graphs are captured again. Deltas
(:mod:`serve.delta`) either write their rows into the live tables in place, between batches
(the tensors, and so the graphs, stay; a device count tensor carries a table's new size), or,
where that cannot be done, build a new model whose warm-up captures its own graphs before the
swap; so this never happens on the serving path.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from serve.batcher import PendingScores
from serve.host_batch import HostBatch, HostKjt
from serve.lookup import PAD_ID
from shared.batch import Batch
from shared.cuda_capture import capture, capture_streams, graph_pool
from shared.dense_inputs import DenseLayout, Pairs, batch_pair_count, padded_pair_index, pair_count

if TYPE_CHECKING:
    from serve.model import LoadedModel

log = logging.getLogger(__name__)

# The default buckets, in one place. Pairs per candidate (the mean sequence length of the batch's
# users) of 8, 32 and 128 (sequences of the seed config are at most 100 clicks): each step is
# x4, so a batch pays for at most 4x its pairs (padding), and 3 ratios x 14 candidate sizes (1 to
# 8192, x2 steps: at most 2x its rows) make 42 graphs. (4, 16, 32, 64, 128) made 70: 2/3 more
# capture time at load for less padding, while a batch is bound by launches, not by its pairs.
DEFAULT_PAIR_RATIOS = (8, 32, 128)
MAX_DEFAULT_PAIRS = 1 << 20  # no default bucket beyond (its graph would hold GBs of activations)
CHECK_ATOL = 1e-5  # a captured graph whose replay differs more from eager is not used
# Captures stop (the larger buckets then run eagerly) once the device has less than this share
# of its memory free: the rest is for eager batches, the next version's load (it captures into a
# pool of its own while this one serves) and other server processes on the same GPU. 12 GiB for
# the default buckets at 8192 rows is a fraction of an H200, most of a 24 GiB card.
MIN_FREE_MEMORY_FRACTION = 0.25


@dataclass(frozen=True, order=True)
class Bucket:
    """Capacities of one graph (ordered by cost: pairs, then elements, then candidates)."""

    pairs: int  # (candidate, element) pairs
    elements: int  # sequence elements (ids per sequence feature)
    candidates: int  # candidate rows, and users; the graph has one more of each (dummies)

    def __post_init__(self) -> None:
        if self.candidates < 1 or self.elements < 1 or self.pairs < 1:
            raise ValueError(f"bucket {self}: candidates, elements and pairs must be >= 1")


def default_buckets(
    max_candidates: int, ratios: Sequence[int] = DEFAULT_PAIR_RATIOS
) -> tuple[Bucket, ...]:
    """Candidates 1, 2, 4, ... up to the first power of two >= ``max_candidates``, each with
    ``pairs = elements = candidates * r`` for r in ``ratios`` (a user's elements each make at
    least one pair, so elements <= pairs), at most :data:`MAX_DEFAULT_PAIRS` pairs."""
    if max_candidates < 1:
        raise ValueError(f"max_candidates must be >= 1, got {max_candidates}")
    top = math.ceil(math.log2(max_candidates))
    out = {
        Bucket(c * r, c * r, c)
        for c in (1 << k for k in range(top + 1))
        for r in ratios
        if c * r <= MAX_DEFAULT_PAIRS
    }
    return tuple(sorted(out))


@dataclass
class GraphStats:
    """What :class:`CudaGraphs` did: graphs captured, batches replayed, batches run eagerly by
    reason, and the buckets whose capture failed with why."""

    captures: int = 0
    replays: int = 0
    eager: dict[str, int] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # not captured: memory (why)
    capture_seconds: float = 0.0  # wall time of all captures (and their checks)
    memory_allocated_bytes: int = 0  # torch.cuda.memory_allocated after - before the captures
    memory_reserved_bytes: int = 0  # ... memory_reserved: the pool's segments (what it costs)

    def as_dict(self) -> dict[str, object]:
        return {
            "captures": self.captures,
            "replays": self.replays,
            "eager": dict(self.eager),
            "failures": dict(self.failures),
            "skipped": dict(self.skipped),
            "capture_seconds": self.capture_seconds,
            "memory_allocated_bytes": self.memory_allocated_bytes,
            "memory_reserved_bytes": self.memory_reserved_bytes,
        }


def scores(
    model: LoadedModel, batch: Batch, pairs: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """What a graph holds: lookups + dense program + sigmoid of a batch on the model's device
    → [B] float32 probabilities there (eager; no host sync for a program taking the pairs)."""
    inputs = model.tables.embed(batch, pairs=pairs, cold=model.program.takes_cold)
    return torch.sigmoid(model.program(**inputs).float())


# --------------------------------------------------------------------------- one bucket's buffers


@dataclass(frozen=True)
class _KjtShape:
    """One KJT of a bucket: its keys, rows (real capacity + 1 dummy) and ids per key."""

    keys: tuple[str, ...]
    rows: int
    per_key: int  # id capacity of each key

    @property
    def offsets(self) -> list[int]:
        return [k * self.per_key for k in range(len(self.keys) + 1)]


# what a fill wrote into one KJT's slots beyond the padding: (real rows, ids of each key)
_Extent = tuple[int, tuple[int, ...]]


class _Buffers:
    """A bucket's inputs as int64 slots of one pinned host buffer and one device buffer of the
    same layout: the host fills the slots (numpy), one copy moves them, the graph reads them.
    On the CPU (tests of the padding) both are one buffer."""

    def __init__(self, shapes: Sequence[_KjtShape], device: torch.device) -> None:
        sizes = [n for s in shapes for n in (len(s.keys) * s.per_key, len(s.keys) * s.rows)]
        sizes += [shapes[1].rows, 1]  # user_index, the number of real candidate rows
        cuda = device.type == "cuda"
        self.host = torch.zeros(sum(sizes), dtype=torch.int64, pin_memory=cuda)
        self.device = self.host.to(device) if cuda else self.host
        starts = np.cumsum([0, *sizes])
        flat = self.host.numpy()
        self.views = [flat[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]
        self.on_device = list(self.device.split(sizes))

    def copy(self) -> None:
        if self.device is not self.host:
            self.device.copy_(self.host, non_blocking=True)


def _fill_kjt(
    kjt: HostKjt, shape: _KjtShape, slots: tuple[np.ndarray, np.ndarray], was: _Extent
) -> tuple[list[int], _Extent]:
    """Write ``kjt`` padded to ``shape`` into the (values, lengths) slots, whose last fill wrote
    ``was``; returns each key's padding ids and what this fill wrote.

    Only what the last fill wrote beyond this one's real data is padded again: the rest of the
    slots already holds padding (PAD_ID ids, empty bags), so the cost follows the batch, not the
    bucket's capacity. Keys with the same number of ids (the usual batch) are written as one
    [K, n] block: each numpy call costs ~1 µs of the device process's Python."""
    k, rows, real, cap = len(shape.keys), shape.rows, kjt.stride, shape.per_key
    per_key = kjt.per_key
    lens = slots[1].reshape(k, rows)
    lens[:, :real] = kjt.lengths.reshape(k, real)
    pad = [cap - n for n in per_key]
    lens[:, real] = pad  # every padding id in a bag of the first dummy row
    was_rows, was_per_key = was
    if was_rows > real:
        lens[:, real + 1 : was_rows + 1] = 0
    ids = slots[0].reshape(k, cap)
    block = kjt.blocks()  # [K, n] or None
    if block is not None:
        ids[:, : block.shape[1]] = block
    else:  # one slice per key
        for key, key_ids in enumerate(kjt.by_key()):
            ids[key, : len(key_ids)] = key_ids
    if was_per_key != per_key:
        for key, (n, stale) in enumerate(zip(per_key, was_per_key, strict=True)):
            if stale > n:
                ids[key, n:stale] = PAD_ID
    return pad, (real, per_key)


def host_pair_count(batch: HostBatch, lay: DenseLayout) -> int:
    """:func:`shared.dense_inputs.batch_pair_count` of a host batch: the same count."""
    u = batch.num_users
    if not lay.sequence:
        return 0
    first = batch.sequence.keys.index(lay.sequence[0])
    return pair_count(batch.sequence.lengths[first * u : (first + 1) * u], batch.user_index)


# --------------------------------------------------------------------------- one bucket's graph


class BucketGraph:
    """One bucket: its input buffers, the padding of a batch into them (:meth:`fill`, on any
    device) and, on CUDA, its captured graph and output [candidates + 1]."""

    def __init__(self, model: LoadedModel, bucket: Bucket, keys: Sequence[tuple[str, ...]]):
        rows = bucket.candidates + 1
        self.bucket = bucket
        self.shapes = [
            _KjtShape(keys[0], rows, rows),
            _KjtShape(keys[1], rows, rows),
            _KjtShape(keys[2], rows, bucket.elements),
        ]
        self.buffers = _Buffers(self.shapes, model.device)
        # what a fill of a whole bucket writes (all of it padding): the extents of fresh slots
        self._full: tuple[_Extent, ...] = tuple(
            (s.rows - 1, (s.per_key,) * len(s.keys)) for s in self.shapes
        )
        self._dirty()
        fs = model.fs
        # per KJT key: its table, for the padding left out of the statistics
        self.tables = [[fs.features[k].table for k in s.keys] for s in self.shapes]
        self.batch = self._device_batch()
        sequence = model.tables.layout.sequence  # the first sequence feature's lengths: T per user
        self._lengths_key = self.shapes[2].keys.index(sequence[0]) if sequence else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None  # after the last launch's copy of the slots
        # holds the model's capture stream (CudaGraphs): while any of its graphs lives (a
        # pending result keeps its graph), no other model's graphs are captured on it
        self.lease: object = None

    def _device_batch(self) -> Batch:
        slots = self.buffers.on_device
        kjts = [
            KeyedJaggedTensor(
                keys=list(s.keys),
                values=slots[2 * j],
                lengths=slots[2 * j + 1],
                stride=s.rows,
                length_per_key=[s.per_key] * len(s.keys),
                offset_per_key=s.offsets,
            )
            for j, s in enumerate(self.shapes)
        ]
        return Batch(user=kjts[0], item=kjts[1], sequence=kjts[2], user_index=slots[6])

    def fits(self, b: int, u: int, t: int, n: int, per_key: Sequence[Sequence[int]]) -> bool:
        bucket = self.bucket
        if (
            b > bucket.candidates
            or u > bucket.candidates
            or t > bucket.elements
            or n > bucket.pairs
        ):
            return False  # the usual refusal, before the per-key capacities
        caps = (s.per_key for s in self.shapes)
        return all(max(lens, default=0) <= cap for lens, cap in zip(per_key, caps, strict=True))

    def _dirty(self) -> None:
        """Forget what the slots hold: the next fill pads all of them (as the first one)."""
        self._extents: list[_Extent] = list(self._full)

    def device_pairs(self) -> Pairs:
        """The (pair_segment, pair_element) [pairs] of what the device slots hold, built on the
        device without a sync (:func:`shared.dense_inputs.padded_pair_index`): inside the graph."""
        slots, rows = self.buffers.on_device, self.shapes[2].rows
        key = self._lengths_key
        lengths = (
            torch.zeros(rows, dtype=torch.int64, device=slots[5].device)
            if key is None
            else slots[5][key * rows : (key + 1) * rows]
        )  # [candidates + 1] elements per user row
        return padded_pair_index(lengths, slots[6], slots[7], self.bucket.pairs)

    def fill(self, batch: Batch | HostBatch) -> dict[str, int]:
        """Pad ``batch`` (host) into the host slots; returns the padding ids per table. The
        pairs are not written: the graph builds them (:meth:`device_pairs`).

        Waits until the last :meth:`launch`'s copy has read the slots (the batch before may
        still be on its way to the device); the padding below relies on what that batch wrote."""
        if self._copied is not None:
            self._copied.synchronize()
        views, padding = self.buffers.views, dict[str, int]()
        if isinstance(batch, Batch):
            batch = HostBatch.of(batch)
        extents = self._extents
        self._dirty()  # until this fill is complete
        for j, (kjt, shape, tables) in enumerate(
            zip(batch.kjts, self.shapes, self.tables, strict=True)
        ):
            pad, extents[j] = _fill_kjt(kjt, shape, (views[2 * j], views[2 * j + 1]), extents[j])
            for table, p in zip(tables, pad, strict=True):
                padding[table] = padding.get(table, 0) + p
        b, u = batch.batch_size, batch.num_users
        views[6][:b] = batch.user_index
        views[6][b:] = u  # dummy candidates belong to the dummy user
        views[7][0] = b
        self._extents = extents
        return padding

    def capture(
        self,
        run: Callable[[Batch, Pairs], torch.Tensor],
        pool: torch.cuda._POOL_HANDLE | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> float:
        """Warm up, capture (into the memory ``pool``, shared by the model's graphs, on the
        capture ``stream`` of the model's graphs: see the module docstring), replay once: max
        |replay - eager| (a float).

        The warm-up runs on the current stream (the model's load stream: not the one requests
        are served on); ``thread_local`` capture lets other threads (the version being served
        while this one loads) use CUDA meanwhile."""
        self.buffers.copy()
        for _ in range(2):  # lookup plans and allocator blocks made before the capture
            want = run(self.batch, self.device_pairs())
        graph = torch.cuda.CUDAGraph()
        # not torch.cuda.graph(): it synchronizes and empties the caches (shared.cuda_capture)
        with capture(graph, pool=pool, device=self.buffers.device.device, stream=stream):
            self.out = run(self.batch, self.device_pairs())
        graph.replay()
        self.graph = graph
        return float((self.out - want).abs().max())

    @torch.inference_mode()  # the buffers were made in inference mode (an in-place copy)
    def launch(self) -> None:
        """Copy the filled host slots over and replay the graph (asynchronously); an event
        after the copy tells :meth:`fill` when the slots may be written again."""
        assert self.graph is not None, "launch before capture"
        stream = torch.cuda.current_stream(self.buffers.device.device)
        self.buffers.copy()
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record(stream)
        self.graph.replay()

    def read_async(self, b: int, *, keep: object = None) -> PendingScores:
        """The scores of the first ``b`` rows, on their way to pinned host memory.

        Enqueued on the replay's stream, right after it and before any later replay: so the
        copy reads this replay's output even though the graphs share one memory pool (a later
        replay of another bucket may write its intermediates over this output's blocks, and one
        of this bucket overwrites it). The pending keeps this graph and its buffers alive, and
        ``keep`` (what else the replay reads: the model's tables and program)."""
        assert self.out is not None, "read before capture"
        stream = torch.cuda.current_stream(self.out.device)
        host = torch.empty(b, dtype=self.out.dtype, pin_memory=True)  # [b]
        host.copy_(self.out[:b], non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        return PendingScores(host, done, keep=(self, keep))


# --------------------------------------------------------------------------- the buckets


class _Lease:
    """Holds a model's capture stream (:func:`shared.cuda_capture.capture_streams`) for as long
    as it lives: its :class:`CudaGraphs` and each of their :class:`BucketGraph` keep it, so a
    retired model's stream comes back only once its last pending result was read (its replay
    done), never while one of its replays may still run."""


def _bucket_pairs(graph: BucketGraph) -> int:
    """The sort key of :attr:`CudaGraphs.graphs` that :meth:`CudaGraphs._smallest_fit` bisects."""
    return graph.bucket.pairs


class CudaGraphs:
    """The captured graphs of one CUDA model and :meth:`predict` through them."""

    def __init__(self, model: LoadedModel, keys: Sequence[tuple[str, ...]]) -> None:
        self.model = model
        self.keys = tuple(tuple(k) for k in keys)
        self.graphs: list[BucketGraph] = []  # sorted by bucket (cost)
        self.stats = GraphStats()
        self._logged: set[str] = set()
        # what the graphs read (module docstring): replays only while the model still has them
        self._tables, self._program = model.tables, model.program
        self._pool: Any = None  # one memory pool for every capture (shared.cuda_capture.graph_pool)
        self._stream: Any = None  # one capture stream, no other live model's (module docstring)
        self._lease = _Lease()  # what holds it: this and each of the graphs

    @classmethod
    def capture(cls, model: LoadedModel, buckets: Iterable[Bucket]) -> CudaGraphs:
        """Capture a graph per bucket for ``model`` (CUDA, a program that takes the pairs),
        the KJT key orders taken from feature generation's (:func:`serve.model.synthetic_batch`
        orders keys as :func:`shared.fg.table_to_batch` does). A failed capture leaves its
        bucket out, with the reason in :attr:`stats` and the log."""
        from serve.model import synthetic_batch

        if model.device.type != "cuda" or not model.program.takes_pairs:
            raise ValueError(
                f"CUDA graphs need a CUDA model whose dense program takes the pairs (bundle "
                f"format 3); this one is on {model.device}, pairs: {model.program.takes_pairs}"
            )
        probe = synthetic_batch(model.fs, 1, 1, (0,))
        graphs = cls(model, [tuple(k.keys()) for k in (probe.user, probe.item, probe.sequence)])
        graphs._pool = graph_pool(model.device)
        graphs._stream = capture_streams(model.device).take(graphs._lease)
        pairs = batch_pair_count(probe, model.tables.layout)
        torch.cuda.current_stream(model.device).synchronize()
        t0 = time.perf_counter()
        allocated = torch.cuda.memory_allocated(model.device)
        reserved = torch.cuda.memory_reserved(model.device)
        with torch.inference_mode():
            graphs.capture_while_room(
                sorted(set(buckets)),
                lambda bucket: graphs._capture_one(bucket, probe, pairs),
                lambda: torch.cuda.mem_get_info(model.device),
            )
        torch.cuda.current_stream(model.device).synchronize()
        stats = graphs.stats
        stats.capture_seconds = time.perf_counter() - t0
        stats.memory_allocated_bytes = torch.cuda.memory_allocated(model.device) - allocated
        stats.memory_reserved_bytes = torch.cuda.memory_reserved(model.device) - reserved
        model.tables.reset_stats()
        return graphs

    def capture_while_room(
        self,
        buckets: Sequence[Bucket],
        capture_one: Callable[[Bucket], None],
        memory: Callable[[], tuple[int, int]],
    ) -> None:
        """``capture_one`` each bucket (cheapest first) while the device keeps at least
        :data:`MIN_FREE_MEMORY_FRACTION` of its memory free (``memory``: free and total bytes);
        the buckets after the first that finds less are skipped, with why, and their batches
        run eagerly."""
        for i, bucket in enumerate(buckets):
            free, total = memory()
            if free < MIN_FREE_MEMORY_FRACTION * total:
                why = (
                    f"{free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB free, under "
                    f"{MIN_FREE_MEMORY_FRACTION:.0%}"
                )
                for rest in buckets[i:]:
                    self.stats.skipped[str(rest)] = why
                log.warning(
                    "CUDA graphs: %d of %d buckets not captured (GPU memory: %s); batches that "
                    "need them run eagerly. Fewer server processes per GPU, or a smaller "
                    "--max-batch-rows, leave room for them",
                    len(buckets) - i,
                    len(buckets),
                    why,
                )
                return
            capture_one(bucket)

    def _capture_one(self, bucket: Bucket, probe: Batch, pairs: int) -> None:
        try:
            graph = BucketGraph(self.model, bucket, self.keys)
            if pairs > bucket.pairs:
                raise ValueError(f"the capture batch's {pairs} pairs do not fit")
            graph.fill(probe)
            graph.lease = self._lease
            diff = graph.capture(self._run, self._pool.id, self._stream)
            if not diff <= CHECK_ATOL:  # also NaN
                raise RuntimeError(f"replay differs from eager by {diff} (> {CHECK_ATOL})")
        except Exception as err:  # noqa: BLE001 - any failure: that bucket runs eagerly
            reason = f"{type(err).__name__}: {str(err)[:300]}"
            self.stats.failures[str(bucket)] = reason
            log.warning(
                "CUDA graph of %s not captured (%s); its batches run eagerly", bucket, reason
            )
            torch.cuda.synchronize(self.model.device)
            return
        self.graphs.append(graph)
        self.stats.captures += 1

    def _run(self, batch: Batch, pairs: Pairs) -> torch.Tensor:
        return scores(self.model, batch, pairs)

    def rebind(self, model: LoadedModel) -> None:
        """Make these graphs ``model``'s: a model over the very tables and program they read
        (the next version written into them, :mod:`serve.spare`)."""
        if model.tables is not self._tables or model.program is not self._program:
            raise ValueError("graphs are only valid for the tables and program they captured")
        self.model = model

    def verify(self) -> float:
        """Replay the smallest graph over what its input buffers hold and run the same inputs
        eagerly: max |replay - eager|, i.e. whether the graphs still read the tensors the
        model holds (after new rows and weights were written into them: :mod:`serve.spare`).
        On the current stream; it waits for the result."""
        if not self.graphs:
            return 0.0
        graph = self.graphs[0]
        assert graph.out is not None, "verify before capture"
        with torch.inference_mode():
            graph.launch()
            want = self._run(graph.batch, graph.device_pairs())
            return float((graph.out - want).abs().max())

    @property
    def buckets(self) -> list[Bucket]:
        return [g.bucket for g in self.graphs]

    def predict(
        self, batch: Batch | HostBatch, timings: dict[str, float] | None = None
    ) -> torch.Tensor | None:
        """[B] probabilities on the CPU through the smallest bucket that fits ``batch`` (host
        tensors, no labels or weights), or None (counted by reason): run it eagerly."""
        pending = self.start(batch, timings)
        return None if pending is None else pending.result(timings)

    def start(
        self, batch: Batch | HostBatch, timings: dict[str, float] | None = None
    ) -> PendingScores | None:
        """:meth:`predict` without the wait: the scores on their way to the host, or None
        (counted by reason): run it eagerly. ``timings`` gets ``h2d`` and ``compute`` (and
        ``sync`` 0: :meth:`PendingScores.result` adds the wait)."""
        t0 = time.perf_counter()
        graph = self.prepare(batch)
        if graph is None:
            return None
        t1 = time.perf_counter()
        graph.launch()
        pending = graph.read_async(batch.batch_size, keep=self)  # self: the model, its tables
        t2 = time.perf_counter()
        self.stats.replays += 1
        if timings is not None:  # as LoadedModel.predict splits them; h2d: the padding
            timings.update(h2d=t1 - t0, compute=t2 - t1, sync=0.0)
        return pending

    def prepare(self, batch: Batch | HostBatch) -> BucketGraph | None:
        """The host side of :meth:`predict`: ``batch`` padded into the host slots of the
        smallest bucket that fits it (its padding discounted), that bucket's graph; or None
        (counted by reason): run it eagerly."""
        reason = self._refusal(batch)
        if reason is not None:
            self._eager(reason)
            return None
        host = batch if isinstance(batch, HostBatch) else HostBatch.of(batch)
        graph = self._fit(host, host_pair_count(host, self.model.tables.layout))
        if graph is None:
            self._eager("no bucket fits")
            return None
        padding = graph.fill(host)
        self.model.tables.discount_padding(padding)
        return graph

    def _refusal(self, batch: Batch | HostBatch) -> str | None:
        if self.model.tables is not self._tables or self.model.program is not self._program:
            return "tables or program replaced"
        if isinstance(batch, HostBatch):
            if tuple(k.keys for k in batch.kjts) != self.keys:
                return "key order"
            if any(k.weights is not None for k in batch.kjts):
                return "labels or weights"
            return None
        kjts = (batch.user, batch.item, batch.sequence)
        if tuple(tuple(k.keys()) for k in kjts) != self.keys:
            return "key order"
        if batch.labels is not None or any(k.weights_or_none() is not None for k in kjts):
            return "labels or weights"
        if any(t.device.type != "cpu" for k in kjts for t in (k.values(), k.lengths())):
            return "not on the host"
        if batch.user_index.device.type != "cpu":
            return "not on the host"
        return None

    def bucket_for(self, batch: Batch | HostBatch) -> Bucket | None:
        """The bucket :meth:`predict` replays ``batch`` in (None: it runs eagerly)."""
        if self._refusal(batch) is not None:
            return None
        host = batch if isinstance(batch, HostBatch) else HostBatch.of(batch)
        graph = self._fit(host, host_pair_count(host, self.model.tables.layout))
        return None if graph is None else graph.bucket

    def _fit(self, batch: HostBatch, pairs: int) -> BucketGraph | None:
        per_key = [k.per_key for k in batch.kjts]
        t = max(per_key[2], default=0)  # elements: every sequence feature has T
        return self._smallest_fit(batch.batch_size, batch.num_users, t, pairs, per_key)

    def _smallest_fit(
        self, b: int, u: int, t: int, n: int, per_key: Sequence[Sequence[int]]
    ) -> BucketGraph | None:
        # graphs are sorted by pairs: skip those with too few, then take the first that fits
        start = bisect.bisect_left(self.graphs, n, key=_bucket_pairs)  # O(log) keys, no list
        for graph in self.graphs[start:]:
            if graph.fits(b, u, t, n, per_key):
                return graph
        return None

    def _eager(self, reason: str) -> None:
        """Count (and the first time, log) a batch that runs eagerly."""
        self.stats.eager[reason] = self.stats.eager.get(reason, 0) + 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.info(
                "a batch runs eagerly (%s); later ones for this reason are only counted", reason
            )
