"""The fixed-size (num_buckets / hash_bucket_size / boundaries) tables of a model, small ones fused.

Every dense-gradient table of one dim (:func:`train.model.sparse_arch.uses_sparse_grad` False)
lives in one ``[Σ rows, dim]`` matrix, table ``t`` in rows ``[offset_t, offset_t + rows_t)``:
a step does one ``index_select`` for all their features (ids + the table's offset), its backward
one ``index_add`` (instead of one lookup and one ``embedding_dense_backward`` per table), and
Adagrad updates one parameter. Large tables (row-sparse gradients) keep one ``nn.Embedding`` each.

What crosses a process boundary stays per table, as when every table was an ``nn.Embedding`` of a
torchrec ``EmbeddingCollection``: the module's state_dict holds ``embeddings.<table>.weight``
([rows, dim], table order) and loads it back (hooks split and merge the fused matrix), and
:func:`keep_per_table_state` does the same for the sparse optimizer's state (one ``sum`` per
table, in the same order). Checkpoints, resume, fine-tune, conversion, bundles and deltas do not
see the fusion::

    tables = DenseTables(specs, sparse_grad={"user_emb"}, device="cpu")
    rows = tables([("age_level", "age_level_emb", ids)])  # [[n, dim]]
    tables.state_dict().keys()  # embeddings.age_level_emb.weight, embeddings.user_emb.weight, ...

Ids must be in ``[0, rows)`` of their table, or a lookup would read a neighbouring table's rows.
Feature generation makes them so by construction (``MOD``: ``% num_buckets``, ``HASH``:
``% hash_bucket_size``, ``BUCKETIZE``: at most ``len(boundaries)``). Ids on the host (CPU
training, evaluation, export) are also checked here, with an error that names the feature. Ids
on a GPU are checked by a device-side assertion (``torch._assert_async``, no host sync): a bad id
stops the process with a CUDA device-side assert, as ``nn.Embedding``'s own bounds check did
before the tables were fused (naming the feature would need a host sync per step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shared.features import TableSpec

# One lookup: (feature, table, ids [n] int64)
Lookup = tuple[str, str, torch.Tensor]


@dataclass(frozen=True)
class _Slot:
    """Where one table lives: the parameter (index in :meth:`DenseTables.parameters` order) and,
    for a fused table, its rows ``[start, stop)`` in that parameter."""

    param: int
    start: int | None = None
    stop: int | None = None

    @property
    def fused(self) -> bool:
        return self.start is not None


class FusedTables(nn.Module):
    """Tables of one dim in one ``weight`` [Σ rows, dim]; :meth:`forward` looks up any of them."""

    def __init__(self, tables: Sequence[TableSpec], *, device: torch.device | str) -> None:
        super().__init__()
        dims = {t.dim for t in tables}
        if len(dims) != 1:
            raise ValueError(f"FusedTables: tables of one dim only, got dims {sorted(dims)}")
        self.dim = dims.pop()
        self.rows = {t.name: int(t.num_rows or 0) for t in tables}
        starts = [0]
        for n in self.rows.values():
            starts.append(starts[-1] + n)
        self.offsets = dict(zip(self.rows, starts, strict=False))
        self.weight = nn.Parameter(torch.empty(starts[-1], self.dim, device=device))
        self._bounds: dict[tuple[str, ...], torch.Tensor] = {}  # see _per_id

    def weights(self) -> dict[str, torch.Tensor]:
        """Table name → its rows of ``weight`` ([rows, dim] views: writes land in ``weight``)."""
        return {t: self.weight[o : o + self.rows[t]] for t, o in self.offsets.items()}

    def forward(self, lookups: Sequence[Lookup]) -> list[torch.Tensor]:
        """The rows of each lookup ([n_i, dim], in order): one ``index_select`` for all.

        The ids of all lookups are concatenated first and shifted to their table's rows in one
        ``add`` (each id's table offset, repeated per lookup), and checked in one pass (see the
        module docstring): a constant number of ops, whatever the number of lookups."""
        ids = [i for _, _, i in lookups]
        flat = torch.cat(ids) if len(ids) > 1 else ids[0]  # [Σ n_i] ids in their own tables
        sizes = [int(i.numel()) for i in ids]
        if flat.numel():
            offset, rows = self._per_id([t for _, t, _ in lookups], sizes, flat)  # [Σ n_i] each
            in_table = (flat >= 0) & (flat < rows)  # [Σ n_i] bool
            if flat.device.type == "cpu":
                if not bool(in_table.all()):  # on the host: find the lookup, name its feature
                    for feature, table, i in lookups:
                        _check_ids(feature, table, i, self.rows[table])
            else:
                torch._assert_async(in_table.all())
            flat = flat + offset  # [Σ n_i] rows of weight
        rows_out = self.weight.index_select(0, flat)  # [Σ n_i, dim]; backward: one index_add
        return list(torch.split(rows_out, sizes))

    def _per_id(
        self, tables: list[str], sizes: list[int], flat: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(offset, rows) of each id's table, [Σ n_i] each: the per-lookup values (cached on the
        device per table layout) repeated by the lookups' sizes (host-known, no sync)."""
        key = tuple(tables)
        bounds = self._bounds.get(key)
        if bounds is None:  # [2, L] (first row, rows) of each lookup's table
            rows = [[self.offsets[t] for t in tables], [self.rows[t] for t in tables]]
            bounds = self._bounds[key] = torch.tensor(rows, device=flat.device)
        counts = torch.tensor(sizes)
        if flat.device.type != "cpu":
            counts = counts.pin_memory().to(flat.device, non_blocking=True)
        per_id = torch.repeat_interleave(bounds, counts, dim=1, output_size=flat.numel())
        offset, rows_per_id = per_id.unbind(0)
        return offset, rows_per_id


def _check_ids(feature: str, table: str, ids: torch.Tensor, rows: int) -> None:
    """Raise if a host-resident id is outside ``[0, rows)``; ids on a GPU pass unchecked (see the
    module docstring: a check that names the feature would sync the host every step)."""
    if ids.device.type != "cpu" or ids.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(ids))
    if lo < 0 or hi >= rows:
        bad = lo if lo < 0 else hi
        raise IndexError(
            f"feature {feature!r}: id {bad} is outside table {table!r}, which has {rows} rows; "
            f"ids must be in [0, {rows}) (feature generation keeps them there: % num_buckets, "
            "% hash_bucket_size or a bucket of the boundaries), so build the batch with shared.fg"
        )


class DenseTables(nn.Module):
    """The fixed-size tables of a model: fused per dim where the gradient is dense, one
    ``nn.Embedding(sparse=True)`` each where it is row-sparse. State dict: one tensor per table,
    ``embeddings.<table>.weight``, in ``tables`` order (see the module docstring)."""

    def __init__(
        self,
        tables: Sequence[TableSpec],
        *,
        sparse_grad: set[str],
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.order = [t.name for t in tables]
        self.embeddings = nn.ModuleDict(
            {t.name: _sparse_embedding(t, device) for t in tables if t.name in sparse_grad}
        )
        by_dim: dict[int, list[TableSpec]] = {}
        for t in tables:
            if t.name not in sparse_grad:
                by_dim.setdefault(t.dim, []).append(t)
        self.fused = nn.ModuleDict(
            {f"dim{d}": FusedTables(ts, device=device) for d, ts in by_dim.items()}
        )
        self._group = {t: g for g, m in self.fused.items() for t in _fused(m).rows}
        self.slots = self._slots()
        self.register_state_dict_post_hook(_split_state_dict)
        self.register_load_state_dict_pre_hook(_merge_state_dict)

    def _slots(self) -> dict[str, _Slot]:
        """Table name → its :class:`_Slot`, in table order."""
        index = {id(p): i for i, p in enumerate(self.parameters())}
        out = {}
        for name in self.order:
            if name in self.embeddings:
                out[name] = _Slot(index[id(_embedding(self.embeddings[name]).weight)])
                continue
            group = _fused(self.fused[self._group[name]])
            start = group.offsets[name]
            out[name] = _Slot(index[id(group.weight)], start, start + group.rows[name])
        return out

    def weights(self) -> dict[str, torch.Tensor]:
        """Table name → its weight [rows, dim] (a view into the fused matrix for a fused table),
        in table order: what exports and deltas read."""
        fused = {t: w for m in self.fused.values() for t, w in _fused(m).weights().items()}
        return {
            t: _embedding(self.embeddings[t]).weight if t in self.embeddings else fused[t]
            for t in self.order
        }

    def forward(self, lookups: Sequence[Lookup]) -> list[torch.Tensor]:
        """The rows of each lookup ([n_i, dim], in order): one call per fused dim, one
        ``nn.Embedding`` call per lookup of a row-sparse table."""
        out: list[torch.Tensor | None] = [None] * len(lookups)
        per_group: dict[str, list[int]] = {}
        for i, (feature, table, ids) in enumerate(lookups):
            if table in self.embeddings:
                emb = _embedding(self.embeddings[table])
                _check_ids(feature, table, ids, emb.num_embeddings)
                out[i] = emb(ids)  # [n_i, dim]
            else:
                per_group.setdefault(self._group[table], []).append(i)
        for group, idx in per_group.items():
            found = self.fused[group]([lookups[i] for i in idx])
            for i, rows in zip(idx, found, strict=True):
                out[i] = rows
        assert all(o is not None for o in out)
        return out  # type: ignore[return-value]


def _sparse_embedding(t: TableSpec, device: torch.device | str) -> nn.Embedding:
    """An uninitialised row-sparse ``nn.Embedding`` of ``t`` (the caller initialises it)."""
    weight = torch.empty(int(t.num_rows or 0), t.dim, device=device)
    return nn.Embedding(weight.shape[0], t.dim, sparse=True, _weight=weight, _freeze=False)


def _fused(m: nn.Module) -> FusedTables:
    assert isinstance(m, FusedTables)
    return m


def _embedding(m: nn.Module) -> nn.Embedding:
    assert isinstance(m, nn.Embedding)
    return m


def _table_key(prefix: str, table: str) -> str:
    return f"{prefix}embeddings.{table}.weight"


def _split_state_dict(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """State-dict post hook: the fused matrices → one ``embeddings.<table>.weight`` per table,
    in table order (a fused table's rows are copied out, so each is a tensor of its own)."""
    tables = _dense_tables(module)
    mine = {k: state_dict.pop(k) for k in list(state_dict) if k.startswith(prefix)}
    for name, slot in tables.slots.items():
        if not slot.fused:
            state_dict[_table_key(prefix, name)] = mine[_table_key(prefix, name)]
            continue
        matrix = mine[f"{prefix}fused.{tables._group[name]}.weight"]
        rows = matrix.detach()[slot.start : slot.stop]  # keep_vars: a view, writes reach it
        state_dict[_table_key(prefix, name)] = (
            rows if isinstance(matrix, nn.Parameter) else rows.clone()
        )


def _merge_state_dict(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load-state-dict pre hook: the fused tables' ``embeddings.<table>.weight`` → their fused
    matrix. A missing table keeps its rows (and is reported missing under ``strict``); a table of
    the wrong shape is reported as torch reports a size mismatch."""
    tables = _dense_tables(module)
    for group, m in tables.fused.items():
        fused = _fused(m)
        merged = fused.weight.detach().clone()  # [Σ rows, dim]
        for name, start in fused.offsets.items():
            key = _table_key(prefix, name)
            value = state_dict.pop(key, None)
            if value is None:
                if strict:
                    missing_keys.append(key)
                continue
            shape = torch.Size((fused.rows[name], fused.dim))
            if value.shape != shape:
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {value.shape} from "
                    f"checkpoint, the shape in current model is {shape}."
                )
                continue
            merged[start : start + fused.rows[name]] = value
        state_dict[f"{prefix}fused.{group}.weight"] = merged


def _dense_tables(module: nn.Module) -> DenseTables:
    assert isinstance(module, DenseTables)
    return module


def keep_per_table_state(optimizer: torch.optim.Optimizer, tables: DenseTables) -> None:
    """Make ``optimizer`` (one param group over ``tables.parameters()``) save and load its state
    per table, as an optimizer over one parameter per table did: entry ``j`` of ``state`` is
    table ``j`` (table order), a fused table's per-row tensors (Adagrad's ``sum``) its rows of
    the fused one and its scalars (``step``) those of the fused parameter."""
    slots = list(tables.slots.values())
    names = list(tables.slots)
    n_params = len(list(tables.parameters()))

    def split(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        (group,) = _one_group(sd, n_params, "this model's fused")
        state = sd["state"]
        sd["state"] = {
            j: {k: _rows_of(v, slot) for k, v in state[slot.param].items()}
            for j, slot in enumerate(slots)
            if slot.param in state
        }
        group["params"] = list(range(len(slots)))
        return sd

    def merge(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        sd = {**sd, "param_groups": [dict(g) for g in sd["param_groups"]]}
        (group,) = _one_group(sd, len(slots), "one per num_buckets table")
        sd["state"] = _merged_state(sd["state"], slots, names, tables)
        group["params"] = list(range(n_params))
        return sd

    optimizer.register_state_dict_post_hook(split)
    optimizer.register_load_state_dict_pre_hook(merge)


def _one_group(sd: dict[str, Any], n: int, what: str) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = sd["param_groups"]
    if len(groups) != 1 or len(groups[0]["params"]) != n:
        sizes = [len(g["params"]) for g in groups]
        raise ValueError(
            f"sparse optimizer state: param groups of sizes {sizes}, expected one group of {n} "
            f"({what}); was the checkpoint written with another config's num_buckets tables?"
        )
    return groups


def _rows_of(value: Any, slot: _Slot) -> Any:
    """One table's part of a state value: its rows of a per-row tensor, a copy of a scalar."""
    if not isinstance(value, torch.Tensor):
        return value
    if slot.fused and value.dim() > 0:
        return value[slot.start : slot.stop].clone()
    return value.clone() if slot.fused else value


def _merged_state(
    state: Mapping[int, Mapping[str, Any]],
    slots: Sequence[_Slot],
    names: Sequence[str],
    tables: DenseTables,
) -> dict[int, dict[str, Any]]:
    """Per-table optimizer state (entry j = table j) → per-parameter state (the fused tables of
    a parameter concatenated in row order; scalars from its first table)."""
    members: dict[int, list[int]] = {}
    for j, slot in enumerate(slots):
        members.setdefault(slot.param, []).append(j)
    weights = tables.weights()
    out: dict[int, dict[str, Any]] = {}
    for p, js in members.items():
        present = [j for j in js if j in state]
        if not present:
            continue
        if len(present) != len(js):
            lost = [names[j] for j in js if j not in state]
            raise ValueError(
                f"sparse optimizer state: tables {lost} have no state but {names[present[0]]!r} "
                "has; their tables share one fused parameter, so all or none must have state"
            )
        if not slots[js[0]].fused:
            out[p] = dict(state[js[0]])
            continue
        out[p] = {}
        for key, first in state[js[0]].items():
            if not (isinstance(first, torch.Tensor) and first.dim() > 0):
                out[p][key] = first
                continue
            for j in js:
                got, want = state[j][key].shape, weights[names[j]].shape
                if got != want:
                    raise ValueError(
                        f"sparse optimizer state of table {names[j]!r}: {key!r} is {list(got)}, "
                        f"the table is {list(want)}; load a checkpoint of this config"
                    )
            out[p][key] = torch.cat([state[j][key] for j in js])
    return out
