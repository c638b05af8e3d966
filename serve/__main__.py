"""``python -m serve --bundle DIR | --model-dir DIR --port P [--metrics-port M] ...``"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from serve.batcher import BatcherConfig
from serve.model import default_device
from serve.server import PredictionServer, ServerConfig
from serve.validation import Limits

# one request of 500-1000 candidates fills a CPU batch; a GPU runs 8K rows in about the time of 1K
DEFAULT_BATCH_ROWS = {"cpu": 1024, "cuda": 8192}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serve", description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--bundle", type=Path, help="serve this bundle directory")
    src.add_argument("--model-dir", type=Path, help="watch <dir>/<version>/ bundles, hot-swap")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8500)
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port")
    p.add_argument(
        "--max-batch-rows",
        type=int,
        default=None,
        help=f"candidate rows per batch (default: {DEFAULT_BATCH_ROWS['cpu']} on the CPU, "
        f"{DEFAULT_BATCH_ROWS['cuda']} on CUDA, where a larger batch costs about the same)",
    )
    p.add_argument("--max-wait-us", type=int, default=500)
    p.add_argument("--max-queue", type=int, default=256, help="pending requests before overload")
    p.add_argument("--max-candidates", type=int, default=1000)
    p.add_argument("--max-sequence-length", type=int, default=100)
    p.add_argument("--max-message-bytes", type=int, default=4 << 20)
    p.add_argument("--rpc-threads", type=int, default=64)
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (0: torch's default, one per core); 1 suits a small CPU host "
        "where the RPC threads need the other cores",
    )
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="Python's GIL switch interval (sys.setswitchinterval; default 5 ms): how long a "
        "thread that wants the GIL back (the batcher, after each torch call) may wait for the "
        "RPC threads running validation and feature generation",
    )
    p.add_argument(
        "--reuse-port",
        action="store_true",
        help="SO_REUSEPORT: several server processes share --port (the kernel spreads "
        "connections over them), e.g. one per few cores to get past the GIL of one process",
    )
    p.add_argument("--poll-interval-s", type=float, default=2.0)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if any")
    p.add_argument("--no-verify-checksums", action="store_true")
    p.add_argument(
        "--no-admin-writes", action="store_true", help="refuse ModelAdminService.ApplyDelta"
    )
    return p.parse_args(argv)


def config_from_args(a: argparse.Namespace) -> ServerConfig:
    device = a.device or default_device()
    rows = a.max_batch_rows or DEFAULT_BATCH_ROWS.get(device, DEFAULT_BATCH_ROWS["cpu"])
    return ServerConfig(
        bundle=a.bundle,
        model_dir=a.model_dir,
        host=a.host,
        port=a.port,
        metrics_port=a.metrics_port,
        device=a.device,
        limits=Limits(a.max_candidates, a.max_sequence_length),
        batching=BatcherConfig(rows, a.max_wait_us, a.max_queue),
        max_message_bytes=a.max_message_bytes,
        rpc_threads=a.rpc_threads,
        torch_threads=a.torch_threads or None,
        poll_interval_s=a.poll_interval_s,
        reuse_port=a.reuse_port,
        switch_interval_s=None if a.switch_interval_ms is None else a.switch_interval_ms / 1e3,
        verify_checksums=not a.no_verify_checksums,
        admin_writes=not a.no_admin_writes,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(parse_args(argv))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    server = PredictionServer(config).start()
    signal.signal(signal.SIGTERM, lambda *_: server.stop(grace=5.0))
    if not server.wait_ready():
        logging.error("no model could be loaded: %s", server.load_error)
        server.stop(grace=0)
        return 1
    print(f"SERVING on {config.host}:{server.port} (metrics: {server.metrics_port})", flush=True)
    try:
        server.wait()
    except KeyboardInterrupt:
        server.stop(grace=5.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
