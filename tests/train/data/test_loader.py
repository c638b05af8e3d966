"""The Parquet loader: batch sizes, coverage, seeded order, cheap resume, worker processes."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import pickle
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch

from shared.batch import Batch, byte_span
from shared.features import FeatureSet, feature_set_from_text
from shared.fg import FgStats
from train.data import synthetic, taobao
from train.data.in_order import file_rows
from train.data.loader import InOrderLoader, Loader, usable_workers
from train.data.memory import shared_buffer
from train.data.messages import Message, Packed

ROOT = Path(__file__).resolve().parents[3]
SEED_TEXT = (ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config").read_text()


@pytest.fixture(scope="module")
def fs() -> FeatureSet:
    return feature_set_from_text(SEED_TEXT, "seed")


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory, fs: FeatureSet) -> Path:
    out = tmp_path_factory.mktemp("loader")
    synthetic.generate("tiny", out, seed=0)
    # small files and row groups so that shuffling and workers have units to work with
    taobao.build_samples(out / "raw", out / "samples", fs, rows_per_part=1500, row_group_rows=300)
    return out / "samples"


def fingerprint(batches: list[Batch]) -> list[tuple[int, ...]]:
    """(user_id, adgroup_id) of every row, in order: identifies rows and their order."""
    out: list[tuple[int, ...]] = []
    for b in batches:
        users = b.user["user_id"].values().tolist()
        ads = b.item["adgroup_id"].values().tolist()
        out += list(zip(users, ads, strict=True))
    return out


def test_batches_cover_the_split_once_in_a_seeded_order(samples: Path, fs: FeatureSet) -> None:
    loader = Loader(samples / "train", fs, batch_size=512, seed=7, shuffle_rows=900)
    batches = list(loader.epoch(0))
    assert [b.batch_size for b in batches[:-1]] == [512] * (len(batches) - 1)
    assert 0 < batches[-1].batch_size <= 512 and len(batches) == loader.num_batches(0)
    rows = fingerprint(batches)
    assert len(rows) == loader.rows
    again = fingerprint(
        list(Loader(samples / "train", fs, batch_size=512, seed=7, shuffle_rows=900).epoch(0))
    )
    assert again == rows  # same seed and epoch: same order
    other_epoch = fingerprint(list(loader.epoch(1)))
    other_seed = fingerprint(
        list(Loader(samples / "train", fs, batch_size=512, seed=8, shuffle_rows=900).epoch(0))
    )
    assert sorted(other_epoch) == sorted(rows) and other_epoch != rows and other_seed != rows
    assert batches[0].labels is not None and batches[0].oracle is not None
    assert loader.stats.rows == 2 * loader.rows and loader.stats.missing["pvalue_level"] > 0


def test_eval_order_is_the_file_order(samples: Path, fs: FeatureSet) -> None:
    import pyarrow.parquet as pq

    loader = Loader(samples / "eval", fs, batch_size=256, shuffle=False)
    table = pq.read_table(samples / "eval", columns=["user_id", "adgroup_id"])
    want = list(
        zip(
            table.column("user_id").to_pylist(), table.column("adgroup_id").to_pylist(), strict=True
        )
    )
    assert fingerprint(list(loader.epoch(0))) == want


def test_unshuffled_batches_are_the_file_order_for_any_workers(
    samples: Path, fs: FeatureSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """shuffle=False: every worker count gives the same batches, tensor for tensor (and the same
    fg stats): the files' rows in order, cut into whole batches across row-group and file ends
    (files of 1500 rows, row groups of 300, batches of 256), only the last one short. Messages
    of two batches, so each worker reads several slices; windows of 600 rows, so that the old
    window-per-worker order would differ."""
    # 4 usable cores, so that 3 workers are 3 processes on a smaller host too (the clamp to the
    # cores is for speed; the order must not depend on it)
    import pyarrow.parquet as pq

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(4)))

    table = pq.read_table(samples / "train", columns=["user_id", "adgroup_id"])
    files = list(zip(table["user_id"].to_pylist(), table["adgroup_id"].to_pylist(), strict=True))
    assert len(list((samples / "train").glob("*.parquet"))) > 1

    def load(workers: int, skip: int = 0) -> tuple[list[Batch], FgStats]:
        loader = Loader(samples / "train", fs, batch_size=256, num_workers=workers, shuffle=False,
                        seed=3, shuffle_rows=600, message_rows=512, pin_memory=False)  # fmt: skip
        assert loader.num_workers == workers
        return list(loader.epoch(1, skip_batches=skip)), loader.stats

    one, stats = load(1)
    assert fingerprint(one) == files
    assert [b.batch_size for b in one] == [256] * (len(files) // 256) + [len(files) % 256]
    for workers in (0, 2, 3):
        got, got_stats = load(workers)
        assert len(got) == len(one) and got_stats.as_dict() == stats.as_dict(), workers
        for a, b in zip(got, one, strict=True):
            _assert_same_batch(a, b)
    for k in (1, 3, len(one) - 1, len(one)):  # resume: the rest of the same sequence
        assert fingerprint(load(3, skip=k)[0]) == fingerprint(one[k:]), k


def test_unshuffled_drop_last_drops_only_the_short_last_batch(
    samples: Path, fs: FeatureSet
) -> None:
    loader = Loader(samples / "train", fs, batch_size=256, num_workers=2, shuffle=False,
                    drop_last=True, message_rows=256)  # fmt: skip
    got = list(loader.epoch(0))
    assert [b.batch_size for b in got] == [256] * (loader.rows // 256) == loader.batch_rows(0)
    everything = list(Loader(samples / "train", fs, batch_size=256, shuffle=False).epoch(0))
    assert fingerprint(got) == fingerprint(everything)[: 256 * len(got)]


def test_file_rows_reads_a_head_of_the_last_group_as_its_whole(
    samples: Path, fs: FeatureSet
) -> None:
    """Rows across row groups (of 300) ending in a group's first half (streamed alone) or its
    second half (read whole): the same rows as a read of the whole file."""
    import pyarrow.parquet as pq

    path = sorted((samples / "train").glob("*.parquet"))[0]
    f, columns = pq.ParquetFile(path), fs.columns()
    whole = f.read(columns=columns, use_threads=False)
    for start, rows in ((0, 100), (250, 110), (250, 300), (599, 2), (10, 1100), (0, 1500)):
        got = file_rows(f, start, rows, columns)
        assert got.equals(whole.slice(start, rows)), (start, rows)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_skips_batches_cheaply_and_exactly(
    samples: Path, fs: FeatureSet, workers: int
) -> None:
    loader = Loader(
        samples / "train", fs, batch_size=256, num_workers=workers, seed=3, shuffle_rows=600
    )
    full = list(loader.epoch(2))
    assert len(full) == loader.num_batches(2)
    assert sorted(fingerprint(full)) == sorted(
        fingerprint(list(Loader(samples / "train", fs, batch_size=256).epoch(2)))
    )
    for k in (1, 5, len(full) - 1):
        rest = list(loader.epoch(2, skip_batches=k))
        assert fingerprint(rest) == fingerprint(full[k:]), k


def test_from_config_and_bad_inputs(samples: Path, fs: FeatureSet, tmp_path: Path) -> None:
    from shared.config import parse_config

    config = parse_config(SEED_TEXT.replace("data/small/samples", str(samples)))
    loader = Loader.from_config(config, fs, "eval", num_workers=0)
    assert loader.batch_size == 8192 and not loader.shuffle and not loader.pin_memory
    assert Loader.from_config(config, fs, "train", batch_size=64).shuffle
    config.data_config.shuffle = False  # honoured for training
    assert not Loader.from_config(config, fs, "train", batch_size=64).shuffle
    with pytest.raises(FileNotFoundError):
        Loader(tmp_path, fs, batch_size=8)
    other = feature_set_from_text(SEED_TEXT.replace('"occupation"', '"job"'))
    with pytest.raises(ValueError, match="job"):
        Loader(samples / "train", other, batch_size=8)
    with pytest.raises(ValueError, match="batch_size"):
        Loader(samples / "train", fs, batch_size=0)


def test_workers_are_clamped_to_the_cores_saying_so_once(
    samples: Path, fs: FeatureSet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="train.data.loader")

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "train.data.loader"]

    # values no other test asks for: each (asked, cores) is said once per process
    assert usable_workers(3, cores=4) == 3
    assert usable_workers(38, cores=2) == usable_workers(38, cores=2) == 2
    assert len(said()) == 1 and "num_workers 38" in said()[0] and "2 CPU cores" in said()[0]
    cores = len(os.sched_getaffinity(0))
    loader = Loader(samples / "train", fs, batch_size=256, num_workers=cores + 41)
    assert loader.num_workers == cores
    assert len(said()) == 2 and f"num_workers {cores + 41}" in said()[1]


@pytest.mark.parametrize("message_rows", [1, 3 * 256])
def test_message_size_changes_nothing_but_the_messages(
    samples: Path, fs: FeatureSet, message_rows: int
) -> None:
    def load(rows: int, skip: int = 0) -> list[Batch]:
        loader = Loader(
            samples / "train", fs, batch_size=256, num_workers=2, seed=3, shuffle_rows=600,
            message_rows=rows,
        )  # fmt: skip
        return list(loader.epoch(1, skip_batches=skip))

    want, got = load(10**9), load(message_rows)  # one message per stream, and several
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert len(a.tensors()) == len(b.tensors())
        for x, y in zip(a.tensors(), b.tensors(), strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y)
        assert a.user.keys() == b.user.keys() and a.sequence.stride() == b.sequence.stride()
        assert a.user.length_per_key() == b.user.length_per_key()
    assert fingerprint(load(message_rows, skip=5)) == fingerprint(want[5:])
    with pytest.raises(ValueError, match="message_rows"):
        Loader(samples / "train", fs, batch_size=8, message_rows=0)


def _assert_same_batch(got: Batch, want: Batch) -> None:
    """Every tensor equal (dtype, shape, values), every KJT's host metadata equal."""
    for a, b in zip(
        (got.user, got.item, got.sequence), (want.user, want.item, want.sequence), strict=True
    ):
        assert (a.keys(), a.stride()) == (b.keys(), b.stride())
        assert a.length_per_key_or_none() == b.length_per_key_or_none()
        assert a.offset_per_key_or_none() == b.offset_per_key_or_none()
        for x, y in zip(
            (a.lengths_or_none(), a.offsets_or_none(), a.weights_or_none()),
            (b.lengths_or_none(), b.offsets_or_none(), b.weights_or_none()),
            strict=True,
        ):
            assert (x is None) == (y is None)
    assert (got.labels is None, got.oracle is None) == (want.labels is None, want.oracle is None)
    assert got.rows_are_users == want.rows_are_users
    assert len(got.tensors()) == len(want.tensors())
    for x, y in zip(got.tensors(), want.tensors(), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def _some_batches(samples: Path, fs: FeatureSet) -> list[Batch]:
    """Three batches of the tiny samples, the last without labels and oracle."""
    loader = Loader(samples / "train", fs, batch_size=200, seed=1, pin_memory=False)
    batches = list(itertools.islice(loader.epoch(0), 3))
    return [*batches[:2], dataclasses.replace(batches[2], labels=None, oracle=None)]


def test_a_packed_message_unpickles_to_the_same_batches(samples: Path, fs: FeatureSet) -> None:
    """A worker's message (:class:`Packed`) through the DataLoader's pickler: the same batches,
    as views of one buffer (one byte range each, for the prefetcher's one copy); and the same
    from a copy of the buffer (how the pin-memory thread rebuilds them)."""
    batches = _some_batches(samples, fs)
    packed = Packed.of(batches, shared_buffer)
    received = pickle.loads(ForkingPickler.dumps(Message(packed, FgStats())))
    assert isinstance(received.batches, Packed) and len(received.batches.slots) == sum(
        len(b.tensors()) for b in batches
    )
    got = received.unpacked()
    storage = received.batches.buffer.untyped_storage().data_ptr()
    for b, want in zip(got, batches, strict=True):
        _assert_same_batch(b, want)
        span = byte_span(b)
        assert span is not None and span[0].data_ptr() == storage
    copied = Packed(packed.buffer.clone(), packed.layouts, packed.slots)
    for b, want in zip(copied.unpack(), batches, strict=True):
        _assert_same_batch(b, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned memory)")
def test_a_pinned_message_holds_the_same_batches_in_pinned_memory(
    samples: Path, fs: FeatureSet
) -> None:
    batches = _some_batches(samples, fs)
    pinned = Message(Packed.of(batches, shared_buffer), FgStats()).pin_memory()
    assert isinstance(pinned.batches, list)
    for b, want in zip(pinned.unpacked(), batches, strict=True):
        _assert_same_batch(b, want)
        assert all(t.is_pinned() for t in b.tensors())


@pytest.mark.parametrize("workers", [0, 3])
def test_in_order_slices_come_back_in_row_order_across_files(
    samples: Path, fs: FeatureSet, workers: int
) -> None:
    """Slices put while the loader runs (starting mid-file, ending in the next files) come back
    as batches in row order, each slice's last batch short: the rows of an unshuffled epoch."""
    import pyarrow.parquet as pq

    files = tuple((str(f), pq.ParquetFile(f).metadata.num_rows)
                  for f in sorted((samples / "train").glob("*.parquet")))  # fmt: skip
    everything = fingerprint(list(Loader(samples / "train", fs, batch_size=100, shuffle=False,
                                         num_workers=0).epoch(0)))  # fmt: skip
    loader = InOrderLoader(fs, batch_size=100, num_workers=workers, message_rows=300)
    try:
        pieces = [*loader.slices(files, 250, 1400), *loader.slices(files, 1650, 401)]
        assert [(p.start, p.rows) for p in pieces][:2] == [(250, 300), (550, 300)]
        assert (pieces[-1].start, pieces[-1].batch_rows()) == (1950, [100, 1])
        for piece in pieces:
            loader.put(piece)
        batches = loader.batches()
        got = [next(batches) for _ in range(sum(len(p.batch_rows()) for p in pieces))]
    finally:
        loader.close()
    assert [b.batch_size for b in got][-3:] == [100, 100, 1]
    assert fingerprint(got) == everything[250:2051]
