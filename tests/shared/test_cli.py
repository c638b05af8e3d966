"""shared.cli in-process: which errors become one line, --debug, help defaults, port checks."""

from __future__ import annotations

import errno
import json
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from shared.cli import Parser, check_port, plain, run_cli, write_result


def _raises(err: BaseException) -> Callable[[list[str]], int]:
    def main(argv: list[str]) -> int:
        raise err

    return main


def test_expected_error_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(_raises(ValueError("--x 3: too big;\n  use --x 2")), []) == 2
    assert capsys.readouterr().err == "error: --x 3: too big; use --x 2\n"
    missing = FileNotFoundError(errno.ENOENT, "No such file or directory", "/no/such")
    assert run_cli(_raises(missing), []) == 2
    assert capsys.readouterr().err == "error: /no/such: No such file or directory; check the path\n"


def test_debug_reraises_and_bugs_propagate() -> None:
    with pytest.raises(ValueError, match="bad"):
        run_cli(_raises(ValueError("bad")), ["--debug"])
    with pytest.raises(RuntimeError):  # not an expected error: a traceback, always
        run_cli(_raises(RuntimeError("bug")), [])


def test_debug_is_taken_out_of_argv() -> None:
    seen: list[list[str]] = []

    def main(argv: list[str]) -> int:
        seen.append(argv)
        return 0

    assert run_cli(main, ["cmd", "--debug", "--x", "1"]) == 0
    assert seen == [["cmd", "--x", "1"]]


def test_parser_usage_error_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    p = Parser(prog="prog")
    p.add_argument("--n", type=int, default=3, help="how many")
    p.add_argument("--name", help="no default to show")
    p.add_argument("--flag", action="store_true", help="on/off")
    p.add_argument("--seed", type=int, default=0, help="seed")  # 0 == False, yet shown
    p.add_argument("--rate", type=float, default=0.0, help="rate")
    text = p.format_help()
    assert "how many (default: 3)" in text and "(default: None)" not in text
    assert "seed (default: 0)" in text and "rate (default: 0.0)" in text
    assert "(default: False)" not in text and "--debug" in text
    with pytest.raises(SystemExit) as stop:
        p.parse_args(["--n", "x"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        "error: argument --n: invalid int value: 'x'; see prog --help\n"
    )


def test_plain_strips_rest() -> None:
    assert plain("``python -m x`` (:mod:`a.b`)::\n") == "python -m x (a.b):\n"


def test_check_port_names_the_flag() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"--metrics-port {port}: cannot bind"):
            check_port("127.0.0.1", port, "--metrics-port")
    check_port("127.0.0.1", 0, "--port")  # any free port: not checked
    check_port("127.0.0.1", None, "--metrics-port")  # off


def test_write_result_replaces_a_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "r.json"
    write_result(path, {"a": 1})
    write_result(path, {"b": [2, 3]})
    assert json.loads(path.read_text()) == {"b": [2, 3]}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temp file left
