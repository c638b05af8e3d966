"""Set-up of the loaders' worker processes (:mod:`train.data.loader`): what each worker does
when it starts (:func:`worker_init`, :func:`in_order_worker_init`), what the parent does once
before forking them (:func:`freeze_inherited_objects_at_fork`), and :func:`die_with_parent` (also
used by the stream's publisher). The workers run the datasets of :mod:`train.data.streams` and
:mod:`train.data.in_order`.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import os
import signal
import sys

from train.data.memory import keep_freed_memory

log = logging.getLogger(__name__)


def worker_init(_worker_id: int) -> None:
    """Keep freed arrays for reuse in the worker (:func:`~train.data.memory.keep_freed_memory`)."""
    keep_freed_memory()


@functools.cache
def freeze_inherited_objects_at_fork() -> None:
    """From now on, a child forked from this process (a DataLoader worker) leaves the objects it
    inherits out of its garbage collection, from its first instruction on: a full collection over
    them (~340K objects) took ~350 ms and copied their pages, and a collection that frees an
    inherited CUDA object (a model's CUDA graph left in a reference cycle, e.g. by a model trained
    earlier in the same process) kills the worker with a CUDA initialization error. Registered
    once per process; objects the child makes are collected as usual."""
    os.register_at_fork(after_in_child=gc.freeze)


def identity(x: object) -> object:
    return x


def die_with_parent(parent: int) -> None:
    """Call in a child process: on Linux it is killed when ``parent`` (its parent's pid) dies,
    kill -9 included (``PR_SET_PDEATHSIG``); it exits now if that already happened. A worker
    that waits for work it is handed (:class:`~train.data.loader.InOrderLoader`'s) would
    otherwise outlive a killed parent, since the DataLoader's own check runs only between items."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL) != 0:  # PR_SET_PDEATHSIG
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent:
        os._exit(1)


def in_order_worker_init(parent: int, _worker_id: int) -> None:
    keep_freed_memory()
    die_with_parent(parent)
