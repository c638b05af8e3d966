"""NVIDIA dynamicemb's checkpoint files, as ``DynamicEmbDump`` writes them and ``DynamicEmbLoad``
reads them (NVIDIA/recsys-examples @ 43465aea, ``corelib/dynamicemb/dynamicemb/``; the rules and
a golden dump are in ``tests/fixtures/dynamicemb_ckpt/``).

In a collection directory ``<ckpt>/dynamicemb/<collection module path>/``, for table ``T``
(the torchrec table name, ``user_id_emb``) saved by rank ``R`` of ``W``::

    T_emb_keys.rank_R.world_size_W          int64   [N]
    T_emb_values.rank_R.world_size_W        float32 [N, dim]
    T_emb_scores.rank_R.world_size_W        int64   [N]   TIMESTAMP: age in ns at dump time
    T_emb_opt_values.rank_R.world_size_W    float32 [N, opt_dim]  exact Adagrad: opt_dim = dim
    T_counter_keys.rank_R.world_size_W      int64   [C]   admission counter (possibly empty)
    T_counter_frequencies.rank_R.world_size_W  int64 [C]
    T_opt_args.json                         rank 0 only: opt_type, lr, eps, ...

(``batched_dynamicemb_tables.py`` ``encode_checkpoint_file_path`` l. 77,
``encode_counter_checkpoint_file_path`` l. 86, ``encode_meta_json_file_path`` l. 73.) Raw
little-endian, no header. Rank ``R`` holds the keys ``key % W == R`` (``dist_type``
"roundrobin"). ``T_opt_args.json`` has no dim, no dtype, no world size: the dim comes from our
config (or, without one, from the file sizes), the world size from the file names.

Scores (``key_value_table.py`` ``_dump_table`` l. 1171-1172, ``DynamicEmbStorage.load``
l. 1970-1971): TIMESTAMP tables (``EvictStrategy.KLru``) store ``dump_time - score``, which a
load turns back into ``max(load_time - age, 0)``. dynamicemb's clock is the GPU
``%globaltimer`` in nanoseconds, ours microseconds: ages are written and read in nanoseconds,
so a file moves between the two unchanged. Every other strategy stores its score as is.

Optimizer states (``optimizer.py``: ``get_opt_args`` l. 330 / 410 / 487, ``get_optimizer_state_dim``
l. 36, ``get_optimizer_ckpt_state_dim``): we train exact Adagrad, so ``exact_adagrad`` sums
``[N, dim]`` are read as they are; ``exact_row_wise_adagrad`` sums ``[N, 1]`` are read and
broadcast to every column (the step size each element had stays the same); ``adam``
``[N, 2·dim]`` (moments) and ``sgd`` (none) have no Adagrad sums to give and are not read: the
rows start from ``initial_accumulator_value``, and the read says so in its notes. Any other
``opt_type`` is refused. ``evict_strategy`` and ``dist_type`` must match ours (as
``_validate_load_meta`` l. 1294 requires). The file's lr / eps are not applied (dynamicemb's
``set_opt_args`` would): the config's sparse optimizer is the one that trains.
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.features import ScoreStrategy
from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.checkpoint_io import (
    FLOAT,
    KEY,
    CheckpointError,
    ReadRequest,
    ReadTable,
    SavedTable,
    TableInfo,
    check_rows,
    read_array,
    read_parts,
    saved_world_size,
    write_array,
)
from shared.hashtable.storage import TableState

LAYOUT = "dynamicemb"
OPT_TYPE = "exact_adagrad"
DIST_TYPE = "roundrobin"
NS_PER_SCORE_UNIT = 1000  # our TIMESTAMP scores are µs; dynamicemb's ages are ns
EVICT_STRATEGY = {
    ScoreStrategy.LFU: "EvictStrategy.KLfu",
    ScoreStrategy.TIMESTAMP: "EvictStrategy.KLru",
    ScoreStrategy.STEP: "EvictStrategy.KCustomized",
    ScoreStrategy.NO_EVICTION: "EvictStrategy.KCustomized",
}
# what a file's evict_strategy tells a reader without a config (KCustomized: STEP or NO_EVICTION)
_STRATEGY_OF = {
    "EvictStrategy.KLfu": ScoreStrategy.LFU,
    "EvictStrategy.KLru": ScoreStrategy.TIMESTAMP,
    "EvictStrategy.KCustomized": ScoreStrategy.STEP,
}
_EMB_KEYS = re.compile(r"^(.+)_emb_keys\.rank_\d+\.world_size_\d+$")
_OPT_ARGS = "_opt_args.json"


def emb_file(table: str, item: str, rank: int, world_size: int) -> str:
    """``emb_file("user_id_emb", "keys", 0, 2) == "user_id_emb_emb_keys.rank_0.world_size_2"``."""
    if item not in ("keys", "values", "scores", "opt_values"):
        raise ValueError(f"unknown table file item {item!r}; keys, values, scores or opt_values")
    return f"{table}_emb_{item}.rank_{rank}.world_size_{world_size}"


def counter_file(table: str, item: str, rank: int, world_size: int) -> str:
    """``counter_file("user_id_emb", "keys", 0, 2) == "user_id_emb_counter_keys.rank_0.world_size_2"``."""
    if item not in ("keys", "frequencies"):
        raise ValueError(f"unknown counter file item {item!r}; keys or frequencies")
    return f"{table}_counter_{item}.rank_{rank}.world_size_{world_size}"


def opt_args_file(table: str) -> str:
    return f"{table}{_OPT_ARGS}"


def _f32(x: float) -> float:
    """A float32 config value as its shortest decimal (tzrec writes lr 0.001, not 0.0010000000474)."""
    return float(str(np.float32(x)))


def opt_args(adagrad: AdagradConfig, strategy: ScoreStrategy, step_score: int) -> dict[str, Any]:
    """``T_opt_args.json`` exactly as dynamicemb's ``_dump_table`` writes it for exact Adagrad:
    ``get_opt_args()``, then ``evict_strategy``, ``dist_type``, ``step_score`` (the score the
    table gives now: LFU 1, TIMESTAMP 0, STEP the step, NO_EVICTION 0)."""
    return {
        "opt_type": OPT_TYPE,
        "lr": _f32(adagrad.lr),
        "eps": _f32(adagrad.eps),
        "initial_accumulator_value": _f32(adagrad.initial_accumulator_value),
        "evict_strategy": EVICT_STRATEGY[strategy],
        "dist_type": DIST_TYPE,
        "step_score": int(step_score),
    }


def step_score(strategy: ScoreStrategy, step: int) -> int:
    return {ScoreStrategy.LFU: 1, ScoreStrategy.STEP: step}.get(strategy, 0)


def write_table_files(
    directory: Path,
    table: str,
    state: TableState,
    *,
    strategy: ScoreStrategy,
    now: int,
    args: dict[str, Any] | None,
    rank: int = 0,
    world_size: int = 1,
    counter: bool = False,
) -> None:
    """Write the rows of ``state`` that ``rank`` owns (``key % world_size == rank``) as table
    ``table``'s files into ``directory`` (no temp dir: callers publish atomically). ``args``:
    the ``T_opt_args.json`` content, written only when given (rank 0). ``counter``: write the
    admission counter files (possibly empty), as dynamicemb does for tables with admission.
    ``now``: the TIMESTAMP clock (µs) that scores become ages against."""
    own = (state.keys % world_size) == rank
    scores = state.scores[own]
    if strategy is ScoreStrategy.TIMESTAMP:
        scores = (now - scores).clamp(min=0) * NS_PER_SCORE_UNIT
    parts: list[tuple[str, torch.Tensor, str]] = [
        (emb_file(table, "keys", rank, world_size), state.keys[own], KEY),
        (emb_file(table, "values", rank, world_size), state.values[own], FLOAT),
        (emb_file(table, "scores", rank, world_size), scores, KEY),
        (emb_file(table, "opt_values", rank, world_size), state.accumulators[own], FLOAT),
    ]
    if counter:
        ck = state.counter_keys if state.counter_keys is not None else torch.zeros(0).long()
        cc = state.counter_counts if state.counter_counts is not None else torch.zeros(0).long()
        mine = (ck % world_size) == rank
        parts.append((counter_file(table, "keys", rank, world_size), ck[mine], KEY))
        parts.append((counter_file(table, "frequencies", rank, world_size), cc[mine], KEY))
    for name, tensor, dtype in parts:
        write_array(directory / name, tensor, dtype)
    if args is not None:
        (directory / opt_args_file(table)).write_text(json.dumps(args, indent=4))


# --------------------------------------------------------------------------- reading


def collection_dirs(root: Path) -> list[Path]:
    """The collection directories of ``<root>/dynamicemb/`` (temp dirs of a save excluded)."""
    base = root / "dynamicemb"
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))


def table_names(directory: Path) -> set[str]:
    """Tables with key files or an ``_opt_args.json`` in one collection directory."""
    names = {m[1] for p in directory.iterdir() if (m := _EMB_KEYS.match(p.name))}
    names |= {p.name[: -len(_OPT_ARGS)] for p in directory.glob(f"*{_OPT_ARGS}")}
    return names


class DynamicembReader:
    """Reads dynamicemb's layout: theirs (TorchEasyRec, dynamicemb) and ours since format 2.

    ``meta``: our ``dynamic_tables.json`` beside ``dynamicemb/`` when the checkpoint is ours
    (dims, score strategies, capacities for tools that run without a config, the id mode of the
    keys); never required. ``id_mode``: the meta's, ``"dynrec"`` when it predates the key, None
    without meta (TorchEasyRec's checkpoints: their keys are made as the TZREC id mode does).
    """

    layout = LAYOUT

    def __init__(self, root: Path, meta: dict[str, Any] | None = None) -> None:
        self.root = Path(root)
        self.meta_tables: dict[str, dict[str, Any]] = dict((meta or {}).get("tables", {}))
        self.id_mode: str | None = None if meta is None else str(meta.get("id_mode", "dynrec"))

    def tables(self) -> list[SavedTable]:
        out = []
        for d in collection_dirs(self.root):
            for name in sorted(table_names(d)):
                w = saved_world_size(
                    d,
                    name,
                    f"{name}_emb_keys.rank_*.world_size_*",
                    partial(emb_file, name, "keys"),
                )
                out.append(SavedTable(name, d.name, d, w))
        return out

    def _args(self, table: SavedTable) -> dict[str, Any]:
        path = table.directory / opt_args_file(table.name)
        if not path.is_file():
            raise CheckpointError(
                f"{path} is missing: dynamicemb writes it on rank 0 only, and a load needs its "
                "evict_strategy, dist_type and opt_type; copy it from the rank-0 output"
            )
        return dict(json.loads(path.read_text()))

    def _ours(self, table: SavedTable) -> dict[str, Any]:
        m = self.meta_tables.get(table.name, {})
        return m if m.get("collection") == table.collection else {}

    def describe(self, table: SavedTable) -> TableInfo:
        ours = self._ours(table)
        dim = ours.get("dim") or self._dim_from_sizes(table)
        if "score_strategy" in ours:
            strategy: ScoreStrategy | None = ScoreStrategy(ours["score_strategy"])
        else:
            args_path = table.directory / opt_args_file(table.name)
            evict = (
                json.loads(args_path.read_text()).get("evict_strategy")
                if args_path.is_file()
                else None
            )
            strategy = _STRATEGY_OF.get(str(evict))
        return TableInfo(dim, strategy, ours.get("max_capacity"), ours.get("admission_threshold"))

    def _dim_from_sizes(self, table: SavedTable) -> int | None:
        for r in range(table.world_size or 0):
            w = table.world_size
            assert w is not None
            n = (table.directory / emb_file(table.name, "keys", r, w)).stat().st_size // 8
            if n:
                size = (table.directory / emb_file(table.name, "values", r, w)).stat().st_size
                return size // 4 // n
        return None

    def _files(self, table: SavedTable) -> int:
        if table.world_size is None:
            raise CheckpointError(
                f"{table.directory}: table {table.name!r} has {opt_args_file(table.name)} but no "
                f"key files ({emb_file(table.name, 'keys', 0, 1)} ...): an incomplete dump; "
                "copy the checkpoint again or dump the table again"
            )
        return table.world_size

    def parts(self, table: SavedTable, dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self._files(table)
        return read_parts(table, dim, emb_file)

    def read(self, table: SavedTable, want: ReadRequest) -> ReadTable:
        args = self._args(table)
        file_strategy = self._check_meta(table, args, want.strategy)
        dim = want.dim if want.dim is not None else (self.describe(table).dim or 0)
        parts = self.parts(table, dim)
        keys = torch.cat([k for k, _ in parts])
        values = torch.cat([v for _, v in parts])
        notes: list[str] = []
        scores = self._scores(table, len(parts), [k.numel() for k, _ in parts], notes)
        if file_strategy is ScoreStrategy.TIMESTAMP:
            scores = (want.now - scores // NS_PER_SCORE_UNIT).clamp(min=0)  # ages (ns) → µs
        accum = self._opt_states(table, args, [k.numel() for k, _ in parts], dim, notes)
        if accum is None:
            accum = torch.full((keys.numel(), dim), float(want.initial_accumulator_value))
        ck, cc = self._counters(table, len(parts))
        rows = tuple(k.numel() for k, _ in parts)
        return ReadTable(TableState(keys, values, scores, accum, ck, cc), rows, notes)

    def _check_meta(
        self, table: SavedTable, args: dict[str, Any], strategy: ScoreStrategy | None
    ) -> ScoreStrategy | None:
        dist = args.get("dist_type", DIST_TYPE)
        if dist != DIST_TYPE:
            raise CheckpointError(
                f"{table.directory / opt_args_file(table.name)}: dist_type {dist!r}, but dynrec "
                f"shards rows {DIST_TYPE!r} (key % world_size == rank); re-dump the table with "
                f"dist_type {DIST_TYPE!r}"
            )
        evict = args.get("evict_strategy")
        if strategy is not None and evict is not None and evict != EVICT_STRATEGY[strategy]:
            raise CheckpointError(
                f"{table.directory / opt_args_file(table.name)}: evict_strategy {evict!r}, but "
                f"table {table.name!r} has score_strategy {strategy.value} here, which is "
                f"{EVICT_STRATEGY[strategy]!r}; set the table's dynamicemb.score_strategy to the "
                "checkpoint's (LFU: KLfu, TIMESTAMP: KLru, STEP or NO_EVICTION: KCustomized)"
            )
        return strategy if strategy is not None else _STRATEGY_OF.get(str(evict))

    def _scores(
        self, table: SavedTable, w: int, counts: list[int], notes: list[str]
    ) -> torch.Tensor:
        paths = [table.directory / emb_file(table.name, "scores", r, w) for r in range(w)]
        if not any(p.is_file() for p in paths):
            notes.append("no score files: every row gets score 0 (first to be evicted)")
            return torch.zeros(sum(counts), dtype=torch.int64)
        out = []
        for p, n in zip(paths, counts, strict=True):
            if not p.is_file():
                raise CheckpointError(
                    f"{p} is missing (incomplete checkpoint); copy every rank's files again"
                )
            s = read_array(p, KEY)
            check_rows(p, table.name, s.numel(), n, 1, "scores")
            out.append(s)
        return torch.cat(out)

    def _opt_states(
        self, table: SavedTable, args: dict[str, Any], counts: list[int], dim: int, notes: list[str]
    ) -> torch.Tensor | None:
        """Adagrad sums [N, dim] from the optimizer files, or None (rows start from the initial
        accumulator value; a note says why)."""
        w = len(counts)
        paths = [table.directory / emb_file(table.name, "opt_values", r, w) for r in range(w)]
        opt_type = str(args.get("opt_type", ""))
        if not any(p.is_file() for p in paths):
            notes.append("no optimizer state files (dumped without optim): Adagrad sums start "
                         "from initial_accumulator_value")  # fmt: skip
            return None
        width = {"exact_adagrad": dim, "exact_row_wise_adagrad": 1, "adam": 2 * dim, "sgd": 0}
        if opt_type not in width:
            raise CheckpointError(
                f"{table.directory / opt_args_file(table.name)}: opt_type {opt_type!r} is not "
                f"one dynrec can read ({', '.join(width)}); dump the table with "
                "optim=False to load its rows without optimizer states"
            )
        states = []
        for p, n in zip(paths, counts, strict=True):
            s = read_array(p, FLOAT) if p.is_file() else torch.zeros(0)
            check_rows(p, table.name, s.numel(), n, width[opt_type], f"{opt_type} state floats")
            states.append(s.view(n, width[opt_type]))
        if opt_type == "exact_adagrad":
            return torch.cat(states)
        if opt_type == "exact_row_wise_adagrad":
            notes.append(f"row-wise Adagrad sums [N, 1] read and broadcast to all {dim} columns")
            return torch.cat(states).expand(-1, dim).contiguous()
        notes.append(
            f"{opt_type} optimizer states [N, {width[opt_type]}] not read (no Adagrad sums in "
            "them): Adagrad sums start from initial_accumulator_value"
        )
        return None

    def _counters(
        self, table: SavedTable, w: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        kp = [table.directory / counter_file(table.name, "keys", r, w) for r in range(w)]
        fp = [table.directory / counter_file(table.name, "frequencies", r, w) for r in range(w)]
        have = [p.is_file() for p in kp + fp]
        if not any(have):
            return None, None
        if not all(have):
            missing = [p.name for p in kp + fp if not p.is_file()]
            raise CheckpointError(
                f"{table.directory}: admission counter files {missing} are missing (every rank "
                "writes both, possibly empty); copy them or delete all counter files of the table"
            )
        keys = [read_array(p, KEY) for p in kp]
        freqs = [read_array(p, KEY) for p in fp]
        for p, k, f in zip(fp, keys, freqs, strict=True):
            check_rows(p, table.name, f.numel(), k.numel(), 1, "frequencies")
        return torch.cat(keys), torch.cat(freqs)
