"""The device prefetcher and the one-buffer batches it copies at once (shared.batch.pack)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shared.batch import Batch, byte_span, pack, rebase
from shared.features import FeatureSet
from train.data.loader import Loader
from train.data.prefetch import prefetch_to_device, to_device

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _batches(tiny_samples: Path, fs: FeatureSet, **options: object) -> list[Batch]:
    loader = Loader(tiny_samples / "train", fs, batch_size=300, seed=1, **options)  # type: ignore[arg-type]
    return list(loader.epoch(0))


def assert_same(a: Batch, b: Batch) -> None:
    """Equal tensors (dtype, shape, values) and equal host metadata."""
    assert len(a.tensors()) == len(b.tensors())
    for x, y in zip(a.tensors(), b.tensors(), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.cpu(), y.cpu())
    for k1, k2 in ((a.user, b.user), (a.item, b.item), (a.sequence, b.sequence)):
        assert k1.keys() == k2.keys() and k1.stride() == k2.stride()
        assert k1.length_per_key() == k2.length_per_key()
    assert a.rows_are_users == b.rows_are_users


def test_cpu_is_a_pass_through_of_the_same_objects(tiny_samples: Path, seed_fs: FeatureSet) -> None:
    batches = _batches(tiny_samples, seed_fs, pin_memory=False)
    out = list(prefetch_to_device(iter(batches), torch.device("cpu")))
    assert len(out) == len(batches) and all(o is b for o, b in zip(out, batches, strict=True))
    assert list(prefetch_to_device([], torch.device("cpu"))) == []


def test_pack_and_rebase_keep_every_tensor(tiny_samples: Path, seed_fs: FeatureSet) -> None:
    batches = _batches(tiny_samples, seed_fs, pin_memory=False)[:3]
    packed = pack(batches, lambda n: torch.empty(n, dtype=torch.uint8))
    spans = [byte_span(b) for b in packed]
    assert all(s is not None for s in spans) and byte_span(batches[0]) is None  # fg: many
    storage = packed[0].user_index.untyped_storage()
    for b, p, span in zip(batches, packed, spans, strict=True):
        assert_same(p, b)
        assert span is not None and span[0].data_ptr() == storage.data_ptr()
        _, first, end = span
        assert first % 64 == 0 and end - first <= sum(t.nbytes + 64 for t in b.tensors())
        # one copy of the span, the batch as views of it: what the prefetcher does on CUDA
        home = torch.empty(0, dtype=torch.uint8).set_(storage, first, (end - first,), (1,))
        moved = rebase(p, home.clone(), first)
        assert_same(moved, b)
        assert {t.untyped_storage().data_ptr() for t in moved.tensors()} == {
            moved.user_index.untyped_storage().data_ptr()
        }
    with pytest.raises(ValueError, match="1-D uint8"):
        pack(batches, lambda n: torch.empty(n, dtype=torch.int64))


def test_loader_batches_of_workers_are_packed(tiny_samples: Path, seed_fs: FeatureSet) -> None:
    """Workers send each message's batches in one buffer; the main process's own are as fg
    made them (no copy): same tensors either way."""
    own = _batches(tiny_samples, seed_fs, pin_memory=False, num_workers=0)
    sent = _batches(tiny_samples, seed_fs, pin_memory=False, num_workers=1)
    assert len(own) == len(sent)
    for a, b in zip(own, sent, strict=True):
        assert_same(a, b)
        assert byte_span(b) is not None


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("workers", [0, 2])
def test_device_batches_equal_batch_to(
    tiny_samples: Path, seed_fs: FeatureSet, workers: int
) -> None:
    """Pinned loader batches (packed: one copy each) and unpacked ones (a copy per tensor) reach
    the device equal to ``Batch.to``."""
    device = torch.device("cuda")
    pinned = _batches(tiny_samples, seed_fs, pin_memory=True, num_workers=workers)
    assert all(b.user_index.is_pinned() and byte_span(b) is not None for b in pinned)
    plain = _batches(tiny_samples, seed_fs, pin_memory=False, num_workers=0)
    for one_copy in (True, False):
        out = list(prefetch_to_device(iter(pinned), device, one_copy=one_copy))
        assert len(out) == len(plain)
        for got, want in zip(out, plain, strict=True):
            assert all(t.device.type == "cuda" for t in got.tensors())
            assert_same(got, want.to(device))
            storages = {t.untyped_storage().data_ptr() for t in got.tensors()}
            assert (len(storages) == 1) == one_copy
    unpinned = list(prefetch_to_device(iter(plain), device))
    for got, want in zip(unpinned, plain, strict=True):
        assert_same(got, want)


@pytest.mark.gpu
@cuda
def test_consumer_stream_sees_the_copied_batch(tiny_samples: Path, seed_fs: FeatureSet) -> None:
    """Work on another stream than the copies' reads each batch complete: it waits for the
    copy's event, and memory freed early is not reused under it (record_stream)."""
    device = torch.device("cuda")
    pinned = _batches(tiny_samples, seed_fs, pin_memory=True, num_workers=0) * 4

    def sums(b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 sums wrap the same in any order; labels are 0/1: exact."""
        assert b.labels is not None
        return b.item.values().sum(), b.labels.double().sum()

    want = [tuple(float(x) for x in sums(b)) for b in pinned]
    compute = torch.cuda.Stream(device)
    got: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.cuda.stream(compute):
        for batch in prefetch_to_device(iter(pinned), device):
            torch.cuda._sleep(2_000_000)  # a long kernel ahead of the reads, on `compute`
            got.append(sums(batch))
            del batch  # freed while `compute` still has work queued on it
    compute.synchronize()
    assert [tuple(float(x) for x in g) for g in got] == want
    moved = to_device(pinned[0], device)
    assert_same(moved, pinned[0])


def test_ahead_keeps_the_order_and_raises_where_the_producer_failed() -> None:
    from train.data.prefetch import ahead

    assert list(ahead(iter(range(50)), 2)) == list(range(50))
    assert list(ahead(iter([]), 1)) == []

    def failing() -> Iterator[int]:
        yield 1
        yield 2
        raise ValueError("columns missing")

    got: list[int] = []
    with pytest.raises(ValueError, match="columns missing"):
        for x in ahead(failing(), 3):
            got.append(x)
    assert got == [1, 2]  # every item before the error, then the error itself


def test_ahead_stops_its_producer_when_the_caller_stops() -> None:
    from train.data.prefetch import ahead

    finished = threading.Event()
    produced: list[int] = []

    def endless() -> Iterator[int]:
        try:
            i = 0
            while True:
                produced.append(i)
                yield i
                i += 1
        finally:
            finished.set()  # the producer let go of it

    items = ahead(endless(), 2, name="feeder-under-test")
    assert [next(items) for _ in range(5)] == [0, 1, 2, 3, 4]
    items.close()
    # the close waited for the thread: none is left to die inside torch at the interpreter's exit
    assert finished.is_set(), "the producer thread did not stop"
    assert "feeder-under-test" not in [t.name for t in threading.enumerate()]
    assert produced[:5] == [0, 1, 2, 3, 4] and len(produced) <= 5 + 2 + 1
