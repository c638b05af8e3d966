"""bench.bench_oip: the windows of each mode, the ratios of the phases, the flags that cannot be
honoured, the frontend pids read from the server's log, and real runs against a
``python -m serve`` on CPU in mixed mode (no timing checks): one process, and two frontends with
three client processes, each process accounted per protocol and connection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_oip
from bench.bench_oip import INFER, PREDICT, Mode, compare, round_windows, server_pids


def test_mixed_round_is_one_window_whose_connections_each_carry_both_protocols() -> None:
    p, o = [b"p"], [b"o"]
    for r in range(3):  # the same window every round
        (w,) = round_windows(Mode.MIXED, r, p, o, clients=16, procs=4)
        got = [(x.name, x.method, x.payloads) for x in w.protocols]
        assert got == [("predict", PREDICT, p), ("oip", INFER, o)]
        assert w.connections_per_proc() == [2, 2, 2, 2]  # 8 connections, 2 calls each
    # odd --procs is fine now: every process runs both protocols
    (w,) = round_windows(Mode.MIXED, 0, p, o, clients=8, procs=3)
    assert w.connections_per_proc() == [2, 1, 1]
    (w,) = round_windows(Mode.MIXED, 0, p, o, clients=2, procs=4)
    assert w.connections_per_proc() == [1]  # never a process without a connection


def test_alternating_rounds_swap_the_order_and_give_each_protocol_every_call() -> None:
    even = round_windows(Mode.ALTERNATING, 0, [b"p"], [b"o"], clients=4, procs=2)
    odd = round_windows(Mode.ALTERNATING, 1, [b"p"], [b"o"], clients=4, procs=2)
    assert [[x.name for x in w.protocols] for w in even] == [["predict"], ["oip"]]
    assert [[x.name for x in w.protocols] for w in odd] == [["oip"], ["predict"]]
    assert all(w.connections_per_proc() == [2, 2] for w in even + odd)


def test_server_pids_are_the_frontends_named_on_the_serving_line() -> None:
    line = "SERVING on 127.0.0.1:5 (metrics: 6, frontend pids [101, None, 103])\n"
    assert server_pids("loading\n" + line, pid=7) == [101, 103]  # one not running: left out
    assert server_pids("SERVING on 127.0.0.1:5 (metrics: 6)\n", pid=7) == [7]


def _phase(requests: int, latency_s: float, seconds: float = 2.0) -> dict[str, object]:
    return {
        "latencies": [latency_s] * requests,
        "errors": [],
        "seconds": seconds,
        "requests_per_proc": [requests],
    }


def test_compare_pools_the_rounds_and_pairs_them_by_round() -> None:
    """Predict 100 then 300 requests, OIP 90 then 150: pooled 240/400 = 0.6 (the goal's
    figure, under 0.9), rounds 0.9 and 0.5, p99 OIP 2x Predict's."""
    by = {
        "predict": [_phase(100, 0.01), _phase(300, 0.01)],
        "oip": [_phase(90, 0.02), _phase(150, 0.02)],
    }
    got = compare(by, candidates=10)
    assert got["predict"]["candidates_per_s"] == pytest.approx(400 * 10 / 4.0)
    assert got["predict"]["candidates_per_s_rounds"] == pytest.approx([500.0, 1500.0])
    assert got["ratio_candidates_per_s"] == pytest.approx(0.6)
    assert got["ratio_candidates_per_s_rounds"] == pytest.approx([0.9, 0.5])
    assert got["ratio_candidates_per_s_median_of_rounds"] == pytest.approx(0.7)
    assert got["ratio_p99"] == pytest.approx(2.0)
    assert got["meets_goal"] is False
    assert got["oip"]["requests_per_proc_rounds"] == [[90], [150]]
    assert got["oip"]["p99_ms_rounds"] == pytest.approx([20.0, 20.0])
    by["oip"] = [_phase(95, 0.01), _phase(270, 0.01)]  # 365/400 >= 0.9
    assert compare(by, candidates=10)["meets_goal"] is True


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--clients", "4", "3"], "3 is odd"),
        (["--clients", "1"], "1 is odd"),
    ],
)
def test_mixed_mode_refuses_an_uneven_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    out = tmp_path / "oip.json"
    with pytest.raises(SystemExit) as exit_:
        bench_oip.main(["--out", str(out), *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --mode mixed") and named in err
    assert not out.exists()  # refused before any server starts
    # the alternating mode splits nothing, so an odd count is its to take (not run here)
    assert bench_oip._parser().parse_args(["--out", "x", "--mode", "alternating", *flags])


def test_mixed_run_against_real_frontends_accounts_each_process_per_round(
    tmp_path: Path, tiny_samples: Path
) -> None:
    """Two frontends, 6 calls: 3 connections (one Predict and one ModelInfer loop each) over 3
    client processes; each process's requests per protocol and the frontend of its connection
    are in the JSON and add up to the protocols' figures."""
    out = tmp_path / "oip.json"
    argv = ["--out", str(out), "--work", str(tmp_path / "work"), "--samples",
            str(tiny_samples / "eval"), "--keys", "3000", "--candidates", "5", "--requests", "20",
            "--clients", "6", "--procs", "3", "--frontends", "2", "--rounds", "2", "--duration",
            "1", "--warmup", "0.5", "--settle", "0.5", "--profile-requests", "2",
            "--profile-iters", "2"]  # fmt: skip
    assert bench_oip.main(argv) == 0
    got = json.loads(out.read_text())
    assert got["mode"] == "mixed" and got["settings"]["mode"] == "mixed"
    assert got["scores_checked"]["max_abs_gap"] == 0.0  # bit-equal on CPU
    assert len(got["server_pids"]) == 2  # the frontends, read from the server's log
    (run,) = got["runs"]
    assert run["clients"] == 6 and run["clients_per_protocol"] == 3
    windows = run["windows"]
    assert [(w["round"], w["protocols"]) for w in windows] == [
        (0, ["predict", "oip"]),
        (1, ["predict", "oip"]),
    ]
    for w in windows:
        assert [(p["connections"], len(p["frontends"])) for p in w["procs"]] == [(1, 1)] * 3
        assert {f for p in w["procs"] for f in p["frontends"]} <= {0, 1}  # every end found
        assert sum(w["connections_per_frontend"]) == 3
        idle = [i for i, p in enumerate(w["procs"]) if 0 in p["requests"].values()]
        assert w["idle_procs"] == idle
    assert run["windows_with_idle_procs"] == [i for i, w in enumerate(windows) if w["idle_procs"]]
    for name in ("predict", "oip"):
        per_proc = run[name]["requests_per_proc_rounds"]
        assert per_proc == [[p["requests"][name] for p in w["procs"]] for w in windows]
        assert sum(map(sum, per_proc)) == run[name]["requests"]
    for name in ("predict", "oip"):
        side = run[name]
        assert side["requests"] > 0 and side["errors"] == []
        assert len(side["candidates_per_s_rounds"]) == 2
        assert side["candidates_per_s"] == pytest.approx(side["requests"] * 5 / 2.0)
    rounds = [
        o / p
        for p, o in zip(
            run["predict"]["candidates_per_s_rounds"],
            run["oip"]["candidates_per_s_rounds"],
            strict=True,
        )
    ]
    assert run["ratio_candidates_per_s_rounds"] == pytest.approx(rounds)
    ratio = run["oip"]["candidates_per_s"] / run["predict"]["candidates_per_s"]
    assert run["ratio_candidates_per_s"] == pytest.approx(ratio)
    assert run["meets_goal"] == (ratio >= bench_oip.GOAL_RATIO)
