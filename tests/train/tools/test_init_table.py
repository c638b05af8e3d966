"""init-ckpt: an init table becomes a dynamicemb checkpoint that training starts from."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from shared.hashtable.checkpoint import DEEP_COLLECTION
from shared.hashtable.checkpoint_dynamicemb import counter_file, emb_file
from tests.conftest import SEED_CONFIG, write_config
from train.tools.__main__ import main
from train.tools.init_table import InitTableError, read_init_table
from train.trainer import Trainer, TrainOptions

DIM = 16


def _table(n: int = 40, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.choice(10**6, n, replace=False).astype(np.int64) + 10**9  # never in the data
    return ids, rng.normal(0, 0.05, (n, DIM)).astype(np.float32)


def _write_csv(path: Path, ids: np.ndarray, emb: np.ndarray, sep: str = ";") -> Path:
    lines = ["id,embedding"] + [
        f'{i},"{sep.join(repr(float(x)) for x in e)}"' for i, e in zip(ids, emb, strict=True)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _read_rank(directory: Path, table: str, kind: str, rank: int, world: int, dtype: str):
    return np.fromfile(directory / emb_file(table, kind, rank, world), dtype=dtype)


def test_init_ckpt_records_a_tables_own_rate(tmp_path: Path) -> None:
    """table_learning_rates: the table's opt_args.json says its own rate, as training's do."""
    ids, emb = _table()
    src = tmp_path / "user.parquet"
    pq.write_table(pa.table({"user_id": ids, "emb": list(emb)}), src)
    config = write_config(
        SEED_CONFIG, tmp_path / "c.config", train=tmp_path, eval_=tmp_path,
        replace={"adagrad_optimizer { lr: 0.001 }": "adagrad_optimizer { lr: 0.001 }\n"
                 'table_learning_rates { feature_name: "user_id" lr_scale: 3 }'},
    )  # fmt: skip
    out = tmp_path / "init"
    assert main(["init-ckpt", "--config", str(config), "--table", f"user_id={src}",
                 "--out", str(out)]) == 0  # fmt: skip
    args = json.loads(
        (out / "dynamicemb" / DEEP_COLLECTION / "user_id_emb_opt_args.json").read_text()
    )
    assert args["lr"] == pytest.approx(0.003)


@pytest.mark.parametrize("fmt", ["parquet_list", "csv_string"])
def test_init_ckpt_values_equal_the_table(tmp_path: Path, fmt: str, capsys) -> None:
    ids, emb = _table()
    if fmt == "parquet_list":
        src = tmp_path / "user.parquet"
        pq.write_table(pa.table({"user_id": ids, "emb": list(emb)}), src)
        sep = []
    else:
        src = _write_csv(tmp_path / "user.csv", ids, emb)
        sep = ["--separator", ";"]
    out = tmp_path / "init"
    args = ["init-ckpt", "--config", str(SEED_CONFIG), "--table", f"user_id={src}"]
    assert main([*args, "--world_size", "2", "--out", str(out), *sep, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tables"]["user_id_emb"]["rows"] == len(ids)
    directory = out / "dynamicemb" / DEEP_COLLECTION
    got: dict[int, np.ndarray] = {}
    for rank in range(2):
        keys = _read_rank(directory, "user_id_emb", "keys", rank, 2, "<i8")
        values = _read_rank(directory, "user_id_emb", "values", rank, 2, "<f4").reshape(-1, DIM)
        scores = _read_rank(directory, "user_id_emb", "scores", rank, 2, "<i8")
        accum = _read_rank(directory, "user_id_emb", "opt_values", rank, 2, "<f4")
        assert (keys % 2 == rank).all() and (scores == 0).all() and (accum == 0).all()
        got.update(zip(keys.tolist(), values, strict=True))
        counters = directory / counter_file("user_id_emb", "keys", rank, 2)
        assert counters.stat().st_size == 0  # admission: counter files, empty, as dynamicemb
    args = json.loads((directory / "user_id_emb_opt_args.json").read_text())  # rank 0 wrote it
    assert (args["opt_type"], args["evict_strategy"], args["lr"]) == (
        "exact_adagrad",
        "EvictStrategy.KLfu",
        0.001,
    )
    assert sorted(p.name for p in directory.glob("*.json")) == ["user_id_emb_opt_args.json"]
    assert sorted(got) == sorted(ids.tolist())
    for i, e in zip(ids.tolist(), emb, strict=True):
        np.testing.assert_array_equal(got[i], e)  # bit-exact (repr round-trips float32)
    assert (out / "DONE").exists() and json.loads((out / "init_ckpt.json").read_text())


def test_training_starts_from_the_init_checkpoint(tiny_samples: Path, tmp_path: Path) -> None:
    ids, emb = _table()
    src = tmp_path / "user.parquet"
    pq.write_table(pa.table({"id": ids, "emb": list(emb)}), src)
    cfg = write_config(
        SEED_CONFIG,
        tmp_path / "with_init.config",
        train=tiny_samples / "train",
        eval_=tiny_samples / "eval",
        replace={
            'expression: "user:user_id"\nembedding_dim: 16\ndynamicemb {': (
                f'expression: "user:user_id"\nembedding_dim: 16\ndynamicemb {{\ninit_table: "{src}"'
            )
        },
    )
    options = TrainOptions(
        config_path=cfg,
        model_dir=tmp_path / "m",
        batch_size=256,
        num_workers=0,
        max_steps=1,
        progress_bar=False,
    )
    with pytest.raises(ValueError, match="init-ckpt"):  # init_table set, no init checkpoint
        Trainer(options).fit()
    # no --table: the config's init_table is used
    assert main(["init-ckpt", "--config", str(cfg), "--out", str(tmp_path / "init")]) == 0
    options.fine_tune_checkpoint = tmp_path / "init"
    trainer = Trainer(options)
    trainer.fit()
    keys, values = trainer.model.sparse.dynamic.export_table("user_id_emb")
    pos = torch.searchsorted(keys, torch.from_numpy(ids))
    assert torch.equal(keys[pos], torch.from_numpy(ids))  # every init key is in the table ...
    torch.testing.assert_close(values[pos], torch.from_numpy(emb), rtol=0, atol=0)  # untouched


def test_bad_rows_are_listed_with_line_numbers(tmp_path: Path, capsys) -> None:
    src = tmp_path / "bad.csv"
    src.write_text(
        "id,embedding\n"
        '1,"0.1,0.2,0.3"\n'  # line 2: ok
        '2,"0.1,0.2"\n'  # 3: wrong dim
        'x,"0.1,0.2,0.3"\n'  # 4: not an integer
        "\n"  # 5: empty line
        '-4,"0.1,0.2,0.3"\n'  # 6: negative
        '1,"0.5,0.5,0.5"\n'  # 7: duplicate of line 2
        '6,"0.1,abc,0.3"\n'  # 8: not a number
        "7,0.1,0.2,0.3\n"  # 9: unquoted: 4 fields
        '8,"1,2,nan"\n'  # 10: not finite
        '9," 1e-3 , -2 , .5 "\n'  # 11: ok
    )
    with pytest.raises(InitTableError) as info:
        read_init_table(src, 3)
    err = info.value
    assert err.total == 8
    assert [line for line, _ in err.problems] == [3, 4, 5, 6, 7, 8, 9, 10]
    text = str(err)
    for needle in (
        "line 3: 2 values, expected 3",
        "line 4: id 'x' is not an integer",
        "line 5: missing id",
        "line 6: negative id -4",
        "line 7: id 1 repeats line 2",
        "line 8: value 2 ('abc') is not a number",
        "line 9: 4 fields, expected 2",
        "line 10: value is NaN or infinite",
    ):
        assert needle in text, text
    capped = pytest.raises(InitTableError, read_init_table, src, 3, max_errors=3).value
    assert len(capped.problems) == 3 and "... and 5 more bad lines" in str(capped)
    # the CLI writes nothing and exits 2
    out = tmp_path / "init"
    cfg = str(SEED_CONFIG)
    args = ["init-ckpt", "--config", cfg, "--table", f"user_id={src}", "--out", str(out)]
    assert main(args) == 2
    assert "bad lines; nothing was written" in capsys.readouterr().err and not out.exists()


def test_parquet_rows_and_string_ids(tmp_path: Path) -> None:
    src = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": [5, 3, 3], "emb": [[1.0, 2, 3], [1.0, 2], [4.0, 5, 6]]}), src)
    err = pytest.raises(InitTableError, read_init_table, src, 3).value
    assert err.problems == [
        (2, "2 values, expected 3 (the embedding_dim)"),
        (3, "id 3 repeats row 2"),
    ]
    # string ids are hashed as feature generation hashes dynamic string ids
    from shared.fg_text import INT64_MAX, hash_strings

    pq.write_table(pa.table({"id": ["a", "b"], "emb": ["1,2,3", "[4, 5, 6]"]}), src)
    table = read_init_table(src, 3)
    want = (hash_strings(pa.array(["a", "b"])) & np.uint64(INT64_MAX)).astype(np.int64)
    assert table.keys.tolist() == want.tolist()
    assert table.values.tolist() == [[1, 2, 3], [4, 5, 6]]


def test_any_rank_loads_its_keys(tmp_path: Path) -> None:
    """An init checkpoint of world size 2 loads into rank 1 of 3 by key owner (re-sharding)."""
    from shared.config import load_config
    from shared.features import build_feature_set
    from train.fine_tune import load_weights
    from train.model.multi_tower_din import MultiTowerDIN

    ids, emb = _table(30)
    src = tmp_path / "user.parquet"
    pq.write_table(pa.table({"id": ids, "emb": list(emb)}), src)
    out = tmp_path / "init"
    args = ["init-ckpt", "--config", str(SEED_CONFIG), "--table", f"user_id_emb={src}"]
    assert main([*args, "--world_size", "2", "--out", str(out)]) == 0
    config = load_config(SEED_CONFIG)
    model = MultiTowerDIN.from_config(config, build_feature_set(config))
    info = load_weights(out, model, rank=1, world_size=3)
    assert info["tables"] == ["user_id_emb"] and info["dense"] is False
    keys, values = model.sparse.dynamic.export_table("user_id_emb")
    mine = ids % 3 == 1
    order = np.argsort(ids[mine])
    assert keys.tolist() == ids[mine][order].tolist()
    assert torch.equal(values, torch.from_numpy(emb[mine][order]))
