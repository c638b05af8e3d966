"""inspect on a checkpoint: sizes, histogram, top keys and admission backlog match the tables."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from shared.hashtable.checkpoint import DEEP_COLLECTION, read_table
from shared.hashtable.summary import score_histogram, top_keys
from train.tools.__main__ import main
from train.tools.inspection import format_report, inspect_checkpoint


def test_checkpoint_report_matches_the_table_files(dyn_run) -> None:
    report = inspect_checkpoint(dyn_run.model_dir, top_k=5)  # a model dir: its newest checkpoint
    assert report["where"] == str(dyn_run.checkpoint)
    assert report["layout"] == "dynamicemb"
    names = [t["name"] for t in report["tables"]]
    assert names == sorted(
        [
            "user_id_emb",
            "adgroup_id_emb",
            "brand_emb",
            "campaign_id_emb",
            "customer_emb",
            "cate_id_emb",
        ]
    )
    for t in report["tables"]:
        state, info = read_table(dyn_run.checkpoint, t["name"])
        keys, scores = state.keys.numpy(), state.scores.numpy()
        assert t["size"] == len(keys) > 0 and t["collection"] == DEEP_COLLECTION
        assert t["capacity"] == info.max_capacity  # world size 1
        assert t["load_factor"] == len(keys) / info.max_capacity
        assert sum(b["count"] for b in t["score_histogram"]) == len(keys)
        # LFU: power-of-two bins; every admitted key was seen >= threshold (3) times
        assert all(b["upper"] == 2 * b["lower"] for b in t["score_histogram"])
        assert min(b["lower"] for b in t["score_histogram"]) >= 2
        best = np.lexsort((keys, -scores))[:5]
        assert t["top_keys"] == [{"key": int(keys[i]), "score": int(scores[i])} for i in best]
        counts = state.counter_counts.numpy()
        assert t["admission_threshold"] == 3 and t["admission_pending"] == len(counts)
        assert all(int(c) < 3 for c in t["admission_pending_by_count"])
        assert sum(t["admission_pending_by_count"].values()) == len(counts)
    text = format_report(report, top_k=5)
    assert "user_id_emb" in text and "top 5 key:score" in text


def test_histogram_bins() -> None:
    s = np.array([0, 1, 2, 3, 4, 100])
    assert score_histogram(s, "LFU") == [
        {"lower": 0, "upper": 1, "count": 1},
        {"lower": 1, "upper": 2, "count": 1},
        {"lower": 2, "upper": 4, "count": 2},
        {"lower": 4, "upper": 8, "count": 1},
        {"lower": 64, "upper": 128, "count": 1},
    ]
    steps = score_histogram(np.array([10, 11, 19, 25]), "STEP", bins=2)
    assert steps == [{"lower": 10, "upper": 18, "count": 2}, {"lower": 18, "upper": 26, "count": 2}]
    assert top_keys(np.array([5, 3, 9]), np.array([1, 7, 7]), 2) == [
        {"key": 3, "score": 7},
        {"key": 9, "score": 7},
    ]


def test_top_keys_are_those_of_a_full_sort() -> None:
    """Only the keys scored at least the k-th highest score are sorted: the same keys, in the
    same order, as a lexsort of every key, ties at the k-th score included."""
    rng = np.random.default_rng(0)
    keys = rng.permutation(5000).astype(np.int64)
    for scores in (rng.integers(0, 30, 5000), rng.integers(0, 10**9, 5000), np.zeros(5000)):
        for k in (1, 7, 20, 4999, 5000, 6000):
            order = np.lexsort((keys, -scores))[:k]
            want = [{"key": int(keys[i]), "score": int(scores[i])} for i in order]
            assert top_keys(keys, scores, k) == want, (k, scores[:5])


def test_cli_json(dyn_run, capsys) -> None:
    assert main(["inspect", "--checkpoint", str(dyn_run.checkpoint), "--json", "--top-k", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == "checkpoint"
    assert all(len(t["top_keys"]) <= 3 for t in report["tables"])
    assert main(["inspect", "--checkpoint", str(Path(dyn_run.checkpoint).parent / "nope")]) == 2


FIXTURE = Path(__file__).parents[2] / "fixtures" / "dynamicemb_ckpt"


def test_foreign_checkpoint_is_listed(tmp_path: Path, capsys) -> None:
    """TorchEasyRec's checkpoint (and its model dir): the tables, their collection, no capacity."""
    want = json.loads((FIXTURE / "expected.json").read_text())["tables"]
    for where in (FIXTURE / "model.ckpt-500", FIXTURE):  # the checkpoint, or the model dir
        report = inspect_checkpoint(where, top_k=3)
        assert report["where"] == str(FIXTURE / "model.ckpt-500")
        assert report["layout"] == "dynamicemb"
        got = {t["name"]: t for t in report["tables"]}
        assert sorted(got) == sorted(want)
        for name, t in got.items():
            assert (t["size"], t["dim"], t["world_size"]) == (want[name]["rows"], 16, 2)
            assert t["collection"] == DEEP_COLLECTION and t["score_strategy"] == "LFU"
            assert t["capacity"] is None and t["load_factor"] is None  # the files do not say
            assert t["admission_pending"] == len(want[name]["counter_keys"])
            assert sum(b["count"] for b in t["score_histogram"]) == want[name]["rows"]
    assert main(["inspect", "--checkpoint", str(FIXTURE), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tables"]) == 2
    assert main(["inspect", "--checkpoint", str(FIXTURE)]) == 0
    text = capsys.readouterr().out
    assert "(dynamicemb layout)" in text
    assert re.search(r"user_id_emb +hash +16 +120 +- +- +- +25\n", text)  # capacity unknown


def test_empty_checkpoint_gives_no_rows_and_a_note(tmp_path: Path, capsys) -> None:
    (tmp_path / "dynamicemb").mkdir()
    assert main(["inspect", "--checkpoint", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tables"] == [] and "no dynamic tables" in report["note"]
    assert main(["inspect", "--checkpoint", str(tmp_path)]) == 0  # no crash on zero rows
    text = capsys.readouterr().out
    assert "table  kind  dim  size" in text and "no dynamic tables" in text


def test_bundle_report_in_both_namings(dyn_run, tmp_path: Path, capsys) -> None:
    """inspect --bundle: the same tables from a bundle in TorchEasyRec's names (the default)
    and from the same checkpoint exported in ours (format 1); only the name prefixes differ.
    The default export's program takes the pairs: format 3, what its manifest says."""
    from shared.bundle import DYNREC_NAMING, TZREC_COLLECTION, read_bundle
    from tests.conftest import SEED_CONFIG
    from train.export import export_bundle
    from train.tools.inspection import inspect_bundle

    ours = export_bundle(
        SEED_CONFIG, out_dir=tmp_path / "ours", checkpoint=dyn_run.checkpoint, naming=DYNREC_NAMING
    )
    tz, dy = inspect_bundle(dyn_run.full_bundle), inspect_bundle(ours)
    assert (tz["naming"], tz["format_version"], dy["naming"], dy["format_version"]) == (
        "tzrec",
        3,
        "dynrec",
        1,
    )

    def without_prefix(report: dict) -> list[dict]:
        return [{k: v for k, v in t.items() if k != "prefix"} for t in report["tables"]]

    assert without_prefix(tz) == without_prefix(dy)
    b = read_bundle(dyn_run.full_bundle)
    for t in tz["tables"]:
        if t["is_hashmap"]:
            assert t["prefix"] == TZREC_COLLECTION
            assert t["size"] == len(b.hash_tables[t["name"]][0]) > 0
            assert sum(c["count"] for c in t["score_histogram"]) == t["size"]
        else:
            assert t["prefix"] == f"{TZREC_COLLECTION}.embedding_bags"
            assert t["size"] == t["capacity"] == b.dense_tables[t["name"]].shape[0]
    assert {t["prefix"] for t in dy["tables"]} == {""}
    assert f"tzrec naming, format_version 3; under {TZREC_COLLECTION}" in format_report(tz)
    assert main(["inspect", "--bundle", str(ours), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == dy
    assert main(["inspect", "--bundle", str(tmp_path / "nope")]) == 2
    assert "no such bundle directory" in capsys.readouterr().err
