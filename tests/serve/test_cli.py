"""``python -m serve`` as a process: flags parse, it serves, SIGTERM stops it cleanly."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serve.__main__ import DEFAULT_BATCH_ROWS, config_from_args, parse_args
from serve.tiers import TierConfig

ROOT = Path(__file__).resolve().parents[2]


def test_flags_map_to_config(tmp_path: Path) -> None:
    cfg = config_from_args(
        parse_args(
            ["--model-dir", str(tmp_path), "--max-batch-rows", "64", "--max-wait-us", "250"]
            + ["--max-candidates", "50", "--max-sequence-length", "30", "--device", "cpu"]
        )
    )
    assert cfg.model_dir == tmp_path and cfg.bundle is None and cfg.device == "cpu"
    assert (cfg.batching.max_batch_rows, cfg.batching.max_wait_us) == (64, 250)
    assert (cfg.limits.max_candidates, cfg.limits.max_sequence_length) == (50, 30)
    assert cfg.admin is None and cfg.tls is None  # admin off, plaintext: the defaults
    assert cfg.host == "127.0.0.1"


def test_limit_and_admission_flags(tmp_path: Path) -> None:
    flags = ["--model-dir", str(tmp_path), "--max-string-bytes", "64", "--max-queue", "5"]
    flags += ["--max-request-bytes", "1000", "--max-detail-bytes", "200", "--reserve-threads", "3"]
    cfg = config_from_args(parse_args(flags))
    lim = cfg.limits
    assert (lim.max_string_bytes, lim.max_request_bytes, lim.max_detail_bytes) == (64, 1000, 200)
    assert lim.max_pending == 5 and cfg.rpc_threads == 8  # every admitted request has a thread
    assert lim.max_sequence_length is None  # default: each sequence's configured length


def test_admin_and_tls_flags(tmp_path: Path) -> None:
    base = ["--model-dir", str(tmp_path)]
    with pytest.raises(ValueError, match="need --admin-address"):
        config_from_args(parse_args([*base, "--delta-root", str(tmp_path)]))
    with pytest.raises(ValueError, match="both --tls-cert and --tls-key"):
        config_from_args(parse_args([*base, "--tls-cert", "c.pem"]))
    flags = [*base, "--admin-address", "unix:/tmp/a.sock", "--delta-root", str(tmp_path)]
    cfg = config_from_args(parse_args([*flags, "--tls-cert", "c.pem", "--tls-key", "k.pem"]))
    assert cfg.admin is not None and cfg.admin.address == "unix:/tmp/a.sock"
    assert cfg.admin.delta_root == tmp_path and cfg.admin.allow_writes
    assert cfg.tls is not None and cfg.tls.client_ca is None


def test_batch_rows_default_by_device_and_process_flags(tmp_path: Path) -> None:
    base = ["--model-dir", str(tmp_path)]
    cpu = config_from_args(parse_args([*base, "--device", "cpu"]))
    cuda = config_from_args(parse_args([*base, "--device", "cuda"]))
    assert cpu.batching.max_batch_rows == DEFAULT_BATCH_ROWS["cpu"] == 1024
    assert cuda.batching.max_batch_rows == DEFAULT_BATCH_ROWS["cuda"] > 1024
    assert (cpu.reuse_port, cpu.switch_interval_s) == (False, None)
    flags = [*base, "--device", "cpu", "--reuse-port", "--switch-interval-ms", "0.5"]
    cfg = config_from_args(parse_args(flags))
    assert cfg.reuse_port and cfg.switch_interval_s == 0.0005
    assert cpu.load_switch_interval_s == 0.0002  # the default
    off = config_from_args(parse_args([*base, "--load-switch-interval-ms", "0"]))
    assert off.load_switch_interval_s is None
    with pytest.raises(ValueError, match="load_switch_interval_s must be > 0"):
        config_from_args(parse_args([*base, "--load-switch-interval-ms", "-1"]))


def test_cuda_graphs_flag(tmp_path: Path) -> None:
    from serve.graphs import default_buckets
    from serve.server import PredictionServer

    base = ["--model-dir", str(tmp_path)]
    cuda = config_from_args(parse_args([*base, "--device", "cuda", "--max-candidates", "500"]))
    off = config_from_args(parse_args([*base, "--device", "cuda", "--cuda-graphs", "off"]))
    cpu = config_from_args(parse_args([*base, "--device", "cpu"]))
    assert (cuda.cuda_graphs, off.cuda_graphs, cpu.cuda_graphs) == (True, False, True)
    assert PredictionServer(cuda).graph_buckets() == default_buckets(DEFAULT_BATCH_ROWS["cuda"])
    assert PredictionServer(off).graph_buckets() == ()
    assert PredictionServer(cpu).graph_buckets() == ()  # graphs are for CUDA only
    with pytest.raises(SystemExit):
        parse_args([*base, "--cuda-graphs", "maybe"])


def test_cli_serves_then_stops_on_sigterm(bundle_v1: Path) -> None:
    cmd = [sys.executable, "-m", "serve", "--bundle", str(bundle_v1), "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, "--metrics-port", "0", "--device", "cpu"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.match(r"SERVING on 127\.0\.0\.1:(\d+)", line)
        assert m, line
        with grpc.insecure_channel(f"127.0.0.1:{m[1]}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10
            )
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert proc.stderr is not None
        log = proc.stderr.read()
        # logging works although torchrec installs a root handler first: timestamped INFO lines
        assert re.search(r"^\d{4}-\d\d-\d\d .* INFO serve.server: listening on ", log, re.M), log
        assert re.search(r" INFO serve.versions: serving model 1 from ", log), log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_tier_flags_map_to_config(tmp_path: Path) -> None:
    base = ["--model-dir", str(tmp_path)]
    assert config_from_args(parse_args(base)).tiers == TierConfig({}, None)
    flags = [*base, "--cache-load-factor", "user_id_emb=0.1", "--cache-load-factor", "brand_emb=1"]
    cfg = config_from_args(parse_args([*flags, "--hbm-budget-gib", "2"]))
    assert cfg.tiers == TierConfig({"user_id_emb": 0.1, "brand_emb": 1.0}, 2 << 30)
    with pytest.raises(ValueError, match="--cache-load-factor 'user_id_emb=0'"):
        config_from_args(parse_args([*base, "--cache-load-factor", "user_id_emb=0"]))
