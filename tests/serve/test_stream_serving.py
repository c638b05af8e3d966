"""Online training end to end: a writer lands partitions while ``train stream`` (a process of
its own) publishes and a real gRPC server follows the publish root (serve.delta_watch)."""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pyarrow.dataset as pads
import pytest

from loadtest.parity import request_for_rows
from loadtest.requests import (
    sequence_formats_from_metadata,
    sides_from_metadata,
    value_types_from_metadata,
)
from protos import predict_pb2, predict_pb2_grpc
from serve.batcher import BatcherConfig
from serve.server import PredictionServer, ServerConfig
from tests.train.stream_data import (
    records,
    split,
    start_stream,
    train_rows,
    wait_for,
    write_partition,
)

PUBLISH_EVERY_S = 1.0
POLL_S = 0.2


def _server(root: Path) -> PredictionServer:
    server = PredictionServer(
        ServerConfig(
            model_dir=root / "full",
            watch_deltas=root / "deltas",
            poll_interval_s=POLL_S,
            device="cpu",
            metrics_port=0,
            batching=BatcherConfig(max_batch_rows=256, max_wait_us=500),
        )
    ).start()
    assert server.wait_ready(60), server.load_error
    return server


class _Probe:
    """One request of eval rows, sent to a server; its scores and version."""

    def __init__(self, server: PredictionServer, eval_rows: Path) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        self.stub = predict_pb2_grpc.PredictionServiceStub(self.channel)
        md = self.metadata()
        self.request = request_for_rows(
            pads.dataset(str(eval_rows), format="parquet").head(8),
            sides_from_metadata(md),
            value_types_from_metadata(md),
            "probe",
            sequence_formats=sequence_formats_from_metadata(md),
        )

    def metadata(self) -> predict_pb2.ModelMetadata:
        return self.stub.GetModelMetadata(predict_pb2.ModelMetadataRequest(), timeout=10)

    def __call__(self) -> tuple[str, list[float]]:
        answer = self.stub.Predict(self.request, timeout=10)
        return answer.model_version, list(answer.probabilities)


@pytest.fixture()
def stream(tiny_samples: Path, tmp_path: Path) -> Iterator[dict]:
    parts = split(train_rows(tiny_samples), 8)
    source, model_dir, root = tmp_path / "src", tmp_path / "model", tmp_path / "pub"
    write_partition(source, "p0000", parts[0])
    proc = start_stream(source, model_dir, "--publish-root", str(root), "--publish-every-s",
                        str(PUBLISH_EVERY_S), "--full-every", "3")  # fmt: skip
    yield {"parts": parts, "source": source, "model_dir": model_dir, "root": root, "proc": proc}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _published(model_dir: Path) -> str:
    done = records(model_dir, "publish")
    return done[-1]["version"] if done else ""


def test_stream_to_server_fresh_restartable_and_refusing_bad_deltas(
    stream: dict, tiny_samples: Path
) -> None:
    proc, root, model_dir = stream["proc"], stream["root"], stream["model_dir"]
    wait_for("the first publish", lambda: _published(model_dir), 60, proc)
    server = _server(root)
    try:
        probe = _Probe(server, tiny_samples / "eval")
        version, scores = probe()
        versions = [version]
        # a new partition: the probe's scores change within the publish interval + apply time
        for i in (1, 2, 3):
            written = time.monotonic()
            write_partition(stream["source"], f"p{i:04d}", stream["parts"][i])
            wait_for(
                f"partition {i} served", lambda old=(version, scores): probe() != old, 30, proc
            )
            took = time.monotonic() - written
            publish_s = max(r["publish_seconds"] for r in records(model_dir, "publish"))
            assert took <= PUBLISH_EVERY_S + publish_s + 2 * POLL_S + 10, took  # CI slack
            version, scores = probe()
            versions.append(version)
        # deltas applied in place of the base, each version named by its last delta
        assert any(v.startswith(f"{versions[0]}+step-") for v in versions[1:]), versions
        md = probe.metadata()
        assert md.event_time_unix > 0 and 0 <= md.freshness_seconds < 120
        age = server.metrics.registry.get_sample_value("dynrec_serving_model_age_seconds")
        assert age is not None and 0 <= age < 120

        proc.send_signal(signal.SIGTERM)  # stops cleanly: checkpoint, last publish, exit 0
        assert proc.wait(timeout=30) == 0
        last = _published(model_dir)
        wait_for("the last publish served", lambda: probe()[0] == last, 30)
        live = probe()
        _restarted_scores_like_live(root, tiny_samples, live)
        _bad_delta_refused(server, probe, root, live)
    finally:
        server.stop(grace=0)


def _restarted_scores_like_live(root: Path, tiny_samples: Path, live: tuple) -> None:
    """A server started now from the root (newest base + its newest delta) = the live one."""
    restarted = _server(root)
    try:
        probe = _Probe(restarted, tiny_samples / "eval")
        got = wait_for("the restarted server caught up", lambda: probe()[0] == live[0] and
                       probe(), 30)  # fmt: skip
        assert got[1] == pytest.approx(live[1], abs=1e-6)
    finally:
        restarted.stop(grace=0)


def _bad_delta_refused(server: PredictionServer, probe: _Probe, root: Path, live: tuple) -> None:
    """A corrupt newer delta is refused; the model serving goes on."""
    base = live[0].split("+")[0]
    folder = root / "deltas" / base
    folder.mkdir(parents=True, exist_ok=True)
    newest = max(folder.iterdir(), default=None, key=lambda p: p.stat().st_mtime)
    bad = folder / "step-999999"
    if newest is not None:
        shutil.copytree(newest, bad)
        tensors = bad / "delta.safetensors"
        tensors.write_bytes(tensors.read_bytes()[:-8] + b"\x00" * 8)  # a flipped tail
    else:
        bad.mkdir()
        (bad / "manifest.json").write_text("{not json")
    refusals = "dynrec_serving_delta_refusals_total"
    wait_for("the refusal", lambda: server.metrics.registry.get_sample_value(refusals), 10)
    assert probe() == live
