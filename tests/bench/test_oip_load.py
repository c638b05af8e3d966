"""bench.oip_load: the split of connections over client processes, the tally per frontend, and
the frontend of a connection read from real sockets (the windows themselves run against a real
server in tests/bench/test_bench_oip.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

from bench.oip_load import Protocol, Window, frontends_of, split, tally


def test_split_is_near_equal_with_the_first_parts_larger() -> None:
    assert split(8, 4) == [2, 2, 2, 2]
    assert split(7, 3) == [3, 2, 2]
    assert sum(split(13, 5)) == 13


def test_a_window_has_one_connection_per_call_of_each_protocol() -> None:
    p, o = Protocol("predict", "/p", [b"p"]), Protocol("oip", "/o", [b"o"])
    assert Window((p, o), clients=16, procs=4).connections_per_proc() == [2, 2, 2, 2]
    assert Window((p,), clients=16, procs=4).connections_per_proc() == [4, 4, 4, 4]
    assert Window((p, o), clients=4, procs=8).connections_per_proc() == [1, 1]


def test_tally_counts_connections_per_frontend_and_skips_unknown_ends() -> None:
    procs: list[dict[str, Any]] = [
        {"frontends": [0, 2]},
        {"frontends": [2, None]},
        {"frontends": []},
    ]
    assert tally(procs, 3) == [1, 0, 2]


def test_frontends_of_finds_the_process_holding_the_other_end() -> None:
    """This process listens and connects twice: both connections end in this process (index 1
    of the pids given); with only another process's pid, or one that has exited, no end is
    found."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with (
            socket.create_connection(("127.0.0.1", port)) as a,
            socket.create_connection(("127.0.0.1", port)) as b,
        ):
            accepted = [server.accept()[0] for _ in range(2)]
            try:
                assert a.getsockname() != b.getsockname()
                assert frontends_of(port, [other.pid, os.getpid()]) == [1, 1]
                assert frontends_of(port, [other.pid, gone.pid]) == [None, None]
            finally:
                for c in accepted:
                    c.close()
                other.kill()
                other.wait()
