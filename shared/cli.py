"""One way for every command line to fail: ``error: <what>; <what to do>`` and exit code 2.

Each CLI's ``main(argv)`` is ``run_cli(_main, argv)``: ``_main`` parses with :class:`Parser` and
runs; an expected error (a bad config, a missing or existing path, a bad flag value, a busy port,
a device that is not there, a server that does not answer) becomes one line on stderr and exit
code 2. ``--debug`` anywhere on the command line shows the traceback instead::

    $ python -m train train --config typo.config
    error: typo.config:17: text_format: ... has no field named "batch_sise"; fix that line ...
    $ python -m train train --config typo.config --debug     # the traceback
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

EXIT_ERROR = 2  # argparse's exit code for usage errors; ours for every expected error
DEBUG_FLAG = "--debug"
DEBUG_HELP = "show the traceback of an error instead of one error line"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults and keeps the layout of descriptions and
    epilogs, whose usage errors are one ``error:`` line, and which lists ``--debug``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}; see {self.prog} --help", file=sys.stderr)
        sys.exit(EXIT_ERROR)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``(default: X)`` after an option's help unless the help gives it or there is none to
    give (no default, a plain on/off flag); descriptions and epilogs printed as written.

    The check is by identity, so that a default of 0 (== False) or 0.0 is shown."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or not action.option_strings
            or (isinstance(default, list) and not default)
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def plain(doc: str | None) -> str:
    """A docstring as help text: ``code`` and :role:`target` markup removed, ``::`` → ``:``."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc or "")
    return text.replace("``", "").replace("::\n", ":\n")


def check_device(device: str | None, flag: str = "--device") -> None:
    """Refuse a CUDA device where torch sees none, before anything is built or loaded."""
    if device is not None and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                f"{flag} {device}: this machine has no usable CUDA device; use {flag} cpu"
            )


def check_port(host: str, port: int | None, flag: str, *, reuse_port: bool = False) -> None:
    """Refuse a TCP port that cannot be bound (in use, or ``host`` not this machine's) with a
    message naming ``flag``, before a server library fails on it with a log line of its own.
    Port 0 (any free one) and None (off) are not checked."""
    import socket

    if not port:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port and hasattr(socket, "SO_REUSEPORT"):
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            probe.bind(address)
    except OSError as err:
        reason = err.strerror or str(err)
        raise OSError(
            f"{flag} {port}: cannot bind {host}:{port} ({reason}); stop the process using it "
            f"or choose another {flag} (0: any free port)"
        ) from err


def expected_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that are a user's mistake or the environment's state, not a bug.

    Our ConfigError, FeatureError, BundleError, DeltaError, CheckpointError, ... are ValueErrors;
    OSError covers missing and existing paths, busy ports and timeouts; grpc.RpcError a server
    that does not answer (UNAVAILABLE, DEADLINE_EXCEEDED) or refuses (UNAUTHENTICATED, ...)."""
    import grpc

    return (ValueError, OSError, grpc.RpcError)


def run_cli(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> int:
    """``main(argv)`` with expected errors as one ``error:`` line and exit code 2.

    ``--debug`` is taken out of ``argv`` wherever it stands (so it works before or after a
    subcommand) and re-raises the error with its traceback."""
    quiet_third_party()
    args = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in args
    args = [a for a in args if a != DEBUG_FLAG]
    try:
        return main(args) or 0
    except expected_errors() as err:
        if debug:
            raise
        print(f"error: {_message(err)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        if debug:
            raise
        print("error: interrupted", file=sys.stderr)
        return 130


def _message(err: BaseException) -> str:
    """The one-line message of an expected error."""
    import grpc

    if isinstance(err, grpc.RpcError) and isinstance(err, grpc.Call):
        code, details = err.code(), err.details()
        hint = _RPC_HINTS.get(code.name, "see the server's log")
        if code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            return f"no answer from the server ({code.name}: {details}); {hint}"
        return f"the server answered {code.name}: {details}; {hint}"
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        what = f"{err.filename}: {err.strerror}"
        if isinstance(err, FileNotFoundError):
            return f"{what}; check the path"
        if isinstance(err, FileExistsError):
            return f"{what}; choose another path or remove it"
        return what
    return " ".join(str(err).split()) or type(err).__name__


_RPC_HINTS = {
    "UNAVAILABLE": "check that a server runs at that address (--server, --host) and, for "
    "TLS, --tls-ca",
    "DEADLINE_EXCEEDED": "check that a server runs at that address (--server, --host), or "
    "allow it more time",
    "UNAUTHENTICATED": "check --token-file (the server's --admin-token-file)",
    "PERMISSION_DENIED": "check --token-file and the server's --no-admin-writes",
}

# (logger, message start) of third-party log lines that say nothing to a user: fbgemm_gpu logs
# each library it loads on the root logger; torch.fx warns about is_fx_tracing on every run
_NOISE = (
    ("root", "Successfully loaded: "),
    ("torch.fx._symbolic_trace", "is_fx_tracing will return true"),
)


def _is_signal(record: logging.LogRecord) -> bool:
    msg = record.msg if isinstance(record.msg, str) else ""
    return not any(record.name == name and msg.startswith(start) for name, start in _NOISE)


def quiet_third_party() -> None:
    """Drop the known third-party noise (fbgemm's loader lines, torch's is_fx_tracing and
    LeafSpec notices) where it is emitted; every other record and warning (ours included)
    passes. Log filters sit on the emitting loggers, so they survive ``basicConfig(force=True)``."""
    # torch.export's (de)serialization, through copyreg: torch's own deprecation, not ours
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
    )
    for name in dict(_NOISE):
        logger = logging.getLogger(None if name == "root" else name)
        if _is_signal not in logger.filters:
            logger.addFilter(_is_signal)


def exit_code(result: object) -> int:
    """A ``main``'s result as an exit code: ints as they are, anything else (a benchmark's
    result dict, None) 0."""
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def write_result(path: Path, result: Any, *, indent: int | None = 2) -> None:
    """A command's JSON result at ``path`` (parents made), written to a temp file and renamed:
    a file there is always complete, and an earlier one stays until the new one is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=indent) + "\n")
    tmp.replace(path)
