"""Training on `tiny`: loss goes down, tables update, resume equals an uninterrupted run."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from shared.hashtable import cuda as cuda_kernels
from shared.hashtable import host_move
from tests.conftest import BASELINE_CONFIG, SEED_CONFIG, write_config
from train.checkpoint import Progress, latest_checkpoint, list_checkpoints
from train.model.multi_tower_din import MultiTowerDIN
from train.trainer import Trainer, TrainOptions, train_step


def _options(tiny: Path, model_dir: Path, config: Path = SEED_CONFIG, **kw: object) -> TrainOptions:
    base = dict(
        config_path=config,
        model_dir=model_dir,
        train_path=tiny / "train",
        eval_path=tiny / "eval",
        batch_size=256,
        num_workers=0,
        log_every=2,
        checkpoint_every=4,
        progress_bar=False,
    )
    return TrainOptions(**(base | kw))  # type: ignore[arg-type]


def test_loss_decreases_and_tables_update(tiny_samples: Path, tmp_path: Path) -> None:
    trainer = Trainer(_options(tiny_samples, tmp_path / "m", max_steps=1))
    model, opts = trainer.model, trainer.optimizers
    batches = list(trainer.loader.epoch(0))[:3]
    dense_before = model.sparse.dense_table_weights()["age_level_emb"].detach().clone()
    losses = []
    for step in range(12):  # a few passes over the same three batches: loss must fall
        losses.append(float(train_step(model, opts, batches[step % 3], step)))
    assert sum(losses[-3:]) < sum(losses[:3])
    assert not torch.equal(dense_before, model.sparse.dense_table_weights()["age_level_emb"])
    stats = model.sparse.dynamic.stats()
    assert stats["user_id_emb"]["size"] > 0 and stats["adgroup_id_emb"]["size"] > 0


def test_sequence_and_top_level_feature_update_the_same_rows(
    tiny_samples: Path, tmp_path: Path
) -> None:
    """A key seen only through click_50_seq__adgroup_id lands in adgroup_id_emb and is trained."""
    trainer = Trainer(_options(tiny_samples, tmp_path / "m", max_steps=1))
    model, opts = trainer.model, trainer.optimizers
    batch = next(iter(trainer.loader.epoch(0)))
    seq_keys = batch.sequence["click_50_seq__adgroup_id"].values()
    top_keys = batch.item["adgroup_id"].values()
    only_seq = seq_keys[~torch.isin(seq_keys, top_keys) & (seq_keys > 0)].unique()
    assert len(only_seq) > 0
    for step in range(4):  # admission threshold 3: the keys enter on the third sighting
        train_step(model, opts, batch, step)
    keys, values = model.sparse.dynamic.export_table("adgroup_id_emb")
    stored = torch.isin(only_seq, keys)
    assert stored.all(), "sequence-only keys must be admitted into the shared adgroup_id table"
    before = values[torch.isin(keys, only_seq)].clone()
    train_step(model, opts, batch, 4)
    keys2, values2 = model.sparse.dynamic.export_table("adgroup_id_emb")
    after = values2[torch.isin(keys2, only_seq)]
    assert not torch.equal(before, after), "the sequence lookup must update the shared rows"


def test_resume_equals_uninterrupted(tiny_samples: Path, tmp_path: Path) -> None:
    full = Trainer(_options(tiny_samples, tmp_path / "full", max_steps=10, checkpoint_every=100))
    full.fit()
    first = Trainer(_options(tiny_samples, tmp_path / "resumed", max_steps=5, checkpoint_every=5))
    first.fit()
    assert latest_checkpoint(tmp_path / "resumed").name == "step_5"
    second = Trainer(_options(tiny_samples, tmp_path / "resumed", max_steps=10, resume=True))
    result = second.fit()
    assert result.progress.step == 10
    a, b = full.model, second.model
    for (name, p), (_, q) in zip(
        a.dense.state_dict().items(), b.dense.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    for t in ("user_id_emb", "adgroup_id_emb", "brand_emb"):
        ka, va = a.sparse.dynamic.export_table(t)
        kb, vb = b.sparse.dynamic.export_table(t)
        assert torch.equal(ka, kb), t
        torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-6, msg=t)
    torch.testing.assert_close(
        a.sparse.dense.state_dict()["embeddings.pid_emb.weight"],
        b.sparse.dense.state_dict()["embeddings.pid_emb.weight"],
    )


def test_baseline_num_buckets_config_trains_with_the_same_code(
    tiny_samples: Path, tmp_path: Path
) -> None:
    result = Trainer(
        _options(tiny_samples, tmp_path / "base", config=BASELINE_CONFIG, max_steps=3)
    ).fit()
    assert result.progress.step == 3
    assert result.final_eval is not None and 0.0 < result.final_eval.auc < 1.0
    assert (tmp_path / "base" / "metrics.jsonl").exists() and (
        tmp_path / "base" / "curves.png"
    ).exists()


def test_summary_splits_the_loop_time(tiny_samples: Path, tmp_path: Path) -> None:
    """The summary says how long the loop waited for input and spent checkpointing: parts of
    train_seconds, and the checkpoints of the cadence are counted (every 2 steps of 6)."""
    result = Trainer(_options(tiny_samples, tmp_path / "m", max_steps=6, checkpoint_every=2)).fit()
    summary = next(r for r in result.history if r["kind"] == "summary")
    kinds = ("input_wait", "log", "checkpoint", "eval")
    parts = [summary[f"{k}_seconds"] for k in kinds]
    assert all(p >= 0 for p in parts) and sum(parts) <= summary["train_seconds"]
    assert summary["checkpoint_seconds"] > 0 and summary["eval_seconds"] == 0  # no eval_every
    assert summary["log_seconds"] > 0  # a train record every 2 steps
    assert result.loop_times.seconds["checkpoint"] == summary["checkpoint_seconds"]
    # each train record splits its own window the same way; the windows add up to at most the
    # run's (the last checkpoint, after the last record, is in none)
    windows = [r for r in result.history if r["kind"] == "train"]
    assert [r["step"] for r in windows] == [2, 4, 6]
    for k in kinds:
        assert all(r[f"{k}_seconds"] >= 0 for r in windows)
        assert sum(r[f"{k}_seconds"] for r in windows) <= summary[f"{k}_seconds"] + 1e-9
    # the checkpoint of step 2 (after its record) is in the next window, not in the first
    assert windows[0]["checkpoint_seconds"] == 0 and windows[1]["checkpoint_seconds"] > 0


def test_loader_workers_start_before_the_model_is_built(
    tiny_samples: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh run's first epoch starts its workers in the constructor, before the model (they
    read while it is built), and fit() trains on that epoch; a resume starts its own."""
    import multiprocessing

    from train import trainer as trainer_module

    build = trainer_module.MultiTowerDIN.from_config
    seen: list[int] = []

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(len(multiprocessing.active_children()))
        return build(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(trainer_module.MultiTowerDIN, "from_config", spy)
    options = _options(tiny_samples, tmp_path / "m", num_workers=1, max_steps=3)
    result = Trainer(options).fit()
    assert seen == [1] and result.progress.step == 3
    resumed = Trainer(_options(tiny_samples, tmp_path / "m", num_workers=1, max_steps=4,
                               resume=True))  # fmt: skip
    assert seen == [1, 0] and resumed._started is None
    assert resumed.fit().progress.step == 4


def test_checkpoints_are_complete_and_pruned(tiny_samples: Path, tmp_path: Path) -> None:
    Trainer(_options(tiny_samples, tmp_path / "m", max_steps=10, checkpoint_every=2)).fit()
    names = [p.name for p in list_checkpoints(tmp_path / "m")]
    # the last 3 kept, by step number: in name order step_10 would sort before step_2
    assert names == ["step_6", "step_8", "step_10"]
    assert not [p for p in (tmp_path / "m" / "checkpoints").iterdir() if p.name.startswith(".")]


def test_evaluation_reports_oracle_and_head_tail(tiny_samples: Path, tmp_path: Path) -> None:
    result = Trainer(_options(tiny_samples, tmp_path / "m", max_steps=2)).fit()
    ev = result.final_eval
    assert ev is not None
    assert ev.oracle_auc is not None and 0.5 < ev.oracle_auc <= 1.0
    assert ev.auc_vs_oracle == pytest.approx(ev.auc / ev.oracle_auc)
    assert ev.tail_rows > 0 and ev.head_auc is not None and ev.tail_auc is not None
    assert 0 < ev.tail_rows < ev.rows


TZREC_MODEL_DIR = Path(__file__).parents[1] / "fixtures" / "dynamicemb_ckpt"


def test_resume_refuses_a_torcheasyrec_model_dir(tiny_samples: Path, tmp_path: Path) -> None:
    """--resume on tzrec's model dir (model.ckpt-N, no checkpoints/step_N) never starts over."""
    model_dir = tmp_path / "tzrec"
    shutil.copytree(TZREC_MODEL_DIR / "model.ckpt-500", model_dir / "model.ckpt-500")
    trainer = Trainer(_options(tiny_samples, model_dir, max_steps=1, resume=True))
    with pytest.raises(
        ValueError, match=r"no dynrec checkpoint .* TorchEasyRec checkpoints \(model.ckpt-500\)"
    ) as err:
        trainer.fit()
    assert f"--fine-tune-checkpoint {model_dir / 'model.ckpt-500'}" in str(err.value)
    assert not (model_dir / "checkpoints").exists()


def test_fine_tune_from_torcheasyrec_then_resume(tiny_samples: Path, tmp_path: Path) -> None:
    """tzrec's tables start a run; its checkpoint is in dynamicemb's layout and resumes."""
    names = ("user_id_emb", "adgroup_id_emb")
    first = Trainer(
        _options(
            tiny_samples,
            tmp_path / "m",
            max_steps=2,
            fine_tune_checkpoint=TZREC_MODEL_DIR,
            fine_tune_tables=names,
        )
    )
    dyn = first.model.sparse.dynamic
    first.fit()
    ckpt = latest_checkpoint(tmp_path / "m")
    coll = ckpt / "dynamicemb" / "model.model.embedding_group.emb_impls.__BASE__.ebc"
    assert (coll / "user_id_emb_emb_keys.rank_0.world_size_1").is_file()
    assert (coll / "user_id_emb_opt_args.json").is_file() and (
        ckpt / "dynamic_tables.json"
    ).is_file()
    stored, _ = dyn.export_table("user_id_emb")
    assert 4297926228 in stored.tolist()  # a fixture key (above 2**32) survived training
    second = Trainer(_options(tiny_samples, tmp_path / "m", max_steps=3, resume=True))
    assert second.fit().progress.step == 3


def test_resume_respects_max_steps(tiny_samples: Path, tmp_path: Path) -> None:
    """A resume of a run that reached --max-steps N trains 0 steps with N, exactly 5 with N+5."""
    first = Trainer(_options(tiny_samples, tmp_path / "m", max_steps=3)).fit()
    again = Trainer(_options(tiny_samples, tmp_path / "m", max_steps=3, resume=True)).fit()
    assert again.progress.step == 3 and again.progress.samples == first.progress.samples
    more = Trainer(_options(tiny_samples, tmp_path / "m", max_steps=8, resume=True)).fit()
    assert more.progress.step == 8
    assert latest_checkpoint(tmp_path / "m").name == "step_8"


def test_stale_checkpoint_temp_dirs_are_removed_at_start(
    tiny_samples: Path, tmp_path: Path
) -> None:
    """Only hidden .step_N.* temp dirs older than this process go; fresh and other names stay."""
    root = tmp_path / "m" / "checkpoints"
    old = time.time() - 3600
    paths = {}
    for name in (".step_4.ab_c1234", ".step_9.zz9_abcd", ".other.ab12cd34", "step_2", "keep"):
        (root / name).mkdir(parents=True)
        (root / name / "dense.pt").write_bytes(b"x")
        paths[name] = root / name
    (root / ".step_6.file1234").write_bytes(b"not a dir")
    for name in (".step_4.ab_c1234", ".other.ab12cd34", "step_2", "keep"):
        os.utime(paths[name] / "dense.pt", (old, old))
        os.utime(paths[name], (old, old))
    os.utime(root / ".step_6.file1234", (old, old))
    # .step_9.zz9_abcd is fresh (written after this process started): a live run's, kept
    Trainer(_options(tiny_samples, tmp_path / "m", max_steps=1))._start_progress()
    left = sorted(p.name for p in root.iterdir())
    assert left == [".other.ab12cd34", ".step_6.file1234", ".step_9.zz9_abcd", "keep", "step_2"]


def test_progress_total_is_the_run_and_a_log_gets_plain_lines(
    tiny_samples: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Total = min(max_steps, epochs x batches per epoch); stderr (not a TTY) gets 'step N/M'."""
    trainer = Trainer(_options(tiny_samples, tmp_path / "m", max_steps=3, progress_bar=True))
    epoch = trainer.loader.num_batches(0)
    assert epoch > 3
    assert trainer._total_steps(Progress(), None) == epoch  # the seed config: one epoch
    assert trainer._total_steps(Progress(), 3) == 3
    resumed = Progress(step=epoch - 2, epoch=0, batch_in_epoch=epoch - 2)
    assert trainer._total_steps(resumed, None) == epoch
    trainer.fit()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train: ")]
    assert lines and lines[-1].startswith("train: step 3/3 (100%) ")
    assert "samples/s, loss " in lines[-1]


def _interrupted(tiny: Path, model_dir: Path, config: Path, *, at: int, end: int) -> Trainer:
    """A run of ``config`` stopped (and checkpointed) at step ``at``, then resumed to ``end``:
    the resumed trainer."""
    Trainer(_options(tiny, model_dir, config=config, max_steps=at, checkpoint_every=at)).fit()
    second = Trainer(_options(tiny, model_dir, config=config, max_steps=end, resume=True))
    second.fit()
    return second


def test_learning_rate_schedules_drive_every_optimizer_and_resume_where_they_stopped(
    tiny_samples: Path, tmp_path: Path
) -> None:
    """tzrec schedules on both optimizers: the dense optimizer, the num_buckets tables and the
    dynamic tables take each step's rate (the train records show it), and a resumed run
    continues the schedule, so it ends where the uninterrupted one does."""
    text = SEED_CONFIG.read_text()
    text = text.replace(
        "constant_learning_rate {}",
        "manual_step_learning_rate { schedule_sizes: [2, 6] learning_rates: [0.05, 0.01] }",
        1,
    ).replace("constant_learning_rate {}", "cosine_annealing_learning_rate { T_max: 10 }")
    config = tmp_path / "scheduled.config"
    config.write_text(text)
    full = Trainer(_options(tiny_samples, tmp_path / "full", config=config, max_steps=10,
                            checkpoint_every=100))  # fmt: skip
    full.fit()
    sparse, dense = full.schedules["sparse"], full.schedules["dense"]
    assert full.optimizers["dense"].param_groups[0]["lr"] == dense.rate(9, 0) != 0.001
    last = sparse.rate(9, 0)
    assert last == pytest.approx(0.01)  # float32 config fields
    assert full.optimizers["sparse"].param_groups[0]["lr"] == last
    for storage in full.model.sparse.dynamic._storages:
        assert storage.adagrad.lr == last and float(storage.adagrad.rate) == pytest.approx(-last)
    records = [r for r in full.metrics.records if r["kind"] == "train"]
    assert records and all(
        r["sparse_lr"] == sparse.rate(r["step"] - 1, 0) and r["dense_lr"] == dense.rate(r["step"] - 1, 0)
        for r in records
    )  # fmt: skip
    second = _interrupted(tiny_samples, tmp_path / "resumed", config, at=5, end=10)
    a, b = full.model, second.model
    for (name, p), (_, q) in zip(
        a.dense.state_dict().items(), b.dense.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    for t in ("user_id_emb", "adgroup_id_emb"):
        torch.testing.assert_close(
            a.sparse.dynamic.export_table(t)[1], b.sparse.dynamic.export_table(t)[1], msg=t
        )


def _ema_config(tmp_path: Path, extra: str = "") -> Path:
    text = SEED_CONFIG.read_text().replace(
        "adam_optimizer { lr: 0.001 }", "adam_optimizer { lr: 0.001 }\nema { decay: 0.5 }", 1
    )
    path = tmp_path / f"ema{len(extra)}.config"
    path.write_text(text + extra)
    return path


def test_dense_ema_evaluates_checkpoints_resumes_and_exports(
    tiny_samples: Path, tmp_path: Path
) -> None:
    """With dense_optimizer.ema the final eval scores the averages, a checkpoint keeps them
    (a resumed run ends with the uninterrupted run's average), and a restored model takes
    them where export_config says so (by default), its trained values where it says not."""
    from shared.hashtable.checkpoint_io import CheckpointError
    from train.export import evaluate_checkpoint, restore_model

    config = _ema_config(tmp_path)
    full = Trainer(_options(tiny_samples, tmp_path / "full", config=config, max_steps=8,
                            checkpoint_every=100))  # fmt: skip
    result = full.fit()
    ema = full.dense_ema
    assert ema is not None and ema.updates == 8 and full.eval_with_ema
    averages = {n: a.detach().clone() for n, a in ema.averaged().items()}
    trained = {n: p.detach().clone() for n, p in full.model.dense.named_parameters()}
    assert any(not torch.equal(averages[n], trained[n]) for n in trained)
    assert result.final_eval is not None
    offline = evaluate_checkpoint(config, model_dir=tmp_path / "full", train_path=tiny_samples /
                                  "train", eval_path=tiny_samples / "eval")  # fmt: skip
    assert offline.auc == pytest.approx(result.final_eval.auc, abs=1e-6)
    full.eval_with_ema = False
    assert full.run_eval(None, 8).auc != pytest.approx(result.final_eval.auc, abs=1e-6)

    second = _interrupted(tiny_samples, tmp_path / "resumed", config, at=4, end=8)
    assert second.dense_ema is not None and second.dense_ema.updates == 8
    for n, a in second.dense_ema.averaged().items():
        torch.testing.assert_close(a, averages[n], rtol=1e-5, atol=1e-6, msg=n)

    exported, _, _ = restore_model(config, model_dir=tmp_path / "full")
    no_ema = _ema_config(tmp_path, "\nexport_config { use_dense_ema: false }\n")
    as_trained, _, _ = restore_model(no_ema, model_dir=tmp_path / "full")
    for n, p in exported.dense.named_parameters():
        assert torch.equal(p, averages[n]), n
    for n, p in as_trained.dense.named_parameters():
        assert torch.equal(p, trained[n]), n

    plain = Trainer(_options(tiny_samples, tmp_path / "plain", max_steps=2, checkpoint_every=100))
    plain.fit()
    with pytest.raises(CheckpointError, match="holds no dense EMA.*use_dense_ema: false"):
        restore_model(config, model_dir=tmp_path / "plain")


def _assert_same_models(a: MultiTowerDIN, b: MultiTowerDIN) -> None:
    """The same dense weights and dynamic tables (keys, values, scores, accumulators), bit for
    bit."""
    for (name, p), (_, q) in zip(
        a.dense.state_dict().items(), b.dense.state_dict().items(), strict=True
    ):
        assert torch.equal(p, q), name
    sa, sb = a.sparse.dynamic.table_states(), b.sparse.dynamic.table_states()
    for t, state in sa.items():
        for field in ("keys", "values", "scores", "accumulators"):
            assert torch.equal(getattr(state, field), getattr(sb[t], field)), (t, field)


def test_a_cached_run_equals_the_hbm_only_run(tiny_samples: Path, tmp_path: Path) -> None:
    """A device budget that caches every dynamic table (CACHING, rows over a host tier) changes
    where rows live, not the run: the same dense weights and tables, bit for bit on CPU, and
    the loop runs the next batch's row prefetch."""
    hbm = Trainer(_options(tiny_samples, tmp_path / "hbm", max_steps=6, checkpoint_every=100))
    hbm.fit()
    cached = Trainer(
        _options(
            tiny_samples,
            tmp_path / "cached",
            max_steps=6,
            checkpoint_every=100,
            hbm_budget_gib=0.08,
        )
    )
    result = cached.fit()
    assert not hbm.model.sparse.tiered and cached.model.sparse.tiered
    a, b = hbm.model, cached.model
    _assert_same_models(a, b)
    tiers = b.sparse.dynamic.tier_stats()
    assert {s["cache_lines"] > 0 for s in tiers.values()} == {True}
    assert sum(s["cache_hits"] for s in tiers.values()) > 0
    assert result.loop_times.seconds["row_prefetch"] > 0


# a tenth of the seed config's max capacities of the big tables (the cate table's 5000 stays:
# a max capacity below init_capacity_per_rank's 1024 is refused)
TENTH_CAPACITIES = {
    f"max_capacity: {n}\n": f"max_capacity: {n // 10}\n" for n in (300000, 250000, 150000, 100000)
}


@pytest.mark.parametrize("factor", ["0.0018", "0.5"])
def test_a_cached_run_through_the_static_sparse_step_equals_the_hbm_only_one(
    tiny_samples: Path, tmp_path: Path, factor: str
) -> None:
    """cache_load_factor 0.0018 on every dynamic table (under 200 lines, fewer than a step's 7168
    padded keys and than the rows the run stores) with the static sparse step on (eagerly on
    CPU, as cuda_graphs_for turns it on for CUDA): every step of the cached storage takes the
    static path (lines resolved with no host read, evictions, new keys' rows made in their
    lines, rows past the lines bypassed through staging slots), and the run equals HBM_ONLY's
    with the static step, bit for bit: dense weights, tables, eval AUC and rows. At 0.5 (more
    lines than a step's keys) with the static prefetch on (``--static-prefetch``) the loop's
    prefetch takes the static form (the next batch's stored rows brought into lines; on CUDA
    beside the step), with the same run."""
    # both runs' big tables at a tenth of the seed config's max capacities (the static step ranks
    # every bucket of a table reserved at its max: a step's CPU time follows the capacity), still
    # far above the rows 6 steps store; the cached one at 0.0018 of them: 180 lines in all, about
    # what 0.0002 of the seed's capacities gives
    configs = {
        name: write_config(
            SEED_CONFIG,
            tmp_path / f"{name}.config",
            train=tiny_samples / "train",
            eval_=tiny_samples / "eval",
            replace={**TENTH_CAPACITIES, **cache},
        )
        for name, cache in (
            ("hbm", {}),
            ("cached", {"max_capacity: ": f"cache_load_factor: {factor}\nmax_capacity: "}),
        )
    }
    runs = []
    for name, config in configs.items():
        trainer = Trainer(
            _options(tiny_samples, tmp_path / name, config, max_steps=6, checkpoint_every=100)
        )
        dynamic = trainer.model.sparse.dynamic
        # as cuda_graphs_for(static_prefetch=True) on CUDA where the run prefetches
        dynamic.use_static_step(capture=False, prefetch=factor == "0.5")
        dynamic.reserve_max_capacity()
        runs.append((trainer.fit(), trainer.model))
    (hbm, a), (cached, b) = runs
    assert not a.sparse.tiered and b.sparse.tiered
    for model in (a, b):
        for ran in model.sparse.dynamic.static_stats().values():
            assert {k: ran[k] for k in ("captures", "replays", "eager")} == {
                "captures": 0, "replays": 0, "eager": 6}  # fmt: skip
    tiers = b.sparse.dynamic.tier_stats()
    prefetches = [r["prefetches"] for r in b.sparse.dynamic.static_stats().values()]
    if factor == "0.0018":
        assert all(0 < s["cache_lines"] < 200 for s in tiers.values())  # ceil of each table's
        for counter in ("cache_hits", "cache_misses", "cache_created", "cache_evictions",
                        "cache_bypassed"):  # fmt: skip
            assert sum(s[counter] for s in tiers.values()) > 0, counter
        assert sum(prefetches) == 0  # steps past the lines: no prefetch beside them
    else:
        # after each step, the next batch's (the tiny data's 618 rows all fit the lines: the
        # prefetch finds them there; its reads are test_row_cache_static's)
        assert prefetches == [6]
        assert sum(s["cache_bypassed"] for s in tiers.values()) == 0
    _assert_same_models(a, b)
    assert hbm.final_eval is not None and cached.final_eval is not None
    assert cached.final_eval.auc == hbm.final_eval.auc
    assert cached.final_eval.rows == hbm.final_eval.rows


@pytest.mark.parametrize("threads", [3, 0])
def test_cache_row_threads_are_refused_off_the_cuda_static_step(
    tiny_samples: Path, tmp_path: Path, threads: int
) -> None:
    """Host threads that move cached rows belong to the CUDA static step: refused on the CPU
    (and below 1), naming the option, before any loader worker starts."""
    options = _options(tiny_samples, tmp_path / "run", max_steps=1, cache_row_threads=threads)
    with pytest.raises(ValueError, match=f"TrainOptions.cache_row_threads={threads}: host"):
        Trainer(options)


@pytest.mark.gpu
@pytest.mark.skipif(
    cuda_kernels.unavailable_reason() is not None or host_move.unavailable_reason() is not None,
    reason=f"needs the CUDA kernels ({cuda_kernels.unavailable_reason()}) and the native mover "
    f"({host_move.unavailable_reason()})",
)
def test_on_cuda_cached_rows_moved_by_the_hosts_threads_train_as_by_the_device(
    tiny_samples: Path, tmp_path: Path
) -> None:
    """``cache_row_threads`` (train --cache-row-threads): the cached tables' misses read by a
    host node and their write-backs written by the host's threads beside the step, in the
    captured static step of a CUDA run: the same run as the device's own reads and writes
    (rows are copied, never computed: dense weights and tables within the CUDA tolerances)."""
    config = write_config(
        SEED_CONFIG, tmp_path / "cached.config", train=tiny_samples / "train",
        eval_=tiny_samples / "eval",
        replace={**TENTH_CAPACITIES, "max_capacity: ": "cache_load_factor: 0.5\nmax_capacity: "},
    )  # fmt: skip
    models = []
    for threads in (None, 3):
        trainer = Trainer(_options(tiny_samples, tmp_path / f"t{threads}", config, max_steps=6,
                                   checkpoint_every=100, device="cuda",
                                   cache_row_threads=threads))  # fmt: skip
        trainer.fit()
        models.append(trainer.model)
        stats = trainer.model.sparse.dynamic.static_stats()
        assert all(r["replays"] > 0 for r in stats.values()), stats
    moved = [getattr(s.payload, "host_move_spent", dict)()
             for s in models[1].sparse.dynamic._storages]  # fmt: skip
    assert any(moved) and all(m["fill"][1] > 0 for m in moved if m), moved  # the host node ran
    assert models[0].sparse.tiered and models[1].sparse.tiered
    for (name, p), (_, q) in zip(models[0].dense.state_dict().items(),
                                 models[1].dense.state_dict().items(), strict=True):  # fmt: skip
        torch.testing.assert_close(p, q, msg=name)
    sa, sb = (m.sparse.dynamic.table_states() for m in models)
    for t, state in sa.items():  # by key: two CUDA runs may place keys in other slots
        ia, ib = torch.argsort(state.keys), torch.argsort(sb[t].keys)
        assert torch.equal(state.keys[ia], sb[t].keys[ib]), t
        torch.testing.assert_close(state.values[ia], sb[t].values[ib], msg=t)


@pytest.mark.parametrize("memory", ["driver", "huge"])
def test_host_memory_other_than_registered_is_refused_off_cuda(
    tiny_samples: Path, tmp_path: Path, memory: str
) -> None:
    """The CUDA driver's host memory (shared.hashtable.host_memory) needs a CUDA device, and an
    unknown kind is named; both before any loader worker starts."""
    options = _options(tiny_samples, tmp_path / "run", max_steps=1, host_memory=memory)
    with pytest.raises(ValueError, match=f"TrainOptions.host_memory='{memory}': give one of"):
        Trainer(options)
