"""Typed feature definitions derived from a pipeline config: the single source for train/ and serve/.

A :class:`FeatureSet` says, for every feature, which raw column it reads, how raw values become ids
(``num_buckets`` modulo, ``hash_bucket_size`` hash, dynamic raw id, bucketized float; the hashes
and dynamic keys follow the config's :class:`IdMode`), which embedding table it looks up, and
which model groups use it and how (pooled in DEEP, query or sequence in SEQUENCE). Sequence
sub-features (``click_50_seq__adgroup_id``) share the table of the top-level feature with the same
embedding name. Example::

    fs = build_feature_set(load_config("configs/multi_tower_din_taobao_dynamicemb.config"))
    fs.tables["adgroup_id_emb"].dynamic.max_capacity   # 250000
    fs.features["click_50_seq__brand"].table            # "brand_emb"
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum, unique

from protos import pipeline_pb2
from shared.config import ConfigError, ConfigSource, FieldPath, parse_config, source_of


@unique
class FeatureKind(Enum):
    ID = "id"  # one id per row (possibly missing → empty bag)
    RAW_BUCKETIZED = "raw_bucketized"  # float → bucket index by boundaries
    SEQUENCE_ID = "sequence_id"  # jagged list of ids per row


@unique
class Side(Enum):
    USER = "user"
    ITEM = "item"
    CONTEXT = "context"


@unique
class IdTransform(Enum):
    MOD = "num_buckets"  # id mod num_buckets
    HASH = "hash_bucket_size"  # stable hash of the string mod hash_bucket_size (see IdMode)
    DYNAMIC = "dynamic"  # DYNREC: raw int64 id >= 0 (strings: hash into [0, 2**63)); see IdMode
    BUCKETIZE = "boundaries"  # float → index in [0, len(boundaries)]


@unique
class IdMode(Enum):
    """Which hash functions the id transforms use (``data_config.dynrec_id_mode``, default DYNREC).

    DYNREC: ``hash_bucket_size`` strings by :func:`~shared.fg_text.hash64` (FNV-1a + SplitMix64),
    dynamic tables keyed by the raw non-negative id (strings: ``hash64 & (2**63 - 1)``).
    TZREC: the ids TorchEasyRec's feature generation (pyfg) makes, so its tables and checkpoints
    line up with ours: ``hash_bucket_size`` by :func:`~shared.fg_text.std_hash` (libstdc++'s
    ``std::hash<std::string>``) of the value's string form, dynamic keys
    ``std_hash(str(id)) % (2**63 - 1)`` for integer and string ids alike. ``num_buckets`` and
    boundaries are the same in both.
    """

    DYNREC = "dynrec"
    TZREC = "tzrec"


@unique
class InitMode(Enum):
    NORMAL = "NORMAL"
    TRUNCATED_NORMAL = "TRUNCATED_NORMAL"
    UNIFORM = "UNIFORM"
    CONSTANT = "CONSTANT"


@unique
class ScoreStrategy(Enum):
    STEP = "STEP"
    TIMESTAMP = "TIMESTAMP"
    LFU = "LFU"
    NO_EVICTION = "NO_EVICTION"


@unique
class GroupType(Enum):
    DEEP = "DEEP"
    SEQUENCE = "SEQUENCE"


@dataclass(frozen=True)
class InitializerSpec:
    """How new rows are filled. Defaults follow tzrec (see :func:`_initializer`)."""

    mode: InitMode
    mean: float = 0.0
    std_dev: float = 0.0
    lower: float = 0.0
    upper: float = 0.0
    value: float = 0.0


CONSTANT_ZERO = InitializerSpec(InitMode.CONSTANT, value=0.0)


@dataclass(frozen=True)
class AdmissionSpec:
    """Frequency admission: a key enters the table once seen ``threshold`` times."""

    threshold: int
    initializer: InitializerSpec  # embedding of a not-yet-admitted key
    counter_capacity: int
    counter_bucket_capacity: int


@dataclass(frozen=True)
class LfuDecaySpec:
    """How an LFU table's use counts age (``dynamicemb.lfu_decay``): at each training step that
    is a multiple of ``interval_steps``, before the step's lookups, every stored count becomes
    ``count >> shift``. Without it a key that was hot long ago keeps a count that keys hot now
    take as long to reach, so on a stream whose popular ids change the table fills with old
    favourites and refuses new ones; halving the counts every interval weighs a use ``k``
    intervals ago by ``2**-k`` (as Redis's LFU decay and TinyLFU's reset do). Integer shifts:
    scores are int64 and the same on CPU and CUDA."""

    interval_steps: int
    shift: int = 1


@dataclass(frozen=True)
class DynamicTableSpec:
    """Options of a dynamic hash-table embedding (tzrec's ``dynamicemb {}`` block)."""

    max_capacity: int
    init_capacity: int
    bucket_capacity: int
    score_strategy: ScoreStrategy
    initializer: InitializerSpec
    eval_initializer: InitializerSpec
    admission: AdmissionSpec | None
    init_table: str | None
    # the share of rows whose values live in device memory (tzrec's field); None: unset, i.e. 1.0
    # (shared.hashtable.placement plans it and refuses what this build cannot run)
    cache_load_factor: float | None = None
    # LFU counts' decay (``lfu_decay``); None: counts never decay
    lfu_decay: LfuDecaySpec | None = None


@dataclass(frozen=True)
class TableSpec:
    """One embedding table. Dense tables have ``num_rows``; dynamic ones have ``dynamic``."""

    name: str
    dim: int
    num_rows: int | None
    dynamic: DynamicTableSpec | None
    pooling: str  # sum | mean (for pooled lookups)

    @property
    def is_dynamic(self) -> bool:
        return self.dynamic is not None


@dataclass(frozen=True)
class FeatureSpec:
    """One model input: the raw column it reads and how it becomes ids of ``table``."""

    name: str  # also the sample column name, e.g. "click_50_seq__brand"
    kind: FeatureKind
    side: Side
    source: str  # input name after "side:" in the expression, e.g. "brand"
    table: str
    transform: IdTransform
    num_buckets: int | None = None
    hash_bucket_size: int | None = None
    boundaries: tuple[float, ...] = ()
    sequence_name: str | None = None
    sequence_length: int | None = None
    sequence_delim: str | None = None
    id_mode: IdMode = IdMode.DYNREC  # the config's, the same on every feature of a FeatureSet

    @property
    def is_sequence(self) -> bool:
        return self.kind is FeatureKind.SEQUENCE_ID


@dataclass(frozen=True)
class GroupSpec:
    """A model feature group. DEEP: ``features`` pooled and concatenated. SEQUENCE: ``query``
    features (one id each) and ``sequence`` features (jagged, one per query feature, aligned)."""

    name: str
    type: GroupType
    features: tuple[str, ...]
    query: tuple[str, ...] = ()
    sequence: tuple[str, ...] = ()


@dataclass(frozen=True)
class FeatureSet:
    features: dict[str, FeatureSpec]
    tables: dict[str, TableSpec]
    groups: dict[str, GroupSpec]
    # dynamic tables of one feature group share one storage (table fusion): group → tables
    fusion_groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    label_fields: tuple[str, ...] = ("clk",)

    @property
    def id_mode(self) -> IdMode:
        """The id mode of every feature (DYNREC for a set without features). Checkpoints and
        bundles record ``fs.id_mode.value`` so that ids are generated alike where they are read."""
        modes = {f.id_mode for f in self.features.values()}
        if len(modes) > 1:
            raise ValueError(
                f"features disagree on id_mode ({', '.join(sorted(m.value for m in modes))}); "
                "one FeatureSet has one mode; build it from one config (data_config.dynrec_id_mode)"
            )
        return modes.pop() if modes else IdMode.DYNREC

    @property
    def dynamic_tables(self) -> list[TableSpec]:
        return [t for t in self.tables.values() if t.is_dynamic]

    @property
    def dense_tables(self) -> list[TableSpec]:
        return [t for t in self.tables.values() if not t.is_dynamic]

    def columns(self) -> list[str]:
        """Sample columns a batch needs: one per feature (in config order) plus the labels."""
        return [*self.features, *self.label_fields]

    def group(self, type_: GroupType) -> GroupSpec:
        found = [g for g in self.groups.values() if g.type is type_]
        if len(found) != 1:
            raise ValueError(
                f"expected one {type_.value} group, found {len(found)}; give "
                f"model_config.feature_groups exactly one group_type: {type_.value}"
            )
        return found[0]


# --------------------------------------------------------------------------- building


def build_feature_set(
    config: pipeline_pb2.EasyRecConfig, source: ConfigSource | None = None
) -> FeatureSet:
    """Derive and validate the feature definitions of ``config``.

    ``source`` (the config text) lets errors point at a line; it defaults to the text
    :func:`~shared.config.parse_config` read ``config`` from. Without either, errors name the
    field only.
    """
    src = source or source_of(config) or ConfigSource("", "<config>")
    tables: dict[str, TableSpec] = {}
    features: dict[str, FeatureSpec] = {}
    for i, fc in enumerate(config.feature_configs):
        which = fc.WhichOneof("feature")
        at: FieldPath = ("feature_configs", i, str(which))
        if which == "id_feature":
            _add_id_feature(fc.id_feature, src, tables, features, at)
        elif which == "raw_feature":
            _add_raw_feature(fc.raw_feature, src, tables, features, at)
        elif which == "sequence_feature":
            _add_sequence_feature(fc.sequence_feature, src, tables, features, at)
        else:
            raise src.error(
                "feature_configs",
                "empty feature_configs entry; give it an id_feature, raw_feature or "
                "sequence_feature, or remove it",
                at=at[:2],
            )
    mode = IdMode[pipeline_pb2.IdMode.Name(config.data_config.dynrec_id_mode)]
    features = {name: replace(f, id_mode=mode) for name, f in features.items()}
    groups = _build_groups(config.model_config, features, src)
    fusion = _fusion_groups(groups, features, tables)
    labels = tuple(config.data_config.label_fields) or ("clk",)
    return FeatureSet(features, tables, groups, fusion, labels)


def feature_set_from_text(text: str, name: str = "<config>") -> FeatureSet:
    """Parse and build in one go, with line numbers in errors."""
    return build_feature_set(parse_config(text, name), ConfigSource(text, name))


def _split_expression(
    expr: str, field_name: str, src: ConfigSource, at: FieldPath
) -> tuple[Side, str]:
    side, sep, name = expr.partition(":")
    if not sep or not name:
        raise src.error(
            field_name,
            f"expression {expr!r} must look like 'user:user_id'; write <side>:<input column>",
            at=at,
        )
    try:
        return Side(side), name
    except ValueError:
        sides = ", ".join(s.value for s in Side)
        raise src.error(
            field_name, f"side {side!r} is not one of {sides}; write one of them before ':'", at=at
        ) from None


def _initializer(
    msg: pipeline_pb2.DynamicEmbInitializerArgs | None,
    *,
    default_mode: InitMode,
    dim: int,
    max_capacity: int,
    field_name: str,
    src: ConfigSource,
    at: FieldPath,
) -> InitializerSpec:
    """tzrec defaults: mode UNIFORM, std_dev sqrt(1/dim), bounds ±sqrt(1/max_capacity), value 0."""
    mode = default_mode
    if msg is not None and msg.HasField("mode"):
        try:
            mode = InitMode(msg.mode)
        except ValueError:
            modes = ", ".join(m.value for m in InitMode)
            raise src.error(
                f"{field_name}.mode",
                f"{msg.mode!r} is not one of {modes}; set mode to one of them",
                at=(*at, "mode"),
            ) from None
    bound = math.sqrt(1.0 / max_capacity)

    def get(name: str, default: float) -> float:
        return float(getattr(msg, name)) if msg is not None and msg.HasField(name) else default

    spec = InitializerSpec(
        mode=mode,
        mean=get("mean", 0.0),
        std_dev=get("std_dev", math.sqrt(1.0 / dim)),
        lower=get("lower", -bound),
        upper=get("upper", bound),
        value=get("value", 0.0),
    )
    if spec.std_dev < 0:
        raise src.error(
            f"{field_name}.std_dev",
            f"must be >= 0, got {spec.std_dev}; set std_dev >= 0 or remove it (sqrt(1/dim))",
            at=(*at, "std_dev"),
        )
    if spec.lower > spec.upper:
        raise src.error(
            f"{field_name}.lower",
            f"lower {spec.lower} > upper {spec.upper}; set lower <= upper",
            at=(*at, "lower"),
        )
    return spec


def _capacities_and_strategy(
    de: pipeline_pb2.DynamicEmbedding, err: Callable[[str, str], ConfigError]
) -> tuple[int, ScoreStrategy]:
    """(init_capacity_per_rank, score_strategy) of a ``dynamicemb`` message, checked."""
    if not de.HasField("max_capacity") or de.max_capacity < 1:
        raise err("max_capacity", "required and must be >= 1; set it to the rows per rank")
    init_cap = (
        de.init_capacity_per_rank if de.HasField("init_capacity_per_rank") else de.max_capacity
    )
    if init_cap < 1:
        raise err(
            "init_capacity_per_rank",
            f"must be >= 1, got {init_cap}; raise it or remove it (default: max_capacity)",
        )
    if de.max_capacity < init_cap:
        raise err(
            "max_capacity",
            f"max_capacity {de.max_capacity} < init_capacity_per_rank {init_cap}; raise "
            "max_capacity or lower init_capacity_per_rank",
        )
    if de.bucket_capacity < 1:
        raise err(
            "bucket_capacity",
            f"must be >= 1, got {de.bucket_capacity}; raise it or remove it (default: 128)",
        )
    try:
        strategy = ScoreStrategy(de.score_strategy)
    except ValueError:
        names = ", ".join(s.value for s in ScoreStrategy)
        raise err(
            "score_strategy",
            f"{de.score_strategy!r} is not one of {names}; set score_strategy to one of them "
            "(TIMESTAMP evicts the least recently used rows)",
        ) from None
    return int(init_cap), strategy


def _dynamic_spec(
    de: pipeline_pb2.DynamicEmbedding, dim: int, fname: str, src: ConfigSource, at: FieldPath
) -> DynamicTableSpec:
    """``at``: the path of the ``dynamicemb`` message."""
    path = f"feature_configs.id_feature({fname}).dynamicemb"

    def err(sub: str, message: str) -> ConfigError:
        return src.error(f"{path}.{sub}", message, at=(*at, *sub.split(".")))

    init_cap, strategy = _capacities_and_strategy(de, err)

    def init(msg_field: str, default_mode: InitMode, sub: str) -> InitializerSpec:
        holder = de if "." not in sub else de.frequency_admission_strategy
        msg = getattr(holder, msg_field) if holder.HasField(msg_field) else None
        return _initializer(
            msg,
            default_mode=default_mode,
            dim=dim,
            max_capacity=de.max_capacity,
            field_name=f"{path}.{sub}",
            src=src,
            at=(*at, *sub.split(".")),
        )

    admission = None
    if de.HasField("frequency_admission_strategy"):
        fa = de.frequency_admission_strategy
        if fa.threshold < 1:
            raise err(
                "frequency_admission_strategy.threshold",
                f"must be >= 1, got {fa.threshold}; set threshold >= 1 (1 admits every key)",
            )
        counter_cap = fa.counter_capacity if fa.HasField("counter_capacity") else de.max_capacity
        if counter_cap < 1 or fa.counter_bucket_capacity < 1:
            raise err(
                "frequency_admission_strategy.counter_capacity",
                "counter_capacity and counter_bucket_capacity must be >= 1; raise them or remove "
                "them (defaults: max_capacity, 1024)",
            )
        admission = AdmissionSpec(
            threshold=int(fa.threshold),
            initializer=init(
                "initializer_args",
                InitMode.CONSTANT,
                "frequency_admission_strategy.initializer_args",
            ),
            counter_capacity=int(counter_cap),
            counter_bucket_capacity=int(fa.counter_bucket_capacity),
        )
    return DynamicTableSpec(
        max_capacity=int(de.max_capacity),
        init_capacity=int(init_cap),
        bucket_capacity=int(de.bucket_capacity),
        score_strategy=strategy,
        initializer=init("initializer_args", InitMode.UNIFORM, "initializer_args"),
        eval_initializer=init("eval_initializer_args", InitMode.CONSTANT, "eval_initializer_args"),
        admission=admission,
        init_table=de.init_table if de.HasField("init_table") else None,
        cache_load_factor=_cache_load_factor(de, err),
        lfu_decay=_lfu_decay(de, strategy, err),
    )


# a shift of 63 bits or more leaves 0 of any int64 count: the largest that keeps some of it
MAX_LFU_DECAY_SHIFT = 62


def _lfu_decay(
    de: pipeline_pb2.DynamicEmbedding,
    strategy: ScoreStrategy,
    err: Callable[[str, str], ConfigError],
) -> LfuDecaySpec | None:
    if not de.HasField("lfu_decay"):
        return None
    if strategy is not ScoreStrategy.LFU:
        raise err(
            "lfu_decay",
            f"decays LFU use counts, but score_strategy is {strategy.value}; remove lfu_decay "
            "or set score_strategy to LFU (STEP and TIMESTAMP scores age by themselves)",
        )
    decay = de.lfu_decay
    if decay.interval_steps < 1:
        raise err(
            "lfu_decay.interval_steps",
            f"must be >= 1, got {decay.interval_steps}; set it to the training steps between "
            "two decays (or remove lfu_decay: no decay)",
        )
    if not 1 <= decay.shift <= MAX_LFU_DECAY_SHIFT:
        raise err(
            "lfu_decay.shift",
            f"must be in [1, {MAX_LFU_DECAY_SHIFT}], got {decay.shift}; it is the bits each "
            "count is shifted right by (1: halved); remove lfu_decay for no decay",
        )
    return LfuDecaySpec(interval_steps=int(decay.interval_steps), shift=int(decay.shift))


def _cache_load_factor(
    de: pipeline_pb2.DynamicEmbedding, err: Callable[[str, str], ConfigError]
) -> float | None:
    if not de.HasField("cache_load_factor"):
        return None
    factor = float(de.cache_load_factor)
    if not 0.0 < factor <= 1.0:
        raise err(
            "cache_load_factor",
            f"must be in (0, 1], got {factor}; it is the share of the table's rows kept in "
            "device memory (1.0: all of them)",
        )
    return factor


def _register_table(
    tables: dict[str, TableSpec], table: TableSpec, fname: str, src: ConfigSource, at: FieldPath
) -> None:
    """Add ``table`` or check it agrees with the table of the same name already registered."""
    old = tables.get(table.name)
    if old is None:
        tables[table.name] = table
        return
    if old.dim != table.dim:
        raise src.error(
            f"feature({fname}).embedding_dim",
            f"table {table.name!r} is shared and already has embedding_dim {old.dim}, "
            f"got {table.dim}; use the same dim or another embedding_name",
            at=(*at, "embedding_dim"),
        )
    if (old.num_rows, old.dynamic) != (
        table.num_rows,
        table.dynamic,
    ) and table.num_rows is not None:
        raise src.error(
            f"feature({fname})",
            f"table {table.name!r} is shared but declared with different rows/dynamicemb options; "
            "declare it alike in each feature or give this one another embedding_name",
            at=at,
        )


def _id_table_and_transform(
    f: pipeline_pb2.IdFeature,
    src: ConfigSource,
    tables: dict[str, TableSpec],
    path: str,
    at: FieldPath,
) -> tuple[TableSpec | None, IdTransform, int | None, int | None]:
    """Table declared by an id_feature (None when it only refers to a shared table)."""
    name = f.embedding_name or f"{f.feature_name}_emb"
    has_nb, has_hb, has_de = (
        f.HasField("num_buckets"),
        f.HasField("hash_bucket_size"),
        f.HasField("dynamicemb"),
    )
    if has_de and (has_nb or has_hb):
        other = "num_buckets" if has_nb else "hash_bucket_size"
        raise src.error(
            f"{path}.dynamicemb",
            f"dynamicemb and {other} are exclusive on one feature: a dynamic table has no fixed "
            f"row count; remove {other}",
            at=(*at, "dynamicemb"),
        )
    if has_nb and has_hb:
        raise src.error(
            f"{path}.num_buckets",
            "num_buckets and hash_bucket_size are exclusive; keep one",
            at=(*at, "hash_bucket_size"),
        )
    if f.embedding_dim < 1:
        raise src.error(
            f"{path}.embedding_dim", "must be >= 1; set embedding_dim", at=(*at, "embedding_dim")
        )
    if f.pooling not in ("sum", "mean"):
        raise src.error(
            f"{path}.pooling",
            f"{f.pooling!r} is not sum or mean; set pooling to one of them",
            at=(*at, "pooling"),
        )
    if has_de:
        dyn = _dynamic_spec(f.dynamicemb, f.embedding_dim, f.feature_name, src, (*at, "dynamicemb"))
        return (
            TableSpec(name, f.embedding_dim, None, dyn, f.pooling),
            IdTransform.DYNAMIC,
            None,
            None,
        )
    if has_nb:
        if f.num_buckets < 1:
            raise src.error(
                f"{path}.num_buckets", "must be >= 1; set num_buckets", at=(*at, "num_buckets")
            )
        table = TableSpec(name, f.embedding_dim, int(f.num_buckets), None, f.pooling)
        return table, IdTransform.MOD, int(f.num_buckets), None
    if has_hb:
        if f.hash_bucket_size < 1:
            raise src.error(
                f"{path}.hash_bucket_size",
                "must be >= 1; set hash_bucket_size",
                at=(*at, "hash_bucket_size"),
            )
        table = TableSpec(name, f.embedding_dim, int(f.hash_bucket_size), None, f.pooling)
        return table, IdTransform.HASH, None, int(f.hash_bucket_size)
    return None, IdTransform.DYNAMIC, None, None  # resolved against a shared table later


def _add_id_feature(
    f: pipeline_pb2.IdFeature,
    src: ConfigSource,
    tables: dict[str, TableSpec],
    features: dict[str, FeatureSpec],
    at: FieldPath,
) -> None:
    path = f"feature_configs.id_feature({f.feature_name})"
    if f.feature_name in features:
        raise src.error(
            path, "duplicate feature_name; rename one of them", at=(*at, "feature_name")
        )
    side, source = _split_expression(f.expression, f"{path}.expression", src, (*at, "expression"))
    table, transform, nb, hb = _id_table_and_transform(f, src, tables, path, at)
    if table is None:
        raise src.error(
            path, "needs a table; add one of num_buckets, hash_bucket_size or dynamicemb {}", at=at
        )
    _register_table(tables, table, f.feature_name, src, at)
    features[f.feature_name] = FeatureSpec(
        f.feature_name, FeatureKind.ID, side, source, table.name, transform, nb, hb
    )


def _add_raw_feature(
    f: pipeline_pb2.RawFeature,
    src: ConfigSource,
    tables: dict[str, TableSpec],
    features: dict[str, FeatureSpec],
    at: FieldPath,
) -> None:
    path = f"feature_configs.raw_feature({f.feature_name})"
    side, source = _split_expression(f.expression, f"{path}.expression", src, (*at, "expression"))
    bounds = tuple(float(b) for b in f.boundaries)
    if not bounds:
        raise src.error(
            f"{path}.boundaries",
            "raw features without boundaries (dense values) are not supported; add boundaries",
            at=at,
        )
    for i in range(1, len(bounds)):
        if not bounds[i] > bounds[i - 1]:
            raise src.error(
                f"{path}.boundaries",
                f"must be strictly increasing: boundaries[{i - 1}]={bounds[i - 1]} >= "
                f"boundaries[{i}]={bounds[i]}; sort them and drop duplicates",
                at=(*at, "boundaries", i),
            )
    if not f.HasField("embedding_dim") or f.embedding_dim < 1:
        raise src.error(
            f"{path}.embedding_dim",
            "required (>= 1) with boundaries; set embedding_dim",
            at=(*at, "embedding_dim"),
        )
    table = TableSpec(
        f.embedding_name or f"{f.feature_name}_emb",
        f.embedding_dim,
        len(bounds) + 1,
        None,
        f.pooling,
    )
    _register_table(tables, table, f.feature_name, src, at)
    features[f.feature_name] = FeatureSpec(
        f.feature_name,
        FeatureKind.RAW_BUCKETIZED,
        side,
        source,
        table.name,
        IdTransform.BUCKETIZE,
        boundaries=bounds,
    )


def _add_sequence_feature(
    seq: pipeline_pb2.SequenceFeature,
    src: ConfigSource,
    tables: dict[str, TableSpec],
    features: dict[str, FeatureSpec],
    at: FieldPath,
) -> None:
    spath = f"feature_configs.sequence_feature({seq.sequence_name})"
    if seq.sequence_length < 1:
        raise src.error(
            f"{spath}.sequence_length",
            "must be >= 1; set sequence_length to the longest history kept",
            at=(*at, "sequence_length"),
        )
    if not seq.sequence_delim:
        raise src.error(
            f"{spath}.sequence_delim",
            "must not be empty; set it to the separator of the sequence column, e.g. ';'",
            at=(*at, "sequence_delim"),
        )
    for j, sub in enumerate(seq.features):
        sub_at: FieldPath = (*at, "features", j, "id_feature")
        if sub.WhichOneof("feature") != "id_feature":
            raise src.error(
                spath,
                "only id_feature sub-features are supported; write each one as id_feature { }",
                at=(*at, "features", j),
            )
        f = sub.id_feature
        name = f"{seq.sequence_name}__{f.feature_name}"
        path = f"{spath}.id_feature({f.feature_name})"
        side, source = _split_expression(
            f.expression, f"{path}.expression", src, (*sub_at, "expression")
        )
        table, transform, nb, hb = _id_table_and_transform(f, src, tables, path, sub_at)
        table_name = f.embedding_name or f"{f.feature_name}_emb"
        if table is None:
            shared = tables.get(table_name)
            if shared is None:
                raise src.error(
                    path,
                    f"declares no table and no earlier feature owns {table_name!r}; put the "
                    "top-level feature first or give num_buckets/dynamicemb here",
                    at=sub_at,
                )
            if shared.dim != f.embedding_dim:
                raise src.error(
                    f"{path}.embedding_dim",
                    f"table {table_name!r} is shared and has embedding_dim {shared.dim}, got "
                    f"{f.embedding_dim}; use the same dim or another embedding_name",
                    at=(*sub_at, "embedding_dim"),
                )
            owner = next(x for x in features.values() if x.table == table_name)
            transform, nb, hb = owner.transform, owner.num_buckets, owner.hash_bucket_size
        else:
            _register_table(tables, table, f.feature_name, src, sub_at)
        features[name] = FeatureSpec(
            name,
            FeatureKind.SEQUENCE_ID,
            side,
            source,
            table_name,
            transform,
            nb,
            hb,
            sequence_name=seq.sequence_name,
            sequence_length=int(seq.sequence_length),
            sequence_delim=seq.sequence_delim,
        )


def _build_groups(
    model: pipeline_pb2.ModelConfig, features: dict[str, FeatureSpec], src: ConfigSource
) -> dict[str, GroupSpec]:
    groups: dict[str, GroupSpec] = {}
    for gi, g in enumerate(model.feature_groups):
        path = f"model_config.feature_groups({g.group_name})"
        at: FieldPath = ("model_config", "feature_groups", gi)
        for k, name in enumerate(g.feature_names):
            if name not in features:
                raise src.error(
                    f"{path}.feature_names",
                    f"unknown feature {name!r}; use one of {', '.join(features)} or declare it in "
                    "feature_configs",
                    at=(*at, "feature_names", k),
                )
        gtype = pipeline_pb2.FeatureGroupType.Name(g.group_type)
        if gtype not in GroupType.__members__:
            raise src.error(
                f"{path}.group_type",
                f"{gtype} groups are not supported; use DEEP or SEQUENCE",
                at=(*at, "group_type"),
            )
        names = tuple(g.feature_names)
        if GroupType[gtype] is GroupType.DEEP:
            bad = [n for n in names if features[n].is_sequence]
            if bad:
                raise src.error(
                    f"{path}.feature_names",
                    f"sequence features {bad} cannot be pooled in DEEP; move them to a SEQUENCE "
                    "group",
                    at=(*at, "feature_names", names.index(bad[0])),
                )
            groups[g.group_name] = GroupSpec(g.group_name, GroupType.DEEP, names)
            continue
        query = tuple(n for n in names if not features[n].is_sequence)
        sequence = tuple(n for n in names if features[n].is_sequence)
        if len(query) != len(sequence):
            raise src.error(
                f"{path}.feature_names",
                f"a SEQUENCE group needs one sequence feature per query feature; got query "
                f"{list(query)} and sequence {list(sequence)}; list the query feature of "
                "each sequence feature (adgroup_id for click_seq__adgroup_id)",
                at=at,
            )
        groups[g.group_name] = GroupSpec(g.group_name, GroupType.SEQUENCE, names, query, sequence)
    return groups


def _fusion_groups(
    groups: dict[str, GroupSpec], features: dict[str, FeatureSpec], tables: dict[str, TableSpec]
) -> dict[str, tuple[str, ...]]:
    """Each dynamic table joins the fusion storage of the first group that uses it."""
    placed: set[str] = set()
    fusion: dict[str, tuple[str, ...]] = {}
    for g in groups.values():
        members: list[str] = []
        for name in g.features:
            t = features[name].table
            if tables[t].is_dynamic and t not in placed:
                placed.add(t)
                members.append(t)
        if members:
            fusion[g.name] = tuple(members)
    return fusion
