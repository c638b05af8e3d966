"""ModelManager over a watched directory, with a fake loader: no bundles, no threads, no sleeps.

A "bundle" here is a directory holding the files of :data:`FILES`; the fake loader refuses one
that misses any. Every file gets an explicit mtime (``os.utime`` in ns), so stamps change only
when a test changes them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from serve.versions import REASON_CHARS, ModelManager, Refusal

FILES = ("manifest.json", "fg.json", "dense.pt2", "model-00001-of-00001.safetensors")
NS = 1_700_000_000_000_000_000  # an mtime in ns; tests add to it to "touch" a file


@dataclass(frozen=True)
class Stub:
    version: str


class FakeLoader:
    """Loads a directory that has every file of FILES; records each attempt."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, path: Path) -> Stub:
        self.calls.append(path.name)
        missing = [f for f in FILES if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(f"incomplete bundle {path}: missing {', '.join(missing)}")
        return Stub(path.name)


def _write(path: Path, data: bytes = b"x", ns: int = NS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.utime(path, ns=(ns, ns))


def _bundle(model_dir: Path, version: str, files: tuple[str, ...] = FILES) -> Path:
    for name in files:
        _write(model_dir / version / name)
    return model_dir / version


@pytest.fixture
def loader() -> FakeLoader:
    return FakeLoader()


@pytest.fixture
def manager(loader: FakeLoader) -> ModelManager[Stub]:
    return ModelManager(loader)


def _serving(manager: ModelManager[Stub]) -> str | None:
    return None if manager.current is None else manager.current.version


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_initial_poll_loads_highest_version_at_once(
    tmp_path: Path, manager: ModelManager[Stub], loader: FakeLoader
) -> None:
    for version in ("2", "10", "9"):
        _bundle(tmp_path, version)
    _bundle(tmp_path, ".11.tmp")  # hidden: a writer's temp dir
    _bundle(tmp_path, "12", files=FILES[1:])  # no manifest yet: not a version
    assert manager.poll(tmp_path)
    assert _serving(manager) == "10" and loader.calls == ["10"]
    assert manager.ready.is_set() and manager.last_refusal is None and manager.refusals == 0
    assert not manager.poll(tmp_path) and loader.calls == ["10"]


def test_refusal_records_version_and_reason(
    tmp_path: Path, loader: FakeLoader, caplog: pytest.LogCaptureFixture
) -> None:
    refused: list[tuple[Path, Exception]] = []
    manager = ModelManager(loader, on_refused=lambda p, e: refused.append((p, e)))
    _bundle(tmp_path, "1")
    v2 = _bundle(tmp_path, "2", files=FILES[:1])
    before = time.time()
    with caplog.at_level(logging.INFO, logger="serve.versions"):
        assert manager.poll(tmp_path)
    assert _serving(manager) == "1" and loader.calls == ["2", "1"]
    refusal = manager.last_refusal
    assert isinstance(refusal, Refusal) and (refusal.version, refusal.path) == ("2", v2)
    assert "missing fg.json, dense.pt2" in refusal.reason
    assert before <= refusal.at_unix <= time.time()
    assert manager.refusals == 1 and [p for p, _ in refused] == [v2]
    [error] = _messages(caplog, logging.ERROR)
    assert "refused model 2 from" in error and "missing fg.json" in error
    assert _messages(caplog, logging.INFO) == [
        f"serving model 1 from {tmp_path / '1'} (previous: None)"
    ]


def test_refusal_reason_is_one_line_and_bounded(tmp_path: Path) -> None:
    def loader(path: Path) -> Stub:
        raise ValueError("first line\n  second line\n" + "y" * 2000)

    manager = ModelManager(loader)
    assert not manager.load(_bundle(tmp_path, "7"))
    refusal = manager.last_refusal
    assert refusal is not None and refusal.version == "7"
    assert refusal.reason.startswith("first line second line yyy")
    assert "\n" not in refusal.reason and len(refusal.reason) <= REASON_CHARS


def test_refused_unchanged_dir_is_not_retried(
    tmp_path: Path, manager: ModelManager[Stub], loader: FakeLoader
) -> None:
    _bundle(tmp_path, "1")
    _bundle(tmp_path, "2", files=FILES[:2])
    assert manager.poll(tmp_path) and loader.calls == ["2", "1"]
    for _ in range(3):
        assert not manager.poll(tmp_path)
    assert loader.calls == ["2", "1"] and manager.refusals == 1 and _serving(manager) == "1"


def test_manifest_first_copy_is_refused_then_loaded_once_complete_and_stable(
    tmp_path: Path,
    manager: ModelManager[Stub],
    loader: FakeLoader,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _bundle(tmp_path, "1")
    assert manager.poll(tmp_path)
    _bundle(tmp_path, "2", files=FILES[:1])  # the copy has landed the manifest only
    with caplog.at_level(logging.INFO, logger="serve.versions"):
        assert not manager.poll(tmp_path) and loader.calls == ["1"]  # new: wait a poll
        assert not manager.poll(tmp_path) and loader.calls == ["1", "2"]  # stalled: refused
        assert manager.last_refusal is not None and manager.last_refusal.version == "2"
        assert not manager.poll(tmp_path) and loader.calls == ["1", "2"]  # unchanged
        _bundle(tmp_path, "2", files=FILES[1:])  # the rest lands
        assert not manager.poll(tmp_path) and loader.calls == ["1", "2"]  # changed: wait
        assert manager.poll(tmp_path) and loader.calls == ["1", "2", "2"]  # stable: retried
    assert _serving(manager) == "2" and manager.refusals == 1
    retry, served = _messages(caplog, logging.INFO)
    assert retry.startswith("retrying refused model 2 from")
    assert served == f"serving model 2 from {tmp_path / '2'} (previous: 1)"
    assert not manager.poll(tmp_path) and loader.calls == ["1", "2", "2"]


def test_refused_dir_changing_on_every_poll_is_not_retried_until_it_stops(
    tmp_path: Path, manager: ModelManager[Stub], loader: FakeLoader
) -> None:
    _bundle(tmp_path, "1")
    _bundle(tmp_path, "2", files=FILES[:1])
    assert manager.poll(tmp_path) and loader.calls == ["2", "1"]  # startup: refused at once
    shard = tmp_path / "2" / FILES[-1]
    for step in range(1, 4):  # a shard still being written: its size grows on every poll
        _write(shard, b"x" * step)
        assert not manager.poll(tmp_path) and loader.calls == ["2", "1"]
    _bundle(tmp_path, "2", files=FILES[1:-1])
    assert not manager.poll(tmp_path)
    assert manager.poll(tmp_path) and _serving(manager) == "2"


def test_new_dir_still_changing_is_not_loaded_until_stable(
    tmp_path: Path, manager: ModelManager[Stub], loader: FakeLoader
) -> None:
    _bundle(tmp_path, "1")
    assert manager.poll(tmp_path)
    v2 = _bundle(tmp_path, "2")
    assert not manager.poll(tmp_path)  # new
    os.utime(v2 / "dense.pt2", ns=(NS + 1, NS + 1))
    assert not manager.poll(tmp_path)  # a file's mtime moved
    _write(v2 / "extra" / "notes.txt")
    assert not manager.poll(tmp_path)  # a file appeared in a subdirectory
    assert loader.calls == ["1"] and _serving(manager) == "1"
    assert manager.poll(tmp_path) and loader.calls == ["1", "2"] and _serving(manager) == "2"


def test_serving_version_rewritten_in_place_reloads_once_stable(
    tmp_path: Path, manager: ModelManager[Stub], loader: FakeLoader
) -> None:
    _bundle(tmp_path, "1")
    v2 = _bundle(tmp_path, "2")
    assert manager.poll(tmp_path) and loader.calls == ["2"]
    _write(v2 / "dense.pt2", b"new program")
    assert not manager.poll(tmp_path)  # being rewritten: keep serving it, do not fall back to 1
    assert manager.poll(tmp_path) and loader.calls == ["2", "2"] and _serving(manager) == "2"


class Retiring:
    """A model that refers to itself (as a CUDA model and its graphs do) until retired."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.cycle: object = self

    def retire(self) -> None:
        self.cycle = None


def test_a_replaced_model_is_held_then_retired_and_freed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc
    import threading
    import weakref

    import serve.versions

    monkeypatch.setattr(serve.versions, "RETIRE_AFTER_S", 0.2)
    retired: list[str] = []
    done = threading.Event()

    def on_retired(model: Retiring) -> None:
        retired.append(model.version)
        model.retire()
        done.set()

    manager = ModelManager(lambda p: Retiring(p.name), on_retired=on_retired)
    assert manager.load(_bundle(tmp_path, "1"))
    first = weakref.ref(manager.current)
    gc.disable()  # freed by its reference count once retired, not by a collection
    try:
        assert manager.load(_bundle(tmp_path, "2"))
        assert first() is not None and not retired  # held: requests may still run on it
        assert done.wait(5)
        time.sleep(0.05)  # the timer thread returns from the retirement
        assert retired == ["1"] and first() is None
        assert manager.load(_bundle(tmp_path, "3"))  # stop() retires at once what waits
        manager.stop()
        assert retired == ["1", "2"]
    finally:
        gc.enable()
