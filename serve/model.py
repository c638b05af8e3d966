"""A loaded model version: bundle → device tables + dense program, warmed up, ready to predict.

:meth:`LoadedModel.load` times each startup stage (read, table_build, program_load, warmup,
graphs, total), logs the split and keeps it in :attr:`LoadedModel.startup` (served by GetModelMetadata and
the metrics). :meth:`LoadedModel.predict` is the whole request path after feature generation::

    model = LoadedModel.load("exports/v3", device="cuda")
    probs = model.predict(batch)         # Batch from shared.fg → [B] float32 on the CPU
    pending = model.start(batch)         # the same without waiting for the device (serve.batcher)
    probs = pending.result()

A dense program that takes the (candidate, element) pairs (bundle format 3, told by its input
names: :class:`DenseProgram`) gets them computed on the host and moved with the batch's one copy;
one without them (formats 1 and 2) computes them itself, reading their count back. On CUDA,
``graph_buckets`` (``LoadedModel.load(..., graph_buckets=default_buckets(1024))``) makes the
warm-up capture a CUDA graph per bucket (startup stage ``graphs``), and :meth:`LoadedModel.predict` replays the batches
that fit one (:mod:`serve.graphs`); the others run eagerly.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from serve.batcher import PendingScores
from serve.graphs import Bucket, CudaGraphs, GraphStats
from serve.host_batch import HostBatch
from serve.lookup import EmbeddingTables, TableStats
from serve.program_cache import ProgramCache, program_digest
from serve.tiers import TierConfig
from shared.batch import Batch
from shared.bundle import Bundle, BundleError, read_bundle
from shared.bundle.layout import DENSE_PROGRAM
from shared.bundle.naming import PAIR_PROGRAM_FORMAT, program_signature
from shared.delta import BaseKeyIndex
from shared.dense_inputs import (
    INPUT_NAMES,
    Pairs,
    Signature,
    batch_pairs,
    pair_index_torch,
    program_input_names,
    sequence_lengths,
    signature_of,
)
from shared.features import FeatureSet, Side

log = logging.getLogger(__name__)

STAGES = ("read", "table_build", "program_load", "warmup", "graphs", "total")


@dataclass(frozen=True)
class StartupTimes:
    """Seconds per startup stage. The program loads while the bundle is read and the tables are
    built (a thread of its own), so ``total`` (wall time to ready) is less than the sum.
    ``warmup`` is the eager warm-up, ``graphs`` the capture of the CUDA graphs after it (0
    without graphs)."""

    read: float
    table_build: float
    program_load: float
    warmup: float
    graphs: float
    total: float

    @classmethod
    def split(
        cls,
        read: float,
        table_build: float,
        program_load: float,
        warmup: float,
        total: float,
        *,
        model: LoadedModel,
        captured_before: float = 0.0,
    ) -> StartupTimes:
        """The stages, with ``warmup`` (eager warm-up + captures) split into warm-up and the
        graphs' capture time (:attr:`~serve.graphs.GraphStats.capture_seconds`, less
        ``captured_before``: what the graphs had captured before this build, for a successor
        that shares its predecessor's graphs, :meth:`LoadedModel.successor`)."""
        stats = model.graph_stats()
        graphs = 0.0 if stats is None else stats.capture_seconds - captured_before
        return cls(read, table_build, program_load, max(warmup - graphs, 0.0), graphs, total)

    def as_dict(self) -> dict[str, float]:
        return {s: float(getattr(self, s)) for s in STAGES}


def build_tables(
    bundle: Bundle, device: torch.device, tiers: TierConfig | None = None
) -> EmbeddingTables:
    """Every table of ``bundle`` on ``device``, fused by dim (:mod:`serve.lookup`), each dynamic
    table in HBM or in a host tier with an HBM cache as ``tiers`` plans (:mod:`serve.tiers`;
    None: as the bundle's fg.json says)."""
    return EmbeddingTables.from_bundle(bundle, device=device, tiers=tiers)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _side_stream(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Loading work goes to a CUDA stream of its own, so that a model loading in the
    background does not queue kernels in front of the requests served on the default stream."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    # one stream per device for every load: the caching allocator keeps freed blocks per
    # stream, so a new stream per load would strand the memory of each replaced version
    if str(device) not in _LOAD_STREAMS:
        _LOAD_STREAMS[str(device)] = torch.cuda.Stream(device)
    return torch.cuda.stream(_LOAD_STREAMS[str(device)])


_LOAD_STREAMS: dict[str, torch.cuda.Stream] = {}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


PROGRAMS = ProgramCache()  # process-wide: the last dense program per device


def _full_load(path: Path, device: torch.device) -> tuple[torch.nn.Module, bool]:
    program = torch.export.load(path)
    if device.type != "cpu":
        from torch.export.passes import move_to_device_pass

        program = move_to_device_pass(program, device)
    return program.module(), _keyword_inputs(program)


@dataclass(frozen=True)
class DenseProgram:
    """A loaded ``dense.pt2`` as ``f(**inputs) -> logits`` [B], and which inputs it takes:
    its :class:`~shared.dense_inputs.Signature`: the pairs and the cold masks (format 4), the
    pairs (format 3), or :data:`~shared.dense_inputs.INPUT_NAMES` (formats 1 and 2, keywords
    or positional). It is
    called with the inputs it takes from whatever it is given (the pairs are ignored by a
    program without them)."""

    module: Callable[..., torch.Tensor]
    keyword: bool  # keyword inputs (else the six of INPUT_NAMES, positionally)
    signature: Signature
    # the archive's graph (serve.program_cache.program_digest): equal for a retrained program of
    # the same graph, whose weights serve.spare may then write into this module's tensors
    digest: str | None = None

    @property
    def takes_pairs(self) -> bool:
        return self.signature.takes_pairs

    @property
    def takes_cold(self) -> bool:
        return self.signature.takes_cold

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.signature.value

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        if self.keyword:
            return self.module(**{name: inputs[name] for name in self.input_names})
        return self.module(*(inputs[name] for name in INPUT_NAMES))


def load_program(
    path: Path, device: torch.device, cache: ProgramCache | None = PROGRAMS
) -> DenseProgram:
    """``dense.pt2`` on ``device`` (constants and parameters moved there too), whether it was
    exported with keyword or positional inputs, with or without the pairs (told by its input
    names). With ``cache``, a program whose graph equals the last one loaded only gets new
    weights."""
    try:
        if cache is None:
            (module, keyword), digest = _full_load(path, device), program_digest(path)
        else:
            module, keyword, digest = cache.load(path, device, _full_load)
    except Exception as err:
        raise BundleError(
            f"{path}: cannot load the dense program on {device} ({type(err).__name__}: {err}); "
            f"re-export it with torch {torch.__version__.split('+')[0]} or check the bundle"
        ) from err
    try:
        signature = signature_of(program_input_names(module) if keyword else ())
    except ValueError as err:
        raise BundleError(f"{path}: {err}") from None
    return DenseProgram(module, keyword, signature, digest)


def check_signature(bundle: Bundle, program: DenseProgram) -> None:
    """Refuse a bundle of format 3 or 4 whose program does not take the inputs its format
    number says (formats 1 and 2 predate the number's meaning: their programs are told by their
    inputs alone)."""
    version = bundle.format_version
    want = program_signature(version)
    if version >= PAIR_PROGRAM_FORMAT and program.signature is not want:
        raise BundleError(
            f"{bundle.path}: format_version {version} says the dense program takes "
            f"{list(want.value)}, but it takes {list(program.input_names)}; re-export the bundle"
        )


def _timed_program(
    path: Path, device: torch.device, cache: ProgramCache | None
) -> tuple[DenseProgram, float]:
    t0 = time.perf_counter()
    program = load_program(path, device, cache)
    return program, time.perf_counter() - t0


def _keyword_inputs(program: torch.export.ExportedProgram) -> bool:
    spec = program.call_spec.in_spec
    assert spec is not None
    kwargs = spec.child(1) if hasattr(spec, "child") else spec.children_specs[1]
    return bool(kwargs.context)


class LoadedModel:
    """One model version on one device. Thread safety: :meth:`predict` is called by one worker."""

    reports_timings = True  # predict(batch, timings=...) splits its time (serve.batcher)
    takes_host_batches = True  # predict takes serve.host_batch.HostBatch es too (serve.batcher)

    def __init__(
        self,
        bundle: Bundle,
        tables: EmbeddingTables,
        program: DenseProgram,
        device: torch.device,
        startup: StartupTimes,
        *,
        graph_buckets: Sequence[Bucket] = (),
    ) -> None:
        self.bundle = bundle
        self.tables = tables
        self.program = program
        self.device = device
        self.startup = startup
        self.loaded_at = time.time()
        self._lock = threading.Lock()  # predict may also be called directly (offline, tests)
        # delta updates (serve.delta): the bundle as read from disk, its program, deltas applied
        self.base_bundle: Bundle = bundle
        self.base_program: DenseProgram = program
        # its hashmap tables' keys sorted once, for every delta's merge (shared.delta)
        self.base_key_index: dict[str, BaseKeyIndex] = {}
        self.deltas: tuple[str, ...] = ()
        # CUDA graphs (serve.graphs): captured by warmup() for these buckets, if any
        self.graph_buckets = tuple(graph_buckets)
        self.graphs: CudaGraphs | None = None
        # a delta written in place (serve.delta): the model that now serves with these tables
        self._superseded_by: LoadedModel | None = None

    @property
    def version(self) -> str:
        return self.bundle.version

    @property
    def fs(self) -> FeatureSet:
        return self.bundle.feature_set

    @property
    def path(self) -> Path:
        return self.bundle.path

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        device: str | torch.device | None = None,
        verify_checksums: bool = True,
        warmup_rounds: int = 2,
        warmup_candidates: int = 100,
        program_cache: ProgramCache | None = PROGRAMS,
        graph_buckets: Sequence[Bucket] = (),
        tiers: TierConfig | None = None,
    ) -> LoadedModel:
        """Read, build, load and warm up the bundle at ``path``; :class:`BundleError` if bad.

        The warm-up runs the full request path on synthetic batches (one user with
        ``warmup_candidates`` candidates, and a few users) and checks the scores are finite, so
        a bundle whose program does not fit its tables is refused here, not on live traffic.
        ``program_cache=None`` always deserializes ``dense.pt2`` (see :mod:`serve.program_cache`).
        ``graph_buckets`` (CUDA, a program that takes the pairs): the warm-up also captures a
        CUDA graph per bucket, which :meth:`predict` replays (:mod:`serve.graphs`).
        ``tiers``: where the dynamic tables live (:func:`build_tables`).
        """
        dev = torch.device(device or default_device())
        t0 = time.perf_counter()
        # dense.pt2 deserializes (Python-bound) while the bundle is read and checksummed and the
        # tables are built (GIL released in hashing, file reads and device kernels); a program
        # from a bundle that fails verification is dropped with it.
        with _side_stream(dev), ThreadPoolExecutor(1, thread_name_prefix="program-load") as pool:
            pending = pool.submit(_timed_program, Path(path) / DENSE_PROGRAM, dev, program_cache)
            bundle = read_bundle(path, verify_checksums=verify_checksums)
            t1 = time.perf_counter()
            tables = build_tables(bundle, dev, tiers)
            _sync(dev)
            t2 = time.perf_counter()
            program, program_s = pending.result()
            check_signature(bundle, program)
            t3 = time.perf_counter()
            model = cls(
                bundle,
                tables,
                program,
                dev,
                StartupTimes(t1 - t0, t2 - t1, program_s, 0, 0, 0),
                graph_buckets=graph_buckets,
            )
            model.warmup(rounds=warmup_rounds, candidates=warmup_candidates)
            _sync(dev)
        t4 = time.perf_counter()
        model.startup = StartupTimes.split(
            t1 - t0, t2 - t1, program_s, t4 - t3, t4 - t0, model=model
        )
        model.loaded_at = time.time()
        log.info(
            "model %s loaded from %s on %s in %.3fs (%s)",
            model.version,
            bundle.path,
            dev,
            model.startup.total,
            ", ".join(f"{k} {v * 1e3:.1f}ms" for k, v in model.startup.as_dict().items()),
        )
        return model

    def warmup(self, *, rounds: int = 2, candidates: int = 100) -> None:
        shapes = [(1, candidates, (8,)), (4, 4 * 16, (0, 3, 17, 1))]
        for _ in range(max(rounds, 1)):
            for users, cands, lengths in shapes:
                probs = self.predict(synthetic_batch(self.fs, users, cands, lengths))
                if probs.shape != (cands,) or not bool(torch.isfinite(probs).all()):
                    raise BundleError(
                        f"{self.path}: warm-up gave {list(probs.shape)} scores "
                        f"(finite: {bool(torch.isfinite(probs).all())}) for {cands} candidates; "
                        "the dense program does not match the tables"
                    )
        self._capture_graphs()
        self.tables.reset_stats()

    def _capture_graphs(self) -> None:
        """CUDA graphs of :attr:`graph_buckets`, where they can be had (else eager, logged)."""
        if not self.graph_buckets or self.graphs is not None:
            return
        if self.device.type != "cuda":
            log.info("model %s: no CUDA graphs on %s", self.version, self.device)
            return
        if not self.program.takes_pairs:
            log.info(
                "model %s: no CUDA graphs: its dense program (bundle format %d) reads the pair "
                "count back to the host; re-export the bundle (format 3) to replay graphs",
                self.version,
                self.bundle.format_version,
            )
            return
        self.graphs = CudaGraphs.capture(self, self.graph_buckets)
        stats = self.graphs.stats
        log.info(
            "model %s: %d CUDA graphs captured (%d failed, %d skipped for memory) in %.2fs, "
            "one memory pool: %+.1f MiB allocated, %+.1f MiB reserved",
            self.version,
            stats.captures,
            len(stats.failures),
            len(stats.skipped),
            stats.capture_seconds,
            stats.memory_allocated_bytes / 2**20,
            stats.memory_reserved_bytes / 2**20,
        )

    def graph_stats(self) -> GraphStats | None:
        """Captures, replays and eager batches by reason; None without graphs."""
        return None if self.graphs is None else self.graphs.stats

    def to_device(self, batch: Batch) -> Batch:
        """``batch`` on :attr:`device`: one pinned host buffer and one host-to-device copy on
        CUDA (see :func:`batch_to_device`), the batch itself on the CPU."""
        return self._inputs_to_device(batch)[0]

    def _inputs_to_device(self, batch: Batch) -> tuple[Batch, Pairs | None]:
        """:meth:`to_device`, and the pairs if the program takes them: computed on the host
        (:func:`~shared.dense_inputs.batch_pairs`) and moved in the batch's one copy."""
        for kjt in (batch.user, batch.item, batch.sequence):
            kjt.length_per_key()  # computed (and kept) on the host: no device sync later
        on_host = batch.user_index.device.type == "cpu"
        if not self.program.takes_pairs or not on_host:
            return batch_to_device(batch, self.device), None
        seg, elem = batch_pairs(batch, self.tables.layout)
        moved, (seg_t, elem_t) = move_to_device(
            batch, self.device, extra=[torch.from_numpy(seg), torch.from_numpy(elem)]
        )
        return moved, (seg_t, elem_t)

    @torch.inference_mode()
    def logits(self, batch: Batch) -> torch.Tensor:
        """[B] logits on the device."""
        return self._logits(*self._inputs_to_device(batch))

    @torch.inference_mode()
    def _logits(self, batch: Batch, pairs: Pairs | None = None) -> torch.Tensor:
        """[B] logits of ``batch`` on the device; a program that takes the pairs gets
        ``pairs``, or computes them on the device if not given (one host sync)."""
        if self.program.takes_pairs and pairs is None:
            lengths = sequence_lengths(batch, self.tables.layout)
            if lengths is None:
                lengths = torch.zeros(batch.num_users, dtype=torch.int64, device=self.device)
            pairs = pair_index_torch(lengths.to(torch.int64), batch.user_index.to(torch.int64))
        inputs = self.tables.embed(batch, pairs=pairs, cold=self.program.takes_cold)
        return self.program(**inputs)

    def successor(self, bundle: Bundle, program: DenseProgram) -> LoadedModel:
        """A model over these same tables (and lock) with ``bundle`` and ``program``: for a
        delta written into the tables in place (:mod:`serve.delta`). Its graphs are this
        model's if the program is the same, else none (captured by its :meth:`warmup`).
        :meth:`supersede` then makes this model's predictions its successor's."""
        model = copy.copy(self)
        model.bundle, model.program, model.loaded_at = bundle, program, time.time()
        model._superseded_by = None
        if program is not self.program:
            model.graphs = None
        return model

    @property
    def superseded(self) -> bool:
        """Whether an in-place delta made another model serve with these tables."""
        return self._superseded_by is not None

    def retire(self) -> None:
        """Drop this model's CUDA graphs, once it is replaced (:mod:`serve.versions` retires
        it): they refer back to it, so without this only a garbage collection would free it.
        A request that still holds it runs eagerly; a successor keeps the graphs it shares."""
        self.graphs = None

    @contextlib.contextmanager
    def between_batches(self) -> Iterator[None]:
        """Hold the predict lock (shared by a model and its successors): no batch starts inside,
        and the device is idle (synchronized on entry and exit): a batch started before (its
        :class:`~serve.batcher.PendingScores` maybe not yet read) has finished on the device,
        so the writes inside never race it."""
        with self._lock:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def supersede(self, successor: LoadedModel) -> None:
        """From now on :meth:`predict` of this model (requests accepted before the swap) runs
        ``successor``'s: call inside :meth:`between_batches`, with the tables' writes, so that
        no batch mixes this model's program with the successor's tables."""
        assert successor._lock is self._lock, "a successor shares its predecessor's lock"
        self._superseded_by = successor

    def _serving(self) -> LoadedModel:
        model = self
        while model._superseded_by is not None:
            model = model._superseded_by
        return model

    def predict(
        self, batch: Batch | HostBatch, timings: dict[str, float] | None = None
    ) -> torch.Tensor:
        """[B] click probabilities, float32, on the CPU, in candidate order.

        A :class:`~serve.host_batch.HostBatch` is padded straight into a CUDA graph's inputs;
        it is built into a :class:`Batch` only when it runs eagerly.

        ``timings`` (optional) receives wall seconds of ``h2d`` (packing and the copy),
        ``compute`` (lookups and dense program: launch time on CUDA, where kernels run
        asynchronously) and ``sync`` (waiting for the device and copying the scores back).
        A model superseded by an in-place delta predicts with its successor.
        """
        return self.start(batch, timings).result(timings)

    def start(
        self, batch: Batch | HostBatch, timings: dict[str, float] | None = None
    ) -> PendingScores:
        """:meth:`predict`, not waiting for the device: a batch replayed in a CUDA graph is
        returned on its way to the host; an eager one (and any on the CPU) computed, done.

        The lock is held only while the batch is started, so the next one can be prepared while
        this one runs; its ``result`` adds the wait to ``timings["sync"]``. The pending holds the
        graph it replays in, which so outlives a version swapped out meanwhile."""
        with self._lock:
            return self._serving()._start(batch, timings)

    def _start(self, batch: Batch | HostBatch, timings: dict[str, float] | None) -> PendingScores:
        """:meth:`start`, the lock held."""
        if self.graphs is not None:
            replayed = self.graphs.start(batch, timings)
            if replayed is not None:
                return replayed
        return PendingScores.ready(self._predict_eagerly(batch, timings))

    def _predict_eagerly(
        self, batch: Batch | HostBatch, timings: dict[str, float] | None
    ) -> torch.Tensor:
        """[B] probabilities on the CPU, without graphs (waits for the device)."""
        if isinstance(batch, HostBatch):
            batch = batch.to_batch()
        if timings is None:
            return torch.sigmoid(self.logits(batch).float()).cpu()
        t0 = time.perf_counter()
        on_device, pairs = self._inputs_to_device(batch)
        t1 = time.perf_counter()
        with torch.inference_mode():
            probs = torch.sigmoid(self._logits(on_device, pairs).float())
        t2 = time.perf_counter()
        out = probs.cpu()
        t3 = time.perf_counter()
        timings.update(h2d=t1 - t0, compute=t2 - t1, sync=t3 - t2)
        return out

    def table_stats(self) -> list[TableStats]:
        return self.tables.stats()


def _device_kjt(
    kjt: KeyedJaggedTensor, values: torch.Tensor, lengths: torch.Tensor
) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=values,
        lengths=lengths,
        stride=kjt.stride(),
        length_per_key=kjt.length_per_key(),
        offset_per_key=kjt.offset_per_key(),
    )


def batch_to_device(batch: Batch, device: torch.device, *, packed: bool | None = None) -> Batch:
    """``batch`` on ``device``; on CUDA (``packed``) with one host-to-device copy.

    ``Batch.to`` copies every tensor on its own (values and lengths of three KJTs and the user
    index: 7 copies from pageable memory, each staged by the driver and each synchronizing the
    stream). Packed, their bytes go into one pinned buffer (numpy copies, no torch ops), are
    copied once without blocking and are viewed back with their dtypes and shapes; KJTs keep
    their host-side ``length_per_key``. Batches with labels, weights or tensors already off the
    CPU take ``Batch.to``. ``packed=True`` on the CPU (no pinning, no copy) is for tests.
    """
    return move_to_device(batch, device, packed=packed)[0]


def move_to_device(
    batch: Batch,
    device: torch.device,
    *,
    extra: Sequence[torch.Tensor] = (),
    packed: bool | None = None,
) -> tuple[Batch, list[torch.Tensor]]:
    """:func:`batch_to_device`, and the CPU tensors ``extra`` (e.g. the pairs) in the same copy."""
    packed = device.type == "cuda" if packed is None else packed
    kjts = (batch.user, batch.item, batch.sequence)
    parts = [t for k in kjts for t in (k.values(), k.lengths())] + [batch.user_index]
    parts += list(extra)
    if (
        not packed
        or batch.labels is not None
        or batch.oracle is not None
        or any(k.weights_or_none() is not None for k in kjts)
        or any(t.device.type != "cpu" for t in parts)
    ):
        moved_extra = [t.to(device, non_blocking=True) for t in extra]
        return batch.to(device, non_blocking=True), moved_extra
    moved = _packed_copy(parts, device)
    out = Batch(
        user=_device_kjt(batch.user, moved[0], moved[1]),
        item=_device_kjt(batch.item, moved[2], moved[3]),
        sequence=_device_kjt(batch.sequence, moved[4], moved[5]),
        user_index=moved[6],
    )
    return out, moved[7:]


def _packed_copy(parts: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """CPU tensors → views of one buffer copied to ``device`` at once (pinned on CUDA)."""
    arrays = [t.detach().contiguous().view(-1).numpy().view(np.uint8) for t in parts]
    sizes = [(a.nbytes + 7) // 8 * 8 for a in arrays]  # 8-byte aligned: views of any dtype
    host = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=device.type == "cuda")
    buf = host.numpy()
    offset = 0
    for a, size in zip(arrays, sizes, strict=True):
        buf[offset : offset + a.nbytes] = a
        offset += size
    chunks = host.to(device, non_blocking=True).split(sizes)
    return [
        c[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        for c, t in zip(chunks, parts, strict=True)
    ]


def synthetic_batch(
    fs: FeatureSet, users: int, candidates: int, seq_lengths: Sequence[int]
) -> Batch:
    """A valid batch of id 0 everywhere (row 0 of dense tables, a miss in dynamic ones).

    ``seq_lengths`` gives each user's sequence length (cycled over ``users``); candidates are
    spread round-robin over the users. Used for warm-up and benchmarks.
    """
    lengths_u = torch.tensor([seq_lengths[i % len(seq_lengths)] for i in range(users)])
    scalar = [f for f in fs.features.values() if not f.is_sequence]
    user_keys = [f.name for f in scalar if f.side is Side.USER]
    item_keys = [f.name for f in scalar if f.side is not Side.USER]
    seq_keys = [f.name for f in fs.features.values() if f.is_sequence]

    def kjt(keys: list[str], lengths: torch.Tensor, stride: int) -> KeyedJaggedTensor:
        all_lengths = lengths.repeat(len(keys)).to(torch.int64)
        values = torch.zeros(int(all_lengths.sum()), dtype=torch.int64)
        return KeyedJaggedTensor(keys=keys, values=values, lengths=all_lengths, stride=stride)

    return Batch(
        user=kjt(user_keys, torch.ones(users, dtype=torch.int64), users),
        item=kjt(item_keys, torch.ones(candidates, dtype=torch.int64), candidates),
        sequence=kjt(seq_keys, lengths_u, users),
        user_index=torch.arange(candidates, dtype=torch.int64) % max(users, 1),
    )
