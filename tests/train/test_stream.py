"""Online training (train.stream): the partition source, the row log, exactly once across
kill -9, SIGTERM, eviction over a long stream, publishing."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from shared.batch import Batch
from tests.conftest import DEVICES, SEED_CONFIG, write_config
from tests.train.stream_data import (
    records,
    split,
    start_stream,
    train_rows,
    wait_for,
    write_partition,
)
from train.checkpoint import latest_checkpoint, list_checkpoints
from train.data.loader import InOrderLoader
from train.stream.publish import Publisher, PublishOptions
from train.stream.row_log import RowLog
from train.stream.source import PartitionSource, Piece, Position, Span, StreamReader
from train.stream.trainer import StreamOptions, StreamTrainer


def _progress(ckpt: Path) -> dict:
    import torch

    return torch.load(ckpt / "dense.pt", map_location="cpu", weights_only=False)["progress"]


def _read_all(reader: StreamReader) -> list[tuple[Span, Batch]]:
    out = []
    batches = reader.batches()
    while reader.plan():
        batch = next(batches)
        out.append((reader.take(), batch))
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_source_reads_complete_partitions_in_order(
    tiny_samples: Path, tmp_path: Path, workers: int
) -> None:
    """Batches in partition then row order through the loader's workers (slices of 2 batches
    handed to them in turn), each batch's span exact (across a partition's end), a restart
    mid-partition reads on there."""
    from shared.config import load_config
    from shared.features import build_feature_set
    from shared.fg import table_to_batch

    fs = build_feature_set(load_config(SEED_CONFIG))
    rows = train_rows(tiny_samples).slice(0, 500)
    write_partition(tmp_path, "p1", rows.slice(0, 300), event_time=200)
    write_partition(tmp_path, "p0", rows.slice(300, 150), event_time=100)
    (tmp_path / "p2").mkdir()  # no _SUCCESS yet: not read
    source = PartitionSource(tmp_path)
    assert source.partitions() == ["p0", "p1"]
    assert source.pending_rows(Position()) == 450

    def reader(pos: Position) -> StreamReader:
        loader = InOrderLoader(fs, batch_size=64, num_workers=workers, message_rows=128)
        return StreamReader(source, loader, pos, ahead_slices=2)

    first = reader(Position())
    try:
        seen = _read_all(first)
    finally:
        first.close()
    # a batch goes on into the next partition: rows k*64 .. of p0 (150 rows) then p1 (300 rows)
    spans = [[(p.partition, p.start, p.end) for p in s.pieces] for s, _ in seen]
    assert spans[:3] == [[("p0", 0, 64)], [("p0", 64, 128)], [("p0", 128, 150), ("p1", 0, 42)]]
    assert spans[3:] == [[("p1", a, min(a + 64, 300))] for a in range(42, 300, 64)]
    assert [s.event_time for s, _ in seen] == [100, 100] + [200] * 6
    ordered = pa.concat_tables([rows.slice(300, 150), rows.slice(0, 300)])
    start = 0
    for span, batch in seen:  # each batch is its span's rows, as batch training builds them
        want = table_to_batch(fs, ordered.slice(start, span.rows))
        assert torch.equal(batch.item.values(), want.item.values()), span
        assert torch.equal(batch.labels, want.labels), span
        start += span.rows
    assert source.pending_rows(Position("p1", 300)) == 0
    again = reader(Position("p1", 256))  # a restart: the rows of p1 from 256 on, in file order
    try:
        rest = _read_all(again)
    finally:
        again.close()
    assert [s.pieces for s, _ in rest] == [(Piece("p1", 256, 300),)]
    assert rest[0][1].labels.tolist() == rows.slice(256, 44)["clk"].to_pylist()
    changed = reader(Position("p0", 151))
    try:
        with pytest.raises(ValueError, match="a complete partition changed"):
            changed.plan()
    finally:
        changed.close()


def test_row_log_cuts_uncommitted_steps(tmp_path: Path) -> None:
    log = RowLog(tmp_path / "rows.jsonl", 0)
    for step in (1, 2, 3):
        log.add(step, Span((Piece("p0", 10 * (step - 1), 10 * step),), 0))
    log.flush()
    log.close()
    with (tmp_path / "rows.jsonl").open("a") as f:
        f.write('{"step": 4, "partit')  # torn by a kill
    RowLog(tmp_path / "rows.jsonl", 2).close()  # restored at step 2
    assert RowLog.read(tmp_path / "rows.jsonl") == [("p0", 0, 10), ("p0", 10, 20)]


def _covered(rows_log: Path) -> dict[str, list[tuple[int, int]]]:
    by: dict[str, list[tuple[int, int]]] = {}
    for partition, start, end in RowLog.read(rows_log):
        by.setdefault(partition, []).append((start, end))
    return by


def _running(model_dir: Path) -> list[int]:
    """Pids of the live processes whose command line names ``model_dir`` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(model_dir).encode() in cmdline and state != "Z":
            out.append(int(entry.name))
    return out


def test_kill9_and_restart_train_every_row_once(tiny_samples: Path, tmp_path: Path) -> None:
    """Killed at random points twice, restarted: the committed state holds each row once."""
    seed = int(os.environ.get("STREAM_KILL_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    source, model_dir = tmp_path / "src", tmp_path / "model"
    parts = split(train_rows(tiny_samples), 4)
    for i, part in enumerate(parts):
        write_partition(source, f"p{i:04d}", part)
    total = sum(p.num_rows for p in parts)
    args = ("--checkpoint-every", "2", "--row-log", str(tmp_path / "rows.jsonl"))
    for run in range(2):
        proc = start_stream(source, model_dir, *args)
        wait_for("a checkpoint", lambda n=run: len(list_checkpoints(model_dir)) > n, 60, proc)
        time.sleep(rng.uniform(0.0, 1.5))  # a random point: in a step, a checkpoint, a poll
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # its loader workers (forked: the same command line) die with it
        wait_for("the killed trainer's workers ended", lambda: not _running(model_dir), 30)
    proc = start_stream(source, model_dir, *args, "--idle-exit-s", "0.5")
    assert proc.wait(timeout=90) == 0, f"seed {seed}"
    progress = _progress(latest_checkpoint(model_dir))  # type: ignore[arg-type]
    assert progress["samples"] == total, f"seed {seed}"
    assert (progress["source_partition"], progress["source_row"]) == ("p0003", parts[3].num_rows)
    covered = _covered(tmp_path / "rows.jsonl")
    for i, part in enumerate(parts):  # contiguous ranges from 0 to the end: each row once
        ranges = covered[f"p{i:04d}"]
        assert ranges[0][0] == 0 and ranges[-1][1] == part.num_rows, f"seed {seed}"
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), seed
    assert sum(e - s for r in covered.values() for s, e in r) == total


def test_sigterm_finishes_the_step_checkpoints_and_exits_0(
    tiny_samples: Path, tmp_path: Path
) -> None:
    source, model_dir = tmp_path / "src", tmp_path / "model"
    write_partition(source, "p0000", train_rows(tiny_samples).slice(0, 600))
    proc = start_stream(source, model_dir, "--checkpoint-every", "1000")
    wait_for("idle", lambda: any(r["lag_rows"] == 0 for r in records(model_dir, "stream")),
             60, proc)  # fmt: skip
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    progress = _progress(latest_checkpoint(model_dir))  # type: ignore[arg-type]
    assert (progress["step"], progress["samples"], progress["source_row"]) == (3, 600, 600)
    assert progress["event_time"] > 0


@pytest.mark.parametrize("strategy", ["STEP", "TIMESTAMP"])
def test_tables_stay_within_max_capacity_on_a_long_stream(
    tiny_samples: Path, tmp_path: Path, strategy: str
) -> None:
    """user_id capped at 256 keys (2 buckets) over 3 passes of the rows: the lowest score of a
    full bucket is evicted (STEP and TIMESTAMP scores age with the stream), the table never
    grows past its max_capacity. (Its own storage: the seed config's LFU tables are fused, and
    a fused storage holds the sum of its tables' max_capacity.)"""
    old = (
        'max_capacity: 300000\ninitializer_args { mode: "NORMAL"; std_dev: 0.05 }\n'
        'score_strategy: "LFU"\ninit_capacity_per_rank: 1024'
    )
    new = (
        f'max_capacity: 256\ninitializer_args {{ mode: "NORMAL"; std_dev: 0.05 }}\n'
        f'score_strategy: "{strategy}"\ninit_capacity_per_rank: 256'
    )
    config = write_config(SEED_CONFIG, tmp_path / "small.config",
                          train=tiny_samples / "train", eval_=tiny_samples / "eval",
                          replace={old: new})  # fmt: skip
    rows = train_rows(tiny_samples)
    for i in range(3):
        write_partition(tmp_path / "src", f"p{i}", rows)
    trainer = StreamTrainer(StreamOptions(config_path=config, source=tmp_path / "src",
                                          model_dir=tmp_path / "m", batch_size=512,
                                          idle_exit_s=0.0, log_every_s=1e9))  # fmt: skip
    result = trainer.run()
    assert result.progress.samples == 3 * rows.num_rows
    stats = trainer.model.sparse.dynamic.stats()["user_id_emb"]
    assert stats["size"] <= 256 and stats["evictions"] > 0, stats


def test_publisher_full_then_deltas_then_full(tiny_samples: Path, tmp_path: Path) -> None:
    """Full bundle, K deltas against it (event time in each), then a new full bundle, over four
    runs of the trainer that each train one new partition and publish at the end: each run's
    publisher reads the state back from the root."""
    from shared.bundle import read_bundle
    from shared.delta_reader import read_delta

    rows = train_rows(tiny_samples).slice(0, 1024)
    pub = PublishOptions(root=tmp_path / "pub", every_steps=1, full_every=2)
    for i, part in enumerate(split(rows, 4)):
        write_partition(tmp_path / "src", f"p{i}", part, event_time=1000 + i)
        trainer = StreamTrainer(StreamOptions(config_path=SEED_CONFIG, source=tmp_path / "src",
                                              model_dir=tmp_path / "m", batch_size=256,
                                              idle_exit_s=0.0, log_every_s=1e9, num_workers=0,
                                              publish=pub))  # fmt: skip
        result = trainer.run()
        assert (result.progress.step, result.publishes) == (i + 1, 1)
    full = read_bundle(tmp_path / "pub" / "full" / "step-1", verify_checksums=False)
    assert full.manifest["extra"]["event_time"] == 1000
    deltas = sorted((tmp_path / "pub" / "deltas" / "step-1").iterdir())
    assert [d.name for d in deltas] == ["step-2", "step-3"]
    assert [read_delta(d).event_time for d in deltas] == [1001, 1002]
    assert (tmp_path / "pub" / "full" / "step-4" / "manifest.json").is_file()
    again = Publisher(SEED_CONFIG, pub)
    assert again.last_step == 4 and not again.due(4, time.monotonic())
    published = [r["version"] for r in records(tmp_path / "m", "publish")]
    assert published == ["step-1", "step-1+step-2", "step-1+step-3", "step-4"]
    assert json.loads((deltas[0] / "manifest.json").read_text())["event_time"] == 1001


@pytest.mark.parametrize("device", DEVICES)
def test_the_stream_trains_every_row_through_workers_and_prefetch(
    tiny_samples: Path, tmp_path: Path, device: str
) -> None:
    """Three partitions through 2 loader workers (on CUDA: pinned, prefetched, CUDA graphs):
    every row once, batches whole across partition ends but the last, the position at the end;
    on CUDA the dense step replays its graph."""
    rows = train_rows(tiny_samples)
    parts = split(rows, 3)
    for i, part in enumerate(parts):
        write_partition(tmp_path / "src", f"p{i}", part)
    trainer = StreamTrainer(StreamOptions(config_path=SEED_CONFIG, source=tmp_path / "src",
                                          model_dir=tmp_path / "m", batch_size=256, device=device,
                                          num_workers=2, idle_exit_s=0.0, log_every_s=1e9,
                                          row_log=tmp_path / "rows.jsonl"))  # fmt: skip
    result = trainer.run()
    p = result.progress
    assert (p.samples, p.step) == (rows.num_rows, -(-rows.num_rows // 256))
    assert (p.source_partition, p.source_row) == ("p2", parts[2].num_rows)
    logged = RowLog.read(tmp_path / "rows.jsonl")
    assert sum(end - start for _, start, end in logged) == rows.num_rows
    if device == "cuda":
        assert trainer.graphs is not None and trainer.graphs.stats["replays"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_the_stream_trains_as_the_batch_trainer_on_its_rows_in_its_order(
    tiny_samples: Path, tmp_path: Path, device: str
) -> None:
    """Complete partitions through the stream (2 loader workers; whole batches across
    partition ends) and through the batch trainer on the same files in the same order (a
    config copy with shuffle off, one loader worker) at the same batch size: the same steps
    and rows, and the same model: on the CPU to the bit, on CUDA within the float sums'
    order. What bench_stream's replay_abs_auc_diff goal rests on (issue #55)."""
    from google.protobuf import text_format

    from shared.config import load_config
    from train.export import evaluate_checkpoint
    from train.trainer import Trainer, TrainOptions

    links = tmp_path / "in_order"
    links.mkdir()
    for i, part in enumerate(split(train_rows(tiny_samples), 3)):
        folder = write_partition(tmp_path / "src", f"p{i}", part, event_time=1000 + i)
        (links / f"p{i}.parquet").symlink_to(folder / "part-00000.parquet")
    config = load_config(SEED_CONFIG)
    config.data_config.shuffle = False
    (tmp_path / "in_order.config").write_text(text_format.MessageToString(config))
    stream = StreamTrainer(StreamOptions(config_path=SEED_CONFIG, source=tmp_path / "src",
                                         model_dir=tmp_path / "s", batch_size=256, device=device,
                                         num_workers=2, idle_exit_s=0.0,
                                         log_every_s=1e9)).run()  # fmt: skip
    batch = Trainer(TrainOptions(config_path=tmp_path / "in_order.config", model_dir=tmp_path / "b",
                                 train_path=links, eval_path=tiny_samples / "eval", device=device,
                                 batch_size=256, num_workers=1, progress_bar=False)).fit()  # fmt: skip
    assert (stream.progress.step, stream.progress.samples) == (
        batch.progress.step,
        batch.progress.samples,
    )
    assert stream.checkpoint is not None and batch.final_eval is not None
    streamed = evaluate_checkpoint(SEED_CONFIG, checkpoint=stream.checkpoint, train_path=links,
                                   eval_path=tiny_samples / "eval", device=device)  # fmt: skip
    if device == "cpu":
        assert (streamed.auc, streamed.logloss) == (batch.final_eval.auc, batch.final_eval.logloss)
        saved = [torch.load(c / "dense.pt", map_location="cpu", weights_only=False)
                 for c in (stream.checkpoint, batch.checkpoint)]  # fmt: skip
        for part in ("dense", "dense_tables"):
            a, b = saved[0][part], saved[1][part]
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    else:
        assert abs(streamed.auc - batch.final_eval.auc) <= 5e-4


def test_the_export_process_dies_with_the_trainer(tmp_path: Path) -> None:
    """kill -9 of the trainer's process ends its export process too, in the middle of a job
    (no publish written by an orphan after a restart)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from train.stream.publish import Publisher, PublishOptions\n"
        f"p = Publisher(Path({str(SEED_CONFIG)!r}), PublishOptions(root=Path({str(tmp_path)!r}),"
        " every_s=1.0))\n"
        "p._process.submit(int).result()\n"
        "p._process.submit(time.sleep, 120)\n"  # busy, as in an export, when the kill comes
        "print(*p._process._processes, flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        os.kill(child, 0)  # alive
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def gone() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for("the export process ended", gone, 30)
