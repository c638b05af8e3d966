"""shared/delta.py's merge (``apply_delta_tables``) with the base's keys sorted once
(``BaseKeyIndex``): the same tables as the set semantics of base + delta, row for row in the
same order, whether the index is built for the call, kept across deltas of one base, or was
built from other keys."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.delta import (
    BaseKeyIndex,
    Delta,
    TableDelta,
    apply_delta_tables,
    diff_tables,
    write_delta,
)
from shared.delta_reader import read_delta

Tables = dict[str, tuple[torch.Tensor, torch.Tensor]]
BASE = {"version": "step-1", "config_digest": "c" * 64, "files": {}}


def _tables(seed: int, n: int) -> Tables:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randperm(4 * n, generator=g)[:n].to(torch.int64)
    return {"t": (keys, torch.randn(n, 4, generator=g))}


def _target(
    base: tuple[torch.Tensor, torch.Tensor], seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``base`` with a third of its rows changed, a tenth evicted and new keys added."""
    keys, values = base
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(keys.numel(), generator=g)
    n = keys.numel()
    keep = torch.ones(n, dtype=torch.bool)
    keep[perm[: n // 10]] = False
    values = values.clone()
    values[perm[n // 10 : n // 10 + n // 3]] += 1.0
    new = torch.arange(50, dtype=torch.int64) + 10 * n  # beyond every base key
    return torch.cat([keys[keep], new]), torch.cat([values[keep], torch.ones(50, 4)])


def _delta(tmp: Path, name: str, base: Tables, target: Tables) -> Delta:
    tables = diff_tables({}, base, {}, target)
    path = write_delta(tmp / name, tables=tables, base_manifest=BASE, delta_id=name,
                       target_version=name, config_digest="c" * 64)  # fmt: skip
    return read_delta(path)


def _as_dict(table: tuple[torch.Tensor, torch.Tensor]) -> dict[int, list[float]]:
    return dict(zip(table[0].tolist(), table[1].tolist(), strict=True))


def _isin_merge(
    base: tuple[torch.Tensor, torch.Tensor], delta_table: TableDelta
) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge as it was written before the index (torch.isin): the reference order."""
    keys, values = base
    assert delta_table.upsert_keys is not None and delta_table.upsert_values is not None
    assert delta_table.evict_keys is not None
    drop = torch.cat([delta_table.upsert_keys, delta_table.evict_keys])
    keep = ~torch.isin(keys, drop)
    return torch.cat([keys[keep], delta_table.upsert_keys]), torch.cat(
        [values[keep], delta_table.upsert_values]
    )


def test_the_merge_gives_the_target_in_the_order_of_the_isin_merge(tmp_path: Path) -> None:
    base = _tables(0, 2000)
    target = {"t": _target(base["t"], 1)}
    delta = _delta(tmp_path, "d1", base, target)
    _, merged = apply_delta_tables({}, base, delta)
    assert _as_dict(merged["t"]) == _as_dict(target["t"])
    want = _isin_merge(base["t"], delta.tables["t"])
    assert torch.equal(merged["t"][0], want[0]) and torch.equal(merged["t"][1], want[1])


def test_an_index_kept_across_deltas_of_one_base_is_built_once(tmp_path: Path) -> None:
    base = _tables(0, 2000)
    index: dict[str, BaseKeyIndex] = {}
    for seed in (1, 2):
        target = {"t": _target(base["t"], seed)}
        delta = _delta(tmp_path, f"d{seed}", base, target)
        _, merged = apply_delta_tables({}, base, delta, index=index)
        if seed == 1:
            built = index["t"]
        assert index["t"] is built and built.keys is base["t"][0]
        assert _as_dict(merged["t"]) == _as_dict(target["t"])
    # an index of other keys (another base) is not trusted: built again from these
    other = _tables(5, 2000)
    target = {"t": _target(other["t"], 3)}
    _, merged = apply_delta_tables({}, other, _delta(tmp_path, "d3", other, target), index=index)
    assert index["t"] is not built and index["t"].keys is other["t"][0]
    assert _as_dict(merged["t"]) == _as_dict(target["t"])


def test_find_gives_the_base_positions_of_the_keys_it_holds() -> None:
    empty = BaseKeyIndex(torch.empty(0, dtype=torch.int64))
    positions, held = empty.find(torch.tensor([3, 5]))
    assert positions.numel() == 0 and held == 0
    index = BaseKeyIndex(torch.tensor([9, 2, 7]))
    positions, held = index.find(torch.tensor([7, 1, 9, 10]))
    assert sorted(positions.tolist()) == [0, 2] and held == 2
    positions, held = index.find(torch.empty(0, dtype=torch.int64))
    assert positions.numel() == 0 and held == 0
