"""How a bundle names its shard files and tensors: TorchEasyRec's RTP export naming, or ours.

The one place that knows the names. The writer is given a naming (default
:data:`TZREC_NAMING`), the manifest records it, and the reader gets it back once
(:func:`naming_of`) before it opens a shard; everything after that asks the naming object, never
"which naming is this?". ``C`` is the collection path, ``T`` a table, ``R`` of ``W`` a rank part::

    tzrec   (format_version 2)  model-000000-of-000001.{safetensors,json}
            dynamic T           C.T.keys/part_R_W int64 [n], C.T.values/part_R_W float32 [n, dim]
                                [C.T.scores/part_R_W int64 [n]: optional, the rows' hotness]
            dense T             C.embedding_bags.T.weight float32 [rows, dim]
    dynrec  (format_version 1)  model-00000-of-00001.{safetensors,json}
            dynamic T           T.keys/part_R_W, T.values/part_R_W [, T.scores/part_R_W]
            dense T             T.weight

A format 2 manifest also says ``"naming": "tzrec"``. ``tzrec`` is what TorchEasyRec's RTP
export writes (``tzrec/utils/export_util.py``: ``_get_rtp_embedding_tensor``, l. 627-735; files
``model-{rank:06d}-of-{world_size:06d}``, l. 1042-1050): dynamic tables under the checkpoint's
collection directory name (:data:`TZREC_COLLECTION` for the DEEP group of MultiTowerDIN), dense
tables by their state_dict name. When reading, any collection path is accepted: the table is the
last dot-free component before ``.values/part_R_W`` or ``.weight`` (tzrec takes
``name.split(".")[-2]``). ``dynrec`` is format 1, what this project wrote before: still read, and
written on request for servers that predate format 2. Example::

    TZREC_NAMING.values_name("user_id_emb", 0, 2)
    # 'model.model.embedding_group.emb_impls.__BASE__.ebc.user_id_emb.values/part_0_2'
    TZREC_NAMING.parse(that, hashmap=True)
    # TensorName(table='user_id_emb', rank=0, world=2, prefix='model.model.embedding_group...')

A dynamic table's part may carry its rows' hotness, ``.scores/part_R_W`` int64 [n] beside the
values (the training table's STEP/TIMESTAMP/LFU score: larger is hotter), named in the part's
model-*.json entry as ``hashmap_score``; a server whose tables do not all fit its device keeps the
hottest rows in device memory by it (``serve.tiers``). It is optional and adds no format number:
a bundle without it is read as before (the hot rows are then the first ones). A reader that
predates it refuses a bundle that has it (an unlisted tensor), so serve such a bundle with a
server of this version or later.

Format 3 (:data:`PAIR_PROGRAM_FORMAT`) is format 2 (tzrec naming, ``"naming": "tzrec"``) whose
dense program takes the (candidate, element) pairs as inputs (``pair_segment``,
``pair_element``: :mod:`shared.dense_inputs`), so that it has no host sync and can be replayed as
a CUDA graph. The program signature is versioned by the format number, not by a field of its own,
because only a number that old readers refuse keeps a server that predates the pair inputs from
loading such a program (it would fail in warm-up at best); this reader knows formats 1-3, and the
server tells the signature by the program's input names, so it also runs format 1 and 2
programs. The writer picks the number from the naming and the program it is given
(:func:`format_version`); format 1 has no pair variant: its readers predate format 2, let alone
the pairs, so a pair program needs tzrec naming (or export one without the pairs).

Format 4 (:data:`COLD_PROGRAM_FORMAT`) is format 3 whose program also takes the cold masks
(``user_cold``, ``item_cold``, ``seq_cold``: a model with a cold-id backoff,
``train/model/backoff.py``); readers of formats 1-3 refuse it, which they must: they would
feed it no masks. The signature of every format is :class:`shared.dense_inputs.Signature`.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from shared.bundle.layout import BundleError
from shared.dense_inputs import Signature

# the directory tzrec's checkpoints give MultiTowerDIN's DEEP-group EmbeddingBagCollection
TZREC_COLLECTION = "model.model.embedding_group.emb_impls.__BASE__.ebc"


@dataclass(frozen=True)
class TensorName:
    """What a tensor name says. ``prefix``: what precedes the table name (the collection path of
    a dynamic table, the module path of a dense weight; ``""`` in dynrec naming)."""

    table: str
    rank: int  # 0 for a dense weight
    world: int  # 1 for a dense weight
    prefix: str


class BundleNaming(ABC):
    """File and tensor names of one naming (:data:`TZREC_NAMING`, :data:`DYNREC_NAMING`)."""

    id: ClassVar[str]  # the manifest's "naming"
    format_version: ClassVar[int]  # the manifest's "format_version" for this naming
    digits: ClassVar[int]  # width of the shard index and count in file names
    values_form: ClassVar[str]  # the tensor name forms, for error messages
    weight_form: ClassVar[str]
    _values_re: ClassVar[re.Pattern[str]]
    _weight_re: ClassVar[re.Pattern[str]]

    def shard_stem(self, index: int, count: int) -> str:
        """The file stem of shard ``index`` of ``count``: ``model-000000-of-000001`` (tzrec)."""
        return f"model-{index:0{self.digits}d}-of-{count:0{self.digits}d}"

    def is_stem(self, stem: str) -> bool:
        return re.fullmatch(rf"model-\d{{{self.digits}}}-of-\d{{{self.digits}}}", stem) is not None

    def manifest_fields(self) -> dict[str, Any]:
        """What the manifest says about the naming (beside ``format_version``)."""
        return {"naming": self.id}

    @abstractmethod
    def weight_name(self, table: str) -> str: ...

    @abstractmethod
    def _table_prefix(self, table: str) -> str: ...

    def keys_name(self, table: str, rank: int, world: int) -> str:
        return f"{self._table_prefix(table)}{table}.keys/part_{rank}_{world}"

    def values_name(self, table: str, rank: int, world: int) -> str:
        return f"{self._table_prefix(table)}{table}.values/part_{rank}_{world}"

    def scores_name(self, table: str, rank: int, world: int) -> str:
        """The optional hotness of a part's rows (int64 [n], the entry's ``hashmap_score``)."""
        return f"{self._table_prefix(table)}{table}.scores/part_{rank}_{world}"

    def for_tables(self, collections: Mapping[str, str]) -> BundleNaming:
        """This naming with dynamic tables under the given collection paths (table → path),
        as a checkpoint keeps them; a naming without collection paths ignores them."""
        return self

    @abstractmethod
    def check_table(self, table: str) -> None:
        """Refuse a table name this naming cannot carry (BundleError naming it and the fix)."""

    def parse(self, name: str, *, hashmap: bool) -> TensorName | None:
        """The table (and part) of a values tensor (``hashmap``) or dense weight; None when
        ``name`` is not of this naming's form."""
        m = (self._values_re if hashmap else self._weight_re).fullmatch(name)
        if m is None:
            return None
        groups = m.groupdict()
        rank, world = (int(groups["rank"]), int(groups["world"])) if hashmap else (0, 1)
        return TensorName(groups["table"], rank, world, groups.get("prefix") or "")


@dataclass(frozen=True)
class TzrecNaming(BundleNaming):
    """TorchEasyRec's RTP export names. Written: a dynamic table under ``collections[table]``
    (its checkpoint's collection directory, as tzrec's export names it), else under
    ``collection``, which also holds the dense tables. Read: any collection path."""

    id = "tzrec"
    format_version = 2
    digits = 6
    values_form = "<collection path>.<table>.values/part_R_W"
    weight_form = "<module path>.<table>.weight"
    _values_re = re.compile(
        r"(?P<prefix>.+)\.(?P<table>[^.]+)\.values/part_(?P<rank>\d+)_(?P<world>\d+)"
    )
    _weight_re = re.compile(r"(?P<prefix>.+)\.(?P<table>[^.]+)\.weight")

    collection: str = TZREC_COLLECTION
    collections: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for c in (self.collection, *self.collections.values()):
            if not c or c.startswith(".") or c.endswith(".") or "/" in c:
                raise BundleError(
                    f"collection path {c!r} must be a dotted module path such as "
                    f"{TZREC_COLLECTION!r}"
                )

    def for_tables(self, collections: Mapping[str, str]) -> BundleNaming:
        return replace(self, collections=dict(collections))

    def _table_prefix(self, table: str) -> str:
        return f"{self.collections.get(table, self.collection)}."

    def weight_name(self, table: str) -> str:
        return f"{self.collection}.embedding_bags.{table}.weight"  # EmbeddingBagCollection's

    def check_table(self, table: str) -> None:
        if "." in table:
            raise BundleError(
                f"table {table!r}: TorchEasyRec names tensors <collection>.<table>.values/..., "
                "so a table name cannot contain '.'; rename it (embedding_name) or write the "
                "bundle in format 1 (naming=DYNREC_NAMING, export --naming dynrec)"
            )


@dataclass(frozen=True)
class DynrecNaming(BundleNaming):
    """This project's names of bundle format 1 (no collection path, five-digit shards)."""

    id = "dynrec"
    format_version = 1
    digits = 5
    values_form = "<table>.values/part_R_W"
    weight_form = "<table>.weight"
    _values_re = re.compile(r"(?P<table>.+)\.values/part_(?P<rank>\d+)_(?P<world>\d+)")
    _weight_re = re.compile(r"(?P<table>.+)\.weight")

    def _table_prefix(self, table: str) -> str:
        return ""

    def weight_name(self, table: str) -> str:
        return f"{table}.weight"

    def check_table(self, table: str) -> None:
        return None  # any name: the table is everything before .values/... or .weight

    def manifest_fields(self) -> dict[str, Any]:
        return {}  # format 1 predates the field: its manifest stays byte for byte as it was


TZREC_NAMING: BundleNaming = TzrecNaming()
DYNREC_NAMING: BundleNaming = DynrecNaming()
NAMINGS: dict[str, BundleNaming] = {n.id: n for n in (TZREC_NAMING, DYNREC_NAMING)}
PAIR_PROGRAM_FORMAT = 3  # format 2 whose dense program takes the pairs (module docstring)
COLD_PROGRAM_FORMAT = 4  # format 3 whose dense program also takes the cold masks
FORMAT_VERSIONS = (
    DYNREC_NAMING.format_version,
    TZREC_NAMING.format_version,
    PAIR_PROGRAM_FORMAT,
    COLD_PROGRAM_FORMAT,
)
# the format of a tzrec-named bundle by its program's signature; dynrec naming has PLAIN only
_FORMAT_OF = {
    Signature.PLAIN: TZREC_NAMING.format_version,
    Signature.PAIRS: PAIR_PROGRAM_FORMAT,
    Signature.COLD: COLD_PROGRAM_FORMAT,
}


def format_version(naming: BundleNaming, signature: Signature) -> int:
    """The manifest's ``format_version`` for a bundle of ``naming`` whose dense program has
    ``signature``; BundleError for a program with the pairs in dynrec naming."""
    if signature is Signature.PLAIN:
        return naming.format_version
    if naming.format_version != TZREC_NAMING.format_version:
        raise BundleError(
            f"the dense program takes {list(signature.value[len(Signature.PLAIN.value) :])} "
            f"(bundle format {_FORMAT_OF[signature]}, tzrec naming), but {naming.id} naming "
            f"writes format {naming.format_version} for servers that predate them; use tzrec "
            "naming, or export the program without the pairs "
            "(train.model.dense_arch.example_inputs(..., pairs=False); not for a model with a "
            "cold-id backoff)"
        )
    return _FORMAT_OF[signature]


def program_signature(version: int) -> Signature:
    """The dense program signature a bundle of format ``version`` has (1 and 2: PLAIN)."""
    return {v: s for s, v in _FORMAT_OF.items()}.get(version, Signature.PLAIN)


def naming_of(manifest: dict[str, Any], where: str) -> BundleNaming:
    """The naming of a bundle from its manifest (format 1: dynrec; 2 and 3: its ``"naming"``,
    tzrec); BundleError naming ``where`` and the fix otherwise."""
    version = manifest.get("format_version")
    if type(version) is int and version == DYNREC_NAMING.format_version:
        return DYNREC_NAMING
    if type(version) is not int or version not in FORMAT_VERSIONS:
        known = list(FORMAT_VERSIONS)
        raise BundleError(
            f"{where}: format_version {version!r} is not supported (this reader knows {known}); "
            "re-export with this version of the code"
        )
    raw = manifest.get("naming")
    naming = NAMINGS.get(raw) if isinstance(raw, str) else None
    if naming is None or naming.format_version != TZREC_NAMING.format_version:
        raise BundleError(
            f"{where}: format_version {version} needs 'naming': {TZREC_NAMING.id!r}, got "
            f"{raw!r}; re-export the bundle"
        )
    return naming


def is_shard_file(filename: str) -> bool:
    """Whether ``filename`` is a shard file (.safetensors/.json) of any naming."""
    stem, dot, ext = filename.rpartition(".")
    return (
        bool(dot)
        and ext in ("safetensors", "json")
        and any(n.is_stem(stem) for n in NAMINGS.values())
    )
