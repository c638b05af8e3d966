from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Value(_message.Message):
    __slots__ = ("int64_value", "double_value", "string_value")
    INT64_VALUE_FIELD_NUMBER: _ClassVar[int]
    DOUBLE_VALUE_FIELD_NUMBER: _ClassVar[int]
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    int64_value: int
    double_value: float
    string_value: str
    def __init__(self, int64_value: _Optional[int] = ..., double_value: _Optional[float] = ..., string_value: _Optional[str] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("values",)
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.MessageMap[str, Value]
    def __init__(self, values: _Optional[_Mapping[str, Value]] = ...) -> None: ...

class IdSequence(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Int64Column(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, values: _Optional[_Iterable[int]] = ...) -> None: ...

class DoubleColumn(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class StringColumn(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class Column(_message.Message):
    __slots__ = ("int64s", "doubles", "strings", "missing")
    INT64S_FIELD_NUMBER: _ClassVar[int]
    DOUBLES_FIELD_NUMBER: _ClassVar[int]
    STRINGS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    int64s: Int64Column
    doubles: DoubleColumn
    strings: StringColumn
    missing: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, int64s: _Optional[_Union[Int64Column, _Mapping]] = ..., doubles: _Optional[_Union[DoubleColumn, _Mapping]] = ..., strings: _Optional[_Union[StringColumn, _Mapping]] = ..., missing: _Optional[_Iterable[bool]] = ...) -> None: ...

class CandidateColumns(_message.Message):
    __slots__ = ("num_candidates", "columns")
    class ColumnsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Column
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Column, _Mapping]] = ...) -> None: ...
    NUM_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    num_candidates: int
    columns: _containers.MessageMap[str, Column]
    def __init__(self, num_candidates: _Optional[int] = ..., columns: _Optional[_Mapping[str, Column]] = ...) -> None: ...

class PredictRequest(_message.Message):
    __slots__ = ("request_id", "user", "sequences", "context", "candidates", "candidate_columns")
    class SequencesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: IdSequence
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[IdSequence, _Mapping]] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    user: Features
    sequences: _containers.MessageMap[str, IdSequence]
    context: Features
    candidates: _containers.RepeatedCompositeFieldContainer[Features]
    candidate_columns: CandidateColumns
    def __init__(self, request_id: _Optional[str] = ..., user: _Optional[_Union[Features, _Mapping]] = ..., sequences: _Optional[_Mapping[str, IdSequence]] = ..., context: _Optional[_Union[Features, _Mapping]] = ..., candidates: _Optional[_Iterable[_Union[Features, _Mapping]]] = ..., candidate_columns: _Optional[_Union[CandidateColumns, _Mapping]] = ...) -> None: ...

class PredictResponse(_message.Message):
    __slots__ = ("probabilities", "model_version", "request_id")
    PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    probabilities: _containers.RepeatedScalarFieldContainer[float]
    model_version: str
    request_id: str
    def __init__(self, probabilities: _Optional[_Iterable[float]] = ..., model_version: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class ModelMetadataRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FeatureInfo(_message.Message):
    __slots__ = ("name", "side", "kind", "table", "value_type", "max_length")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIDE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    VALUE_TYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    side: str
    kind: str
    table: str
    value_type: str
    max_length: int
    def __init__(self, name: _Optional[str] = ..., side: _Optional[str] = ..., kind: _Optional[str] = ..., table: _Optional[str] = ..., value_type: _Optional[str] = ..., max_length: _Optional[int] = ...) -> None: ...

class SequenceInfo(_message.Message):
    __slots__ = ("name", "features", "max_length", "delimiter")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DELIMITER_FIELD_NUMBER: _ClassVar[int]
    name: str
    features: _containers.RepeatedScalarFieldContainer[str]
    max_length: int
    delimiter: str
    def __init__(self, name: _Optional[str] = ..., features: _Optional[_Iterable[str]] = ..., max_length: _Optional[int] = ..., delimiter: _Optional[str] = ...) -> None: ...

class ServingLimits(_message.Message):
    __slots__ = ("max_candidates", "max_string_bytes", "max_request_bytes", "max_message_bytes", "max_detail_bytes", "max_pending")
    MAX_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    MAX_STRING_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_DETAIL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_PENDING_FIELD_NUMBER: _ClassVar[int]
    max_candidates: int
    max_string_bytes: int
    max_request_bytes: int
    max_message_bytes: int
    max_detail_bytes: int
    max_pending: int
    def __init__(self, max_candidates: _Optional[int] = ..., max_string_bytes: _Optional[int] = ..., max_request_bytes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_detail_bytes: _Optional[int] = ..., max_pending: _Optional[int] = ...) -> None: ...

class ModelRefusal(_message.Message):
    __slots__ = ("version", "reason", "at_unix")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    version: str
    reason: str
    at_unix: float
    def __init__(self, version: _Optional[str] = ..., reason: _Optional[str] = ..., at_unix: _Optional[float] = ...) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("name", "is_hashmap", "dim", "rows", "capacity", "load_factor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IS_HASHMAP_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FACTOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    is_hashmap: bool
    dim: int
    rows: int
    capacity: int
    load_factor: float
    def __init__(self, name: _Optional[str] = ..., is_hashmap: _Optional[bool] = ..., dim: _Optional[int] = ..., rows: _Optional[int] = ..., capacity: _Optional[int] = ..., load_factor: _Optional[float] = ...) -> None: ...

class ModelMetadata(_message.Message):
    __slots__ = ("model_version", "config_digest", "features", "tables", "loaded_at_unix", "startup_seconds", "device", "max_candidates", "max_sequence_length", "base_version", "deltas", "limits", "sequences", "last_refusal", "event_time_unix", "freshness_seconds")
    class StartupSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    LOADED_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    STARTUP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    LAST_REFUSAL_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    FRESHNESS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    model_version: str
    config_digest: str
    features: _containers.RepeatedCompositeFieldContainer[FeatureInfo]
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    loaded_at_unix: float
    startup_seconds: _containers.ScalarMap[str, float]
    device: str
    max_candidates: int
    max_sequence_length: int
    base_version: str
    deltas: _containers.RepeatedScalarFieldContainer[str]
    limits: ServingLimits
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceInfo]
    last_refusal: ModelRefusal
    event_time_unix: float
    freshness_seconds: float
    def __init__(self, model_version: _Optional[str] = ..., config_digest: _Optional[str] = ..., features: _Optional[_Iterable[_Union[FeatureInfo, _Mapping]]] = ..., tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ..., loaded_at_unix: _Optional[float] = ..., startup_seconds: _Optional[_Mapping[str, float]] = ..., device: _Optional[str] = ..., max_candidates: _Optional[int] = ..., max_sequence_length: _Optional[int] = ..., base_version: _Optional[str] = ..., deltas: _Optional[_Iterable[str]] = ..., limits: _Optional[_Union[ServingLimits, _Mapping]] = ..., sequences: _Optional[_Iterable[_Union[SequenceInfo, _Mapping]]] = ..., last_refusal: _Optional[_Union[ModelRefusal, _Mapping]] = ..., event_time_unix: _Optional[float] = ..., freshness_seconds: _Optional[float] = ...) -> None: ...

class InspectRequest(_message.Message):
    __slots__ = ("top_k",)
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    top_k: int
    def __init__(self, top_k: _Optional[int] = ...) -> None: ...

class ScoreBin(_message.Message):
    __slots__ = ("lower", "upper", "count")
    LOWER_FIELD_NUMBER: _ClassVar[int]
    UPPER_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    lower: int
    upper: int
    count: int
    def __init__(self, lower: _Optional[int] = ..., upper: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class KeyScore(_message.Message):
    __slots__ = ("key", "score")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    key: int
    score: int
    def __init__(self, key: _Optional[int] = ..., score: _Optional[int] = ...) -> None: ...

class TableInspection(_message.Message):
    __slots__ = ("name", "is_hashmap", "dim", "size", "capacity", "load_factor", "hits", "misses", "score_strategy", "score_histogram", "top_keys", "admission_threshold", "admission_pending", "admission_pending_by_count")
    class AdmissionPendingByCountEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    IS_HASHMAP_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FACTOR_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    SCORE_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    SCORE_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    TOP_KEYS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_PENDING_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_PENDING_BY_COUNT_FIELD_NUMBER: _ClassVar[int]
    name: str
    is_hashmap: bool
    dim: int
    size: int
    capacity: int
    load_factor: float
    hits: int
    misses: int
    score_strategy: str
    score_histogram: _containers.RepeatedCompositeFieldContainer[ScoreBin]
    top_keys: _containers.RepeatedCompositeFieldContainer[KeyScore]
    admission_threshold: int
    admission_pending: int
    admission_pending_by_count: _containers.ScalarMap[str, int]
    def __init__(self, name: _Optional[str] = ..., is_hashmap: _Optional[bool] = ..., dim: _Optional[int] = ..., size: _Optional[int] = ..., capacity: _Optional[int] = ..., load_factor: _Optional[float] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., score_strategy: _Optional[str] = ..., score_histogram: _Optional[_Iterable[_Union[ScoreBin, _Mapping]]] = ..., top_keys: _Optional[_Iterable[_Union[KeyScore, _Mapping]]] = ..., admission_threshold: _Optional[int] = ..., admission_pending: _Optional[int] = ..., admission_pending_by_count: _Optional[_Mapping[str, int]] = ...) -> None: ...

class InspectResponse(_message.Message):
    __slots__ = ("model_version", "base_version", "deltas", "tables")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    model_version: str
    base_version: str
    deltas: _containers.RepeatedScalarFieldContainer[str]
    tables: _containers.RepeatedCompositeFieldContainer[TableInspection]
    def __init__(self, model_version: _Optional[str] = ..., base_version: _Optional[str] = ..., deltas: _Optional[_Iterable[str]] = ..., tables: _Optional[_Iterable[_Union[TableInspection, _Mapping]]] = ...) -> None: ...

class DeltaTableCounts(_message.Message):
    __slots__ = ("new", "updated", "evicted", "rows", "is_hashmap")
    NEW_FIELD_NUMBER: _ClassVar[int]
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    IS_HASHMAP_FIELD_NUMBER: _ClassVar[int]
    new: int
    updated: int
    evicted: int
    rows: int
    is_hashmap: bool
    def __init__(self, new: _Optional[int] = ..., updated: _Optional[int] = ..., evicted: _Optional[int] = ..., rows: _Optional[int] = ..., is_hashmap: _Optional[bool] = ...) -> None: ...

class ApplyDeltaRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class ApplyDeltaResponse(_message.Message):
    __slots__ = ("model_version", "base_version", "deltas", "tables", "dense_program", "apply_seconds")
    class TablesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: DeltaTableCounts
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[DeltaTableCounts, _Mapping]] = ...) -> None: ...
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    DENSE_PROGRAM_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    model_version: str
    base_version: str
    deltas: _containers.RepeatedScalarFieldContainer[str]
    tables: _containers.MessageMap[str, DeltaTableCounts]
    dense_program: bool
    apply_seconds: float
    def __init__(self, model_version: _Optional[str] = ..., base_version: _Optional[str] = ..., deltas: _Optional[_Iterable[str]] = ..., tables: _Optional[_Mapping[str, DeltaTableCounts]] = ..., dense_program: _Optional[bool] = ..., apply_seconds: _Optional[float] = ...) -> None: ...
