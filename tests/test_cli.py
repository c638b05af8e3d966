"""Every CLI, run as a user runs it: an ordinary mistake is one ``error: <what>; <what to do>``
line naming the flag or path, exit code 2, no traceback (``--debug`` shows it); help texts are
complete. One subprocess per bad input (the exit code is the process's), two at a time."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SEED_CONFIG = ROOT / "configs" / "multi_tower_din_taobao_dynamicemb.config"
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def _error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The one ``error:`` line of a failed run (third-party lines around it are tolerated)."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    assert proc.returncode == 2, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    """A port some other process (here: this one) listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture(scope="module")
def dead_address() -> Iterator[str]:
    """host:port where nothing answers (bound, never listening: connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


def _typo_config(tmp: Path) -> Path:
    path = tmp / "typo.config"
    text = SEED_CONFIG.read_text()
    assert "batch_size:" in text
    path.write_text(text.replace("batch_size:", "batch_sise:", 1))
    return path


def _existing_bundle(tmp: Path) -> Path:
    out = tmp / "bundle"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    return out


# name -> (tmp_path, busy port, dead address) -> (argv after `python`, what the line must name)
Case = Callable[[Path, int, str], tuple[list[str], list[str]]]
TRAIN = ["-m", "train", "train", "--config"]
CASES: dict[str, Case] = {
    "train typo'd config field": lambda t, p, d: (
        [*TRAIN, str(_typo_config(t))],
        [str(t / "typo.config"), "batch_sise"],
    ),
    "train missing config": lambda t, p, d: ([*TRAIN, str(t / "nope.config")], ["nope.config"]),
    "train missing data dir": lambda t, p, d: (
        [*TRAIN, str(SEED_CONFIG), "--train", str(t / "nodata"), "--eval", str(t / "nodata")]
        + ["--model-dir", str(t / "m"), "--device", "cpu", "--num-workers", "0"],
        [str(t / "nodata"), "--train"],
    ),
    "train bad flag value": lambda t, p, d: (
        [*TRAIN, str(SEED_CONFIG), "--max-steps", "ten"],
        ["--max-steps", "'ten'"],
    ),
    "export existing dir": lambda t, p, d: (
        ["-m", "train", "export", "--config", str(SEED_CONFIG), "--model-dir", str(t / "m")]
        + ["--out", str(_existing_bundle(t))],
        [str(t / "bundle"), "--overwrite"],
    ),
    "train.data missing raw dir": lambda t, p, d: (
        ["-m", "train.data", "build", "--raw", str(t / "raw"), "--out", str(t / "s")],
        [str(t / "raw"), "--raw"],
    ),
    "train.tools convert --samples MISSING": lambda t, p, d: (
        ["-m", "train.tools", "convert", "--from-config", str(SEED_CONFIG), "--checkpoint"]
        + [str(t), "--to-config", str(SEED_CONFIG), "--samples", "MISSING", "--out", str(t)],
        ["--samples MISSING"],
    ),
    "train.tools inspect dead server": lambda t, p, d: (
        ["-m", "train.tools", "inspect", "--server", d],
        ["UNAVAILABLE", "--server"],
    ),
    "serve port in use": lambda t, p, d: (
        ["-m", "serve", "--bundle", str(t), "--port", str(p), "--device", "cpu"],
        [f"--port {p}", "in use"],
    ),
    "serve missing bundle": lambda t, p, d: (
        ["-m", "serve", "--bundle", str(t / "nobundle"), "--port", "0", "--device", "cpu"],
        [f"--bundle {t / 'nobundle'}"],
    ),
    "loadtest dead server": lambda t, p, d: (
        ["-m", "loadtest", "--host", d, "--samples", str(t), "--out", str(t / "lt")]
        + ["--connect-timeout", "1"],
        [d, "--host"],
    ),
    "loadtest missing samples": lambda t, p, d: (
        ["-m", "loadtest", "--host", d, "--samples", str(t / "eval"), "--out", str(t / "lt")],
        [f"--samples {t / 'eval'}"],
    ),
    "bench bad flag value": lambda t, p, d: (
        ["-m", "bench.bench_hashtable", "--out", str(t / "b.json"), "--keys", "many"],
        ["--keys", "'many'"],
    ),
    "pipeline missing raw dir": lambda t, p, d: (
        ["scripts/pipeline.py", "--raw-dir", str(t / "raw"), "--out", str(t / "run")],
        [f"--raw-dir {t / 'raw'}"],
    ),
}
CUDA_CASES: dict[str, Case] = {
    "train --device cuda": lambda t, p, d: (
        [*TRAIN, str(SEED_CONFIG), "--device", "cuda"],
        ["--device cuda", "--device cpu"],
    ),
    "serve --device cuda": lambda t, p, d: (
        ["-m", "serve", "--bundle", str(t), "--port", "0", "--device", "cuda"],
        ["--device cuda", "--device cpu"],
    ),
}


DEBUG = "train typo'd config field --debug"  # not a case: shows the traceback


@pytest.fixture(scope="module")
def mistakes(
    tmp_path_factory: pytest.TempPathFactory, busy_port: int, dead_address: str
) -> Iterator[dict[str, tuple[list[str], Future[subprocess.CompletedProcess[str]]]]]:
    """name -> (what the line must name, the case's run), every case's process (and
    :data:`DEBUG`'s) started here two at a time: each spends seconds importing torch on one
    core, so the module's cases take half the time on a 2-core machine. Cases not run when the
    module ends (a -k selection) are cancelled."""
    cases = {**CASES, **({} if torch.cuda.is_available() else CUDA_CASES)}
    runs = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for i, (name, case) in enumerate(cases.items()):
            argv, named = case(tmp_path_factory.mktemp(f"case{i}"), busy_port, dead_address)
            runs[name] = (named, pool.submit(_run, argv))
        typo = _typo_config(tmp_path_factory.mktemp("debug"))
        runs[DEBUG] = ([], pool.submit(_run, [*TRAIN, str(typo), "--debug"]))
        yield runs
        pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("name", [*CASES, *(pytest.param(n, marks=NO_CUDA) for n in CUDA_CASES)])
def test_mistake_is_one_error_line(
    name: str,
    mistakes: dict[str, tuple[list[str], Future[subprocess.CompletedProcess[str]]]],
) -> None:
    named, run = mistakes[name]
    line = _error_line(run.result())
    assert "; " in line, f"{line!r} does not say what to do"
    for what in named:
        assert what in line, f"{what!r} not in {line!r}"


def test_debug_shows_the_traceback(
    mistakes: dict[str, tuple[list[str], Future[subprocess.CompletedProcess[str]]]],
) -> None:
    proc = mistakes[DEBUG][1].result()  # the typo'd config with --debug
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "ConfigError" in proc.stderr
    assert not any(line.startswith("error:") for line in proc.stderr.splitlines())


def _pipeline_parser() -> argparse.ArgumentParser:
    spec = importlib.util.spec_from_file_location("pipeline", ROOT / "scripts" / "pipeline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parser: argparse.ArgumentParser = module._parser()
    return parser


def _parser(name: str) -> argparse.ArgumentParser:
    if name == "scripts/pipeline.py":
        return _pipeline_parser()
    if name.startswith("bench."):
        bench_parser: argparse.ArgumentParser = importlib.import_module(name)._parser()
        return bench_parser
    module = importlib.import_module(name if name == "loadtest.run" else f"{name}.__main__")
    factory = module.parser if name == "serve" else module._parser
    parser: argparse.ArgumentParser = factory()
    return parser


def _commands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _commands(sub)


# the benchmarks users run
BENCH_CLIS = [
    "bench.bench_bundle",
    "bench.bench_delta",
    "bench.bench_din",
    "bench.bench_distributed",
    "bench.bench_fg",
    "bench.bench_gpu_hashtable",
    "bench.bench_handoff",
    "bench.bench_hashtable",
    "bench.bench_loader",
    "bench.bench_quality",
    "bench.bench_reader",
    "bench.bench_serving",
    "bench.bench_serving_tiers",
    "bench.bench_startup",
    "bench.bench_swap",
    "bench.bench_tiers",
    "bench.bench_train",
    "bench.profile_request",
    "bench.profile_train",
    "bench.quality_sweep",
    "bench.soak_serving",
    "bench.summarize_gpu_suite",
]


@pytest.mark.parametrize(
    "name",
    ["train", "train.data", "train.tools", "serve", "loadtest.run", "scripts/pipeline.py"]
    + BENCH_CLIS,
)
def test_help_is_complete(name: str) -> None:
    for command in _commands(_parser(name)):
        missing = [a.option_strings[0] for a in command._actions if a.option_strings and not a.help]
        assert not missing, f"{command.prog}: no help for {missing}"
        text = command.format_help()
        assert "``" not in text and ":mod:" not in text, f"{command.prog}: raw reST in help"
        assert "example" in (command.epilog or "").lower(), (
            f"{command.prog}: no example in the epilog"
        )
