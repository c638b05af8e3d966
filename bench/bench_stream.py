"""Online training end to end: samples replayed as partitions → ``train stream`` → a server.

A writer lands the train samples as ``--partitions`` partitions, one every
``--partition-every-s`` seconds, each row's ``time_stamp`` set to the moment it lands (so event
time is wall time). ``python -m train stream`` (a process of its own) trains and publishes to a
root that an in-process server follows (``--model-dir R/full --watch-deltas R/deltas``). A probe
reads the server's ``GetModelMetadata`` every ``--probe-every-s`` seconds. Reported (JSON):

- ``served_age_s``: p50/p99/max of the age of what is served (now − its newest event time),
  over the probe's samples once a first version serves;
- ``event_to_served_s``: per served version, p50/p99 of the time from its newest row's event
  to the first probe that saw it served;
- ``rows_per_s``: the trainer's, from its ``stream`` records; ``publish_seconds`` p50/max.

CPU, small scale (the defaults: tiny data, a few partitions)::

    python -m bench.bench_stream --size tiny --out out/bench_stream.json
    python -m bench.bench_stream --samples data/full/samples/train --device cuda \\
        --partitions 24 --publish-every-s 10 --out $OUT/stream.json      # on the device
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config"


def _samples(size: str, work: Path) -> Path:
    from shared.config import load_config
    from shared.features import build_feature_set
    from train.data.synthetic import generate
    from train.data.taobao import build_samples

    generate(size, work / "data", seed=0)
    build_samples(work / "data" / "raw", work / "data" / "samples",
                  build_feature_set(load_config(CONFIG)))  # fmt: skip
    return work / "data" / "samples" / "train"


def _writer(
    rows: pa.Table, source: Path, parts: int, every_s: float, stop: threading.Event
) -> None:
    n = -(-rows.num_rows // parts)
    for i in range(parts):
        if stop.is_set():
            return
        part = rows.slice(i * n, n)
        stamp = pa.array([int(time.time())] * part.num_rows, pa.int64())
        part = part.set_column(part.schema.get_field_index("time_stamp"), "time_stamp", stamp)
        folder = source / f"p{i:06d}"
        folder.mkdir(parents=True)
        pq.write_table(part, folder / "part-00000.parquet")
        (folder / "_SUCCESS").touch()
        stop.wait(every_s)


def _percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p99": None, "max": None, "n": 0}
    a = np.asarray(xs)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max()), "n": len(xs)}  # fmt: skip


def _trainer(args: argparse.Namespace, source: Path, work: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "train", "stream", "--config", str(args.config),
           "--source", str(source), "--model-dir", str(work / "model"), "--device", args.device,
           "--batch-size", str(args.batch_size), "--poll-s", "0.2", "--log-every-s", "1",
           "--publish-root", str(work / "pub"), "--publish-every-s", str(args.publish_every_s),
           "--full-every", str(args.full_every)]  # fmt: skip
    log = open(work / "trainer.log", "wb")  # noqa: SIM115
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def _probe(server: object, until: float, every_s: float) -> tuple[list[float], dict[str, float]]:
    """(ages of what is served, first time each version was seen) until ``until``."""
    import grpc

    from protos import predict_pb2, predict_pb2_grpc

    ages: list[float] = []
    first_seen: dict[str, float] = {}
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:  # type: ignore[attr-defined]
        stub = predict_pb2_grpc.PredictionServiceStub(channel)
        while time.time() < until:
            md = stub.GetModelMetadata(predict_pb2.ModelMetadataRequest(), timeout=10)
            if md.event_time_unix:
                ages.append(md.freshness_seconds)
                first_seen.setdefault(md.model_version, time.time() - md.event_time_unix)
            time.sleep(every_s)
    return ages, first_seen


def run(args: argparse.Namespace) -> dict:
    from serve.server import PredictionServer, ServerConfig

    work = Path(tempfile.mkdtemp(prefix="bench_stream."))
    samples = args.samples or _samples(args.size, work)
    rows = pq.read_table(samples)
    source = work / "src"
    source.mkdir()
    stop = threading.Event()
    writer = threading.Thread(target=_writer, args=(rows, source, args.partitions,
                                                    args.partition_every_s, stop))  # fmt: skip
    writer.start()
    proc = _trainer(args, source, work)
    while not (work / "pub" / "full").is_dir() or not any((work / "pub" / "full").iterdir()):
        if proc.poll() is not None:
            raise SystemExit(f"train stream exited {proc.returncode}: see {work}/trainer.log")
        time.sleep(0.2)
    server = PredictionServer(ServerConfig(model_dir=work / "pub" / "full",
                                           watch_deltas=work / "pub" / "deltas",
                                           poll_interval_s=args.poll_s, device=args.device))  # fmt: skip
    server.start()
    server.wait_ready(120)
    until = time.time() + args.partitions * args.partition_every_s + args.tail_s
    try:
        ages, first_seen = _probe(server, until, args.probe_every_s)
    finally:
        stop.set()
        proc.terminate()
        proc.wait(60)
        server.stop(grace=0)
        writer.join()
    records = [json.loads(x) for x in (work / "model" / "metrics.jsonl").read_text().splitlines()]
    rates = [r["rows_per_s"] for r in records if r["kind"] == "stream" and r["rows_per_s"] > 0]
    publishes = [r["publish_seconds"] for r in records if r["kind"] == "publish"]
    return {
        "bench": "stream",
        "device": args.device,
        "rows": rows.num_rows,
        "partitions": args.partitions,
        "publish_every_s": args.publish_every_s,
        "poll_interval_s": args.poll_s,
        "served_age_s": _percentiles(ages),
        "event_to_served_s": _percentiles(list(first_seen.values())),
        "rows_per_s": _percentiles(rates),
        "publish_seconds": _percentiles(publishes),
        "versions_served": len(first_seen),
        "work_dir": str(work),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_stream", description=__doc__)
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--samples", type=Path, help="train samples (file or dir); default: --size")
    p.add_argument("--size", default="tiny", choices=["tiny", "small"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--partitions", type=int, default=6)
    p.add_argument("--partition-every-s", type=float, default=2.0)
    p.add_argument("--publish-every-s", type=float, default=2.0)
    p.add_argument("--full-every", type=int, default=10)
    p.add_argument("--poll-s", type=float, default=0.5, help="the server's poll interval")
    p.add_argument("--probe-every-s", type=float, default=0.2)
    p.add_argument("--tail-s", type=float, default=8.0, help="probe this long after the last")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
