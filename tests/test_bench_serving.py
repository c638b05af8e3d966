"""The pure parts of bench/bench_serving.py: run specs, the py-spy summary, the metrics profile."""

from __future__ import annotations

import pytest

from bench.bench_serving import RunSpec, graph_profile, server_profile, summarize_py_spy, verdict

P = "dynrec_serving_"


def test_run_spec_parse() -> None:
    assert RunSpec.parse("cuda:4:500:32") == RunSpec("cuda", 4, 500, 32, None, "columnar")
    spec = RunSpec.parse("cpu:1:100:8:0.5")
    assert spec.switch_interval_ms == 0.5 and spec.name == "cpu-w1-c100-u8-si0.5-columnar"
    rows = RunSpec.parse("cuda:1:500:32:rows")
    assert rows.request_format == "rows" and rows.switch_interval_ms is None
    assert rows.name == "cuda-w1-c500-u32-rows"
    both = RunSpec.parse("cuda:1:500:32:0.5:columnar", default_format="rows")
    assert (both.switch_interval_ms, both.request_format) == (0.5, "columnar")
    assert RunSpec.parse("cuda:1:500:32", default_format="rows").request_format == "rows"
    assert RunSpec.parse("cuda:1:500:32::rows").switch_interval_ms is None
    for bad in ("tpu:1:100:8", "cuda:1:100:8:fast", "cuda:1:100:8:0.5:rows:x", "cuda:1:100"):
        with pytest.raises(SystemExit):
            RunSpec.parse(bad)


def test_py_spy_summary_categories_and_gil_share() -> None:
    grpc = "_unary_response_in_pool (grpc/_server.py:788)"
    rpc = f"{grpc};PredictionServicer.Predict.<locals>.run (serve/servicer.py:101)"
    raw = "\n".join(
        [
            f"{rpc};request_inputs (serve/validation.py:200);_item_columns (serve/validation.py:141) 30",
            f"{rpc};request_columns_to_batch (shared/fg_request.py:340);_request_array (shared/fg_request.py:120) 20",
            "Batcher._run_batch (serve/batcher.py:190);LoadedModel.predict (serve/model.py:250);"
            "LoadedModel._logits (serve/model.py:230);forward (<eval_with_key>.5:12) 40",
            f"{grpc} 10",
        ]
    )
    s = summarize_py_spy(raw, rate=100, seconds=2)
    assert s["samples_holding_gil"] == 100 and s["gil_busy_fraction"] == 0.5
    assert s["by_category"] == {
        "batch: dense program": 0.4,
        "rpc: validate": 0.3,
        "rpc: fg": 0.2,
        "grpc: (de)serialize, dispatch": 0.1,
    }
    assert s["top_leaf_functions"][0] == {"frame": "forward (<eval_with_key>.5)", "share": 0.4}


def _scrape(requests: float, validate_s: float, batches: float) -> dict:
    lab = (("method", "Predict"),)
    return {
        (f"{P}request_latency_seconds_count", lab): requests,
        (f"{P}request_latency_seconds_sum", lab): requests * 0.01,
        (f"{P}batch_rows_count", ()): batches,
        (f"{P}batch_rows_sum", ()): batches * 1000,
        (f"{P}batch_requests_sum", ()): requests,
        (f"{P}stage_seconds_count", (("clock", "cpu"), ("stage", "validate"))): requests,
        (f"{P}stage_seconds_sum", (("clock", "cpu"), ("stage", "validate"))): validate_s,
        (f"{P}stage_seconds_count", (("clock", "wall"), ("stage", "compute"))): batches,
        (f"{P}stage_seconds_sum", (("clock", "wall"), ("stage", "compute"))): batches * 0.004,
    }


def test_server_profile_is_the_difference_of_two_scrapes() -> None:
    prof = server_profile(_scrape(10, 0.02, 5), _scrape(110, 0.22, 55))
    assert prof["requests"] == 100 and prof["batches"] == 50
    assert prof["rows_per_batch"] == 1000 and prof["requests_per_batch"] == 2
    assert prof["stages"]["validate"]["cpu_ms_mean"] == pytest.approx(2.0)
    assert prof["stages"]["compute"]["wall_ms_mean"] == pytest.approx(4.0)
    assert prof["stages"]["compute"]["wall_ms_per_request"] == pytest.approx(2.0)
    assert prof["server_latency_ms_mean"] == pytest.approx(10.0)
    busy = server_profile(_scrape(10, 0.02, 5), _scrape(110, 0.22, 55), elapsed_s=2.0)
    assert busy["rpc_stage_cpu_cores"] == pytest.approx(0.1)  # 0.2 s of validate CPU in 2 s


def test_verdict_names_the_limit_from_the_profile() -> None:
    run = {
        "py_spy": {"gil_busy_fraction": 0.97, "by_category": {"rpc: validate": 0.5}},
        "cpu": {"machine_busy_cores": 6.0, "machine_cores": 16.0},
        "gpu": {"util_pct_mean": 20.0},
        "server": {"stages": {}},
    }
    assert verdict(run).startswith("GIL of the server process (97%")
    run["py_spy"] = {"gil_busy_fraction": 0.3}
    assert verdict(run).startswith("not saturated")
    run["server"] = {"stages": {}, "batcher_busy_fraction": 0.95, "batcher_cpu_fraction": 0.475}
    assert verdict(run).startswith("the batcher thread (95% busy running batches, 50% of that")


def test_cuda_runs_are_made_with_graphs_on_and_off() -> None:
    cuda, cpu = RunSpec.parse("cuda:8:500:64"), RunSpec.parse("cpu:1:500:32")
    on, off = cuda.with_graphs(["on", "off"])
    assert (on.cuda_graphs, off.cuda_graphs) == ("on", "off")
    assert on.name == "cuda-w8-c500-u64-columnar-graphs-on"
    assert cpu.with_graphs(["on", "off"]) == [cpu] and cpu.name == "cpu-w1-c500-u32-columnar"


def test_graph_profile_is_the_difference_of_two_scrapes() -> None:
    g = f"{P}graph_"

    def scrape(replays: float, eager: float) -> dict:
        return {
            (f"{g}replays_total", ()): replays,
            (f"{g}eager_batches_total", (("reason", "no bucket fits"),)): eager,
            (f"{g}captures", ()): 84.0,  # two workers of 42
            (f"{g}memory_bytes", (("kind", "reserved"),)): 2.0**30,
        }

    prof = graph_profile(scrape(10, 2), scrape(100, 12))
    assert prof is not None and prof["replays"] == 90 and prof["eager"] == {"no bucket fits": 10}
    assert prof["replayed_fraction"] == 0.9 and prof["captures"] == 84
    assert prof["memory_bytes"] == {"allocated": 0.0, "reserved": 2.0**30}
    assert graph_profile({}, {(f"{P}requests_total", ()): 1.0}) is None  # no graphs
