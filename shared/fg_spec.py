"""fg.json: the feature-generation spec of a bundle, a JSON form of :class:`FeatureSet`.

Serving turns raw request values into ids, buckets and jagged sequences with the same
:class:`~shared.features.FeatureSet` that training used; the bundle carries it as ``fg.json`` so
``serve/`` needs no config file and no ``train/`` code. The dict is derived mechanically from the
dataclasses (never written by hand): enums become their values, tuples become lists, and
:func:`feature_set_from_dict` restores them exactly::

    d = feature_set_to_dict(fs)          # {"format_version": 1, "features": {...}, ...}
    assert feature_set_from_dict(json.loads(json.dumps(d))) == fs

Reading is strict: a missing or unknown key, a wrong type or a dangling reference (a feature whose
table is not declared) raises :class:`FgSpecError` with the path of the bad key, e.g.
``fg.json: tables.user_id_emb.dynamic: missing key 'max_capacity'``. The one exception are the
keys added since format 1 (:data:`_ADDED_KEYS`): an fg.json written before them lacks them and
means what the code did then, their dataclass default (no ``id_mode``: ``"dynrec"``; no
``cache_load_factor``: unset, every row in device memory).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from enum import Enum
from typing import Any

from shared.features import DynamicTableSpec, FeatureSet, FeatureSpec

FG_FORMAT_VERSION = 1
# keys added after format 1 was first written; absent, they take their dataclass default
_ADDED_KEYS: dict[type, frozenset[str]] = {
    FeatureSpec: frozenset({"id_mode"}),
    DynamicTableSpec: frozenset({"cache_load_factor", "lfu_decay"}),
}


class FgSpecError(ValueError):
    """fg.json content that does not describe a valid FeatureSet; the message names the key."""


def feature_set_to_dict(fs: FeatureSet) -> dict[str, Any]:
    """The JSON-able form of ``fs`` (fg.json), with ``"format_version"`` first."""
    body = _encode(fs, "")
    return {"format_version": FG_FORMAT_VERSION, **body}


def feature_set_from_dict(d: dict[str, Any], *, source: str = "fg.json") -> FeatureSet:
    """Rebuild the FeatureSet of :func:`feature_set_to_dict`; ``source`` prefixes error messages."""
    if not isinstance(d, dict):
        raise FgSpecError(f"{source}: expected a JSON object, got {type(d).__name__}")
    if "format_version" not in d:
        raise FgSpecError(f"{source}: missing key 'format_version'; not an fg.json")
    version = d["format_version"]
    if version != FG_FORMAT_VERSION:
        raise FgSpecError(
            f"{source}: format_version {version!r} is not supported (this reader knows "
            f"{FG_FORMAT_VERSION}); re-export the bundle with this version of the code"
        )
    body = {k: v for k, v in d.items() if k != "format_version"}
    fs: FeatureSet = _decode(body, FeatureSet, source, "")
    _check_references(fs, source)
    return fs


# --------------------------------------------------------------------------- encoding


def _encode(value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _encode(getattr(value, f.name), _join(path, f.name))
            for f in dataclasses.fields(value)
        }
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _encode(v, _join(path, str(k))) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        raise FgSpecError(f"{path}: {value} is not finite and has no JSON form")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise FgSpecError(f"{path}: cannot encode {type(value).__name__} {value!r}")


# --------------------------------------------------------------------------- decoding


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _where(source: str, path: str) -> str:
    return f"{source}: {path}" if path else source


def _decode(value: Any, tp: Any, source: str, path: str) -> Any:
    """``value`` (from JSON) as an instance of type hint ``tp``; errors name ``path``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]  # only ``X | None`` is used
        return _decode(value, inner, source, path)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _decode_dataclass(value, tp, source, path)
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in tp)
            raise FgSpecError(
                f"{_where(source, path)}: {value!r} is not one of {allowed}"
            ) from None
    if origin is tuple:
        (item, ellipsis) = typing.get_args(tp)
        assert ellipsis is Ellipsis, tp
        _expect(isinstance(value, list), "a list", value, source, path)
        return tuple(_decode(v, item, source, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        key_tp, item = typing.get_args(tp)
        assert key_tp is str, tp
        _expect(isinstance(value, dict), "an object", value, source, path)
        return {k: _decode(v, item, source, _join(path, k)) for k, v in value.items()}
    if tp is bool:
        _expect(isinstance(value, bool), "true/false", value, source, path)
        return value
    if tp is int:
        _expect(
            isinstance(value, int) and not isinstance(value, bool), "an int", value, source, path
        )
        return value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        _expect(ok, "a number", value, source, path)
        return float(value)
    if tp is str:
        _expect(isinstance(value, str), "a string", value, source, path)
        return value
    raise TypeError(f"fg_spec cannot decode type {tp!r} at {path}")  # a new field type: add it


def _expect(ok: bool, what: str, value: Any, source: str, path: str) -> None:
    if not ok:
        raise FgSpecError(
            f"{_where(source, path)}: expected {what}, got {type(value).__name__} {value!r}"
        )


def _decode_dataclass(value: Any, cls: type, source: str, path: str) -> Any:
    _expect(isinstance(value, dict), "an object", value, source, path)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in value:
        if key not in names:
            known = ", ".join(names)
            raise FgSpecError(
                f"{_where(source, path)}: unknown key {key!r} (known: {known}); the bundle was "
                "written by a newer or different version: re-export it with this code"
            )
    added = _ADDED_KEYS.get(cls, frozenset())
    for name in names:
        if name not in value and name not in added:
            raise FgSpecError(f"{_where(source, path)}: missing key {name!r}")
    kwargs = {n: _decode(value[n], hints[n], source, _join(path, n)) for n in names if n in value}
    return cls(**kwargs)


def _check_references(fs: FeatureSet, source: str) -> None:
    """Dict keys match the names inside, and every name a spec refers to is declared."""
    for section in ("features", "tables", "groups"):
        for key, spec in getattr(fs, section).items():
            if spec.name != key:
                raise FgSpecError(
                    f"{source}: {section}.{key}.name is {spec.name!r}; it must equal its key"
                )
    modes = {f.id_mode for f in fs.features.values()}
    if len(modes) > 1:
        first = next(iter(fs.features.values()))
        odd = next(f for f in fs.features.values() if f.id_mode is not first.id_mode)
        raise FgSpecError(
            f"{source}: features.{odd.name}.id_mode: {odd.id_mode.value!r} differs from "
            f"features.{first.name}.id_mode {first.id_mode.value!r}; one bundle has one id mode"
        )
    for f in fs.features.values():
        if f.table not in fs.tables:
            raise FgSpecError(
                f"{source}: features.{f.name}.table: {f.table!r} is not in tables "
                f"({', '.join(fs.tables)})"
            )
    for g in fs.groups.values():
        for field_name in ("features", "query", "sequence"):
            for name in getattr(g, field_name):
                if name not in fs.features:
                    raise FgSpecError(
                        f"{source}: groups.{g.name}.{field_name}: unknown feature {name!r}"
                    )
    for group, members in fs.fusion_groups.items():
        if group not in fs.groups:
            raise FgSpecError(f"{source}: fusion_groups: unknown group {group!r}")
        for t in members:
            if t not in fs.tables or not fs.tables[t].is_dynamic:
                raise FgSpecError(f"{source}: fusion_groups.{group}: {t!r} is not a dynamic table")
