"""Looked-up embeddings → the inputs of the exported dense program; shared by train/ and serve/.

Training (``train/model``) and serving (``serve/lookup.py``) both look ids up in their own way
(trainable tables vs. read-only hash tables), then pool bags with :func:`pool_bags` and call
:func:`assemble_dense_inputs`, so the order and pooling of the program's inputs cannot drift
between the two sides::

    user_deep   [U, Du]   concat of pooled DEEP-group USER-side embeddings (FeatureSet order)
    item_deep   [B, Di]   concat of pooled DEEP-group ITEM/CONTEXT-side embeddings (FeatureSet order)
    query       [B, Dq]   concat of the SEQUENCE group's query embeddings (GroupSpec.query order)
    seq_values  [T, Dq]   concat of the sequence sub-feature embeddings (GroupSpec.sequence order)
    seq_lengths [U] int64 elements per user (sum = T)
    user_index  [B] int64 user row of each candidate row
    pair_segment [N] int64 candidate row of each (candidate, element) pair   } programs of bundle
    pair_element [N] int64 row in seq_values of each pair                    } formats 3 and 4
    user_cold   [U, Ku] bool  the user's cold features (ColdLayout.user)      }
    item_cold   [B, Ki] bool  the candidate's cold features (ColdLayout.item) } bundle format 4
    seq_cold    [T, Ks] bool  the element's cold features (ColdLayout.sequence) }

A feature is *cold* in a row when it is a dynamic (hash-table) feature whose ids there all have
no row in their table (not admitted, evicted, refused in training; not in the bundle when
serving) and the row has at least one id; programs of bundle format 4 replace its embedding by a
backoff learned from the row's side features (``train/model/backoff.py``). Which features get a
column is fixed by the feature set (:func:`cold_layout`), so training and serving agree without
storing it.

The DIN attends over the N = sum(seq_lengths[user_index]) (candidate, element) pairs, ordered by
candidate, then element. Sizing them on the device needs a host sync (``.item()``), which also
keeps a program out of a CUDA graph; the host that built the batch knows the lengths, so
:func:`pair_index` computes the pairs there (numpy, before the batch's one host-to-device copy)
and programs that take :data:`PAIR_NAMES` get them as inputs. :func:`pair_index_torch` is the
same definition on the device (with the sync), for programs and callers without them, and
:func:`padded_pair_index` the same for a padded batch of static shape, with no sync (serving's
CUDA graphs build their pairs on the device from the rows and lengths they are given)::

    seg, elem = pair_index(np.array([2, 0, 1]), np.array([0, 0, 2, 1]))
    seg   # [0, 0, 1, 1, 2]         candidate 3 (user 1) has no elements
    elem  # [0, 1, 0, 1, 2]         user 0's rows 0-1 for candidates 0 and 1, user 2's row 2

Pure torch, no torchrec kernels beyond KJT accessors, so it runs on CUDA without fbgemm.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, unique
from typing import cast

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from shared.batch import Batch
from shared.features import FeatureSet, GroupType, Side

INPUT_NAMES = ("user_deep", "item_deep", "query", "seq_values", "seq_lengths", "user_index")
PAIR_NAMES = ("pair_segment", "pair_element")  # the pairs, inputs of bundle format 3 programs
PAIR_INPUT_NAMES = (*INPUT_NAMES, *PAIR_NAMES)
COLD_NAMES = ("user_cold", "item_cold", "seq_cold")  # cold masks, inputs of format 4 programs
COLD_INPUT_NAMES = (*PAIR_INPUT_NAMES, *COLD_NAMES)

Pairs = tuple[torch.Tensor, torch.Tensor]  # (pair_segment [N], pair_element [N]) int64


def program_input_names(program: torch.export.ExportedProgram | torch.nn.Module) -> tuple[str, ...]:
    """The keyword input names of a dense program: an ``ExportedProgram`` or its ``.module()``
    (which keeps the program's input spec); ``()`` for a program called positionally (early
    exports: :data:`INPUT_NAMES` in order). :data:`PAIR_INPUT_NAMES` if it takes the pairs."""
    if isinstance(program, torch.export.ExportedProgram):
        spec = program.call_spec.in_spec
    else:
        spec = getattr(program, "_in_spec", None)  # set by ExportedProgram.module()
    if spec is None:
        return ()
    kwargs = spec.child(1) if hasattr(spec, "child") else spec.children_specs[1]
    return tuple(kwargs.context or ())


@unique
class Signature(Enum):
    """The keyword inputs of a dense program, which its bundle format number versions."""

    PLAIN = INPUT_NAMES  # formats 1 and 2 (and positional programs): the DIN sizes the pairs
    PAIRS = PAIR_INPUT_NAMES  # format 3: the pairs as inputs (no host sync, CUDA-graph safe)
    COLD = COLD_INPUT_NAMES  # format 4: format 3 + the cold masks (a backoff for cold ids)

    @property
    def takes_pairs(self) -> bool:
        return self is not Signature.PLAIN

    @property
    def takes_cold(self) -> bool:
        return self is Signature.COLD


def signature_of(input_names: Sequence[str]) -> Signature:
    """The signature of a program with these keyword inputs (:func:`program_input_names`;
    ``()``, a positional program, is PLAIN); ValueError for inputs of no signature."""
    names = tuple(input_names)
    for sig in Signature:
        if names == sig.value or (names == () and sig is Signature.PLAIN):
            return sig
    known = " or ".join(str(list(s.value)) for s in Signature)
    raise ValueError(
        f"dense program inputs {list(names)} are none of {known}; export it with "
        "train.model.dense_arch.export_dense_arch"
    )


def pair_index(seq_lengths: np.ndarray, user_index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (candidate, element) pairs on the host: ``seq_lengths`` [U] and ``user_index`` [B]
    → (pair_segment [N], pair_element [N]) int64, ordered by candidate, then element (see the
    module docstring). Raises IndexError for a user index outside [0, U).

    On the serving path's host (every batch, under the GIL): each pair's element is its
    candidate's shift repeated (``np.repeat``, a fill) rather than gathered through ``seg``,
    and [B]-sized intermediates are updated in place."""
    lengths = np.asarray(seq_lengths, dtype=np.int64)  # [U]
    users = np.asarray(user_index, dtype=np.int64)  # [B]
    cand_len = lengths.take(users)  # [B] elements of each candidate's user
    seg = np.arange(users.shape[0], dtype=np.int64).repeat(cand_len)  # [N]
    # element of pair j: user_start[u] + (j - first pair of its candidate)
    shift = (np.cumsum(lengths) - lengths).take(users)  # [B] user_start of each candidate
    shift += cand_len
    shift -= np.cumsum(cand_len)  # [B] user_start - first pair of the candidate
    elem = shift.repeat(cand_len)  # [N]
    elem += np.arange(seg.shape[0], dtype=np.int64)
    return seg, elem  # [N], [N]


def pair_count(seq_lengths: np.ndarray, user_index: np.ndarray) -> int:
    """N, the number of :func:`pair_index`'s pairs, without building them (to pick a CUDA
    graph's bucket). Raises IndexError for a user index outside [0, U)."""
    lengths = np.asarray(seq_lengths, dtype=np.int64)  # [U]
    users = np.asarray(user_index, dtype=np.int64)  # [B]
    if users.shape[0] and (users.min() < 0 or users.max() >= lengths.shape[0]):
        raise IndexError(
            f"user_index has values outside [0, {lengths.shape[0]}) "
            f"(seq_lengths has {lengths.shape[0]})"
        )
    return int(lengths.take(users).sum())


def pair_index_torch(seq_lengths: torch.Tensor, user_index: torch.Tensor) -> Pairs:
    """:func:`pair_index` on the device; one host sync (the pair count). Under torch.export the
    count is an unbacked symbol, checked to be a valid size."""
    # seq_lengths: [U] int64; user_index: [B] int64
    cand_len = seq_lengths[user_index]  # [B]
    # output_size lets repeat_interleave build [N] without a second pass over cand_len
    n = cast(int, cand_len.sum().item())
    torch._check(n >= 0)
    cand = torch.arange(user_index.shape[0], device=user_index.device)  # [B]
    seg = torch.repeat_interleave(cand, cand_len, output_size=n)  # [N]
    user_start = torch.cumsum(seq_lengths, dim=0) - seq_lengths  # [U]
    shift = user_start[user_index] - (torch.cumsum(cand_len, dim=0) - cand_len)  # [B]
    return seg, torch.arange(n, device=user_index.device) + shift[seg]  # [N], [N]


def padded_pair_index(
    seq_lengths: torch.Tensor, user_index: torch.Tensor, real_rows: torch.Tensor, pairs: int
) -> Pairs:
    """:func:`pair_index` of a padded batch, on the device, with no host sync: the shapes are
    static, so a CUDA graph can hold it (serving's buckets, ``serve/graphs.py``).

    ``seq_lengths`` [R'] and ``user_index`` [R] hold a batch padded to R candidate rows (the
    dummy rows after the first ``real_rows`` [1] ones, the last row always a dummy). The real
    rows' pairs come first, exactly :func:`pair_index`'s; the rest of the ``pairs`` are the
    last row's, with element 0. Needs N <= ``pairs``, which the caller checks on the host
    (:func:`pair_count`); the dummy rows' lengths and users are never read as pairs."""
    rows = user_index.shape[0]
    row = torch.arange(rows, device=user_index.device)  # [R]
    cand_len = torch.where(row < real_rows, seq_lengths[user_index], 0)  # [R], dummies 0
    last = row == rows - 1
    cand_len = torch.where(last, pairs - cand_len.sum(), cand_len)  # the last row: the padding
    seg = torch.repeat_interleave(cand_len, output_size=pairs)  # [P] row of each pair
    user_start = torch.cumsum(seq_lengths, dim=0) - seq_lengths  # [R']
    shift = user_start[user_index] - (torch.cumsum(cand_len, dim=0) - cand_len)  # [R]
    elem = torch.arange(pairs, device=user_index.device) + shift[seg]  # [P]
    return seg, torch.where(seg == rows - 1, 0, elem)  # [P], [P]


@dataclass(frozen=True)
class DenseLayout:
    """Which embedding goes into which dense input, in concatenation order, and the widths."""

    user_deep: tuple[str, ...]  # DEEP-group features with side USER
    item_deep: tuple[str, ...]  # DEEP-group features with side ITEM or CONTEXT
    query: tuple[str, ...]  # SEQUENCE-group query features (one per candidate row)
    sequence: tuple[str, ...]  # SEQUENCE-group sequence features (jagged, one per user row)
    user_deep_dim: int
    item_deep_dim: int
    seq_dim: int  # width of query and of sequence


def embedding_dim(fs: FeatureSet, name: str) -> int:
    """The width of feature ``name``'s embedding (its table's ``dim``)."""
    return fs.tables[fs.features[name].table].dim


def column_starts(fs: FeatureSet, names: Sequence[str]) -> dict[str, int]:
    """Each of ``names``' first column in the concatenation of their embeddings, in that order
    (e.g. of ``user_deep`` for ``dense_layout(fs).user_deep``)."""
    out, at = {}, 0
    for n in names:
        out[n], at = at, at + embedding_dim(fs, n)
    return out


def dense_layout(fs: FeatureSet) -> DenseLayout:
    """Feature order and widths of the dense inputs.

    DEEP features keep the FeatureSet order (config order of ``feature_configs``), USER side into
    ``user_deep``, ITEM and CONTEXT side into ``item_deep``. Query and sequence features keep the
    SEQUENCE group's order; query i and sequence i must have equal widths.
    """
    deep = fs.group(GroupType.DEEP)
    seq = fs.group(GroupType.SEQUENCE)
    in_deep = set(deep.features)
    ordered = [f for f in fs.features.values() if f.name in in_deep]
    user = tuple(f.name for f in ordered if f.side is Side.USER)
    item = tuple(f.name for f in ordered if f.side is not Side.USER)

    def dim(name: str) -> int:
        return embedding_dim(fs, name)

    for q, s in zip(seq.query, seq.sequence, strict=True):
        if dim(q) != dim(s):
            raise ValueError(
                f"group {seq.name!r}: query feature {q!r} has dim {dim(q)} but its sequence "
                f"feature {s!r} has dim {dim(s)}; DIN needs equal widths (same embedding_dim)"
            )
    return DenseLayout(
        user_deep=user,
        item_deep=item,
        query=seq.query,
        sequence=seq.sequence,
        user_deep_dim=sum(dim(n) for n in user),
        item_deep_dim=sum(dim(n) for n in item),
        seq_dim=sum(dim(n) for n in seq.query),
    )


@dataclass(frozen=True)
class ColdLayout:
    """The dynamic features of the dense inputs, in the column order of the cold masks."""

    user: tuple[str, ...]  # user_cold [U, len]: dynamic features of user_deep
    item: tuple[str, ...]  # item_cold [B, len]: of item_deep, then query features not in it
    sequence: tuple[str, ...]  # seq_cold [T, len]: dynamic sequence features

    @property
    def features(self) -> tuple[str, ...]:
        return (*self.user, *self.item, *self.sequence)


def cold_layout(fs: FeatureSet, layout: DenseLayout | None = None) -> ColdLayout:
    """Which features have a column in ``user_cold``, ``item_cold`` and ``seq_cold``: every
    dynamic feature of the dense inputs, in :func:`dense_layout` order."""
    lay = layout or dense_layout(fs)

    def dynamic(names: Sequence[str]) -> tuple[str, ...]:
        return tuple(n for n in names if fs.tables[fs.features[n].table].is_dynamic)

    item = dynamic(lay.item_deep)
    return ColdLayout(
        user=dynamic(lay.user_deep),
        item=item + tuple(n for n in dynamic(lay.query) if n not in item),
        sequence=dynamic(lay.sequence),
    )


def cold_rows(hits: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Which bags are cold: ``hits`` [N] bool (the id has a row) with bag ``lengths`` [R]
    (sum N) → [R] bool, True where the bag has ids and none of them has a row. No host sync."""
    return _cold_of(hits, _bag_index(lengths, hits.shape[0]), lengths)


def _cold_of(hits: torch.Tensor, bag: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """:func:`cold_rows` given the bag of each id (``bag`` [N]); the hits per bag are a count
    (sums of ones and zeros in float32 are exact), so "no hit and some ids" is one comparison:
    hits < min(lengths, 1)."""
    found = hits.new_zeros(lengths.shape[0], dtype=torch.float32)  # [R]
    found.index_add_(0, bag, hits.to(torch.float32))  # [R] hits per bag
    return found < lengths.clamp(max=1)  # [R] bool


# One feature's ids in a batch: (KJT "user" | "item" | "sequence", feature, ids [n], lengths [rows])
FeaturePart = tuple[str, str, torch.Tensor, torch.Tensor]


def feature_parts(batch: Batch) -> list[FeaturePart]:
    """Every feature of ``batch`` with its ids and bag lengths, in KJT order (user, item,
    sequence): what training and serving look up, then pool with :func:`pool_features`."""
    kjts = (("user", batch.user), ("item", batch.item), ("sequence", batch.sequence))
    return [part for which, kjt in kjts for part in _kjt_parts(which, kjt)]


def _kjt_parts(which: str, kjt: KeyedJaggedTensor) -> list[FeaturePart]:
    """One KJT's features: two splits (values by the host-known ids per key, lengths by the
    stride) where ``KJT.to_dict`` costs ~8 torch ops; ``to_dict`` where the ids per key are not
    known on the host (computing them would sync) or the stride varies per key."""
    keys, per_key = kjt.keys(), kjt.length_per_key_or_none()
    if per_key is None or kjt.variable_stride_per_key():
        return [(which, name, jt.values(), jt.lengths()) for name, jt in kjt.to_dict().items()]
    if not keys:
        return []
    values = torch.split(kjt.values(), per_key)  # [n_k] per key
    lengths = torch.split(kjt.lengths(), kjt.stride())  # [rows] per key
    return [(which, *f) for f in zip(keys, values, lengths, strict=True)]


def parts_by_table(fs: FeatureSet, parts: Sequence[FeaturePart]) -> dict[str, list[int]]:
    """Table name → positions in ``parts`` of the features it serves (one lookup per table)."""
    out: dict[str, list[int]] = {}
    for i, (_which, name, _ids, _lengths) in enumerate(parts):
        out.setdefault(fs.features[name].table, []).append(i)
    return out


def pool(emb: torch.Tensor, lengths: torch.Tensor, pooling: str = "sum") -> torch.Tensor:
    """Pool the rows of each bag: ``emb`` [N, D] with ``lengths`` [R] (sum N) → [R, D].

    ``pooling`` is ``"sum"`` or ``"mean"``; an empty bag (a missing value) gives zeros.
    """
    return pool_many([emb], [lengths], [pooling])[0]


def pool_bags(
    emb: torch.Tensor, lengths: torch.Tensor, mean: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum the rows of each bag, or average them where ``mean`` [R] (bool) is True: ``emb``
    [N, D] with ``lengths`` [R] (sum N) → [R, D]; an empty bag gives zeros. One index_add for
    all bags, whatever features they belong to; nothing is read back to the host."""
    return _sum_bags(emb, _bag_index(lengths, emb.shape[0]), lengths, mean)


def _bag_index(lengths: torch.Tensor, n: int) -> torch.Tensor:
    """[N] bag of each row of bags of ``lengths`` [R] (sum ``n``, known on the host: no sync),
    in ``lengths``' integer dtype. ``repeat_interleave`` of the lengths alone is arange(R)
    repeated: a scan and one kernel on CUDA, where repeating an ``arange`` tensor added the
    arange and an ``index_select`` of it (issue #53)."""
    return torch.repeat_interleave(lengths, output_size=n)  # [N]


def _sum_bags(
    emb: torch.Tensor, bag: torch.Tensor, lengths: torch.Tensor, mean: torch.Tensor | None
) -> torch.Tensor:
    """:func:`pool_bags` given the bag of each row (``bag`` [N])."""
    out = emb.new_zeros(lengths.shape[0], emb.shape[1]).index_add_(0, bag, emb)  # [R, D]
    if mean is None:
        return out
    return out / torch.where(mean, lengths.clamp(min=1), 1).unsqueeze(1).to(out.dtype)  # [R, D]


def pool_many(
    embs: Sequence[torch.Tensor], lengths: Sequence[torch.Tensor], poolings: Sequence[str]
) -> list[torch.Tensor]:
    """:func:`pool` of several features at once: one :func:`pool_bags` per embedding width
    instead of four ops per feature (the GPU's host spends ~25 µs per op). Same sums, in the
    same order."""
    return pool_and_flag(embs, lengths, poolings, [None] * len(embs))[0]


def pool_and_flag(
    embs: Sequence[torch.Tensor],
    lengths: Sequence[torch.Tensor],
    poolings: Sequence[str],
    hits: Sequence[torch.Tensor | None],
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """:func:`pool_many`, and :func:`cold_rows` of every embedding with ``hits`` ([n_i] bool:
    the id has a row; None: not a dynamic feature) from the same bag index: per width, the
    embeddings with hits are concatenated first, so that their bags are the first of the
    pooling's and their hits are counted with a prefix of its bag index (one
    ``repeat_interleave`` for both, where a separate :func:`cold_rows` built a second one:
    ~5 launches a step on CUDA, issue #53). Returns ([R_i, D_i] pooled, [R_i] bool or None)
    per embedding; every bag's rows are summed in their order, so both equal the separate
    calls bit for bit."""
    for p in poolings:
        if p not in ("sum", "mean"):
            raise ValueError(f"pooling {p!r} is not sum or mean")
    out: list[torch.Tensor | None] = [None] * len(embs)
    cold: list[torch.Tensor | None] = [None] * len(embs)
    by_width: dict[int, list[int]] = {}
    for i, e in enumerate(embs):
        by_width.setdefault(e.shape[1], []).append(i)
    for idx in by_width.values():
        idx.sort(key=lambda i: hits[i] is None)  # stable: the ones with hits first
        emb = torch.cat([embs[i] for i in idx]) if len(idx) > 1 else embs[idx[0]]  # [N, D]
        lens = torch.cat([lengths[i] for i in idx]) if len(idx) > 1 else lengths[idx[0]]  # [R]
        mean = None
        if any(poolings[i] == "mean" for i in idx):  # [R] bool, made on the device
            flags = [(lengths[i], poolings[i] == "mean") for i in idx]
            mean = torch.cat([torch.full_like(n, m, dtype=torch.bool) for n, m in flags])
        rows = [int(lengths[i].shape[0]) for i in idx]
        bag = _bag_index(lens, emb.shape[0])  # [N]
        pooled = _sum_bags(emb, bag, lens, mean)  # [R, D]
        out_idx = zip(idx, torch.split(pooled, rows), strict=True)
        for i, part in out_idx:
            out[i] = part  # [R_i, D]
        flagged = [k for k, i in enumerate(idx) if hits[i] is not None]  # a prefix of idx
        if flagged:
            found_parts = [cast(torch.Tensor, hits[idx[k]]) for k in flagged]
            found = joined(found_parts)  # [n]
            r = sum(rows[k] for k in flagged)
            flags_r = _cold_of(found, bag[: found.shape[0]], lens[:r])  # [r]
            for k, part in zip(flagged, torch.split(flags_r, rows[: len(flagged)]), strict=True):
                cold[idx[k]] = part  # [R_i] bool
    return out, cold  # type: ignore[return-value]


def joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` of 1-D tensors that need no gradient, as a view (no copy, no
    launch) where they lie one after another in one storage, in order: a lookup's hits split
    per feature (the dynamic storages return them in the caller's order, so a batch's pooled
    features' hits, and its sequence features', are adjacent; issue #53). The view shares the
    pieces' memory, which its callers only read; anything else is concatenated."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    base, at = first.untyped_storage().data_ptr(), first.storage_offset()
    for p in parts:
        if (
            p.dim() != 1
            or p.requires_grad
            or p.dtype != first.dtype
            or p.device != first.device
            or (p.numel() > 1 and p.stride(0) != 1)
            or p.untyped_storage().data_ptr() != base
            or p.storage_offset() != at
        ):
            return torch.cat(list(parts))
        at += p.numel()
    return first.as_strided((at - first.storage_offset(),), (1,))  # [Σ n_i]


def pool_features(
    fs: FeatureSet,
    parts: Sequence[FeaturePart],
    rows: Sequence[torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(pooled, sequences) from looked-up embeddings, as :func:`assemble_dense_inputs` takes
    them. ``parts[i]`` is (which KJT, feature, ids, lengths) with ``which`` "sequence" for the
    jagged sequence sub-features (kept as [T, dim]); ``rows[i]`` is its [n_i, dim] embeddings.
    Every other feature is pooled per bag with its table's pooling (one :func:`pool_many`)."""
    pooled, sequences, _cold = pool_and_flag_features(fs, parts, rows, [None] * len(parts))
    return pooled, sequences


def pool_and_flag_features(
    fs: FeatureSet,
    parts: Sequence[FeaturePart],
    rows: Sequence[torch.Tensor],
    hits: Sequence[torch.Tensor | None],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """:func:`pool_features`, and the cold flags of every part with ``hits`` ([n_i] bool: the
    id has a row; None: not a dynamic feature, or not asked for): feature → a pooled
    feature's [rows] bool (:func:`cold_rows`, counted with the pooling's own bag index,
    :func:`pool_and_flag`) or a sequence feature's [T] bool (``~hits``, all sequences' in one
    negation), in ``parts`` order. Nothing is read back to the host."""
    sequences: dict[str, torch.Tensor] = {}
    names, embs, lengths, poolings, found = [], [], [], [], []
    seq_hits: list[tuple[str, torch.Tensor]] = []
    for (which, name, _ids, lens), emb, h in zip(parts, rows, hits, strict=True):
        if which == "sequence":
            sequences[name] = emb  # [T, dim]
            if h is not None:
                seq_hits.append((name, h))
        else:
            names.append(name)
            embs.append(emb)
            lengths.append(lens)
            poolings.append(fs.tables[fs.features[name].table].pooling)
            found.append(h)
    sums, flags = pool_and_flag(embs, lengths, poolings, found)
    pooled = dict(zip(names, sums, strict=True))  # [rows, dim]
    cold = {n: f for n, f in zip(names, flags, strict=True) if f is not None}  # [rows] bool
    if seq_hits:
        got = [h for _, h in seq_hits]
        missed = ~joined(got)  # [Σ T]
        sizes = [int(h.shape[0]) for h in got]
        cold.update(zip((n for n, _ in seq_hits), torch.split(missed, sizes), strict=True))
    order = [p[1] for p, h in zip(parts, hits, strict=True) if h is not None]
    return pooled, sequences, {n: cold[n] for n in order}


def _concat(parts: list[torch.Tensor], rows: int, like: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts, dim=1) if parts else like.new_zeros(rows, 0)


def sequence_lengths(batch: Batch, lay: DenseLayout) -> torch.Tensor | None:
    """[U] elements per user: the first sequence feature's lengths (None: no sequence features).
    A slice of the lengths, where ``KJT.__getitem__`` costs ~20 µs of host."""
    if not lay.sequence:
        return None
    first, rows = batch.sequence.keys().index(lay.sequence[0]), batch.sequence.stride()
    return batch.sequence.lengths()[first * rows : (first + 1) * rows]  # [U]


def batch_pairs(batch: Batch, lay: DenseLayout) -> tuple[np.ndarray, np.ndarray]:
    """:func:`pair_index` of a batch on the host (CPU tensors), as the program's inputs want it."""
    return pair_index(_host_lengths(batch, lay), batch.user_index.numpy())


def batch_pair_count(batch: Batch, lay: DenseLayout) -> int:
    """:func:`pair_count` of a batch on the host (CPU tensors)."""
    return pair_count(_host_lengths(batch, lay), batch.user_index.numpy())


def _host_lengths(batch: Batch, lay: DenseLayout) -> np.ndarray:
    lengths = sequence_lengths(batch, lay)
    return np.zeros(batch.num_users, np.int64) if lengths is None else lengths.numpy()


def assemble_dense_inputs(
    fs: FeatureSet,
    batch: Batch,
    pooled: Mapping[str, torch.Tensor],
    sequences: Mapping[str, torch.Tensor],
    *,
    layout: DenseLayout | None = None,
    pairs: Pairs | None = None,
    cold: Mapping[str, torch.Tensor] | None = None,
    cold_columns: ColdLayout | None = None,
) -> dict[str, torch.Tensor]:
    """The dense program's keyword inputs (see the module docstring) from looked-up embeddings.

    ``pooled[name]`` is [rows, dim] for every DEEP and query feature (rows = U for user-side
    features, B for item/context ones); ``sequences[name]`` is [T, dim] for every sequence
    feature, jagged with ``batch.sequence``'s lengths (equal across a sequence's sub-features).
    ``layout`` may be passed to skip recomputing :func:`dense_layout` on a hot path. ``pairs``
    (:func:`batch_pairs` of the batch, on its device) adds :data:`PAIR_NAMES`, for programs
    that take them. ``cold`` (feature → [rows] bool, :func:`cold_rows`, for every feature of
    :func:`cold_layout`, which ``cold_columns`` may pass precomputed) adds :data:`COLD_NAMES`.
    """
    lay = layout or dense_layout(fs)
    u, b = batch.num_users, batch.batch_size
    like = next(iter(pooled.values())) if pooled else next(iter(sequences.values()))
    missing = [n for n in (*lay.user_deep, *lay.item_deep, *lay.query) if n not in pooled]
    missing += [n for n in lay.sequence if n not in sequences]
    if missing:
        raise KeyError(f"no embeddings for features {missing}; every feature must be looked up")
    seq_lengths = sequence_lengths(batch, lay)  # no host sync: T comes from the tensors
    if seq_lengths is not None:
        seq_values = torch.cat([sequences[n] for n in lay.sequence], dim=1)  # [T, Dq]
    else:  # no sequence features: T = 0
        seq_lengths = torch.zeros(u, dtype=torch.int64, device=like.device)
        seq_values = like.new_zeros(0, 0)
    inputs = {
        "user_deep": _concat([pooled[n] for n in lay.user_deep], u, like),  # [U, Du]
        "item_deep": _concat([pooled[n] for n in lay.item_deep], b, like),  # [B, Di]
        "query": _concat([pooled[n] for n in lay.query], b, like),  # [B, Dq]
        "seq_values": seq_values,  # [T, Dq]
        "seq_lengths": _as(seq_lengths, torch.int64),  # [U]
        "user_index": _as(batch.user_index, torch.int64),  # [B]
    }
    if pairs is not None:
        inputs.update(zip(PAIR_NAMES, pairs, strict=True))  # [N], [N]
    if cold is not None:
        inputs.update(_cold_masks(fs, lay, cold, cold_columns, (u, b, seq_values.shape[0]), like))
    return inputs


def _cold_masks(
    fs: FeatureSet,
    lay: DenseLayout,
    cold: Mapping[str, torch.Tensor],
    columns: ColdLayout | None,
    rows: tuple[int, int, int],
    like: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """user_cold [U, Ku], item_cold [B, Ki], seq_cold [T, Ks] from each feature's [rows] flags."""
    col = columns or cold_layout(fs, lay)
    missing = [n for n in col.features if n not in cold]
    if missing:
        raise KeyError(f"no cold flags for the dynamic features {missing}; pass all of them")
    out = {}
    for name, names, n in zip(COLD_NAMES, (col.user, col.item, col.sequence), rows, strict=True):
        flags = [_as(cold[f], torch.bool) for f in names]  # [n] each
        if len(flags) > 1:
            out[name] = torch.stack(flags, dim=1)  # [n, K]
        elif flags:
            out[name] = flags[0].unsqueeze(1)  # [n, 1], a view: no copy
        else:
            out[name] = torch.zeros(n, 0, dtype=torch.bool, device=like.device)
    return out


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``; ``t`` itself when it is already, without ``Tensor.to``'s call (its
    dispatch costs host time on every step of a host-bound GPU loop, issue #53)."""
    return t if t.dtype == dtype else t.to(dtype)
