"""The real dynamicemb dump (tests/fixtures/dynamicemb_ckpt, see its README) read row for row,
and what the reader does with optimizer states we do not train."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.features import ScoreStrategy
from shared.hashtable.checkpoint import DEEP_COLLECTION, CheckpointError
from shared.hashtable.checkpoint_dynamicemb import emb_file
from shared.hashtable.embedding import DynamicEmbeddingCollection

from .conftest import dyn_table

ROOT = Path(__file__).parents[2] / "fixtures" / "dynamicemb_ckpt"
FIXTURE = ROOT / "model.ckpt-500"
EXPECTED = json.loads((ROOT / "expected.json").read_text())
NAMES = ("user_id_emb", "adgroup_id_emb")


def _dec(
    strategy: ScoreStrategy = ScoreStrategy.LFU, initial: float = 0.0
) -> DynamicEmbeddingCollection:
    tables = [
        dyn_table(n, dim=16, strategy=strategy, threshold=3, max_capacity=4096) for n in NAMES
    ]
    return DynamicEmbeddingCollection(
        tables, {"deep": list(NAMES)}, lr=0.001, initial_accumulator_value=initial
    )


def _f32(rows: list) -> torch.Tensor:
    return torch.from_numpy(np.asarray(rows, dtype=np.float64).astype(np.float32))


def test_fixture_rows_bit_exact_at_world_sizes_1_2_3() -> None:
    dec = _dec()
    for world in (1, 2, 3):
        got: dict[str, list] = {n: [] for n in NAMES}
        for rank in range(world):
            report = dec.load(FIXTURE, DEEP_COLLECTION, rank=rank, world_size=world)
            assert report.layout == "dynamicemb"
            for n in NAMES:
                s = dec.table_state(n)
                assert (s.keys % world == rank).all() and (s.counter_keys % world == rank).all()
                assert report.tables[n].rows == EXPECTED["tables"][n]["rows"]
                got[n].append(s)
        for n in NAMES:
            want = EXPECTED["tables"][n]
            keys = torch.cat([s.keys for s in got[n]])
            order = torch.argsort(keys)
            assert keys[order].tolist() == want["keys"]
            for field, name in (("values", "values"), ("accumulators", "opt_values")):
                rows = torch.cat([getattr(s, field) for s in got[n]])[order]
                assert torch.equal(rows, _f32(want[name])), (world, n, field)  # bit for bit
            assert torch.cat([s.scores for s in got[n]])[order].tolist() == want["scores"]
            ck = torch.cat([s.counter_keys for s in got[n]])
            cf = torch.cat([s.counter_counts for s in got[n]])
            o = torch.argsort(ck)
            assert ck[o].tolist() == want["counter_keys"]
            assert cf[o].tolist() == want["counter_frequencies"]


def _copy(tmp_path: Path) -> Path:
    out = tmp_path / "model.ckpt-500"
    shutil.copytree(FIXTURE, out)
    for p in out.rglob("*"):
        p.chmod(0o644 if p.is_file() else 0o755)
    return out


def _rewrite_opt(ckpt: Path, opt_type: str, width) -> None:
    """The fixture's tables as if trained with another optimizer (``width(dim)`` columns)."""
    d = ckpt / "dynamicemb" / DEEP_COLLECTION
    for n in NAMES:
        args = json.loads((d / f"{n}_opt_args.json").read_text())
        (d / f"{n}_opt_args.json").write_text(json.dumps({**args, "opt_type": opt_type}, indent=4))
        for r in range(2):
            keys = np.fromfile(d / emb_file(n, "keys", r, 2), "<i8")
            cols = np.arange(width(16), dtype="<f4") + 0.5
            data = np.tile(cols, (len(keys), 1)) * (1 + keys[:, None] % 7)
            (d / emb_file(n, "opt_values", r, 2)).write_bytes(data.astype("<f4").tobytes())


def test_row_wise_adagrad_sums_are_broadcast(tmp_path, caplog) -> None:
    ckpt = _copy(tmp_path)
    _rewrite_opt(ckpt, "exact_row_wise_adagrad", lambda d: 1)
    dec = _dec()
    report = dec.load(ckpt, DEEP_COLLECTION)
    s = dec.table_state("user_id_emb")
    want = (0.5 * (1 + s.keys % 7)).float()[:, None].expand(-1, 16)
    assert torch.equal(s.accumulators, want)
    assert (
        "row-wise Adagrad sums [N, 1] read and broadcast" in report.tables["user_id_emb"].notes[0]
    )
    assert "broadcast" in caplog.text


def test_adam_and_sgd_states_are_not_read_and_say_so(tmp_path, caplog) -> None:
    ckpt = _copy(tmp_path)
    _rewrite_opt(ckpt, "adam", lambda d: 2 * d)
    dec = _dec(initial=0.1)
    report = dec.load(ckpt, DEEP_COLLECTION)
    s = dec.table_state("adgroup_id_emb")
    assert torch.equal(s.accumulators, torch.full_like(s.accumulators, 0.1))
    assert torch.equal(
        s.values[torch.argsort(s.keys)], _f32(EXPECTED["tables"]["adgroup_id_emb"]["values"])
    )
    note = report.tables["adgroup_id_emb"].notes[0]
    assert "adam optimizer states [N, 32] not read" in note and "initial_accumulator_value" in note
    assert "adam optimizer states" in caplog.text
    _rewrite_opt(ckpt, "sgd", lambda d: 0)
    report = _dec().load(ckpt, DEEP_COLLECTION)
    assert "sgd optimizer states [N, 0] not read" in report.tables["user_id_emb"].notes[0]


def test_unknown_or_inconsistent_optimizer_states_are_refused(tmp_path) -> None:
    ckpt = _copy(tmp_path)
    _rewrite_opt(ckpt, "lamb", lambda d: d)
    with pytest.raises(CheckpointError, match=r"opt_type 'lamb' is not one dynrec can read"):
        _dec().load(ckpt, DEEP_COLLECTION)
    _rewrite_opt(ckpt, "adam", lambda d: d)  # says adam, holds [N, dim]
    with pytest.raises(CheckpointError, match=r"expected 32 per key"):
        _dec().load(ckpt, DEEP_COLLECTION)


def test_evict_strategy_mismatch_names_both(tmp_path) -> None:
    with pytest.raises(
        CheckpointError,
        match=r"evict_strategy 'EvictStrategy.KLfu'.*STEP.*'EvictStrategy.KCustomized'",
    ):
        _dec(ScoreStrategy.STEP).load(FIXTURE, DEEP_COLLECTION)


def test_timestamp_ages_of_a_klru_dump_restore_against_the_load_time(tmp_path) -> None:
    ckpt = _copy(tmp_path)
    d = ckpt / "dynamicemb" / DEEP_COLLECTION
    for n in NAMES:
        p = d / f"{n}_opt_args.json"
        p.write_text(p.read_text().replace("KLfu", "KLru"))
    dec = _dec(ScoreStrategy.TIMESTAMP)
    dec.set_clock(lambda: 10**12)  # µs
    dec.load(ckpt, DEEP_COLLECTION)
    s = dec.table_state("user_id_emb")
    ages_ns = torch.tensor(EXPECTED["tables"]["user_id_emb"]["scores"])  # the fixture's ints
    assert s.scores[torch.argsort(s.keys)].tolist() == (10**12 - ages_ns // 1000).tolist()
