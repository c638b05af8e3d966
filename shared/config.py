"""Read a pipeline config (tzrec-compatible protobuf text format) from a file or a string.

Only the edge of the system sees protobuf: :func:`load_config` returns the parsed message, and
:func:`shared.features.build_feature_set` turns it into typed dataclasses that the rest of the code
uses. Errors name the file, line and field, e.g.::

    ConfigError: configs/x.config:31: feature_configs.id_feature(user_id).dynamicemb.score_strategy:
    'LRU' is not one of STEP, TIMESTAMP, LFU, NO_EVICTION

Syntax errors get their line from protobuf's parser; value errors (found after parsing) get it
from a :class:`ConfigSource`, which indexes the line of every field by its path in the message
(protobuf's Python ``text_format``, 7.x here, reports no field locations). :func:`parse_config`
remembers the source of the messages it returns, so ``build_feature_set(load_config(path))``
points at lines without passing the source around.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections import OrderedDict
from pathlib import Path
from typing import cast

from google.protobuf import descriptor, text_format

from protos import pipeline_pb2

# A field's place in a message: names, with the index after a repeated field's name, e.g.
# ("feature_configs", 3, "id_feature", "dynamicemb", "score_strategy").
FieldPath = tuple[str | int, ...]


class ConfigError(ValueError):
    """A config that does not parse or contradicts itself. The message names field and line."""

    def __init__(self, source: str, line: int | None, field: str, message: str) -> None:
        where = f"{source}:{line}" if line else source
        super().__init__(f"{where}: {field}: {message}")
        self.source = source
        self.line = line
        self.field = field


class ConfigSource:
    """The text a config came from, to point errors at the line of a field.

    Example::

        src = ConfigSource('data_config {\\n  batch_size: 0\\n}\\n', "cfg")
        src.line_at(("data_config", "batch_size"))   # 2
        src.error("data_config.batch_size", "must be >= 1", at=("data_config", "batch_size"))
        # ConfigError('cfg:2: data_config.batch_size: must be >= 1')
    """

    def __init__(self, text: str, name: str) -> None:
        self.text = text
        self.name = name
        self._index: dict[FieldPath, int] | None = None

    def line_at(self, path: FieldPath) -> int | None:
        """1-based line of the field at ``path``; of its nearest written parent if it is absent
        (a defaulted field is reported at the message that lacks it). None without text."""
        if self._index is None:
            text = _split_adjacent_feature_names(self.text)  # entries as parse_config reads them
            root = cast(descriptor.Descriptor, pipeline_pb2.EasyRecConfig.DESCRIPTOR)
            self._index = _field_lines(text, root)
        for n in range(len(path), 0, -1):
            line = self._index.get(path[:n])
            if line is not None:
                return line
        return None

    def error(self, field: str, message: str, *, at: FieldPath | None = None) -> ConfigError:
        """A :class:`ConfigError` named ``field``, at the line of the field at path ``at``."""
        return ConfigError(self.name, self.line_at(at) if at else None, field, message)


# --------------------------------------------------------------------------- line index

_TOKEN = re.compile(
    r"""\s+|\#[^\n]*|(?P<tok>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|[^\s{}\[\]<>:,;"'\#]+|.)"""
)


def _tokens(text: str) -> list[tuple[str, int]]:
    """(token, 1-based line) of the text-format tokens of ``text``; comments dropped."""
    out, line, pos = [], 1, 0
    for m in _TOKEN.finditer(text):
        if m.group("tok") is not None:
            out.append((m.group("tok"), line + text.count("\n", pos, m.start())))
            line, pos = out[-1][1], m.start()
    return out


def _field_lines(text: str, root: descriptor.Descriptor) -> dict[FieldPath, int]:
    """Line of every field written in ``text`` (already parsed, so well formed), by path.

    Best effort: on anything it does not follow (extensions, ``Any``) it returns what it has.
    """
    toks = _tokens(text)
    index: dict[FieldPath, int] = {}
    with contextlib.suppress(IndexError, KeyError, StopIteration):
        _index_message(toks, 0, root, (), index, end=None)
    return index


def _index_message(
    toks: list[tuple[str, int]],
    i: int,
    desc: descriptor.Descriptor,
    path: FieldPath,
    index: dict[FieldPath, int],
    end: str | None,
) -> int:
    """Index the fields of one message body from token ``i``; returns the index after it."""
    counts: dict[str, int] = {}
    while i < len(toks) and toks[i][0] != end:
        name, line = toks[i]
        field = desc.fields_by_name.get(name)
        if field is None:  # a group is written by its type name
            field = next(f for f in desc.fields if f.message_type and f.message_type.name == name)
        name = field.name
        i += 1
        if toks[i][0] == ":":
            i += 1
        repeated = field.is_repeated
        if toks[i][0] == "[":
            i += 1
            while toks[i][0] != "]":
                k = counts.get(name, 0)
                counts[name] = k + 1
                index.setdefault((*path, name, k), toks[i][1])
                i = _index_value(toks, i, field, (*path, name, k), index)
                if toks[i][0] == ",":
                    i += 1
            i += 1
        else:
            here: FieldPath = (*path, name)
            if repeated:
                k = counts.get(name, 0)
                counts[name] = k + 1
                index.setdefault(here, line)
                here = (*here, k)
            index.setdefault(here, line)
            i = _index_value(toks, i, field, here, index)
        if i < len(toks) and toks[i][0] in (",", ";"):
            i += 1
    return i + 1


def _index_value(
    toks: list[tuple[str, int]],
    i: int,
    field: descriptor.FieldDescriptor,
    path: FieldPath,
    index: dict[FieldPath, int],
) -> int:
    if field.message_type is not None:
        close = {"{": "}", "<": ">"}[toks[i][0]]
        return _index_message(toks, i + 1, field.message_type, path, index, end=close)
    i += 1
    while i < len(toks) and toks[i][0][:1] in ('"', "'"):  # adjacent literals concatenate
        i += 1
    return i


# --------------------------------------------------------------------------- parsing

# `feature_names: "a" "b"` on one line: protobuf text format (and so tzrec, which parses configs
# with it) concatenates adjacent string literals into one name "ab". We deliberately read them as
# two entries, the reading the seed config's layout suggests. The rewrite keeps the line count.
_MULTI_NAMES = re.compile(r'^([ \t]*feature_names[ \t]*:[ \t]*)((?:"[^"\\\n]*"[ \t]*){2,})$', re.M)

# The sources of recently parsed configs, by message id (messages take no weak references; the
# entry holds the message, so its id is not reused while it is here).
_SOURCES: OrderedDict[int, tuple[pipeline_pb2.EasyRecConfig, ConfigSource]] = OrderedDict()
_SOURCES_KEPT = 16


def _split_adjacent_feature_names(text: str) -> str:
    def repl(m: re.Match[str]) -> str:
        names = re.findall(r'"[^"\\\n]*"', m.group(2))
        return f"{m.group(1)}[{', '.join(names)}]"

    return _MULTI_NAMES.sub(repl, text)


def source_of(config: pipeline_pb2.EasyRecConfig) -> ConfigSource | None:
    """The :class:`ConfigSource` ``config`` was parsed from by :func:`parse_config`, if known."""
    entry = _SOURCES.get(id(config))
    return entry[1] if entry is not None and entry[0] is config else None


def parse_config(text: str, name: str = "<config>") -> pipeline_pb2.EasyRecConfig:
    """Parse config text; unknown fields and bad values raise :class:`ConfigError`.

    One deliberate extension of protobuf text format, which tzrec parses its configs with as is:
    several quoted names on one ``feature_names:`` line are several entries here, where protobuf
    (and so tzrec) concatenates adjacent literals into one string (``"a" "b"`` is ``"ab"``).
    The seed config lays its groups out so; ``feature_names: ["a", "b"]`` reads alike in both.
    """
    msg = pipeline_pb2.EasyRecConfig()
    try:
        text_format.Parse(_split_adjacent_feature_names(text), msg)
    except text_format.ParseError as err:
        line = err.GetLine() if hasattr(err, "GetLine") else None
        what = re.sub(r"^\d+:\d+ : ", "", str(err)).rstrip(".")  # line: in the prefix
        fix = "fix that line (the fields are protos/pipeline.proto's)"
        raise ConfigError(name, line, "text_format", f"{what}; {fix}") from None
    _SOURCES[id(msg)] = (msg, ConfigSource(text, name))
    while len(_SOURCES) > _SOURCES_KEPT:
        _SOURCES.popitem(last=False)
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
