"""Worker-process set-up (train/data/workers.py)."""

from __future__ import annotations

import os

from train.data.workers import freeze_inherited_objects_at_fork


class _Finalized:
    """In a reference cycle; its finalizer writes to a pipe (who freed it, parent or child)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.me = fd, self

    def __del__(self) -> None:
        os.write(self.fd, b"c" if os.getpid() != _PARENT[0] else b"p")


_PARENT = [0]


def test_a_forked_worker_never_frees_what_it_inherits() -> None:
    """Garbage of the parent (a CUDA graph in a cycle, in the case this guards) is not collected
    in a forked child, whose collections would free it there (the worker then dies)."""
    import gc

    freeze_inherited_objects_at_fork()
    read, write = os.pipe()
    _PARENT[0] = os.getpid()
    gc.disable()  # the cycle stays uncollected until the fork
    try:
        _Finalized(write)  # garbage now: a cycle only a collection frees
        pid = os.fork()
        if pid == 0:  # the child: collect everything, report the frozen count, exit at once
            gc.collect()
            os.write(write, b"f" if gc.get_freeze_count() > 0 else b"n")
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert status == 0
        assert os.read(read, 16) == b"f"  # frozen, and the inherited cycle was not freed there
    finally:
        gc.enable()
        gc.collect()  # the parent frees it itself
        os.close(write)
        assert os.read(read, 16) == b"p"
        os.close(read)
