"""bench.py_spy's split of a py-spy recording by thread."""

from __future__ import annotations

from bench.py_spy import by_thread

RAW = """\
thread (1): MainThread;<module> (bench/bench_train.py:9);fit (train/trainer.py:40);sort (torch/x.py:3) 30
thread (1): MainThread;<module> (bench/bench_train.py:9);fit (train/trainer.py:41) 10
thread (2): pin;_bootstrap (threading.py:1);run (threading.py:2);_pin_memory_loop (torch/pin.py:5) 20
not a sample line
"""


def test_threads_are_split_with_their_gil_share_and_leaves() -> None:
    main, pin = by_thread(RAW, rate=100, seconds=1)
    assert main["thread"] == "thread (1): MainThread" and main["fraction"] == 0.4
    # what a thread runs: its outermost frame of this repository, without the line
    assert main["runs"] == "<module> (bench/bench_train.py)"
    assert main["top_leaf_functions"][0] == {"frame": "sort (torch/x.py)", "share": 0.75}
    # no frame of ours: the outermost one outside threading.py
    assert pin["runs"] == "_pin_memory_loop (torch/pin.py)" and pin["fraction"] == 0.2
