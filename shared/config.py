"""Read a pipeline config (tzrec-compatible protobuf text format) from a file or a string.

Only the edge of the system sees protobuf: :func:`load_config` returns the parsed message, and
:func:`shared.features.build_feature_set` turns it into typed dataclasses that the rest of the code
uses. Errors name the file, line and field, e.g.::

    ConfigError: configs/x.config:41: feature_configs.id_feature(user_id).dynamicemb.score_strategy:
    'LRU' is not one of STEP, TIMESTAMP, LFU, NO_EVICTION
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from google.protobuf import text_format

from protos import pipeline_pb2


class ConfigError(ValueError):
    """A config that does not parse or contradicts itself. The message names field and line."""

    def __init__(self, source: str, line: int | None, field: str, message: str) -> None:
        where = f"{source}:{line}" if line else source
        super().__init__(f"{where}: {field}: {message}")
        self.source = source
        self.line = line
        self.field = field


class ConfigSource:
    """The text a config came from, to point errors at a line."""

    def __init__(self, text: str, name: str) -> None:
        self.text = text
        self.name = name
        self._lines = text.splitlines()

    def line_of(self, needle: str, after: int = 0) -> int | None:
        """1-based number of the first line at or after ``after`` containing ``needle``."""
        for i in range(max(after - 1, 0), len(self._lines)):
            if needle in self._lines[i]:
                return i + 1
        return None

    def error(
        self, field: str, message: str, *, near: str | None = None, after: int = 0
    ) -> ConfigError:
        line = self.line_of(near, after) if near else None
        return ConfigError(self.name, line, field, message)


# `feature_names: "a" "b"` on one line: text format would concatenate adjacent string literals
# into "ab"; tzrec configs (the seed config among them) mean two entries.
_MULTI_NAMES = re.compile(r'^(\s*feature_names\s*:\s*)((?:"[^"\\]*"\s*){2,})$', re.M)


def _split_adjacent_feature_names(text: str) -> str:
    def repl(m: re.Match[str]) -> str:
        names = re.findall(r'"[^"\\]*"', m.group(2))
        return f"{m.group(1)}[{', '.join(names)}]"

    return _MULTI_NAMES.sub(repl, text)


def parse_config(text: str, name: str = "<config>") -> pipeline_pb2.EasyRecConfig:
    """Parse config text; unknown fields and bad values raise :class:`ConfigError`.

    One deliberate difference from plain protobuf text format: several quoted names on one
    ``feature_names:`` line are several entries (as tzrec configs use them), not one
    concatenated string.
    """
    msg = pipeline_pb2.EasyRecConfig()
    try:
        text_format.Parse(_split_adjacent_feature_names(text), msg)
    except text_format.ParseError as err:
        line = err.GetLine() if hasattr(err, "GetLine") else None
        what = re.sub(r"^\d+:\d+ : ", "", str(err)).rstrip(".")  # line: in the prefix
        fix = "fix that line (the fields are protos/pipeline.proto's)"
        raise ConfigError(name, line, "text_format", f"{what}; {fix}") from None
    return msg


def load_config(path: str | Path) -> pipeline_pb2.EasyRecConfig:
    """Parse the config file at ``path``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), None, "path", "config file not found; check the path")
    return parse_config(path.read_text(), str(path))


def config_digest(config: pipeline_pb2.EasyRecConfig) -> str:
    """A stable sha256 of the config's content (independent of comments and layout)."""
    canonical = text_format.MessageToString(config, as_one_line=True)
    return hashlib.sha256(canonical.encode()).hexdigest()
