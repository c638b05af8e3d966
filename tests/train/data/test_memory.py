"""Worker memory helpers: they change no byte, only where pages come from."""

from __future__ import annotations

import sys

import torch

from train.data.memory import keep_freed_memory, populate, shared_buffer


def test_shared_buffer_is_a_whole_writable_uint8_buffer() -> None:
    buffer = shared_buffer(3 * 4096 + 5)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 3 * 4096 + 5
    assert buffer.storage_offset() == 0 and buffer.untyped_storage().is_shared()
    buffer.fill_(7)
    assert int(buffer.sum()) == 7 * buffer.numel()


def test_malloc_and_madvise_work_on_linux() -> None:
    on_linux = sys.platform.startswith("linux")
    assert keep_freed_memory() is on_linux or not on_linux
    block = torch.zeros(1 << 20, dtype=torch.uint8)
    assert populate(block.data_ptr() + 1, block.numel() - 1) in (True, False)  # never raises
    assert not populate(block.data_ptr(), 0)
