"""bench/stream_reports.py: the serving report (each phase's window of the load's log, the
ratios), the report of a trainer's replay window, and the replay's rate."""

from __future__ import annotations

import time

import numpy as np

from bench.stream_load import PacedLoad
from bench.stream_reports import (
    p99_ratio_interval,
    replay_rate,
    serving_report,
    training_report,
)


def _load(windows: dict[str, tuple[float, list[float]]]) -> PacedLoad:
    """A load's log: per window (start, latencies in ms) one answered request a 0.01 s."""
    load = PacedLoad("127.0.0.1:1", [], per_s=1.0, threads=0)
    for start, latencies in windows.values():
        load.log += [(start + 0.01 * i, x / 1e3, True) for i, x in enumerate(latencies)]
    return load


def test_serving_report_gives_each_phase_and_the_ratios_of_those_measured() -> None:
    lat = {"with_publishing": (0.0, [1.0] * 99 + [300.0] * 3),
           "training_without_publishing": (10.0, [1.0] * 99 + [200.0] * 3),
           "idle": (20.0, [1.0] * 99 + [50.0] * 3)}  # fmt: skip
    load = _load(lat)
    load.log.append((12.0, 9.0, False))  # an error: counted, not in the latencies
    windows = {name: (start, start + 5.0) for name, (start, _) in lat.items()}
    out = serving_report(load, windows)
    assert out["with_publishing"]["requests"] == 102 and out["with_publishing"]["errors"] == 0
    assert out["training_without_publishing"]["errors"] == 1
    assert out["training_without_publishing"]["requests"] == 102
    p99 = {name: float(np.percentile(x, 99)) for name, (_, x) in lat.items()}
    for name in lat:
        assert np.isclose(out[name]["p99_ms"], p99[name])
    assert np.isclose(out["p99_ratio_publishing"],
                      p99["with_publishing"] / p99["training_without_publishing"])  # fmt: skip
    assert np.isclose(out["p99_ratio_training"], p99["training_without_publishing"] / p99["idle"])
    two = serving_report(load, {k: windows[k] for k in list(windows)[:2]})  # idle not yet run
    assert "p99_ratio_publishing" in two and "p99_ratio_training" not in two
    empty = serving_report(load, {**windows, "idle": (100.0, 105.0)})  # no request in it
    assert empty["idle"]["requests"] == 0 and empty["p99_ratio_training"] is None


def test_training_report_reads_the_window_of_the_replay() -> None:
    def rec(at: float, samples: int, rate: float, lag: int) -> dict:
        return {"kind": "stream", "at_unix": at, "samples": samples, "rows_per_s": rate,
                "lag_rows": lag}  # fmt: skip

    stream = [
        rec(99.0, 100, 0.0, 0),  # before the window: the first partition trained
        rec(101.0, 400, 300.0, 200),
        rec(102.0, 800, 400.0, 100),
        rec(103.0, 1000, 200.0, 0),
        rec(104.0, 1000, 0.0, 0),  # caught up, then idle
        rec(120.0, 1000, 0.0, 0),  # after the window
    ]
    out = training_report(stream, 100.0, 110.0, 1000)
    assert out["rows_per_s"]["n"] == 3 and out["rows_per_s"]["p50"] == 300.0
    assert out["lag_rows_max"] == 200 and out["trained_rows"] == 1000
    assert out["caught_up"] and out["caught_up_after_s"] == 3.0
    behind = training_report(stream, 100.0, 102.5, 1000)
    assert not behind["caught_up"] and behind["caught_up_after_s"] is None
    assert behind["trained_rows"] == 800


def test_the_replay_rate_is_the_rows_landed_over_the_landings_span() -> None:
    """Landing 0 is the start's; partitions 1..3 land on time at 1,000 rows/s (each when the rows
    before it are due): the rate is 1,000, not the rows over the wall time."""
    landed = [(0.0, 500), (10.0, 1000), (11.0, 3000), (14.0, 2000)]
    assert replay_rate(landed) == 1000.0
    assert replay_rate(landed[:2]) == 0.0  # one replayed landing: no interval yet


def test_a_windows_stats_say_which_second_held_the_slow_answers() -> None:
    """``by_second``: [answers, p99 ms] of each whole second of the window, so a publish's
    moment shows as one slow second; ``start_unix`` places the window on the server log's
    clock."""
    load = PacedLoad("127.0.0.1:1", [], per_s=1.0, threads=0)
    slow = [1.0] * 100 + [80.0] * 100 + [1.0] * 50  # seconds 0, 1 and half of 2, 0.01 s apart
    load.log += [(5.0 + 0.01 * i, x / 1e3, True) for i, x in enumerate(slow)]
    got = load.stats(5.0, 8.0)
    assert [n for n, _ in got["by_second"]] == [100, 100, 50]
    assert [p for _, p in got["by_second"]] == [1.0, 80.0, 1.0]
    assert abs(got["start_unix"] - (time.time() - time.monotonic() + 5.0)) < 1.0


def test_the_p99_ratios_interval_holds_the_ratio_and_narrows_with_more_seconds() -> None:
    """The block bootstrap's 95 % interval of a p99 ratio: it holds the measured ratio, is
    seeded (the same run gives the same interval), and a longer window of the same latencies
    gives a narrower one; the serving report carries it beside each ratio."""
    gen = np.random.default_rng(1)

    def seconds(n: int, scale: float) -> list[np.ndarray]:
        return [gen.exponential(scale, 200) for _ in range(n)]

    a, b = seconds(30, 1.2), seconds(30, 1.0)
    ratio = float(np.percentile(np.concatenate(a), 99) / np.percentile(np.concatenate(b), 99))
    low, high = p99_ratio_interval(a, b)
    assert low <= ratio <= high and low < high
    assert p99_ratio_interval(a, b) == [low, high]
    a4, b4 = a + seconds(90, 1.2), b + seconds(90, 1.0)
    low4, high4 = p99_ratio_interval(a4, b4)
    assert high4 - low4 < high - low
    lat = {"with_publishing": (0.0, [1.0] * 99 + [300.0] * 3),
           "training_without_publishing": (10.0, [1.0] * 99 + [200.0] * 3)}  # fmt: skip
    out = serving_report(_load(lat), {k: (s, s + 5.0) for k, (s, _) in lat.items()})
    ci = out["p99_ratio_publishing_ci95"]
    assert ci[0] <= out["p99_ratio_publishing"] <= ci[1]
