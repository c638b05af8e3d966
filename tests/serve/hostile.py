"""Seeded hostile Predict traffic, each request with the answers the serving contract allows.

The requests are built from what any client sees, ``GetModelMetadata`` (features, their sides and
value types, the sequences and the limits), so the robustness test
(``tests/serve/test_robustness.py``) and the soak benchmark (``bench/soak_serving.py``) send the
same traffic to any bundle. A numpy generator seeded once makes every run send the same bytes.

Families (:data:`FAMILIES`): hostile values (wrong kinds, NaN/inf/-0.0, int64 extremes, negative
ids, empty/unicode/over-limit strings) in ``user``, ``context`` or one candidate (which also
makes a column of mixed kinds), the same in one row of a ``candidate_columns`` column, missing
and unknown features (names up to 100 kB), empty and oversize candidate lists, sequences of
unequal or over-limit length, columns of the wrong length, kind or ``missing`` mask, both
encodings at once, oversize requests, and raw bytes (random, truncated messages, invalid UTF-8 in
a string field, deeply nested unknown groups, wrong wire types). Every request is sent as bytes
(:data:`PREDICT_METHOD`, no serializer), so undecodable ones reach the server as they are.

What an answer may be (:class:`Expect`, checked by :func:`check_answer`): OK, INVALID_ARGUMENT
whose details start with the field path (``candidates[3].price: ``, ``request: ``) and, for a
value in a column, name the candidate, or RESOURCE_EXHAUSTED for a request over the size limit;
never INTERNAL or UNKNOWN, and details never longer than ``max_detail_bytes``. Example::

    md = stub.GetModelMetadata(predict_pb2.ModelMetadataRequest())
    gen = HostileGenerator(md, seed=0)
    predict = channel.unary_unary(PREDICT_METHOD, request_serializer=None,
                                  response_deserializer=predict_pb2.PredictResponse.FromString)
    for case in gen.cases(1000):
        answer = call(predict, case.payload)        # (code, details, response or None)
        problem = check_answer(case, *answer, max_detail_bytes=gen.max_detail_bytes)
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from protos import predict_pb2

PREDICT_METHOD = "/dynrec.serving.PredictionService/Predict"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT64_EXTREMES = (INT64_MIN, INT64_MAX, 2**53 + 1, -(2**53 + 1), -1, 0, 2**31, 2**32 + 7)
DOUBLES = (math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1e-300, 1e308, -1.0, 2.0**53 + 2)
# a field path at the start of INVALID_ARGUMENT details (see serve/validation.py's list)
FIELD_PATH = re.compile(
    r"^(request|candidates|candidates\[\d+\]\..*?|candidate_columns|candidate_columns\."
    r'num_candidates|candidate_columns\.columns\[".*?"\]|request_id|(user|context|sequences)\..*?)'
    r": ",
    re.DOTALL,
)
_CUT = " bytes, cut]"  # serve.limits.truncate's marker: the end of the details was cut off


@dataclass(frozen=True)
class Expect:
    """The answers allowed: OK (``ok``), INVALID_ARGUMENT (``invalid``: details start with one
    of these prefixes; ``()``: with any field path; None: not allowed), RESOURCE_EXHAUSTED
    (``exhausted``). ``index``: the candidate an INVALID_ARGUMENT about a column must name."""

    ok: bool = False
    invalid: tuple[str, ...] | None = None
    exhausted: bool = False
    index: int | None = None


OK = Expect(ok=True)
TOO_LARGE = Expect(exhausted=True)


def invalid(field: str, index: int | None = None) -> Expect:
    return Expect(invalid=(f"{field}: ",), index=index)


def either(field: str, index: int | None = None) -> Expect:
    """OK, or INVALID_ARGUMENT naming ``field``: values whose meaning the contract leaves open
    (an empty string id, a price of 2^63-1, a negative hashed id)."""
    return Expect(ok=True, invalid=(f"{field}: ",), index=index)


def combine(expects: Sequence[Expect]) -> Expect:
    """Several independent edits of one request: INVALID_ARGUMENT naming one of the refused
    ones if any edit must be refused, else OK (or one of the open ones refused)."""
    fields = tuple(p for e in expects if e.invalid for p in e.invalid)
    must = any(not e.ok and e.invalid is not None for e in expects)
    if must:
        return Expect(invalid=fields)
    return Expect(ok=True, invalid=fields or None)


@dataclass(frozen=True)
class HostileCase:
    family: str  # one of FAMILIES
    note: str  # what was done to a good request, e.g. "candidates[3].price = double_value nan"
    payload: bytes  # sent as it is
    expect: Expect
    candidates: int | None = None  # probabilities an OK answer has (None: not known)
    request_id: str | None = None  # what an OK answer echoes (None: not known)

    def describe(self, limit: int = 160) -> str:
        head = self.payload[:48].hex()
        return f"[{self.family}] {self.note[:limit]} ({len(self.payload)} bytes: {head}...)"


def check_answer(
    case: HostileCase,
    code: grpc.StatusCode,
    details: str | None,
    response: predict_pb2.PredictResponse | None,
    *,
    max_detail_bytes: int,
) -> str | None:
    """None if the answer is one the contract allows for ``case``, else what is wrong."""
    exp = case.expect
    details = details or ""
    if code is grpc.StatusCode.OK:
        if not exp.ok:
            return f"OK, expected {_wanted(exp)}"
        assert response is not None
        probs = np.asarray(response.probabilities)
        if case.candidates is not None and len(probs) != case.candidates:
            return f"OK with {len(probs)} probabilities for {case.candidates} candidates"
        if not (np.isfinite(probs).all() and ((probs >= 0) & (probs <= 1)).all()):
            return f"OK with probabilities outside [0, 1]: {probs[:8]}"
        if case.request_id is not None and response.request_id != case.request_id:
            return f"OK echoing request_id {response.request_id[:40]!r}"
        return None
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and exp.exhausted:
        return None
    if code is not grpc.StatusCode.INVALID_ARGUMENT or exp.invalid is None:
        return f"{code.name} {details[:300]!r}, expected {_wanted(exp)}"
    size = len(details.encode("utf-8", "surrogatepass"))
    if size > max_detail_bytes:
        return f"details of {size} bytes, more than max_detail_bytes {max_detail_bytes}"
    if details.startswith("candidates[*]"):
        return f"INVALID_ARGUMENT naming no candidate: {details[:300]!r}"
    if not FIELD_PATH.match(details):
        return f"INVALID_ARGUMENT without a field path: {details[:300]!r}"
    if exp.invalid and not details.startswith(exp.invalid):
        return f"INVALID_ARGUMENT {details[:300]!r}, expected a field in {list(exp.invalid)}"
    if exp.index is not None and _CUT not in details and f"candidate {exp.index}" not in details:
        return f"INVALID_ARGUMENT not naming candidate {exp.index}: {details[:300]!r}"
    return None


def _wanted(exp: Expect) -> str:
    out = ["OK"] if exp.ok else []
    if exp.invalid is not None:
        out.append(f"INVALID_ARGUMENT {list(exp.invalid) or 'with a field path'}")
    if exp.exhausted:
        out.append("RESOURCE_EXHAUSTED")
    return " or ".join(out)


# --------------------------------------------------------------------------- raw bytes


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def decodes(payload: bytes) -> bool:
    """Whether ``payload`` parses as a PredictRequest (as the server parses it)."""
    try:
        predict_pb2.PredictRequest.FromString(payload)
    except (DecodeError, RecursionError, ValueError):
        return False
    return True


# --------------------------------------------------------------------------- generator

FAMILIES = (
    "user value",
    "context value",
    "candidate value",
    "mixed-kind column",
    "column value",
    "several values",
    "missing feature",
    "unknown feature",
    "candidate count",
    "sequence",
    "column shape",
    "both encodings",
    "request_id",
    "oversize",
    "random bytes",
    "truncated",
    "invalid utf-8",
    "nested groups",
    "wire type",
    "concatenated",
)
_COLUMN_KIND = {"int64_value": "int64s", "double_value": "doubles", "string_value": "strings"}
_SENTINEL = "\x01\x02\x03\x04\x05\x06"
_BAD_UTF8 = (b"\xff\xfe\xfd\xfc\xfb\xfa", b"\xc3\x28\xa0\xa1\xe2\x28", b"\xed\xa0\x80\xed\xbf\xbf")
_NAMES = ("", "x", "favourite_colour", "USER_ID", "user_id ", "价格", "a:b", "🙂" * 20, "\x00")


class HostileGenerator:
    """Seeded requests for the model and limits of ``metadata`` (see the module doc)."""

    def __init__(
        self, metadata: predict_pb2.ModelMetadata, seed: int = 0, *, id_range: int = 1000
    ) -> None:
        self.rng = np.random.default_rng(seed)
        self.id_range = id_range
        lim = metadata.limits
        self.max_candidates = lim.max_candidates
        self.max_string_bytes = lim.max_string_bytes
        self.max_request_bytes = lim.max_request_bytes
        self.max_detail_bytes = lim.max_detail_bytes
        hashmaps = {t.name for t in metadata.tables if t.is_hashmap}
        scalar = [f for f in metadata.features if f.kind != "sequence_id"]
        self.types = {f.name: f.value_type for f in scalar}
        self.dynamic = {f.name for f in scalar if f.table in hashmaps}
        self.user = [f.name for f in scalar if f.side == "user"]
        self.context = [f.name for f in scalar if f.side == "context"]
        self.items = [f.name for f in scalar if f.side == "item"]
        seqs = [f.name for f in metadata.features if f.kind == "sequence_id"]
        self.sequences = [
            ([n for n in seqs if n in set(s.features)], int(s.max_length))
            for s in metadata.sequences
        ]
        self._families: dict[str, Callable[[], HostileCase]] = {
            name: getattr(self, "_" + re.sub(r"\W+", "_", name)) for name in FAMILIES
        }

    # ------------------------------------------------------------------- good requests

    def _good_value(self, name: str, kind: str | None = None) -> predict_pb2.Value:
        kind = kind or {"int64": "int64_value", "double": "double_value"}.get(
            self.types[name], "string_value"
        )
        if kind == "double_value":
            return predict_pb2.Value(double_value=float(np.round(self.rng.uniform(0, 500), 2)))
        if kind == "string_value":
            return predict_pb2.Value(string_value=f"{int(self.rng.integers(10**6))}_{name[:3]}")
        return predict_pb2.Value(int64_value=int(self.rng.integers(0, self.id_range)))

    def good_request(self, candidates: int | None = None) -> predict_pb2.PredictRequest:
        """A valid request in row format with ``candidates`` (default: random) candidates."""
        rng = self.rng
        n = int(rng.integers(1, self.max_candidates + 1)) if candidates is None else candidates
        req = predict_pb2.PredictRequest(request_id=f"good-{int(rng.integers(10**9))}")
        for name in self.user:
            req.user.values[name].CopyFrom(self._good_value(name))
        for name in self.context:
            req.context.values[name].CopyFrom(self._good_value(name))
        for names, cap in self.sequences:
            length = int(rng.integers(0, min(cap, 12) + 1))
            for name in names:
                req.sequences[name].ids.extend(rng.integers(0, self.id_range, length).tolist())
        for _ in range(n):
            cand = req.candidates.add()
            for name in self.items:
                cand.values[name].CopyFrom(self._good_value(name))
        return req

    def columnar(self, req: predict_pb2.PredictRequest) -> predict_pb2.PredictRequest:
        """``req`` (uniform kinds per feature, as :meth:`good_request` makes) as columns."""
        out = predict_pb2.PredictRequest()
        out.CopyFrom(req)
        out.ClearField("candidates")
        cc = out.candidate_columns
        cc.num_candidates = len(req.candidates)
        for name in self.items:
            values = [c.values[name] for c in req.candidates]
            kind = values[0].WhichOneof("kind")
            col = getattr(cc.columns[name], _COLUMN_KIND[kind])
            col.values.extend(getattr(v, kind) for v in values)
        return out

    def good_case(self, columnar: bool | None = None, candidates: int | None = None) -> HostileCase:
        """A valid request (``columnar`` or not; default: either): it must score."""
        req = self.good_request(candidates)
        n = len(req.candidates)
        if columnar if columnar is not None else self.rng.random() < 0.5:
            req = self.columnar(req)
        return HostileCase(
            "good", "a valid request", req.SerializeToString(), OK, n, req.request_id
        )

    # ------------------------------------------------------------------- cases

    def cases(self, n: int) -> list[HostileCase]:
        """``n`` hostile cases, the families in turn (each at least ``n // len(FAMILIES)``)."""
        return [self._families[FAMILIES[k % len(FAMILIES)]]() for k in range(n)]

    def _finish(
        self,
        family: str,
        note: str,
        req: predict_pb2.PredictRequest,
        expect: Expect,
        candidates: int | None = None,
    ) -> HostileCase:
        payload = req.SerializeToString()
        if len(payload) > self.max_request_bytes:
            expect = TOO_LARGE
        if candidates is None:
            candidates = (
                req.candidate_columns.num_candidates
                if req.HasField("candidate_columns")
                else len(req.candidates)
            )
        return HostileCase(family, note, payload, expect, candidates, req.request_id)

    def _pick(self, seq: Sequence[str]) -> str:
        return seq[int(self.rng.integers(len(seq)))]

    def _string(self) -> tuple[str, str]:
        """(a hostile string, its description)."""
        lim = self.max_string_bytes
        options: list[tuple[str, str]] = [
            ("", "empty"),
            ("é漢字🙂\u200b\u202e", "unicode"),
            ("\x00", "NUL"),
            ("  ", "blanks"),
            ("-5", "negative digits"),
            ("9223372036854775808", "digits past int64"),
            ("nan", "'nan'"),
            ("x" * lim, "exactly the limit"),
            ("x" * (lim + 1), "one byte past the limit"),
            ("é" * (lim // 2), "2-byte chars at the limit"),
            ("🙂" * (lim // 4 + 1), "4-byte chars past the limit"),
            ("y" * int(self.rng.integers(10 * lim, 100_000)), "very long"),
            ("".join(chr(int(c)) for c in self.rng.integers(0x20, 0xD7FF, 8)), "random unicode"),
        ]
        return options[int(self.rng.integers(len(options)))]

    def _hostile_value(
        self, name: str, field: str, index: int | None = None
    ) -> tuple[predict_pb2.Value, Expect, str]:
        """A hostile Value for feature ``name`` at ``field``, the answers allowed, a note."""
        rng, vt, dyn = self.rng, self.types[name], name in self.dynamic
        kind = self._pick(("int64_value", "double_value", "string_value", "unset"))
        if kind == "unset":
            return predict_pb2.Value(), OK, f"{field} unset (missing)"
        if kind == "int64_value":
            raw: object = (
                int(rng.integers(INT64_MIN, INT64_MAX, endpoint=True))
                if rng.random() < 0.2
                else INT64_EXTREMES[int(rng.integers(len(INT64_EXTREMES)))]
            )
            assert isinstance(raw, int)
            if vt == "string":  # hashed: a negative int is open
                exp = either(field, index) if raw < 0 else OK
            elif raw < 0:
                exp = invalid(field, index)
            elif vt == "double" and raw > 2**53:
                exp = either(field, index)  # not exactly a double
            else:
                exp = OK
            return predict_pb2.Value(int64_value=raw), exp, f"{field} = int64 {raw}"
        if kind == "double_value":
            raw = DOUBLES[int(rng.integers(len(DOUBLES)))]
            assert isinstance(raw, float)
            ok = vt == "double" and math.isfinite(raw) and raw >= 0  # -0.0 >= 0
            exp = OK if ok else invalid(field, index)
            return predict_pb2.Value(double_value=raw), exp, f"{field} = double {raw!r}"
        text, what = self._string()
        accepted = vt == "string" or dyn
        if not accepted or len(text.encode()) > self.max_string_bytes:
            exp = invalid(field, index)
        else:
            exp = either(field, index) if text == "" else OK
        return predict_pb2.Value(string_value=text), exp, f"{field} = string ({what}, {len(text)})"

    def _base(self) -> tuple[predict_pb2.PredictRequest, int]:
        req = self.good_request()
        return req, len(req.candidates)

    def _side_value(self, family: str, side: str) -> HostileCase:
        req, _ = self._base()
        name = self._pick(self.user if side == "user" else self.context)
        value, exp, note = self._hostile_value(name, f"{side}.{name}")
        getattr(req, side).values[name].CopyFrom(value)
        if self.rng.random() < 0.3:  # the same user with the candidates as columns
            req, note = self.columnar(req), note + " (candidate_columns)"
        return self._finish(family, note, req, exp)

    def _user_value(self) -> HostileCase:
        return self._side_value("user value", "user")

    def _context_value(self) -> HostileCase:
        return self._side_value("context value", "context")

    def _candidate_value(self) -> HostileCase:
        req, n = self._base()
        i, name = int(self.rng.integers(n)), self._pick(self.items)
        value, exp, note = self._hostile_value(name, f"candidates[{i}].{name}")
        req.candidates[i].values[name].CopyFrom(value)
        return self._finish("candidate value", note, req, exp)

    def _mixed_kind_column(self) -> HostileCase:
        """Every candidate's value of one feature a valid value of an accepted kind, the kinds
        alternating (int64 and string ids; double and int64 prices): valid, must score."""
        req, n = self._base()
        name = self._pick(self.items)
        kinds = {"double": ("double_value", "int64_value")}.get(
            self.types[name], ("int64_value", "string_value")
        )
        if name not in self.dynamic and self.types[name] == "int64":
            kinds = ("int64_value", "int64_value")
        start = int(self.rng.integers(2))
        for i, cand in enumerate(req.candidates):
            cand.values[name].CopyFrom(self._good_value(name, kinds[(i + start) % 2]))
        if self.rng.random() < 0.3 and n > 1:
            req.candidates[int(self.rng.integers(n))].values[name].CopyFrom(predict_pb2.Value())
        return self._finish("mixed-kind column", f"{name}: kinds {kinds} alternating", req, OK)

    def _column_value(self) -> HostileCase:
        """One column of an accepted kind (or not), one row hostile, maybe rows missing."""
        req, n = self._base()
        req = self.columnar(req)
        cc, rng = req.candidate_columns, self.rng
        name = self._pick(self.items)
        field = f'candidate_columns.columns["{name}"]'
        kind = self._pick(("int64_value", "double_value", "string_value"))
        accepted = {"double": ("double_value", "int64_value")}.get(
            self.types[name],
            ("int64_value", "string_value") if name in self.dynamic else ("int64_value",),
        )
        col = cc.columns[name]
        col.Clear()
        values = [self._good_value(name, kind) for _ in range(n)]
        exp, note = OK, f"{field} as {_COLUMN_KIND[kind]}"
        i = int(rng.integers(n))
        if kind not in accepted:
            exp = invalid(field)
        elif rng.random() < 0.8:
            for _ in range(20):  # a hostile value of the column's kind
                value, vexp, vnote = self._hostile_value(name, field, index=i if n > 1 else None)
                if value.WhichOneof("kind") == kind:
                    values[i], exp, note = value, vexp, f"{vnote} at candidate {i}"
                    break
        getattr(col, _COLUMN_KIND[kind]).values.extend(getattr(v, kind) for v in values)
        if rng.random() < 0.3:  # rows marked missing: their placeholders are never read
            missing = rng.random(n) < 0.5
            col.missing.extend(missing.tolist())
            if exp.invalid and kind in accepted and missing[i]:
                exp = OK  # a missing row's placeholder is ignored, whatever it holds
                note += " (that row missing)"
        return self._finish("column value", note, req, exp)

    def _several_values(self) -> HostileCase:
        """Up to four hostile values at distinct places of one request."""
        req, n = self._base()
        places = {("user", name) for name in self.user} | {("context", c) for c in self.context}
        places |= {(f"candidates[{i}]", name) for i in range(n) for name in self.items}
        chosen = sorted(places)
        picks = self.rng.choice(len(chosen), size=min(4, len(chosen)), replace=False)
        expects, notes = [], []
        for k in picks:
            where, name = chosen[int(k)]
            value, exp, note = self._hostile_value(name, f"{where}.{name}")
            target = (
                getattr(req, where)
                if where in ("user", "context")
                else req.candidates[int(where[11:-1])]
            )
            target.values[name].CopyFrom(value)
            expects.append(exp)
            notes.append(note)
        return self._finish("several values", "; ".join(notes), req, combine(expects))

    def _missing_feature(self) -> HostileCase:
        req, n = self._base()
        where = self._pick(
            ("user", "context", "candidate", "column", "sequence", "a whole side", "all values")
        )
        if where == "candidate":
            i, name = int(self.rng.integers(n)), self._pick(self.items)
            del req.candidates[i].values[name]
            field = f"candidates[{i}].{name}"
        elif where == "all values":  # an empty Features: its first feature is named
            i = int(self.rng.integers(n))
            req.candidates[i].Clear()
            field = f"candidates[{i}].{self.items[0]}"
        elif where == "a whole side":
            side = self._pick(("user", "context", "sequences"))
            req.ClearField(side)
            first = {"user": self.user, "context": self.context}.get(side, self.sequences[0][0])
            field = f"{side}.{first[0]}"
        elif where == "column":
            req, name = self.columnar(req), self._pick(self.items)
            del req.candidate_columns.columns[name]
            field = f'candidate_columns.columns["{name}"]'
        elif where == "sequence":
            name = self._pick(self.sequences[0][0])
            del req.sequences[name]
            field = f"sequences.{name}"
        else:
            name = self._pick(self.user if where == "user" else self.context)
            del getattr(req, where).values[name]
            field = f"{where}.{name}"
        return self._finish("missing feature", f"{field} removed", req, invalid(field))

    def _unknown_name(self) -> str:
        if self.rng.random() < 0.25:
            return "f" * int(self.rng.integers(1000, 100_001))  # up to 100 kB
        if self.rng.random() < 0.3:  # a feature of another side
            return self._pick(self.user + self.context + self.items)
        return self._pick(_NAMES)

    def _unknown_feature(self) -> HostileCase:
        req, n = self._base()
        name = self._unknown_name()
        where = self._pick(("user", "context", "candidate", "column", "sequence"))
        if where == "candidate":
            i = int(self.rng.integers(n))
            field = f"candidates[{i}]."
            known = self.items
            req.candidates[i].values[name].int64_value = 1
        elif where == "column":
            req = self.columnar(req)
            field = 'candidate_columns.columns["'
            known = self.items
            req.candidate_columns.columns[name].CopyFrom(
                predict_pb2.Column(int64s=predict_pb2.Int64Column(values=[1] * n))
            )
        elif where == "sequence":
            field, known = "sequences.", [s for names, _ in self.sequences for s in names]
            req.sequences[name].ids.extend([1, 2])
        else:
            field, known = f"{where}.", self.user if where == "user" else self.context
            getattr(req, where).values[name].int64_value = 1
        if name in known:  # a known name after all: one more value of it
            return self._finish("unknown feature", f"{field}{name} again", req, OK)
        prefix = field + name[:48]
        if len(name) <= 48:  # echoed whole: the path ends here (longer names are cut)
            prefix += '"]: ' if where == "column" else ": "
        exp = Expect(invalid=(prefix,))
        return self._finish(
            "unknown feature", f"{field}{name[:48]} ({len(name)} chars) added", req, exp
        )

    def _candidate_count(self) -> HostileCase:
        req, _ = self._base()
        columnar = self.rng.random() < 0.5
        many = int(self.rng.integers(self.max_candidates + 1, 3 * self.max_candidates + 2))
        count = 0 if self.rng.random() < 0.4 else many
        while len(req.candidates) < count:
            req.candidates.add().CopyFrom(req.candidates[0])
        if count == 0:
            del req.candidates[:]
        if columnar and count:
            req = self.columnar(req)
        elif columnar:
            req.candidate_columns.SetInParent()  # present, num_candidates 0
        field = "candidate_columns.num_candidates" if columnar else "candidates"
        note = f"{field}: {count} candidates"
        return self._finish("candidate count", note, req, invalid(field), candidates=count)

    def _sequence(self) -> HostileCase:
        req, _ = self._base()
        names, cap = self.sequences[0]
        rng = self.rng
        j = int(rng.integers(len(names)))
        what = self._pick(("at cap", "past cap", "unequal", "negative id", "extreme ids", "empty"))
        length = len(req.sequences[names[0]].ids)
        if what in ("at cap", "past cap"):
            length = cap if what == "at cap" else int(rng.integers(cap + 1, 10 * cap + 2))
            for name in names:
                req.sequences[name].ClearField("ids")
                req.sequences[name].ids.extend(rng.integers(0, self.id_range, length).tolist())
            exp = OK if what == "at cap" else invalid(f"sequences.{names[0]}")
        elif what == "unequal":
            ids = req.sequences[names[j]].ids
            if len(ids) and rng.random() < 0.5:
                ids.pop()
            else:
                ids.append(1)
            longer = len(ids) > cap
            exp = invalid(f"sequences.{names[j if j or longer else 1]}")
        elif what == "empty":
            for name in names:
                req.sequences[name].ClearField("ids")
            exp = OK
        else:
            ids = req.sequences[names[j]].ids
            if not len(ids):
                for name in names:
                    req.sequences[name].ids.append(3)
            extreme = (INT64_MAX, 2**53 + 1)[int(rng.integers(2))]
            ids[int(rng.integers(len(ids)))] = INT64_MIN if what == "negative id" else extreme
            if what == "negative id" and rng.random() < 0.5:
                ids[0] = -1
            exp = invalid(f"sequences.{names[j]}") if what == "negative id" else OK
        return self._finish("sequence", f"sequences {what} (sub-feature {names[j]})", req, exp)

    def _column_shape(self) -> HostileCase:
        req, n = self._base()
        req = self.columnar(req)
        cc = req.candidate_columns
        name = self._pick(self.items)
        field = f'candidate_columns.columns["{name}"]'
        col = cc.columns[name]
        kind = col.WhichOneof("kind")
        assert kind is not None
        values = getattr(col, kind).values
        what = self._pick(
            ("short", "long", "mask", "no kind", "all missing", "num_candidates", "2^32-1")
        )
        exp = invalid(field)
        if what == "short":
            values.pop()
        elif what == "long":
            values.append(values[0])
        elif what == "mask":
            wrong = [m for m in (1, n - 1, n + 1, 3 * n) if m not in (0, n)]
            col.missing.extend([True] * wrong[int(self.rng.integers(len(wrong)))])
        elif what == "no kind":
            col.ClearField(kind)
        elif what == "all missing":
            col.missing.extend([True] * n)
            exp = OK
        elif what == "2^32-1":
            cc.num_candidates = 2**32 - 1
            exp = invalid("candidate_columns.num_candidates")
        else:
            other = n - 1 if n > 1 else n + 1
            cc.num_candidates = other
            if other > self.max_candidates:
                exp = invalid("candidate_columns.num_candidates")
            else:  # every column is now the wrong length: the first one checked is named
                exp = Expect(
                    invalid=tuple(f'candidate_columns.columns["{f}"]: ' for f in self.items)
                )
        return self._finish("column shape", f"{field} {what}", req, exp, candidates=n)

    def _both_encodings(self) -> HostileCase:
        req, _ = self._base()
        both = self.columnar(req)
        both.candidates.extend(req.candidates[: int(self.rng.integers(1, len(req.candidates) + 1))])
        return self._finish(
            "both encodings", "candidates and candidate_columns", both, invalid("candidate_columns")
        )

    def _request_id(self) -> HostileCase:
        req, _ = self._base()
        text, what = self._string()
        req.request_id = text
        exp = OK if len(text.encode()) <= 256 else either("request_id")
        return self._finish("request_id", f"request_id {what} ({len(text)} chars)", req, exp)

    def _oversize(self) -> HostileCase:
        req, _ = self._base()
        size = int(self.rng.integers(self.max_request_bytes + 1, 3 * self.max_request_bytes))
        where = self._pick(("request_id", "string value", "sequence"))
        if where == "request_id":
            req.request_id = "r" * size
        elif where == "string value":
            name = self._pick(self.context)
            req.context.values[name].string_value = "s" * size
        else:
            for name in self.sequences[0][0]:
                req.sequences[name].ids.extend([1] * (size // 2))
        return self._finish("oversize", f"{size}-byte {where}", req, TOO_LARGE)

    def _raw(self, family: str, note: str, payload: bytes) -> HostileCase:
        if len(payload) > self.max_request_bytes:
            exp = TOO_LARGE
        elif decodes(payload):
            exp = Expect(ok=True, invalid=())  # some message: any deliberate answer
        else:
            exp = invalid("request")
        return HostileCase(family, note, payload, exp)

    def _random_bytes(self) -> HostileCase:
        size = int(self.rng.integers(0, 64 if self.rng.random() < 0.5 else 4096))
        payload = self.rng.bytes(size)
        return self._raw("random bytes", f"{size} random bytes", payload)

    def _truncated(self) -> HostileCase:
        whole = self._base()[0]
        if self.rng.random() < 0.5:
            whole = self.columnar(whole)
        raw = whole.SerializeToString()
        cut = int(self.rng.integers(1, len(raw)))
        return self._raw("truncated", f"{cut} of {len(raw)} bytes of a valid request", raw[:cut])

    def _invalid_utf_8(self) -> HostileCase:
        req, n = self._base()
        where = self._pick(("request_id", "context value", "feature name", "candidate string"))
        if where == "request_id":
            req.request_id = _SENTINEL
        elif where == "context value":
            req.context.values[self._pick(self.context)].string_value = _SENTINEL
        elif where == "feature name":
            req.user.values[_SENTINEL].int64_value = 1
        else:
            name = self._pick(sorted(self.dynamic & set(self.items)) or self.items)
            req.candidates[int(self.rng.integers(n))].values[name].string_value = _SENTINEL
        bad = _BAD_UTF8[int(self.rng.integers(len(_BAD_UTF8)))]
        payload = req.SerializeToString().replace(_SENTINEL.encode(), bad)
        return self._raw("invalid utf-8", f"{bad.hex()} in {where}", payload)

    def _nested_groups(self) -> HostileCase:
        req, _ = self._base()
        depth = int(
            self.rng.integers(1, 50) if self.rng.random() < 0.3 else self.rng.integers(101, 20_000)
        )
        field = int(self.rng.integers(7, 2**20))
        groups = _tag(field, 3) * depth + _tag(field, 4) * depth
        raw = req.SerializeToString()
        payload = groups + raw if self.rng.random() < 0.5 else raw + groups
        return self._raw("nested groups", f"unknown group {field} nested {depth} deep", payload)

    def _wire_type(self) -> HostileCase:
        req, _ = self._base()
        field = int(self.rng.integers(1, 7))
        wire = self._pick(("0", "1", "5", "6", "7", "2"))
        body = {"0": _varint(5), "1": bytes(8), "5": bytes(4), "2": _varint(3) + b"\xff\x00\x01"}
        extra = _tag(field, int(wire)) + body.get(wire, b"")
        raw = req.SerializeToString()
        cut = int(self.rng.integers(len(raw) + 1)) if self.rng.random() < 0.3 else len(raw)
        payload = raw[:cut] + extra + raw[cut:]
        note = f"field {field} with wire type {wire} inserted at byte {cut}"
        return self._raw("wire type", note, payload)

    def _concatenated(self) -> HostileCase:
        """Two valid requests back to back: protobuf merges them (maps merge, candidates add
        up, the last request_id wins), the server answers whatever the merged request is."""
        first, second = self._base()[0], self._base()[0]
        if self.rng.random() < 0.5:
            second = self.columnar(second)
        payload = first.SerializeToString() + second.SerializeToString()
        return self._raw("concatenated", "two valid requests back to back", payload)
