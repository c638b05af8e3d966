"""Train-then-serve pipeline in one command.

data → samples → train → evaluate (AUC vs oracle) → export → serve → gRPC parity check against
the offline scorer → load test → Markdown report → stop the server. Each stage writes under
``--out`` and is skipped when its output exists (``--redo STAGE`` reruns it and what follows).

    bash scripts/pipeline.sh                          # synthetic `small` data, CPU
    bash scripts/pipeline.sh --size tiny --out runs/tiny --load-seconds 3
    bash scripts/pipeline.sh --raw-dir /data/taobao   # the real four CSV files
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.cli import Parser, check_device, plain, run_cli  # noqa: E402 (needs ROOT on the path)

STAGES = ("data", "train", "export", "serve")
log = logging.getLogger("pipeline")


def _run(cmd: list[str], log_file: Path) -> None:
    """Run a stage's command, tee-ing output to ``log_file``; raise with its tail on failure."""
    log.info("$ %s", " ".join(cmd))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log_file.open("w") as f:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            if "\r" not in line:
                sys.stderr.write(line)
        rc = proc.wait()
    if rc != 0:  # its output is already on stderr: name the command and the log
        raise ChildProcessError(
            f"stage command failed (exit code {rc}): {' '.join(cmd)}; its output is above and "
            f"in {log_file}"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON summary line in the stage output")


class Pipeline:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.py = sys.executable
        self.samples = self.out / "data" / "samples"
        self.model_dir = self.out / "model"
        self.bundle = self.out / "bundle"
        self.report: dict[str, object] = {"config": str(args.config), "size": args.size}
        if args.raw_dir:  # --size is not used then
            self.report["raw_dir"] = str(args.raw_dir)
        redo = STAGES.index(args.redo) if args.redo else len(STAGES)
        self.redo = set(STAGES[redo:])

    def stage_data(self) -> None:
        done = (self.samples / "eval").is_dir() and "data" not in self.redo
        if not done:
            shutil.rmtree(self.out / "data", ignore_errors=True)
            if self.args.raw_dir:
                cmd = [self.py, "-m", "train.data", "build", "--raw", str(self.args.raw_dir),
                       "--out", str(self.samples), "--config", str(self.args.config)]  # fmt: skip
            else:
                cmd = [self.py, "-m", "train.data", "all", "--size", self.args.size,
                       "--out", str(self.out / "data"), "--config", str(self.args.config)]  # fmt: skip
            _run(cmd, self.out / "data.log")
        import pyarrow.dataset as ds

        rows = {
            s: ds.dataset(str(self.samples / s), format="parquet").count_rows()
            for s in ("train", "eval")
        }
        self.report["data"] = {
            "train_rows": rows["train"],
            "eval_rows": rows["eval"],
            "dir": str(self.samples),
        }

    def stage_train(self) -> None:
        summary_file = self.model_dir / "train_summary.json"
        if "train" in self.redo or not summary_file.exists():
            shutil.rmtree(self.model_dir, ignore_errors=True)
            cmd = [self.py, "-m", "train", "train", "--config", str(self.args.config),
                   "--train", str(self.samples / "train"), "--eval", str(self.samples / "eval"),
                   "--model-dir", str(self.model_dir), "--device", self.args.device,
                   "--batch-size", str(self.args.batch_size), "--num-workers", str(self.args.num_workers),
                   "--log-every", "20", "--eval-every", str(self.args.eval_every)]  # fmt: skip
            _run(cmd, self.out / "train.log")
            summary = _last_json((self.out / "train.log").read_text())
            summary_file.write_text(json.dumps(summary, indent=2))
        self.report["train"] = json.loads(summary_file.read_text())

    def stage_export(self) -> None:
        if "export" in self.redo or not (self.bundle / "manifest.json").exists():
            cmd = [self.py, "-m", "train", "export", "--config", str(self.args.config),
                   "--model-dir", str(self.model_dir), "--out", str(self.bundle), "--overwrite"]  # fmt: skip
            _run(cmd, self.out / "export.log")
        self.report["bundle"] = {"dir": str(self.bundle), "bytes": _dir_size(self.bundle)}

    def stage_serve(self) -> None:
        """Start the server, check parity, load-test it, stop it (always)."""
        from loadtest.parity import check_parity
        from loadtest.run import fetch_metadata, run_load_test, wait_until_serving

        port, metrics_port = _free_port(), _free_port()
        host = f"127.0.0.1:{port}"
        cmd = [self.py, "-m", "serve", "--bundle", str(self.bundle), "--port", str(port),
               "--metrics-port", str(metrics_port), "--device", self.args.device]  # fmt: skip
        log.info("$ %s", " ".join(cmd))
        server_log = (self.out / "serve.log").open("w")
        started = time.perf_counter()
        server = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                  stdout=server_log, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            # the parity check scores offline here with the serving code (torch, torchrec: about
            # 4 s of imports on a 2-core CPU), which it would import once the server answers:
            # import it while the server process starts instead, on another core
            import serve.model  # noqa: F401
            import serve.offline  # noqa: F401

            wait_until_serving(host, timeout_s=300)
            waited = time.perf_counter() - started  # from the process start, imports included
            metadata = fetch_metadata(host)
            self.report["serve"] = {
                "host": host,
                "model_version": metadata.model_version,
                "device": metadata.device,
                "startup_seconds": dict(metadata.startup_seconds),
                "process_to_serving_s": round(waited, 2),
            }
            parity = check_parity(
                host, self.bundle, self.samples / "eval", num_requests=10, num_candidates=20
            )
            self.report["parity"] = parity.to_dict()
            log.info(
                "parity ok: max abs diff %.2e over %d candidates",
                parity.max_abs_diff,
                parity.candidates,
            )
            summary = run_load_test(
                host, self.samples / "eval", self.out / "loadtest",
                users=self.args.load_users, spawn_rate=self.args.load_users,
                duration_s=self.args.load_seconds, num_candidates=self.args.candidates,
                num_requests=500,
            )  # fmt: skip
            self.report["loadtest"] = {k: summary[k] for k in (
                "requests", "failures", "qps", "candidates_per_s", "latency_ms", "users",
                "candidates_per_request", "duration_s")}  # fmt: skip
            self.report["loadtest"]["plot"] = summary["files"]["plot"]  # type: ignore[index]
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            server_log.close()

    def write_report(self) -> Path:
        path = self.out / "report.md"
        (self.out / "report.json").write_text(json.dumps(self.report, indent=2, default=str))
        path.write_text(render(self.report, self.out) + "\n")
        return path

    def run(self) -> Path:
        t0 = time.perf_counter()
        for stage in STAGES:
            start = time.perf_counter()
            getattr(self, f"stage_{stage}")()
            self.report.setdefault("stage_seconds", {})[stage] = round(
                time.perf_counter() - start, 2
            )  # type: ignore[index]
        self.report["total_seconds"] = round(time.perf_counter() - t0, 2)
        return self.write_report()


def _fmt(v: object, spec: str = ".4f") -> str:
    return "n/a" if v is None else format(v, spec)  # type: ignore[arg-type]


def _data_source(r: dict) -> str:
    """``raw: <dir>`` for a --raw-dir run, else the synthetic --size."""
    return f"raw: {r['raw_dir']}" if r.get("raw_dir") else str(r["size"])


def render(r: dict, out: Path) -> str:
    """The Markdown report of one pipeline run."""
    d, t, b = r["data"], r["train"], r["bundle"]
    ev = t.get("eval") or {}
    source = _data_source(r)
    lines = [
        "# Pipeline report",
        "",
        f"config `{Path(r['config']).name}`, data `{source}`, total {r['total_seconds']} s "
        f"(stages: {', '.join(f'{k} {v} s' for k, v in r['stage_seconds'].items())})",
        "",
        "| data | rows |",
        "|---|---|",
        f"| train | {d['train_rows']:,} |",
        f"| eval | {d['eval_rows']:,} |",
        "",
        "## Training",
        "",
        f"{t['step']} steps in {t['train_seconds']:.1f} s, {t['samples_per_s']:,.0f} samples/s",
        "",
        "| eval AUC | oracle AUC | ratio | head AUC | tail AUC (tail rows) | log loss |",
        "|---|---|---|---|---|---|",
        f"| {_fmt(ev.get('auc'))} | {_fmt(ev.get('oracle_auc'))} | {_fmt(ev.get('auc_vs_oracle'), '.3f')} "
        f"| {_fmt(ev.get('head_auc'))} | {_fmt(ev.get('tail_auc'))} ({ev.get('tail_rows')}) "
        f"| {_fmt(ev.get('logloss'))} |",
        "",
        f"Curves: `{out / 'model' / 'curves.png'}`",
        "",
        "## Bundle and server",
        "",
        f"bundle {b['bytes'] / 1e6:.1f} MB at `{b['dir']}`",
        "",
    ]
    s = r.get("serve", {})
    if s:
        lines += [
            f"server {s['host']} on {s['device']}, model {s['model_version']}",
            "",
            "| startup stage | seconds |",
            "|---|---|",
            *[f"| {k} | {v:.4f} |" for k, v in s["startup_seconds"].items()],
            "",
        ]
    p = r.get("parity")
    if p:
        lines += [
            f"Parity: {p['requests']} gRPC requests, {p['candidates']} candidates, max |online - "
            f"offline| = {p['max_abs_diff']:.2e}",
            "",
        ]
    lt = r.get("loadtest")
    if lt:
        lat = lt["latency_ms"]
        lines += [
            "## Load test",
            "",
            f"{lt['users']} locust users, {lt['candidates_per_request']} candidates/request, "
            f"{lt['duration_s']} s",
            "",
            "| requests | errors | QPS | candidates/s | p50 ms | p95 ms | p99 ms | p99.9 ms |",
            "|---|---|---|---|---|---|---|---|",
            f"| {lt['requests']} | {lt['failures']} | {lt['qps']:.1f} | {lt['candidates_per_s']:,.0f} "
            f"| {lat['p50']:.2f} | {lat['p95']:.2f} | {lat['p99']:.2f} | {lat['p99.9']:.2f} |",
            "",
            f"![latency]({Path(lt['plot']).relative_to(out)})",
            "",
        ]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    doc = plain(__doc__).split("\n\n")
    p = Parser(
        prog="scripts/pipeline.py", description="\n\n".join(doc[:2]), epilog="examples:\n" + doc[2]
    )
    p.add_argument(
        "--config",
        type=Path,
        default=ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config",
        help="pipeline config (text proto)",
    )
    p.add_argument(
        "--size", choices=["tiny", "small", "full"], default="small", help="synthetic data size"
    )
    p.add_argument(
        "--raw-dir",
        type=Path,
        help="directory with the real dataset's four CSV files (instead of synthetic data)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "pipeline", help="stage outputs")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="train and serve on")
    p.add_argument("--batch-size", type=int, default=1024, help="training rows per batch")
    p.add_argument("--num-workers", type=int, default=1, help="data loader processes")
    p.add_argument("--eval-every", type=int, default=64, help="training steps between evaluations")
    p.add_argument("--candidates", type=int, default=100, help="candidates per load-test request")
    p.add_argument("--load-users", type=int, default=4, help="concurrent load-test users")
    p.add_argument("--load-seconds", type=int, default=20, help="load-test duration")
    p.add_argument("--redo", choices=STAGES, help="rerun this stage and every later one")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    check_device(args.device)
    for flag, path in (("--config", args.config), ("--raw-dir", args.raw_dir)):
        if path is not None and not path.exists():
            raise FileNotFoundError(f"{flag} {path}: no such file or directory; check the path")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    report = Pipeline(args).run()
    print(report.read_text())
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
