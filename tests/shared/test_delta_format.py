"""The delta format as it crosses the trainer → server boundary: the manifest's fields (golden),
the tombstones, and ``event_time`` (online training's freshness), optional and checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from serve.freshness import event_time, model_age
from shared.delta import DeltaError, TableDelta, diff_tables, write_delta
from shared.delta_reader import read_delta
from shared.dense_inputs import Signature

BASE = {"version": "step-1", "config_digest": "c" * 64, "files": {}}

MANIFEST_KEYS = {
    "format", "format_version", "delta_id", "created_at", "base", "config_digest",
    "target_version", "dense_program", "tables", "table_summaries", "files",
}  # fmt: skip


def _delta(out: Path, **kw: object) -> Path:
    table = TableDelta(
        "user_id_emb", True, 2, base_rows=3, target_rows=3,
        upsert_keys=torch.tensor([7, 9]), upsert_values=torch.ones(2, 2),
        evict_keys=torch.tensor([4]), new=1,
    )  # fmt: skip
    return write_delta(out, tables={"user_id_emb": table}, base_manifest=BASE, delta_id="step-5",
                       target_version="step-5", config_digest="c" * 64, **kw)  # type: ignore[arg-type]  # fmt: skip


def test_manifest_fields_and_tombstones(tmp_path: Path) -> None:
    path = _delta(tmp_path / "d", event_time=1_765_000_000)
    m = json.loads((path / "manifest.json").read_text())
    assert set(m) == MANIFEST_KEYS | {"event_time"}
    assert (m["format"], m["format_version"], m["event_time"]) == ("dynrec-delta", 1, 1765000000)
    assert m["tables"]["user_id_emb"] == {
        "is_hashmap": True, "dimension": 2, "base_rows": 3, "target_rows": 3,
        "new": 1, "updated": 1, "evicted": 1, "rows": 0,
    }  # fmt: skip
    delta = read_delta(path)
    assert delta.event_time == 1_765_000_000
    assert delta.tables["user_id_emb"].evict_keys.tolist() == [4]  # type: ignore[union-attr]
    old = read_delta(_delta(tmp_path / "old"))  # without event_time: as before
    assert "event_time" not in old.manifest and old.event_time is None


@pytest.mark.parametrize("bad", ["soon", -1, True, 1.5])
def test_a_bad_event_time_is_refused(tmp_path: Path, bad: object) -> None:
    path = _delta(tmp_path / "d", event_time=5)
    m = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**m, "event_time": bad}))
    with pytest.raises(DeltaError, match="event_time"):
        read_delta(path)


class _Bundle:
    def __init__(self, manifest: dict) -> None:
        self.manifest = manifest


class _Model:
    def __init__(self, manifest: dict) -> None:
        self.bundle = _Bundle(manifest)


def test_served_event_time_is_the_last_delta_s_else_the_bundle_s() -> None:
    assert event_time(_Model({"extra": {}})) is None and model_age(None) is None
    assert event_time(_Model({"extra": {"event_time": 100}})) == 100.0
    with_delta = _Model({"extra": {"event_time": 100}, "delta": {"event_time": 160}})
    assert event_time(with_delta) == 160.0
    assert model_age(with_delta, now=200.0) == 40.0
    assert event_time(_Model({"extra": {"event_time": "x"}})) is None


def test_a_table_empty_in_the_base_diffs_to_all_new_keys() -> None:
    """A base exported before a table saw any key (online training's first hour): every key
    of the new table is new, none evicted."""
    empty = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, 4))
    new = (torch.tensor([7, 3]), torch.ones(2, 4))
    delta = diff_tables({}, {"t": empty}, {}, {"t": new})["t"]
    assert delta.upsert_keys.tolist() == [7, 3] and delta.new == 2
    assert delta.evict_keys.numel() == 0


def test_evicted_keys_are_the_base_keys_the_new_table_lacks() -> None:
    """Unsorted keys on both sides, and a new table that lost every key."""
    g = torch.Generator().manual_seed(0)
    base_keys = torch.randperm(1000, generator=g)[:300] * 7
    new_keys = torch.cat([base_keys[torch.randperm(300, generator=g)[:200]], torch.tensor([5])])
    base = (base_keys, torch.zeros(300, 2))
    new = (new_keys, torch.ones(201, 2))
    delta = diff_tables({}, {"t": base}, {}, {"t": new})["t"]
    want = sorted(set(base_keys.tolist()) - set(new_keys.tolist()))
    assert delta.evict_keys.tolist() == want and len(want) == 100
    empty = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2))
    gone = diff_tables({}, {"t": base}, {}, {"t": empty})["t"]
    assert gone.evict_keys.tolist() == sorted(base_keys.tolist())


def test_program_inputs_without_a_program_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DeltaError, match="program_inputs without dense_program_path"):
        _delta(tmp_path / "d", program_inputs=Signature.PAIRS)
