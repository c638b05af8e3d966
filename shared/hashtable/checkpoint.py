"""Dynamic-table checkpoints in dynamicemb's file layout (raw little-endian arrays, no header).

For every table ``T`` of a :class:`DynamicEmbeddingCollection` saved by rank ``R`` of ``W``::

    <ckpt>/dynamicemb/<module>/T_keys.rank_R.world_size_W                 int64   [N]
                               T_values.rank_R.world_size_W               float32 [N, dim]
                               T_scores.rank_R.world_size_W               int64   [N]
                               T_opt_values.rank_R.world_size_W           float32 [N, dim]  Adagrad sums
                               T_counter_keys.rank_R.world_size_W         int64   [C]  (admission only)
                               T_counter_frequencies.rank_R.world_size_W  int64   [C]  (admission only)
                               T_opt_args.json                            lr, eps, dim, dtypes, ...

``T`` is the full table name, which in our configs already ends in ``_emb``, so the files read
``user_id_emb_keys.rank_0.world_size_1`` as in dynamicemb (where ``T`` would be the feature name
plus ``_emb``); all suffixes hang off the same full name. Rows are sorted by key. A rank writes
the keys it owns, ``key % W == R`` (round-robin, as dynamicemb shards rows), so a collection that
holds every key can be saved as any sharding. Files are written into a temporary directory
beside the target and then renamed (the whole directory when it does not exist yet, else file
by file with ``os.replace``), so readers never see a half-written file.

Loading under another world size reads every saved rank's files and keeps the keys this rank
owns under the new world size.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from shared.features import TableSpec
from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.storage import TableState

logger = logging.getLogger(__name__)

FORMAT = "dynrec-dynamicemb/1"
_DTYPES = {
    "keys": "<i8",
    "values": "<f4",
    "scores": "<i8",
    "opt_values": "<f4",
    "counter_keys": "<i8",
    "counter_frequencies": "<i8",
}


class DynamicTables(Protocol):
    """What :func:`save` and :func:`load` use of a ``DynamicEmbeddingCollection`` (which
    imports this module for its ``save``/``load``)."""

    @property
    def tables(self) -> Mapping[str, TableSpec]: ...

    @property
    def adagrad(self) -> AdagradConfig: ...

    def table_state(self, name: str) -> TableState: ...

    def load_table_state(self, name: str, state: TableState) -> None: ...


def file_name(table: str, kind: str, rank: int, world_size: int) -> str:
    """``file_name("user_id_emb", "keys", 0, 1) == "user_id_emb_keys.rank_0.world_size_1"``."""
    if kind not in _DTYPES:
        raise ValueError(f"unknown checkpoint file kind {kind!r}; one of {', '.join(_DTYPES)}")
    return f"{table}_{kind}.rank_{rank}.world_size_{world_size}"


def module_dir(ckpt_dir: str | Path, module_name: str) -> Path:
    return Path(ckpt_dir) / "dynamicemb" / module_name


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")


def _write(path: Path, tensor: torch.Tensor, kind: str) -> None:
    arr = np.ascontiguousarray(tensor.detach().cpu().numpy().astype(_DTYPES[kind], copy=False))
    with open(path, "wb") as f:
        f.write(arr.tobytes())
        f.flush()
        os.fsync(f.fileno())


def _read(path: Path, kind: str) -> torch.Tensor:
    dtype = np.dtype(_DTYPES[kind])
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ValueError(f"{path}: {size} bytes is not a whole number of {dtype} items; truncated?")
    arr = np.fromfile(path, dtype=dtype).astype(dtype.newbyteorder("="), copy=False)
    return torch.from_numpy(arr)


def opt_args(spec: TableSpec, adagrad: AdagradConfig, world_size: int) -> dict[str, object]:
    """The ``<table>_opt_args.json`` content of one dynamic table."""
    dyn = spec.dynamic
    if dyn is None:
        raise ValueError(f"table {spec.name!r} is not dynamic; only hash tables have opt_args")
    return {
        "format": FORMAT,
        "table": spec.name,
        "optimizer": "adagrad",
        "lr": adagrad.lr,
        "eps": adagrad.eps,
        "initial_accumulator_value": adagrad.initial_accumulator_value,
        "dim": spec.dim,
        "opt_values_per_row": spec.dim,
        "key_dtype": "int64",
        "value_dtype": "float32",
        "score_dtype": "int64",
        "byte_order": "little",
        "score_strategy": dyn.score_strategy.value,
        "max_capacity": dyn.max_capacity,
        "admission_threshold": None if dyn.admission is None else dyn.admission.threshold,
        "world_size": world_size,
        "owner": "key % world_size",
    }


def write_table_files(
    directory: Path,
    state: TableState,
    args: dict[str, object],
    rank: int = 0,
    world_size: int = 1,
) -> None:
    """Write the rows of ``state`` that ``rank`` owns (``key % world_size == rank``) as the files
    of table ``args["table"]`` into ``directory`` (no temp dir: callers publish atomically).

    :func:`save` uses it for a live collection; tools use it to write checkpoints built from
    other sources (an init table, a converted num_buckets matrix) without a hash table.
    """
    _check_rank(rank, world_size)
    name = str(args["table"])
    own = (state.keys % world_size) == rank
    parts = {
        "keys": state.keys[own],
        "values": state.values[own],
        "scores": state.scores[own],
        "opt_values": state.accumulators[own],
    }
    if state.counter_keys is not None and state.counter_counts is not None:
        mine = (state.counter_keys % world_size) == rank
        parts["counter_keys"] = state.counter_keys[mine]
        parts["counter_frequencies"] = state.counter_counts[mine]
    for kind, tensor in parts.items():
        _write(directory / file_name(name, kind, rank, world_size), tensor, kind)
    text = json.dumps({**args, "world_size": world_size}, indent=1, sort_keys=True)
    (directory / f"{name}_opt_args.json").write_text(text + "\n")


def save(
    dec: DynamicTables,
    ckpt_dir: str | Path,
    module_name: str,
    rank: int = 0,
    world_size: int = 1,
) -> Path:
    """Write the tables of ``dec`` owned by ``rank``; returns ``<ckpt>/dynamicemb/<module>``."""
    _check_rank(rank, world_size)
    final = module_dir(ckpt_dir, module_name)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{module_name}.tmp-rank{rank}-", dir=final.parent))
    try:
        for name, spec in dec.tables.items():
            args = opt_args(spec, dec.adagrad, world_size)
            write_table_files(tmp, dec.table_state(name), args, rank, world_size)
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


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


_RANK_FILE = re.compile(r"\.rank_(\d+)\.world_size_(\d+)$")


def saved_world_size(directory: Path, table: str) -> int | None:
    """The world size the table's files were written with (None: no files)."""
    sizes: set[int] = set()
    ranks: set[int] = set()
    for f in directory.glob(f"{table}_keys.rank_*.world_size_*"):
        m = _RANK_FILE.search(f.name)
        if m and f.name == file_name(table, "keys", int(m[1]), int(m[2])):
            ranks.add(int(m[1]))
            sizes.add(int(m[2]))
    if not sizes:
        return None
    if len(sizes) > 1:
        raise ValueError(
            f"{directory}: table {table!r} has files of several world sizes {sorted(sizes)}; "
            "save each checkpoint into a fresh directory"
        )
    (w,) = sizes
    missing = sorted(set(range(w)) - ranks)
    if missing:
        raise FileNotFoundError(
            f"{directory}: table {table!r} was saved by {w} ranks but the files of ranks "
            f"{missing} are missing (incomplete checkpoint)"
        )
    return w


def _read_table(directory: Path, table: str, dim: int, w: int) -> TableState:
    cols: dict[str, list[torch.Tensor]] = {k: [] for k in _DTYPES}
    for r in range(w):
        for kind in _DTYPES:
            path = directory / file_name(table, kind, r, w)
            if path.exists():
                cols[kind].append(_read(path, kind))
            elif not kind.startswith("counter"):
                raise FileNotFoundError(f"{path} is missing (incomplete checkpoint)")
    state = {k: torch.cat(v) if v else None for k, v in cols.items()}
    keys = state["keys"]
    assert keys is not None
    for kind in ("values", "opt_values"):
        t = state[kind]
        assert t is not None
        if t.numel() != keys.numel() * dim:
            raise ValueError(
                f"{directory}: table {table!r}: {kind} hold {t.numel()} floats for {keys.numel()} "
                f"keys of dim {dim}; the checkpoint was written for another dim"
            )
        state[kind] = t.view(-1, dim)
    scores = state["scores"]
    assert scores is not None and state["values"] is not None and state["opt_values"] is not None
    if scores.numel() != keys.numel():
        raise ValueError(
            f"{directory}: table {table!r}: {scores.numel()} scores for {keys.numel()} keys"
        )
    return TableState(
        keys,
        state["values"],
        scores,
        state["opt_values"],
        state["counter_keys"],
        state["counter_frequencies"],
    )


def saved_tables(directory: Path) -> list[str]:
    """Names of the tables saved in a module directory (those with a ``_opt_args.json``)."""
    suffix = "_opt_args.json"
    return sorted(p.name[: -len(suffix)] for p in Path(directory).glob(f"*{suffix}"))


def read_table(directory: Path, table: str) -> tuple[TableState, dict[str, Any]]:
    """Every saved rank of ``table`` in a module directory, joined: (state, opt_args).

    The dim comes from ``<table>_opt_args.json``, so no config is needed (inspection tools).
    """
    directory = Path(directory)
    args_path = directory / f"{table}_opt_args.json"
    if not args_path.is_file():
        raise FileNotFoundError(f"{args_path} is missing; is {directory} a dynamicemb module dir?")
    args = json.loads(args_path.read_text())
    w = saved_world_size(directory, table)
    if w is None:
        raise FileNotFoundError(f"{directory}: no key files for table {table!r}")
    return _read_table(directory, table, int(args["dim"]), w), args


def load(
    dec: DynamicTables,
    ckpt_dir: str | Path,
    module_name: str,
    rank: int = 0,
    world_size: int = 1,
    *,
    strict: bool = True,
) -> None:
    """Replace the content of every table of ``dec`` by its saved keys owned by ``rank``.

    Reads all ranks of the saved world size and keeps ``key % world_size == rank``. With
    ``strict`` every table of ``dec`` must be in the checkpoint; otherwise missing ones are
    left as they are (with a warning).
    """
    _check_rank(rank, world_size)
    directory = module_dir(ckpt_dir, module_name)
    if not directory.is_dir():
        raise FileNotFoundError(f"no dynamic embedding checkpoint at {directory}")
    for name, spec in dec.tables.items():
        w = saved_world_size(directory, name)
        if w is None:
            if strict:
                raise FileNotFoundError(
                    f"{directory}: no files for table {name!r} (expected "
                    f"{file_name(name, 'keys', 0, 1)} or similar); pass strict=False to keep "
                    "it as it is"
                )
            logger.warning("checkpoint %s has no table %r; left unchanged", directory, name)
            continue
        args_path = directory / f"{name}_opt_args.json"
        if args_path.exists():
            args = json.loads(args_path.read_text())
            if args.get("dim") != spec.dim:
                raise ValueError(
                    f"{args_path}: dim {args.get('dim')} but table {name!r} has dim {spec.dim}"
                )
        state = _read_table(directory, name, spec.dim, w)
        own = (state.keys % world_size) == rank
        state.keys, state.values = state.keys[own], state.values[own]
        state.scores, state.accumulators = state.scores[own], state.accumulators[own]
        if state.counter_keys is not None and state.counter_counts is not None:
            mine = (state.counter_keys % world_size) == rank
            state.counter_keys, state.counter_counts = (
                state.counter_keys[mine],
                state.counter_counts[mine],
            )
        dec.load_table_state(name, state)
