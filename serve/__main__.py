"""``python -m serve --bundle DIR | --model-dir DIR --port P [--metrics-port M] ...``

The port serves Predict and the Open Inference Protocol (``inference.GRPCInferenceService``;
its HTTP/JSON form on ``--http-port``). Limits, admission, TLS and the admin service are flags
here; ``GetModelMetadata`` reports the limits a client must keep to. The admin service (delta
updates, table inspection) is off unless ``--admin-address`` is given.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
from pathlib import Path

from serve.admin import AdminConfig
from serve.batcher import BatcherConfig
from serve.limits import Limits
from serve.model import default_device
from serve.oip_servicer import DEFAULT_MODEL_NAME
from serve.security import TlsConfig
from serve.server import PredictionServer, ServerConfig
from serve.slots import HandoffConfig
from serve.tiers import KEY_HEADROOM, TierConfig
from shared.cli import Parser, check_device, check_port, plain, run_cli

EXAMPLE = """examples:
  python -m serve --bundle runs/dyn/bundle --port 8500 --metrics-port 9100
  python -m serve --model-dir /srv/models --port 8500 --device cuda   # hot-swaps new versions
  python -m serve --bundle runs/dyn/bundle --port 8500 --http-port 8000   # + KServe v2 REST"""

# one request of 500-1000 candidates fills a CPU batch; a GPU runs 8K rows in about the time of 1K
DEFAULT_BATCH_ROWS = {"cpu": 1024, "cuda": 8192}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m serve", description=plain(__doc__), epilog=EXAMPLE)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--bundle", type=Path, help="serve this bundle directory")
    src.add_argument("--model-dir", type=Path, help="watch <dir>/<version>/ bundles, hot-swap")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine)"
    )
    p.add_argument("--port", type=int, default=8500, help="gRPC port (0: any free one)")
    p.add_argument(
        "--metrics-port", type=int, default=None, help="Prometheus /metrics port (default: off)"
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="the Open Inference Protocol's HTTP/JSON form (KServe v2 REST) on this port, with "
        "the TLS and limits of --port (default: off; gRPC's inference.GRPCInferenceService is "
        "always on --port)",
    )
    p.add_argument(
        "--model-name",
        default=DEFAULT_MODEL_NAME,
        help="the model's name in the Open Inference Protocol (default %(default)s)",
    )
    p.add_argument(
        "--poll-interval-s",
        type=float,
        default=2.0,
        help="--model-dir: seconds between looks for new versions (default %(default)s)",
    )
    p.add_argument(
        "--watch-deltas",
        type=Path,
        help="apply the newest delta under <dir>/<base version>/ as it lands (what train stream "
        "--publish-root R writes to R/deltas; serve R/full with --model-dir)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if any")
    p.add_argument(
        "--cuda-graphs",
        choices=["on", "off"],
        default="on",
        help="CUDA: replay each batch as a captured CUDA graph per shape bucket, captured at "
        "model load (bundles of format 3; others run eagerly) (default %(default)s)",
    )
    p.add_argument(
        "--reuse-graphs",
        choices=["on", "off"],
        default="on",
        help="with CUDA graphs: keep the replaced version (and, from startup, a copy of the first) "
        "as a spare and write the next version into its tables and weights, so a swap captures "
        "no graphs; costs one more copy of the tables and graphs held (serve.spare) "
        "(default %(default)s)",
    )
    p.add_argument(
        "--cache-load-factor",
        action="append",
        default=[],
        metavar="TABLE=F",
        help="serve dynamic table TABLE from host memory with the share F (0 < F <= 1) of its "
        "rows, the hottest, in GPU memory; repeat per table; beats the bundle's fg.json factor "
        "(serve.tiers)",
    )
    p.add_argument(
        "--hbm-budget-gib",
        type=float,
        default=None,
        help="GPU memory the tables may use: tables without a factor share one planned factor "
        "when they do not fit; a budget that cannot fit refuses the load (default: no budget)",
    )
    p.add_argument(
        "--key-headroom",
        type=float,
        default=KEY_HEADROOM,
        metavar="FRACTION",
        help="free slots of the GPU tables for new keys from deltas, a fraction of their keys at "
        "load and at each rebuild: a delta whose new keys fit is written in place; one that "
        "does not rebuilds the tables beside the serving version and captures its CUDA graphs "
        "again. A server that follows a trainer from its first steps sees its keys grow many "
        "times over: give it room (default %(default)s)",
    )
    p.add_argument(
        "--no-verify-checksums",
        action="store_true",
        help="skip the sha256 of the bundle files at load (faster startup)",
    )
    _batching_args(p.add_argument_group("batching and admission"))
    _limit_args(p.add_argument_group("request limits (reported by GetModelMetadata)"))
    _process_args(p.add_argument_group("process"))
    _tls_args(p.add_argument_group("TLS for the public port (and a TCP admin address)"))
    _admin_args(p.add_argument_group("admin service (off unless --admin-address)"))
    return p


def _batching_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--max-batch-rows",
        type=int,
        default=None,
        help=f"candidate rows per batch (default: {DEFAULT_BATCH_ROWS['cpu']} on the CPU, "
        f"{DEFAULT_BATCH_ROWS['cuda']} on CUDA, where a larger batch costs about the same)",
    )
    g.add_argument(
        "--max-wait-us",
        type=int,
        default=500,
        help="how long the first request of a batch waits for others (default %(default)s)",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=Limits().max_pending,
        help="Predicts in flight (parsing, queued or running); past it RESOURCE_EXHAUSTED at "
        "once (default %(default)s)",
    )
    g.add_argument(
        "--reserve-threads",
        type=int,
        default=8,
        help="RPC threads beyond --max-queue, for health checks, metadata and refusals "
        "(default %(default)s)",
    )


def _limit_args(g: argparse._ArgumentGroup) -> None:
    lim = Limits()
    g.add_argument(
        "--max-candidates",
        type=int,
        default=lim.max_candidates,
        help="candidate ads per request (default %(default)s)",
    )
    g.add_argument(
        "--max-sequence-length",
        type=int,
        default=None,
        help="cap every click sequence at this many elements (default: each sequence's "
        "sequence_length from the config)",
    )
    for flag, default, what in (
        ("--max-string-bytes", lim.max_string_bytes, "UTF-8 bytes of one string value"),
        ("--max-request-bytes", lim.max_request_bytes, "serialized PredictRequest size"),
        ("--max-detail-bytes", lim.max_detail_bytes, "error details are cut to this size"),
    ):
        g.add_argument(flag, type=int, default=default, help=f"{what} (default %(default)s)")


def _process_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (0: torch's default, one per core); 1 suits a small CPU host "
        "where the RPC threads need the other cores",
    )
    g.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="Python's GIL switch interval (sys.setswitchinterval; default 5 ms): how long a "
        "thread that wants the GIL back (the batcher, after each torch call) may wait for the "
        "RPC threads running validation and feature generation",
    )
    g.add_argument(
        "--load-switch-interval-ms",
        type=float,
        default=0.2,
        help="the GIL switch interval while a new version loads beside the serving one: how "
        "long the batcher may wait for the loading thread (0: leave it as is) "
        "(default %(default)s)",
    )
    g.add_argument(
        "--reuse-port",
        action="store_true",
        help="SO_REUSEPORT: several server processes share --port (the kernel spreads "
        "connections over them), e.g. one per few cores to get past the GIL of one process",
    )
    g.add_argument(
        "--frontends",
        type=int,
        default=0,
        help="N > 0: this process owns the device (batcher, models, CUDA graphs, admin) and N "
        "frontend processes serve --port (parse, validation, feature generation), handing "
        "batches over in shared memory: one CUDA context instead of one per --reuse-port "
        "process (default 0: this process serves the port)",
    )
    handoff = HandoffConfig()
    g.add_argument(
        "--handoff-slots",
        type=int,
        default=handoff.slots,
        help="--frontends: shared-memory batch slots per frontend (default %(default)s)",
    )
    g.add_argument(
        "--handoff-slot-kib",
        type=int,
        default=handoff.slot_bytes >> 10,
        help="--frontends: KiB per slot; a larger batch goes through the pipe "
        "(default %(default)s)",
    )
    g.add_argument(
        "--handoff-inflight",
        type=int,
        default=handoff.inflight,
        help="--frontends: handoffs a frontend has waiting for answers before it groups the "
        "requests queued behind them into one (default %(default)s)",
    )


def _tls_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--tls-cert", type=Path, help="PEM certificate chain")
    g.add_argument("--tls-key", type=Path, help="PEM private key")
    g.add_argument(
        "--tls-client-ca", type=Path, help="PEM CA bundle: require client certificates (mTLS)"
    )


def _admin_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--admin-address",
        default=None,
        help="host:port or unix:/path for ModelAdminService (delta updates, table inspection); "
        "never the public port",
    )
    g.add_argument(
        "--admin-token-file", type=Path, help="file holding the bearer token admin calls must send"
    )
    g.add_argument(
        "--delta-root", type=Path, help="ApplyDelta reads delta directories only under this one"
    )
    g.add_argument(
        "--no-admin-writes", action="store_true", help="refuse ModelAdminService.ApplyDelta"
    )


def config_from_args(a: argparse.Namespace) -> ServerConfig:
    device = a.device or default_device()
    rows = a.max_batch_rows or DEFAULT_BATCH_ROWS.get(device, DEFAULT_BATCH_ROWS["cpu"])
    return ServerConfig(
        bundle=a.bundle,
        model_dir=a.model_dir,
        host=a.host,
        port=a.port,
        metrics_port=a.metrics_port,
        http_port=a.http_port,
        model_name=a.model_name,
        device=a.device,
        cuda_graphs=a.cuda_graphs == "on",
        reuse_graphs=a.reuse_graphs == "on",
        limits=Limits(
            max_candidates=a.max_candidates,
            max_sequence_length=a.max_sequence_length,
            max_string_bytes=a.max_string_bytes,
            max_request_bytes=a.max_request_bytes,
            max_detail_bytes=a.max_detail_bytes,
            max_pending=a.max_queue,
        ),
        batching=BatcherConfig(rows, a.max_wait_us),
        reserve_threads=a.reserve_threads,
        torch_threads=a.torch_threads or None,
        poll_interval_s=a.poll_interval_s,
        watch_deltas=a.watch_deltas,
        reuse_port=a.reuse_port,
        frontends=a.frontends,
        handoff=HandoffConfig(a.handoff_slots, a.handoff_slot_kib << 10, a.handoff_inflight),
        switch_interval_s=None if a.switch_interval_ms is None else a.switch_interval_ms / 1e3,
        load_switch_interval_s=a.load_switch_interval_ms / 1e3 or None,
        verify_checksums=not a.no_verify_checksums,
        tls=_tls(a),
        admin=_admin(a),
        tiers=TierConfig.from_flags(a.cache_load_factor, a.hbm_budget_gib, a.key_headroom),
    )


def _tls(a: argparse.Namespace) -> TlsConfig | None:
    if a.tls_cert is None and a.tls_key is None:
        if a.tls_client_ca is not None:
            raise ValueError(
                "--tls-client-ca needs --tls-cert and --tls-key; pass both, or drop --tls-client-ca"
            )
        return None
    if a.tls_cert is None or a.tls_key is None:
        raise ValueError("TLS needs both --tls-cert and --tls-key; pass both, or neither")
    return TlsConfig(a.tls_cert, a.tls_key, a.tls_client_ca)


def _admin(a: argparse.Namespace) -> AdminConfig | None:
    if a.admin_address is None:
        given = [
            flag
            for flag, value in (
                ("--admin-token-file", a.admin_token_file),
                ("--delta-root", a.delta_root),
                ("--no-admin-writes", a.no_admin_writes or None),
            )
            if value is not None
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)} need --admin-address (the admin service is off); pass "
                "--admin-address or drop them"
            )
        return None
    return AdminConfig(
        address=a.admin_address,
        token_file=a.admin_token_file,
        delta_root=a.delta_root,
        allow_writes=not a.no_admin_writes,
    )


def _check_machine(config: ServerConfig) -> None:
    """What the flags ask of this machine (a device, a bundle, free ports), before starting."""
    check_device(config.device)
    if config.bundle is not None and not config.bundle.is_dir():
        raise FileNotFoundError(
            f"--bundle {config.bundle}: no such directory; pass a bundle written by "
            "python -m train export (or --model-dir DIR for DIR/<version>/ bundles)"
        )
    reuse = config.reuse_port or config.frontends > 0
    check_port(config.host, config.port, "--port", reuse_port=reuse)
    check_port(config.host, config.metrics_port, "--metrics-port")
    check_port(config.host, config.http_port, "--http-port")


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


def _main(argv: list[str]) -> int:
    # force: importing torchrec installs a root handler first, which would make this a no-op
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    config = config_from_args(parse_args(argv))  # ValueError, OSError: run_cli's error line
    _check_machine(config)
    # what the imports made lives as long as the process: out of the collector's generations, a
    # full collection scans only what came after (a pause of ~0.1 s otherwise, in a p99)
    gc.collect()
    gc.freeze()
    server = PredictionServer(config).start()
    signal.signal(signal.SIGTERM, lambda *_: server.stop(grace=5.0))
    if not server.wait_ready():
        logging.error("no model could be loaded: %s", server.load_error)
        server.stop(grace=0)
        return 1
    frontends = "" if server.frontends is None else f", frontend pids {server.frontends.pids()}"
    print(
        f"SERVING on {config.host}:{server.port} (metrics: {server.metrics_port}{frontends})",
        flush=True,
    )
    try:
        server.wait()
    except KeyboardInterrupt:
        server.stop(grace=5.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
