"""Dynamic-table checkpoints: written in NVIDIA dynamicemb's layout, read in it and in our first one.

Writing (:func:`save`): dynamicemb's files exactly (:mod:`shared.hashtable.checkpoint_dynamicemb`
has the rules) in TorchEasyRec's directories, ``<ckpt>/dynamicemb/<collection>/``, where
``<collection>`` is the torch module path of the torchrec collection that holds the table in a
TorchEasyRec ``MultiTowerDIN`` (:func:`collection_paths`)::

    <ckpt>/dynamic_tables.json     ours (rank 0): format, the id mode of the keys, and per
                                   table its collection, dim, score strategy, max_capacity,
                                   admission threshold
    <ckpt>/dynamicemb/model.model.embedding_group.emb_impls.__BASE__.ebc/
        user_id_emb_emb_keys.rank_0.world_size_2   user_id_emb_emb_values...   ..._emb_scores...
        user_id_emb_emb_opt_values...   user_id_emb_counter_keys...   ..._counter_frequencies...
        user_id_emb_opt_args.json      (rank 0)

Nothing of ours goes into dynamicemb's files; ``dynamic_tables.json`` is optional for readers
(TorchEasyRec's checkpoints have none). Every rank writes into a temporary directory beside the
target and renames it into place (a collection directory as a whole when it does not exist yet,
else file by file), so readers never see a half-written file.

Reading (:func:`open_checkpoint`, the one place that looks at the format): a reader per layout,
chosen once by what is on disk: dynrec's first layout (:mod:`shared.hashtable.checkpoint_v1`)
when its ``_opt_args.json`` files say so, else dynamicemb's. :func:`load` then picks each table's
files (:func:`select_tables`), re-shards (every saved rank is read; this rank keeps ``key %
world_size == rank``) and refuses what would load nothing: a checkpoint with none of the
expected tables, a table missing from it, no rows at all, or keys made in another id mode
(``data_config.dynrec_id_mode``; a meta without ``id_mode`` is ``"dynrec"``, a checkpoint
without meta is not checked).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shared.features import FeatureSet, GroupType, TableSpec
from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.checkpoint_dynamicemb import (
    DynamicembReader,
    collection_dirs,
    opt_args,
    step_score,
    write_table_files,
)
from shared.hashtable.checkpoint_io import (
    CheckpointError,
    CheckpointReader,
    ReadRequest,
    ReadTable,
    SavedTable,
    TableInfo,
)
from shared.hashtable.checkpoint_v1 import V1Reader, v1_dirs
from shared.hashtable.storage import TableState

logger = logging.getLogger(__name__)

FORMAT = "dynrec-ckpt/2"
META_FILE = "dynamic_tables.json"
DEEP_COLLECTION = "model.model.embedding_group.emb_impls.__BASE__.ebc"
SEQUENCE_COLLECTION = "model.model.embedding_group.seq_emb_impls.__BASE__.ec_dict.{dim}"

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "LoadReport",
    "SavedTable",
    "TablesSnapshot",
    "TableInfo",
    "collection_paths",
    "load",
    "open_checkpoint",
    "read_table",
    "save",
    "select_tables",
]


class SavedTables(Protocol):
    """What :func:`save` reads of a ``DynamicEmbeddingCollection`` (or of a
    :class:`TablesSnapshot` of one)."""

    @property
    def tables(self) -> Mapping[str, TableSpec]: ...

    @property
    def adagrad(self) -> AdagradConfig: ...

    def table_adagrad(self, name: str) -> AdagradConfig: ...  # at the table's own rate

    @property
    def id_mode(self) -> str: ...  # the IdMode value its keys are made in

    @property
    def step(self) -> int: ...

    def score_clock(self) -> int: ...

    def table_states(self) -> Mapping[str, TableState]: ...


class DynamicTables(SavedTables, Protocol):
    """What :func:`save` and :func:`load` use of a ``DynamicEmbeddingCollection``."""

    def load_table_state(self, name: str, state: TableState) -> None: ...


@dataclass(frozen=True)
class TablesSnapshot:
    """Everything :func:`save` writes of a collection, taken at one moment and held on the host:
    a background writer saves it while training goes on changing the tables.
    ``TablesSnapshot.of(collection)`` reads every table (device → host copies)."""

    tables: Mapping[str, TableSpec]
    adagrad: AdagradConfig
    id_mode: str
    step: int
    clock: int  # score_clock() when it was taken
    states: Mapping[str, TableState]
    table_adagrads: Mapping[str, AdagradConfig]

    @classmethod
    def of(cls, dec: SavedTables) -> TablesSnapshot:
        states = {name: _on_host(state) for name, state in dec.table_states().items()}
        rates = {name: dec.table_adagrad(name) for name in dec.tables}
        return cls(dict(dec.tables), dec.adagrad, dec.id_mode, dec.step, dec.score_clock(),
                   states, rates)  # fmt: skip

    def table_adagrad(self, name: str) -> AdagradConfig:
        return self.table_adagrads[name]

    def score_clock(self) -> int:
        return self.clock

    def table_states(self) -> Mapping[str, TableState]:
        return self.states


def _on_host(state: TableState) -> TableState:
    """``state`` on the CPU (its tensors are gathered copies: nothing aliases the table)."""
    ck, cc = state.counter_keys, state.counter_counts
    return TableState(
        state.keys.cpu(),
        state.values.cpu(),
        state.scores.cpu(),
        state.accumulators.cpu(),
        None if ck is None else ck.cpu(),
        None if cc is None else cc.cpu(),
    )


def collection_paths(fs: FeatureSet) -> dict[str, str]:
    """Table → the collection directory TorchEasyRec gives it: a table lives where the first
    feature group using it (our fusion group) puts it in tzrec's ``EmbeddingGroup``: DEEP groups
    in ``emb_impls.__BASE__.ebc`` (an EmbeddingBagCollection), SEQUENCE groups in
    ``seq_emb_impls.__BASE__.ec_dict.<dim>`` (EmbeddingCollections by dim), under
    ``model.model`` (``TrainWrapper.model``, as dynamicemb's ``find_sharded_modules`` names it).

    The seed config's six dynamic tables are all in the DEEP group first, so all go to
    ``model.model.embedding_group.emb_impls.__BASE__.ebc``. (tzrec keeps a second copy of the
    sequence tables in the sequence collection; we have one table per embedding name.)
    """
    out: dict[str, str] = {}
    for group, names in fs.fusion_groups.items():
        kind = fs.groups[group].type
        for name in names:
            dim = fs.tables[name].dim
            out[name] = (
                DEEP_COLLECTION if kind is GroupType.DEEP else SEQUENCE_COLLECTION.format(dim=dim)
            )
    for t in fs.dynamic_tables:
        out.setdefault(t.name, DEEP_COLLECTION)
    return out


def _collections(tables: Collection[str], collections: str | Mapping[str, str]) -> dict[str, str]:
    if isinstance(collections, str):
        return dict.fromkeys(tables, collections)
    missing = [t for t in tables if t not in collections]
    if missing:
        raise ValueError(f"no collection directory given for tables {missing}")
    return {t: collections[t] for t in tables}


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}; check the "
            "launcher's RANK and WORLD_SIZE (torchrun --nproc-per-node)"
        )


# --------------------------------------------------------------------------- writing


def table_meta(spec: TableSpec, collection: str) -> dict[str, Any]:
    """Our facts about one table (``dynamic_tables.json``), which dynamicemb's files lack."""
    dyn = spec.dynamic
    if dyn is None:
        raise ValueError(f"table {spec.name!r} is not dynamic; only hash tables are saved here")
    return {
        "collection": collection,
        "dim": spec.dim,
        "score_strategy": dyn.score_strategy.value,
        "max_capacity": dyn.max_capacity,
        "admission_threshold": None if dyn.admission is None else dyn.admission.threshold,
    }


def write_meta(ckpt_dir: Path, tables: Mapping[str, dict[str, Any]], *, id_mode: str) -> None:
    """``<ckpt>/dynamic_tables.json`` (temp file + rename); ``id_mode``: the ``IdMode`` value
    the keys were made in, which :func:`load` checks."""
    meta = {"format": FORMAT, "layout": "dynamicemb", "id_mode": id_mode, "tables": dict(tables)}
    text = json.dumps(meta, indent=1)
    tmp = ckpt_dir / f".{META_FILE}.tmp"
    tmp.write_text(text + "\n")
    os.replace(tmp, ckpt_dir / META_FILE)


def save(
    dec: SavedTables,
    ckpt_dir: str | Path,
    collections: str | Mapping[str, str],
    rank: int = 0,
    world_size: int = 1,
) -> Path:
    """Write the rows of every table of ``dec`` that ``rank`` owns; returns ``<ckpt>/dynamicemb``.

    ``collections``: table → collection directory (:func:`collection_paths`), or one name for
    all tables. Rank 0 also writes each ``T_opt_args.json`` and ``dynamic_tables.json``.
    """
    _check_rank(rank, world_size)
    ckpt_dir = Path(ckpt_dir)
    where = _collections(dec.tables, collections)
    base = ckpt_dir / "dynamicemb"
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-rank{rank}-", dir=base))
    try:
        now = dec.score_clock()
        states = dec.table_states()
        for name, spec in dec.tables.items():
            assert spec.dynamic is not None
            strategy = spec.dynamic.score_strategy
            directory = tmp / where[name]
            directory.mkdir(exist_ok=True)
            write_table_files(
                directory,
                name,
                states[name],
                strategy=strategy,
                now=now,
                args=opt_args(dec.table_adagrad(name), strategy, step_score(strategy, dec.step))
                if rank == 0
                else None,
                rank=rank,
                world_size=world_size,
                counter=spec.dynamic.admission is not None,
            )
        for directory in sorted(tmp.iterdir()):
            _publish(directory, base / directory.name)
        tmp.rmdir()
        if rank == 0:
            tables = {n: table_meta(s, where[n]) for n, s in dec.tables.items()}
            write_meta(ckpt_dir, tables, id_mode=dec.id_mode)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return base


def _publish(tmp: Path, final: Path) -> None:
    """Move the finished files of ``tmp`` into ``final`` atomically (see module docstring)."""
    try:
        os.rename(tmp, final)  # atomic for the whole set when final is absent (or empty)
        return
    except OSError:
        pass
    final.mkdir(parents=True, exist_ok=True)
    for f in sorted(tmp.iterdir()):
        os.replace(f, final / f.name)
    tmp.rmdir()


# --------------------------------------------------------------------------- reading


def open_checkpoint(ckpt_dir: str | Path) -> CheckpointReader:
    """The reader of the checkpoint at ``ckpt_dir``, chosen by what is on disk (the format seam).

    A checkpoint without ``dynamicemb/`` gives a dynamicemb reader that finds no tables.
    """
    root = Path(ckpt_dir)
    meta_path = root / META_FILE
    meta: dict[str, Any] | None = None
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            got = meta.get("format") if isinstance(meta, dict) else meta
            raise CheckpointError(
                f"{meta_path}: format {got!r}; this dynrec reads {FORMAT!r} (and dynamicemb's "
                "files without it): the checkpoint was written by a newer dynrec, upgrade"
            )
    old = v1_dirs(root)
    if not old:
        return DynamicembReader(root, meta)
    others = [d.name for d in collection_dirs(root) if d not in old and any(d.iterdir())]
    if others or meta is not None:
        raise CheckpointError(
            f"{root}: mixes dynrec's first checkpoint layout ({', '.join(d.name for d in old)}) "
            f"with dynamicemb's ({', '.join(others) or META_FILE}); keep one per checkpoint dir"
        )
    return V1Reader(root)


@dataclass
class TableLoad:
    """How one table was loaded."""

    collection: str
    world_size: int  # of the saved files
    rows: int  # embedding rows in the files (every rank)
    counter_rows: int  # admission-counter rows in the files
    rows_loaded: int  # rows this rank kept (key % world_size == rank)
    notes: list[str] = field(default_factory=list)


@dataclass
class LoadReport:
    checkpoint: Path
    layout: str
    tables: dict[str, TableLoad] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)  # "name (collection): why"

    @property
    def rows(self) -> int:
        return sum(t.rows + t.counter_rows for t in self.tables.values())


def _found(saved: list[SavedTable]) -> str:
    return ", ".join(t.where for t in saved) or "none"


def select_tables(
    reader: CheckpointReader,
    wanted: Collection[str],
    collections: str | Mapping[str, str] | None = None,
    *,
    known: Collection[str] | None = None,
) -> tuple[dict[str, SavedTable], list[str]]:
    """Each wanted table's files, and what else the checkpoint holds (``ignored``).

    A table in several collection dirs (a TorchEasyRec checkpoint keeps the sequence tables
    twice) is read from ``collections[name]``. Raises :class:`CheckpointError` when the
    checkpoint has no tables, lacks a wanted one, or (``known`` given) holds a table that is not
    among ``known`` (another config's checkpoint).
    """
    saved = reader.tables()
    where = {} if collections is None else _collections(wanted, collections)
    by_name: dict[str, list[SavedTable]] = {}
    for t in saved:
        by_name.setdefault(t.name, []).append(t)
    head = f"checkpoint {reader.root} ({reader.layout} layout)"
    if not saved:
        raise CheckpointError(
            f"{head} holds no dynamic tables (no {reader.root}/dynamicemb/<collection>/"
            f"<table>_emb_keys.rank_R.world_size_W files); expected {sorted(wanted)}. Pass a "
            "checkpoint dir (step_N, model.ckpt-N or an init-ckpt output), not its parent"
        )
    missing = sorted(n for n in wanted if n not in by_name)
    if missing:
        raise CheckpointError(
            f"{head} has no files for dynamic tables {missing}; expected {sorted(wanted)}, "
            f"found {_found(saved)}. Use the checkpoint of this config, or (fine-tune) name the "
            "tables to load with --fine-tune-tables; the others then start empty"
        )
    if known is not None:
        unknown = sorted({t.name for t in saved} - set(known))
        if unknown:
            raise CheckpointError(
                f"{head} holds tables {unknown} that this config has no dynamic table for "
                f"(expected {sorted(wanted)}); wrong config? To load only some tables name them "
                "with --fine-tune-tables"
            )
    chosen: dict[str, SavedTable] = {}
    ignored: list[str] = []
    for name in wanted:
        options = by_name[name]
        pick = [t for t in options if t.collection == where.get(name)] or options
        if len(pick) > 1:
            raise CheckpointError(
                f"{head}: table {name!r} is in several collections ({_found(options)}) and "
                f"none is the one this config maps it to ({where.get(name)!r}); keep one copy "
                "in the checkpoint dir"
            )
        chosen[name] = pick[0]
        ignored += [f"{t.where}: another copy of {name!r}" for t in options if t is not pick[0]]
    ignored += [f"{t.where}: not asked for" for t in saved if t.name not in chosen]
    return chosen, ignored


def _own(state: TableState, rank: int, world_size: int) -> TableState:
    own = (state.keys % world_size) == rank
    out = TableState(state.keys[own], state.values[own], state.scores[own], state.accumulators[own])
    if state.counter_keys is not None and state.counter_counts is not None:
        mine = (state.counter_keys % world_size) == rank
        out.counter_keys, out.counter_counts = state.counter_keys[mine], state.counter_counts[mine]
    return out


def _check_id_mode(reader: CheckpointReader, id_mode: str) -> None:
    """Refuse keys made in another id mode: none of them would be found (see ``IdMode``)."""
    saved = reader.id_mode
    if saved is not None and saved != id_mode:
        raise CheckpointError(
            f"checkpoint {reader.root}: its keys were made in id mode {saved.upper()} "
            f"({META_FILE} id_mode {saved!r}; absent: 'dynrec'), this config's are made in "
            f"{id_mode.upper()}; no key would be found. Set data_config.dynrec_id_mode: "
            f"{saved.upper()} to use it, or use a checkpoint of this id mode"
        )


def load(
    dec: DynamicTables,
    ckpt_dir: str | Path,
    collections: str | Mapping[str, str] | None = None,
    rank: int = 0,
    world_size: int = 1,
    *,
    tables: Collection[str] | None = None,
) -> LoadReport:
    """Replace the content of the tables of ``dec`` by their saved rows owned by ``rank``.

    ``tables``: the ones to load (default: every table of ``dec``, and then the checkpoint may
    hold no other); the rest of ``dec`` is left as it is. ``collections``: where this config
    puts each table (:func:`collection_paths`; picks among copies). Raises
    :class:`CheckpointError` (see :func:`select_tables`), when the tables hold no rows and
    when the checkpoint's keys were made in another id mode than ``dec.id_mode``.
    """
    _check_rank(rank, world_size)
    wanted = list(dec.tables) if tables is None else list(tables)
    unknown = [n for n in wanted if n not in dec.tables]
    if unknown:
        raise CheckpointError(
            f"tables {unknown} are not dynamic tables of this model ({', '.join(dec.tables)}); "
            "name only these in --fine-tune-tables"
        )
    reader = open_checkpoint(ckpt_dir)
    _check_id_mode(reader, dec.id_mode)
    chosen, ignored = select_tables(
        reader, wanted, collections, known=dec.tables if tables is None else None
    )
    if reader.id_mode is None and dec.id_mode == "dynrec":
        logger.warning(
            "checkpoint %s has no %s (TorchEasyRec's or dynamicemb's own): its keys are not "
            "checked against this config's id mode; TorchEasyRec makes them as the TZREC id mode "
            "does, and this config has DYNREC: if the ids come from TorchEasyRec set "
            "data_config.dynrec_id_mode: TZREC",
            reader.root,
            META_FILE,
        )
    report = LoadReport(Path(ckpt_dir), reader.layout, ignored=ignored)
    read: dict[str, ReadTable] = {}
    now = dec.score_clock()
    for name, saved in chosen.items():
        spec = dec.tables[name]
        assert spec.dynamic is not None and saved.world_size is not None
        want = ReadRequest(
            spec.dim, spec.dynamic.score_strategy, dec.adagrad.initial_accumulator_value, now
        )
        read[name] = got = reader.read(saved, want)
        report.tables[name] = TableLoad(
            saved.collection, saved.world_size, got.rows, got.counter_rows, 0, got.notes
        )
    if report.rows == 0:
        raise CheckpointError(
            f"checkpoint {reader.root} ({reader.layout} layout): the files of "
            f"{', '.join(t.where for t in chosen.values())} hold no rows (0 keys, 0 admission "
            "counters); nothing would be loaded; check that it is the right checkpoint "
            "(--fine-tune-checkpoint, --checkpoint), not an empty or truncated dump"
        )
    for name, got in read.items():
        state = _own(got.state, rank, world_size)
        dec.load_table_state(name, state)
        report.tables[name].rows_loaded = int(state.keys.numel())
        for note in got.notes:
            logger.warning("checkpoint %s table %r: %s", reader.root, name, note)
    for item in ignored:
        logger.warning("checkpoint %s: %s (not loaded)", reader.root, item)
    return report


def read_table(
    ckpt_dir: str | Path, table: str, *, spec: TableSpec | None = None, now: int | None = None
) -> tuple[TableState, TableInfo]:
    """Every saved rank of ``table`` joined, without a model (tools, tests): (state, info).

    Without ``spec`` the dim and score strategy come from the files; ``now`` (µs, default the
    wall clock) is what TIMESTAMP ages are restored against.
    """
    reader = open_checkpoint(ckpt_dir)
    found = [t for t in reader.tables() if t.name == table]
    if not found:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} ({reader.layout} layout) has no table {table!r}; found "
            f"{_found(reader.tables())}; use the checkpoint of this config (its embedding_name)"
        )
    saved = found[0]
    info = reader.describe(saved)
    dyn = spec.dynamic if spec is not None else None
    want = ReadRequest(
        spec.dim if spec is not None else info.dim,
        dyn.score_strategy if dyn is not None else None,
        0.0,
        time.time_ns() // 1000 if now is None else now,
    )
    got = reader.read(saved, want)
    return got.state, info
