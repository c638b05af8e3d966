"""Online training end to end: the train samples replayed as hourly partitions → ``train stream``
→ a serving process under load, then the streamed model's AUC against batch training.

The run, in phases:

0. The samples are cut into partitions by the hour of their ``time_stamp`` (``--split hour``;
   or ``--split N``: N equal parts), rows in time order. The first partition lands; ``python
   -m train stream`` (a process of its own) trains it and publishes a full bundle; a server
   (``python -m serve --model-dir R/full --watch-deltas R/deltas``, a process of its own)
   starts on it and takes a warm-up load.
1. **With publishing:** the other partitions land at ``--replay-rows-per-s`` (each one when its
   rows are due; writer threads prepare them ahead and a rename lands each), while a paced
   load (a process of its own, running on through phase 3) sends ``--load-candidates-per-s``
   (requests of ``--candidates``) and a probe reads ``GetModelMetadata`` every
   ``--probe-every-s``. This phase ends when the trainer has trained every row and its last
   publish serves; the trainer is then stopped (SIGTERM: it commits its last checkpoint).
2. **Training without publishing:** a second ``train stream`` (the same command without
   ``--publish-root``) in a directory of its own (``training/``: source, model dir, row log)
   trains the same partitions from scratch: the first lands, it trains it, and the others land
   at the same rate while the same load runs as long as phase 1 did. Its model is not used
   again.
3. **Idle:** that trainer stopped too and ``--settle-s`` later, the same load as long again on
   the same server. The settling keeps the trainer's exit out of the window: on the H100 on
   2026-12-08 the window began 3.6 s after the stop, and its first six seconds answered at p99
   178-223 ms against 31-98 ms after them (the exit's checkpoint writes, its loader workers and
   its CUDA context going).
4. **AUC** on the eval samples (the last day) of five models trained on the same rows, each one
   epoch at the same batch size (``stream``, phase 1's live run; ``stream_without_publishing``,
   phase 2's; ``batch``, shuffled; ``batch_in_order``; ``stream_replay``), and whether the live
   run's row log (``--row-log``) holds every landed row once, in order. What each model is and
   which goal judges which difference: ``bench/stream_auc.py``.

**Serving: what "without publishing" is.** The issue's goal, "serving p99 at 100K candidates/s
stays <= 1.1x its value without publishing", is judged on phase 1 against phase 2
(``serving_p99_ratio<=1.1`` on ``p99_ratio_publishing``): in production the trainer and the
servers run on machines of their own, so publishing's cost to a server is the delta it takes
in and applies (and, here, the export process and the checkpoints of each publish), not the
trainer's own training; on one bench host the trainer's load can only be held equal, training
in both phases. Phase 2 replays the same rows at the same rate through the same trainer and
loader from the same start (a fresh model, as phase 1's), so its training work is phase 1's
step for step; only the publishes (their checkpoints, exports, the server's applies) are
missing. Phase 3 is the older reading, the trainer stopped: ``p99_ratio_training`` (phase 2
against phase 3, for information) is what training beside the server costs it on a shared
host. Phase 2 leaves phase 1's source, model dir, row log and publish root alone, so the AUC
phase and the exactly-once check read phase 1's live run only, every row trained once.

**Event time is landing time:** each partition's ``time_stamp`` is rewritten to the second it is
due to land, so freshness is "landed → served" (``bench/stream_source.py`` says more).

**The modules:** this one holds the phases, the run, the goals and the CLI; the source (the cut,
the lander) is ``bench/stream_source.py``, the trainer and server processes
``bench/stream_processes.py``, the probe and the load ``bench/stream_load.py``, the reports of
phases 1 to 3 ``bench/stream_reports.py`` and phase 4 ``bench/stream_auc.py``.

Reported (JSON): ``train`` (rows/s of the trainer's ``stream`` records during phase 1, lag),
``publish`` (seconds from snapshot to files in place, the loop's stall per publish),
``freshness`` (``event_to_served_s``: per version of phase 1's rows, the first probe that saw
it served minus its event time; ``served_age_s``: age of what served at each probe of phase 1
from the first of them on; the probes in ``probe.json`` of the work dir),
``train_without_publishing`` (phase 2's trainer: rows/s, whether and when it caught up within
the window), ``serving`` (p50/p99 of the three phases, ``p99_ratio_publishing`` and
``p99_ratio_training``, and ``with_publishing_by_event``: phase 1's answers split by what the
server or the trainer was doing when they were sent, ``bench/stream_events.py``), ``auc`` (each
model's AUC, their differences, each model's steps, rows and seconds, the row log's check;
written as each model is measured, with ``pending`` until the last) and the goals. The JSON is
written after phases 1, 2 and 3 and after each model of phase 4, so a run cut short keeps what
it measured, the issue's goals first.

CPU (a smoke run of all of it, small numbers; ``bench/results/bench_stream_cpu.json``)::

    python -m bench.bench_stream --size small --device cpu --batch-size 1024 \
        --replay-rows-per-s 2000 --out bench/results/bench_stream_cpu.json

The device run is ``bench/run_stream_gpu.sh`` (full data, 168 hourly partitions, 1M rows/s).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa

from bench.stream_auc import auc
from bench.stream_events import attribution, server_applies, trainer_publishes
from bench.stream_load import LoadProcess, PacedLoad, Probe, build_requests
from bench.stream_processes import (
    ROOT,
    free_port,
    records,
    start_server,
    start_trainer,
    stop,
    wait_until,
)
from bench.stream_reports import (
    freshness,
    publish_report,
    serving_report,
    train_report,
    training_report,
)
from bench.stream_source import Lander, cut
from protos import predict_pb2, predict_pb2_grpc

CONFIG = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config"


def _samples(size: str, work: Path) -> Path:
    """``work/data/samples`` (train/ and eval/) of the synthetic dataset of ``size``."""
    from shared.config import load_config
    from shared.features import build_feature_set
    from train.data.synthetic import generate
    from train.data.taobao import build_samples

    generate(size, work / "data", seed=0)
    build_samples(work / "data" / "raw", work / "data" / "samples",
                  build_feature_set(load_config(CONFIG)))  # fmt: skip
    return work / "data" / "samples"


def _first_publish(work: Path) -> bool:
    full = work / "pub" / "full"
    return full.is_dir() and any((p / "manifest.json").is_file() for p in full.iterdir())


def _caught_up(work: Path, total_rows: int) -> bool:
    done = records(work, "stream")
    return bool(done) and done[-1]["samples"] >= total_rows


def phase_0(args: argparse.Namespace, work: Path, lander: Lander) -> dict[str, Any]:
    """First partition, trainer, first publish, server, requests, warm-up load."""
    lander.land_first()
    trainer = start_trainer(args, work, publish=True)
    wait_until("the first publish", lambda: _first_publish(work), args.start_timeout_s, trainer)
    port = free_port()
    server = start_server(args, work, port)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = predict_pb2_grpc.PredictionServiceStub(channel)

    def ready() -> bool:
        try:
            stub.GetModelMetadata(predict_pb2.ModelMetadataRequest(), timeout=2)
            return True
        except grpc.RpcError:
            return False

    wait_until("the server", ready, args.start_timeout_s, server, trainer)
    requests = build_requests(stub, args.eval_rows, args.candidates, 32)
    per_s = args.load_candidates_per_s / args.candidates
    warm = PacedLoad(f"127.0.0.1:{port}", requests, per_s, args.load_threads).run()
    time.sleep(args.warmup_s)
    warm.finish()
    return {"trainer": trainer, "server": server, "stub": stub, "channel": channel,
            "host": f"127.0.0.1:{port}", "requests": requests, "per_s": per_s}  # fmt: skip


def phase_1(args: argparse.Namespace, work: Path, lander: Lander, ctx: dict) -> dict[str, Any]:
    """The replay under load, until every row is trained and the last publish serves."""
    total = sum(p.num_rows for p in lander.parts)
    probe = Probe(ctx["stub"], args.probe_every_s)
    probe.thread.start()
    load = LoadProcess(ctx["host"], ctx["requests"], ctx["per_s"], args.load_threads)
    time.sleep(1.0)  # its clients connected and sending
    t0, replay_start = time.monotonic(), time.time()
    lander.replay(replay_start + 0.5)
    replay_s = total / args.replay_rows_per_s + args.start_timeout_s
    wait_until("the replay", lander.done, replay_s, ctx["trainer"])
    landed_at = time.time()
    wait_until("the trainer caught up", lambda: _caught_up(work, total), args.start_timeout_s,
               ctx["trainer"])  # fmt: skip
    caught_up_at = time.time()

    def last_served() -> bool:
        done = records(work, "publish")
        return bool(done) and done[-1]["step"] >= records(work, "stream")[-1]["step"] and \
            probe.serving() == done[-1]["version"]  # fmt: skip

    wait_until("the last publish served", last_served, args.start_timeout_s, ctx["trainer"])
    t1, end = time.monotonic(), time.time()
    return {"probe": probe, "load": load, "t0": t0, "t1": t1, "replay_start": replay_start,
            "end": end,
            "landed_at": landed_at, "caught_up_at": caught_up_at, "rows": total}  # fmt: skip


def phase_2(args: argparse.Namespace, work: Path, parts: list[pa.Table],
            seconds: float) -> dict[str, Any]:  # fmt: skip
    """Training without publishing (module doc): a second trainer, without ``--publish-root``,
    in ``work/training``: its first partition lands and is trained, then the others land at
    the same rate as in phase 1 for ``seconds`` (phase 1's length), the load's window; then
    the trainer is stopped. Phase 1's trainer must be stopped before."""
    home = work / "training"
    lander = Lander(parts, home / "src", args.replay_rows_per_s, args.writers)
    trainer: subprocess.Popen[bytes] | None = None
    try:
        lander.land_first()
        trainer = start_trainer(args, home, publish=False)
        first = parts[0].num_rows
        wait_until("the trainer without publishing on its first partition",
                   lambda: _caught_up(home, first), args.start_timeout_s, trainer)  # fmt: skip
        t0, replay_start = time.monotonic(), time.time()
        lander.replay(replay_start + 0.5)  # as phase 1
        wait_until("the window of training without publishing",
                   lambda: time.monotonic() - t0 >= seconds, seconds + 60, trainer)  # fmt: skip
        t1, end = time.monotonic(), time.time()
    finally:
        lander.close()
        if trainer is not None:
            stop(trainer)
    rows = sum(p.num_rows for p in parts)
    report = training_report(records(home, "stream"), replay_start, end, rows)
    # an exit other than 0 after the window (the H100 on 2026-12-07: -6, an abort at exit) is
    # a problem of the run, kept in the JSON: the phases after this one still measure
    report["exit_code_at_sigterm"] = trainer.returncode
    if trainer.returncode != 0:
        print(f"the trainer without publishing exited {trainer.returncode} at SIGTERM "
              f"(0 expected): see {home}/trainer.log", file=sys.stderr, flush=True)  # fmt: skip
    report["partitions_landed"] = len(lander.landed)
    report["publishes"] = len(records(home, "publish"))  # none: the trainer did not publish
    return {"window": (t0, t1), "train": report}


def phase_3(seconds: float) -> tuple[float, float]:
    """Idle: no trainer; the load's window of ``seconds`` (monotonic start, end)."""
    t0 = time.monotonic()
    time.sleep(seconds)
    return t0, time.monotonic()


def serving_phases(
    args: argparse.Namespace, work: Path, parts: list[pa.Table], result: dict[str, Any],
    save: Callable[[], None],
) -> None:  # fmt: skip
    """Phases 0 to 3 (module doc), their reports into ``result``; ``save()`` after each of
    1 to 3. The processes are stopped whatever happens."""
    lander = Lander(parts, work / "src", args.replay_rows_per_s, args.writers)
    ctx: dict[str, Any] = {}
    try:
        ctx = phase_0(args, work, lander)
        p1 = phase_1(args, work, lander, ctx)
        stop(ctx["trainer"])  # it commits its last checkpoint: phase 4's "stream"
        seconds, load = p1["t1"] - p1["t0"], p1["load"]
        windows = {"with_publishing": (p1["t0"], p1["t1"])}
        result["train"], result["publish"] = train_report(work, p1, lander), publish_report(work)
        result["train"]["exit_code_at_sigterm"] = ctx["trainer"].returncode  # as phase 2's
        result["freshness"] = freshness(p1)
        result["serving"] = serving_report(load.so_far(), windows)
        save()
        p2 = phase_2(args, work, parts, seconds)
        windows["training_without_publishing"] = p2["window"]
        result["train_without_publishing"] = p2["train"]
        result["serving"] = serving_report(load.so_far(), windows)
        save()
        time.sleep(args.settle_s)  # the second trainer's exit out of the idle window
        windows["idle"] = phase_3(seconds)
        done = load.finish()
        result["serving"] = serving_report(done, windows)
        result["serving"]["with_publishing_by_event"] = attribution(
            done, windows["with_publishing"], server_applies(work / "server.log"),
            trainer_publishes(work), mono_to_unix=time.time() - time.monotonic(),
        )  # fmt: skip
        p1["probe"].stop.set()
        # (unix time, version, event time, age) of each probe
        (work / "probe.json").write_text(json.dumps(p1["probe"].samples))
        save()
    finally:
        lander.close()
        for name in ("trainer", "server"):
            if name in ctx:
                stop(ctx[name], 60)


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench_stream.", dir=args.work_dir))
    samples = args.samples or _samples(args.size, work) / "train"
    args.eval_rows = args.eval_rows or samples.parent / "eval"
    t0 = time.perf_counter()
    parts = cut(samples, args.split)
    result: dict[str, Any] = {
        "bench": "stream", "device": args.device, "machine": _machine(args.device),
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "config": str(args.config),
        "samples": str(samples), "split": args.split, "partitions": len(parts),
        "event_time": "landing time (time_stamp rewritten to the second each partition is due)",
        "publish_every_s": args.publish_every_s, "full_every": args.full_every,
        "server_poll_interval_s": args.poll_s, "settle_s": args.settle_s,
        "cut_seconds": time.perf_counter() - t0,
        "load": {"candidates_per_s": args.load_candidates_per_s, "candidates": args.candidates},
        "work_dir": str(work),
    }  # fmt: skip
    pending = {} if args.no_auc else {"auc": "pending"}

    def save() -> None:  # what is measured so far, for a run cut short
        write(args.out, {**result, **pending, "goals": goals(result)})

    (work / "src").mkdir()
    serving_phases(args, work, parts, result, save)
    if not args.no_auc:

        def save_auc(part: dict[str, Any]) -> None:
            done = {**result, "auc": {**part, "pending": True}}
            write(args.out, {**done, "goals": goals(done)})

        result["auc"] = auc(args, work, samples, save_auc)
    result["goals"] = goals(result)
    return result


def write(out: Path, result: dict[str, Any]) -> None:
    """``result`` as JSON to ``out``, atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)


def _machine(device: str) -> str:
    """The card (CUDA) or the CPU cores this process may use."""
    if device == "cuda":
        import torch

        return f"{torch.cuda.get_device_name()}, {len(os.sched_getaffinity(0))} CPU cores"
    return f"CPU, {len(os.sched_getaffinity(0))} cores"


def goals(r: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, each with the measured value and whether it is met."""
    rate = r["train"]["replay_rows_per_s"]
    p99 = r["freshness"]["event_to_served_s"]["p99"]
    out: dict[str, Any] = {
        "replay_rows_per_s>=1e6": {"value": rate, "met": rate >= 1e6},
        "event_to_served_p99_s<=30": {"value": p99, "met": p99 is not None and p99 <= 30},
    }
    if "p99_ratio_publishing" in r["serving"]:  # with publishing against training without
        ratio = r["serving"]["p99_ratio_publishing"]
        out["serving_p99_ratio<=1.1"] = {
            "value": ratio,
            "met": ratio is not None and ratio <= 1.1,
            "ci95": r["serving"].get("p99_ratio_publishing_ci95"),  # one run's chance spread
        }
    a = r.get("auc")
    if not isinstance(a, dict):
        return out
    # which difference is which: bench/stream_auc.py's module doc; each where phase 4 measured it
    for goal, diff, bound in (("abs_auc_diff<=0.002", "stream_minus_batch", 0.002),
                              ("in_order_abs_auc_diff<=0.002", "stream_minus_batch_in_order", 0.002),
                              ("replay_abs_auc_diff<=0.0005", "stream_replay_minus_batch_in_order",
                               0.0005)):  # fmt: skip
        if diff in a:
            out[goal] = {"value": a[diff], "met": abs(a[diff]) <= bound}
    if "stream_rows_once_in_order" in a:
        once = a["stream_rows_once_in_order"]
        out["stream_rows_once_in_order"] = {"value": once, "met": once}
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.bench_stream", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--samples", type=Path, help="train samples (file or dir); default: --size")
    p.add_argument("--eval-rows", type=Path, help="eval samples; default: beside --samples")
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch-size", type=int, help="default: the config's")
    p.add_argument("--num-workers", type=int, help="loader workers; default: the config's")
    p.add_argument("--split", default="hour", help="'hour' or a number of equal partitions")
    p.add_argument("--replay-rows-per-s", type=float, default=20_000.0)
    p.add_argument("--writers", type=int, default=2, help="threads writing partitions ahead")
    p.add_argument("--publish-every-s", type=float, default=10.0)
    p.add_argument("--full-every", type=int, default=10)
    p.add_argument("--poll-s", type=float, default=0.5, help="the server's poll interval")
    p.add_argument(
        "--frontends", type=int, default=0,
        help="the server's frontend processes (serve --frontends; 0: one process). On the H100 "
        "on 2026-12-07 one process beside the trainer answered 66K of the 100K candidates/s "
        "asked, at p50 245 ms",
    )  # fmt: skip
    p.add_argument(
        "--server-args", type=shlex.split, default=[], metavar="'FLAGS'",
        help="more flags of the server (python -m serve), one shell-quoted string: e.g. "
        "'--key-headroom 20' (the base is published within the first steps, so the keys of "
        "the first deltas outgrow the default 10 %% room and the server rebuilds its tables "
        "once), '--torch-threads 2', '--switch-interval-s 0.0005'",
    )  # fmt: skip
    p.add_argument("--probe-every-s", type=float, default=0.2)
    p.add_argument("--candidates", type=int, default=100, help="candidates per request")
    p.add_argument("--load-candidates-per-s", type=float, default=2_000.0)
    p.add_argument("--load-threads", type=int, default=8)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--settle-s", type=float, default=10.0,
                   help="seconds between phase 2's trainer stopping and the idle window")  # fmt: skip
    p.add_argument("--start-timeout-s", type=float, default=180.0)
    p.add_argument("--no-auc", action="store_true", help="skip phase 4 (the AUC comparison)")
    p.add_argument("--work-dir", type=Path, help="parent of the run's temp dir")
    p.add_argument("--out", type=Path, required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = run(args)
    write(args.out, result)
    print(json.dumps(result))
    codes = {
        phase: result.get(phase, {}).get("exit_code_at_sigterm", 0)
        for phase in ("train", "train_without_publishing")
    }
    failed = {phase: code for phase, code in codes.items() if code != 0}
    if failed:
        print(f"failed: trainers exited other than 0 at SIGTERM: {failed} (see the JSON)",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
