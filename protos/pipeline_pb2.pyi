from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DatasetType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OdpsDataset: _ClassVar[DatasetType]
    ParquetDataset: _ClassVar[DatasetType]
    CsvDataset: _ClassVar[DatasetType]

class FgMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FG_NONE: _ClassVar[FgMode]
    FG_NORMAL: _ClassVar[FgMode]
    FG_DAG: _ClassVar[FgMode]
    FG_BUCKETIZE: _ClassVar[FgMode]

class IdMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DYNREC: _ClassVar[IdMode]
    TZREC: _ClassVar[IdMode]

class FeatureGroupType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEEP: _ClassVar[FeatureGroupType]
    WIDE: _ClassVar[FeatureGroupType]
    SEQUENCE: _ClassVar[FeatureGroupType]
OdpsDataset: DatasetType
ParquetDataset: DatasetType
CsvDataset: DatasetType
FG_NONE: FgMode
FG_NORMAL: FgMode
FG_DAG: FgMode
FG_BUCKETIZE: FgMode
DYNREC: IdMode
TZREC: IdMode
DEEP: FeatureGroupType
WIDE: FeatureGroupType
SEQUENCE: FeatureGroupType

class AdagradOptimizer(_message.Message):
    __slots__ = ("lr", "initial_accumulator_value", "eps")
    LR_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_VALUE_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    lr: float
    initial_accumulator_value: float
    eps: float
    def __init__(self, lr: _Optional[float] = ..., initial_accumulator_value: _Optional[float] = ..., eps: _Optional[float] = ...) -> None: ...

class AdamOptimizer(_message.Message):
    __slots__ = ("lr", "beta1", "beta2", "eps", "weight_decay")
    LR_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    def __init__(self, lr: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ...) -> None: ...

class SGDOptimizer(_message.Message):
    __slots__ = ("lr",)
    LR_FIELD_NUMBER: _ClassVar[int]
    lr: float
    def __init__(self, lr: _Optional[float] = ...) -> None: ...

class ConstantLR(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExponentialDecayLR(_message.Message):
    __slots__ = ("decay_size", "decay_factor", "staircase", "warmup_learning_rate", "warmup_size", "min_learning_rate", "by_epoch")
    DECAY_SIZE_FIELD_NUMBER: _ClassVar[int]
    DECAY_FACTOR_FIELD_NUMBER: _ClassVar[int]
    STAIRCASE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    decay_size: int
    decay_factor: float
    staircase: bool
    warmup_learning_rate: float
    warmup_size: int
    min_learning_rate: float
    by_epoch: bool
    def __init__(self, decay_size: _Optional[int] = ..., decay_factor: _Optional[float] = ..., staircase: _Optional[bool] = ..., warmup_learning_rate: _Optional[float] = ..., warmup_size: _Optional[int] = ..., min_learning_rate: _Optional[float] = ..., by_epoch: _Optional[bool] = ...) -> None: ...

class ManualStepLR(_message.Message):
    __slots__ = ("schedule_sizes", "learning_rates", "warmup", "by_epoch")
    SCHEDULE_SIZES_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATES_FIELD_NUMBER: _ClassVar[int]
    WARMUP_FIELD_NUMBER: _ClassVar[int]
    BY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    schedule_sizes: _containers.RepeatedScalarFieldContainer[int]
    learning_rates: _containers.RepeatedScalarFieldContainer[float]
    warmup: bool
    by_epoch: bool
    def __init__(self, schedule_sizes: _Optional[_Iterable[int]] = ..., learning_rates: _Optional[_Iterable[float]] = ..., warmup: _Optional[bool] = ..., by_epoch: _Optional[bool] = ...) -> None: ...

class CosineAnnealingLR(_message.Message):
    __slots__ = ("T_max", "min_learning_rate", "warmup_learning_rate", "warmup_size", "by_epoch")
    T_MAX_FIELD_NUMBER: _ClassVar[int]
    MIN_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    BY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    T_max: int
    min_learning_rate: float
    warmup_learning_rate: float
    warmup_size: int
    by_epoch: bool
    def __init__(self, T_max: _Optional[int] = ..., min_learning_rate: _Optional[float] = ..., warmup_learning_rate: _Optional[float] = ..., warmup_size: _Optional[int] = ..., by_epoch: _Optional[bool] = ...) -> None: ...

class CosineAnnealingWarmRestartsLR(_message.Message):
    __slots__ = ("T_0", "T_mult", "min_learning_rate", "warmup_learning_rate", "warmup_size", "by_epoch")
    T_0_FIELD_NUMBER: _ClassVar[int]
    T_MULT_FIELD_NUMBER: _ClassVar[int]
    MIN_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    BY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    T_0: int
    T_mult: int
    min_learning_rate: float
    warmup_learning_rate: float
    warmup_size: int
    by_epoch: bool
    def __init__(self, T_0: _Optional[int] = ..., T_mult: _Optional[int] = ..., min_learning_rate: _Optional[float] = ..., warmup_learning_rate: _Optional[float] = ..., warmup_size: _Optional[int] = ..., by_epoch: _Optional[bool] = ...) -> None: ...

class SparseOptimizer(_message.Message):
    __slots__ = ("adagrad_optimizer", "sgd_optimizer", "constant_learning_rate", "exponential_decay_learning_rate", "manual_step_learning_rate", "cosine_annealing_learning_rate", "cosine_annealing_warm_restarts_learning_rate", "table_learning_rates")
    ADAGRAD_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    SGD_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    CONSTANT_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    EXPONENTIAL_DECAY_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    MANUAL_STEP_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    COSINE_ANNEALING_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    COSINE_ANNEALING_WARM_RESTARTS_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    TABLE_LEARNING_RATES_FIELD_NUMBER: _ClassVar[int]
    adagrad_optimizer: AdagradOptimizer
    sgd_optimizer: SGDOptimizer
    constant_learning_rate: ConstantLR
    exponential_decay_learning_rate: ExponentialDecayLR
    manual_step_learning_rate: ManualStepLR
    cosine_annealing_learning_rate: CosineAnnealingLR
    cosine_annealing_warm_restarts_learning_rate: CosineAnnealingWarmRestartsLR
    table_learning_rates: _containers.RepeatedCompositeFieldContainer[TableLearningRate]
    def __init__(self, adagrad_optimizer: _Optional[_Union[AdagradOptimizer, _Mapping]] = ..., sgd_optimizer: _Optional[_Union[SGDOptimizer, _Mapping]] = ..., constant_learning_rate: _Optional[_Union[ConstantLR, _Mapping]] = ..., exponential_decay_learning_rate: _Optional[_Union[ExponentialDecayLR, _Mapping]] = ..., manual_step_learning_rate: _Optional[_Union[ManualStepLR, _Mapping]] = ..., cosine_annealing_learning_rate: _Optional[_Union[CosineAnnealingLR, _Mapping]] = ..., cosine_annealing_warm_restarts_learning_rate: _Optional[_Union[CosineAnnealingWarmRestartsLR, _Mapping]] = ..., table_learning_rates: _Optional[_Iterable[_Union[TableLearningRate, _Mapping]]] = ...) -> None: ...

class TableLearningRate(_message.Message):
    __slots__ = ("feature_name", "lr_scale")
    FEATURE_NAME_FIELD_NUMBER: _ClassVar[int]
    LR_SCALE_FIELD_NUMBER: _ClassVar[int]
    feature_name: str
    lr_scale: float
    def __init__(self, feature_name: _Optional[str] = ..., lr_scale: _Optional[float] = ...) -> None: ...

class EMAConfig(_message.Message):
    __slots__ = ("decay",)
    DECAY_FIELD_NUMBER: _ClassVar[int]
    decay: float
    def __init__(self, decay: _Optional[float] = ...) -> None: ...

class DenseOptimizer(_message.Message):
    __slots__ = ("adam_optimizer", "sgd_optimizer", "adagrad_optimizer", "constant_learning_rate", "exponential_decay_learning_rate", "manual_step_learning_rate", "cosine_annealing_learning_rate", "cosine_annealing_warm_restarts_learning_rate", "ema")
    ADAM_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    SGD_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    ADAGRAD_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    CONSTANT_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    EXPONENTIAL_DECAY_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    MANUAL_STEP_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    COSINE_ANNEALING_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    COSINE_ANNEALING_WARM_RESTARTS_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    EMA_FIELD_NUMBER: _ClassVar[int]
    adam_optimizer: AdamOptimizer
    sgd_optimizer: SGDOptimizer
    adagrad_optimizer: AdagradOptimizer
    constant_learning_rate: ConstantLR
    exponential_decay_learning_rate: ExponentialDecayLR
    manual_step_learning_rate: ManualStepLR
    cosine_annealing_learning_rate: CosineAnnealingLR
    cosine_annealing_warm_restarts_learning_rate: CosineAnnealingWarmRestartsLR
    ema: EMAConfig
    def __init__(self, adam_optimizer: _Optional[_Union[AdamOptimizer, _Mapping]] = ..., sgd_optimizer: _Optional[_Union[SGDOptimizer, _Mapping]] = ..., adagrad_optimizer: _Optional[_Union[AdagradOptimizer, _Mapping]] = ..., constant_learning_rate: _Optional[_Union[ConstantLR, _Mapping]] = ..., exponential_decay_learning_rate: _Optional[_Union[ExponentialDecayLR, _Mapping]] = ..., manual_step_learning_rate: _Optional[_Union[ManualStepLR, _Mapping]] = ..., cosine_annealing_learning_rate: _Optional[_Union[CosineAnnealingLR, _Mapping]] = ..., cosine_annealing_warm_restarts_learning_rate: _Optional[_Union[CosineAnnealingWarmRestartsLR, _Mapping]] = ..., ema: _Optional[_Union[EMAConfig, _Mapping]] = ...) -> None: ...

class TrainConfig(_message.Message):
    __slots__ = ("sparse_optimizer", "dense_optimizer", "num_steps", "num_epochs", "save_checkpoints_steps", "save_checkpoints_epochs", "log_step_count_steps", "is_profiling", "mixed_precision", "table_hbm_budget_gib")
    SPARSE_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    DENSE_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    SAVE_CHECKPOINTS_STEPS_FIELD_NUMBER: _ClassVar[int]
    SAVE_CHECKPOINTS_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    LOG_STEP_COUNT_STEPS_FIELD_NUMBER: _ClassVar[int]
    IS_PROFILING_FIELD_NUMBER: _ClassVar[int]
    MIXED_PRECISION_FIELD_NUMBER: _ClassVar[int]
    TABLE_HBM_BUDGET_GIB_FIELD_NUMBER: _ClassVar[int]
    sparse_optimizer: SparseOptimizer
    dense_optimizer: DenseOptimizer
    num_steps: int
    num_epochs: int
    save_checkpoints_steps: int
    save_checkpoints_epochs: int
    log_step_count_steps: int
    is_profiling: bool
    mixed_precision: str
    table_hbm_budget_gib: float
    def __init__(self, sparse_optimizer: _Optional[_Union[SparseOptimizer, _Mapping]] = ..., dense_optimizer: _Optional[_Union[DenseOptimizer, _Mapping]] = ..., num_steps: _Optional[int] = ..., num_epochs: _Optional[int] = ..., save_checkpoints_steps: _Optional[int] = ..., save_checkpoints_epochs: _Optional[int] = ..., log_step_count_steps: _Optional[int] = ..., is_profiling: _Optional[bool] = ..., mixed_precision: _Optional[str] = ..., table_hbm_budget_gib: _Optional[float] = ...) -> None: ...

class EvalConfig(_message.Message):
    __slots__ = ("num_steps", "use_dense_ema")
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    USE_DENSE_EMA_FIELD_NUMBER: _ClassVar[int]
    num_steps: int
    use_dense_ema: bool
    def __init__(self, num_steps: _Optional[int] = ..., use_dense_ema: _Optional[bool] = ...) -> None: ...

class ExportConfig(_message.Message):
    __slots__ = ("use_dense_ema",)
    USE_DENSE_EMA_FIELD_NUMBER: _ClassVar[int]
    use_dense_ema: bool
    def __init__(self, use_dense_ema: _Optional[bool] = ...) -> None: ...

class DataConfig(_message.Message):
    __slots__ = ("batch_size", "dataset_type", "fg_mode", "label_fields", "num_workers", "drop_remainder", "shuffle", "shuffle_buffer_size", "dynrec_id_mode")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATASET_TYPE_FIELD_NUMBER: _ClassVar[int]
    FG_MODE_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELDS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    DROP_REMAINDER_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_BUFFER_SIZE_FIELD_NUMBER: _ClassVar[int]
    DYNREC_ID_MODE_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    dataset_type: DatasetType
    fg_mode: FgMode
    label_fields: _containers.RepeatedScalarFieldContainer[str]
    num_workers: int
    drop_remainder: bool
    shuffle: bool
    shuffle_buffer_size: int
    dynrec_id_mode: IdMode
    def __init__(self, batch_size: _Optional[int] = ..., dataset_type: _Optional[_Union[DatasetType, str]] = ..., fg_mode: _Optional[_Union[FgMode, str]] = ..., label_fields: _Optional[_Iterable[str]] = ..., num_workers: _Optional[int] = ..., drop_remainder: _Optional[bool] = ..., shuffle: _Optional[bool] = ..., shuffle_buffer_size: _Optional[int] = ..., dynrec_id_mode: _Optional[_Union[IdMode, str]] = ...) -> None: ...

class DynamicEmbInitializerArgs(_message.Message):
    __slots__ = ("mode", "mean", "std_dev", "lower", "upper", "value")
    MODE_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_DEV_FIELD_NUMBER: _ClassVar[int]
    LOWER_FIELD_NUMBER: _ClassVar[int]
    UPPER_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    mean: float
    std_dev: float
    lower: float
    upper: float
    value: float
    def __init__(self, mode: _Optional[str] = ..., mean: _Optional[float] = ..., std_dev: _Optional[float] = ..., lower: _Optional[float] = ..., upper: _Optional[float] = ..., value: _Optional[float] = ...) -> None: ...

class DynamicEmbFrequencyAdmissionStrategy(_message.Message):
    __slots__ = ("threshold", "initializer_args", "counter_capacity", "counter_bucket_capacity")
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_ARGS_FIELD_NUMBER: _ClassVar[int]
    COUNTER_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    COUNTER_BUCKET_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    threshold: int
    initializer_args: DynamicEmbInitializerArgs
    counter_capacity: int
    counter_bucket_capacity: int
    def __init__(self, threshold: _Optional[int] = ..., initializer_args: _Optional[_Union[DynamicEmbInitializerArgs, _Mapping]] = ..., counter_capacity: _Optional[int] = ..., counter_bucket_capacity: _Optional[int] = ...) -> None: ...

class DynamicEmbLfuDecay(_message.Message):
    __slots__ = ("interval_steps", "shift")
    INTERVAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    SHIFT_FIELD_NUMBER: _ClassVar[int]
    interval_steps: int
    shift: int
    def __init__(self, interval_steps: _Optional[int] = ..., shift: _Optional[int] = ...) -> None: ...

class DynamicEmbedding(_message.Message):
    __slots__ = ("initializer_args", "eval_initializer_args", "score_strategy", "max_capacity", "cache_load_factor", "init_capacity_per_rank", "init_table", "bucket_capacity", "lfu_decay", "frequency_admission_strategy")
    INITIALIZER_ARGS_FIELD_NUMBER: _ClassVar[int]
    EVAL_INITIALIZER_ARGS_FIELD_NUMBER: _ClassVar[int]
    SCORE_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    MAX_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_LOAD_FACTOR_FIELD_NUMBER: _ClassVar[int]
    INIT_CAPACITY_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    INIT_TABLE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    LFU_DECAY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_ADMISSION_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    initializer_args: DynamicEmbInitializerArgs
    eval_initializer_args: DynamicEmbInitializerArgs
    score_strategy: str
    max_capacity: int
    cache_load_factor: float
    init_capacity_per_rank: int
    init_table: str
    bucket_capacity: int
    lfu_decay: DynamicEmbLfuDecay
    frequency_admission_strategy: DynamicEmbFrequencyAdmissionStrategy
    def __init__(self, initializer_args: _Optional[_Union[DynamicEmbInitializerArgs, _Mapping]] = ..., eval_initializer_args: _Optional[_Union[DynamicEmbInitializerArgs, _Mapping]] = ..., score_strategy: _Optional[str] = ..., max_capacity: _Optional[int] = ..., cache_load_factor: _Optional[float] = ..., init_capacity_per_rank: _Optional[int] = ..., init_table: _Optional[str] = ..., bucket_capacity: _Optional[int] = ..., lfu_decay: _Optional[_Union[DynamicEmbLfuDecay, _Mapping]] = ..., frequency_admission_strategy: _Optional[_Union[DynamicEmbFrequencyAdmissionStrategy, _Mapping]] = ...) -> None: ...

class IdFeature(_message.Message):
    __slots__ = ("feature_name", "expression", "embedding_name", "embedding_dim", "hash_bucket_size", "num_buckets", "pooling", "default_value", "dynamicemb")
    FEATURE_NAME_FIELD_NUMBER: _ClassVar[int]
    EXPRESSION_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_NAME_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIM_FIELD_NUMBER: _ClassVar[int]
    HASH_BUCKET_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_VALUE_FIELD_NUMBER: _ClassVar[int]
    DYNAMICEMB_FIELD_NUMBER: _ClassVar[int]
    feature_name: str
    expression: str
    embedding_name: str
    embedding_dim: int
    hash_bucket_size: int
    num_buckets: int
    pooling: str
    default_value: str
    dynamicemb: DynamicEmbedding
    def __init__(self, feature_name: _Optional[str] = ..., expression: _Optional[str] = ..., embedding_name: _Optional[str] = ..., embedding_dim: _Optional[int] = ..., hash_bucket_size: _Optional[int] = ..., num_buckets: _Optional[int] = ..., pooling: _Optional[str] = ..., default_value: _Optional[str] = ..., dynamicemb: _Optional[_Union[DynamicEmbedding, _Mapping]] = ...) -> None: ...

class RawFeature(_message.Message):
    __slots__ = ("feature_name", "expression", "embedding_name", "embedding_dim", "boundaries", "pooling", "default_value")
    FEATURE_NAME_FIELD_NUMBER: _ClassVar[int]
    EXPRESSION_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_NAME_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIM_FIELD_NUMBER: _ClassVar[int]
    BOUNDARIES_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_VALUE_FIELD_NUMBER: _ClassVar[int]
    feature_name: str
    expression: str
    embedding_name: str
    embedding_dim: int
    boundaries: _containers.RepeatedScalarFieldContainer[float]
    pooling: str
    default_value: str
    def __init__(self, feature_name: _Optional[str] = ..., expression: _Optional[str] = ..., embedding_name: _Optional[str] = ..., embedding_dim: _Optional[int] = ..., boundaries: _Optional[_Iterable[float]] = ..., pooling: _Optional[str] = ..., default_value: _Optional[str] = ...) -> None: ...

class SeqFeatureConfig(_message.Message):
    __slots__ = ("id_feature", "raw_feature")
    ID_FEATURE_FIELD_NUMBER: _ClassVar[int]
    RAW_FEATURE_FIELD_NUMBER: _ClassVar[int]
    id_feature: IdFeature
    raw_feature: RawFeature
    def __init__(self, id_feature: _Optional[_Union[IdFeature, _Mapping]] = ..., raw_feature: _Optional[_Union[RawFeature, _Mapping]] = ...) -> None: ...

class SequenceFeature(_message.Message):
    __slots__ = ("sequence_name", "sequence_length", "sequence_delim", "features")
    SEQUENCE_NAME_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_DELIM_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    sequence_name: str
    sequence_length: int
    sequence_delim: str
    features: _containers.RepeatedCompositeFieldContainer[SeqFeatureConfig]
    def __init__(self, sequence_name: _Optional[str] = ..., sequence_length: _Optional[int] = ..., sequence_delim: _Optional[str] = ..., features: _Optional[_Iterable[_Union[SeqFeatureConfig, _Mapping]]] = ...) -> None: ...

class FeatureConfig(_message.Message):
    __slots__ = ("id_feature", "raw_feature", "sequence_feature")
    ID_FEATURE_FIELD_NUMBER: _ClassVar[int]
    RAW_FEATURE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FEATURE_FIELD_NUMBER: _ClassVar[int]
    id_feature: IdFeature
    raw_feature: RawFeature
    sequence_feature: SequenceFeature
    def __init__(self, id_feature: _Optional[_Union[IdFeature, _Mapping]] = ..., raw_feature: _Optional[_Union[RawFeature, _Mapping]] = ..., sequence_feature: _Optional[_Union[SequenceFeature, _Mapping]] = ...) -> None: ...

class FeatureGroupConfig(_message.Message):
    __slots__ = ("group_name", "feature_names", "group_type")
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    FEATURE_NAMES_FIELD_NUMBER: _ClassVar[int]
    GROUP_TYPE_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    feature_names: _containers.RepeatedScalarFieldContainer[str]
    group_type: FeatureGroupType
    def __init__(self, group_name: _Optional[str] = ..., feature_names: _Optional[_Iterable[str]] = ..., group_type: _Optional[_Union[FeatureGroupType, str]] = ...) -> None: ...

class MLP(_message.Message):
    __slots__ = ("hidden_units", "dropout_ratio", "activation", "use_bn")
    HIDDEN_UNITS_FIELD_NUMBER: _ClassVar[int]
    DROPOUT_RATIO_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    USE_BN_FIELD_NUMBER: _ClassVar[int]
    hidden_units: _containers.RepeatedScalarFieldContainer[int]
    dropout_ratio: _containers.RepeatedScalarFieldContainer[float]
    activation: str
    use_bn: bool
    def __init__(self, hidden_units: _Optional[_Iterable[int]] = ..., dropout_ratio: _Optional[_Iterable[float]] = ..., activation: _Optional[str] = ..., use_bn: _Optional[bool] = ...) -> None: ...

class Tower(_message.Message):
    __slots__ = ("input", "mlp")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    MLP_FIELD_NUMBER: _ClassVar[int]
    input: str
    mlp: MLP
    def __init__(self, input: _Optional[str] = ..., mlp: _Optional[_Union[MLP, _Mapping]] = ...) -> None: ...

class DINTower(_message.Message):
    __slots__ = ("input", "attn_mlp")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    ATTN_MLP_FIELD_NUMBER: _ClassVar[int]
    input: str
    attn_mlp: MLP
    def __init__(self, input: _Optional[str] = ..., attn_mlp: _Optional[_Union[MLP, _Mapping]] = ...) -> None: ...

class ColdBackoff(_message.Message):
    __slots__ = ("sources", "id_dropout")
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    ID_DROPOUT_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedCompositeFieldContainer[BackoffSources]
    id_dropout: float
    def __init__(self, sources: _Optional[_Iterable[_Union[BackoffSources, _Mapping]]] = ..., id_dropout: _Optional[float] = ...) -> None: ...

class BackoffSources(_message.Message):
    __slots__ = ("feature_name", "side_features")
    FEATURE_NAME_FIELD_NUMBER: _ClassVar[int]
    SIDE_FEATURES_FIELD_NUMBER: _ClassVar[int]
    feature_name: str
    side_features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, feature_name: _Optional[str] = ..., side_features: _Optional[_Iterable[str]] = ...) -> None: ...

class FeatureCrosses(_message.Message):
    __slots__ = ("pairs",)
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    pairs: _containers.RepeatedCompositeFieldContainer[FeatureCross]
    def __init__(self, pairs: _Optional[_Iterable[_Union[FeatureCross, _Mapping]]] = ...) -> None: ...

class FeatureCross(_message.Message):
    __slots__ = ("user_feature", "item_feature")
    USER_FEATURE_FIELD_NUMBER: _ClassVar[int]
    ITEM_FEATURE_FIELD_NUMBER: _ClassVar[int]
    user_feature: str
    item_feature: str
    def __init__(self, user_feature: _Optional[str] = ..., item_feature: _Optional[str] = ...) -> None: ...

class MultiTowerDIN(_message.Message):
    __slots__ = ("towers", "din_towers", "final", "cold_backoff", "crosses", "item_tower")
    TOWERS_FIELD_NUMBER: _ClassVar[int]
    DIN_TOWERS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    COLD_BACKOFF_FIELD_NUMBER: _ClassVar[int]
    CROSSES_FIELD_NUMBER: _ClassVar[int]
    ITEM_TOWER_FIELD_NUMBER: _ClassVar[int]
    towers: _containers.RepeatedCompositeFieldContainer[Tower]
    din_towers: _containers.RepeatedCompositeFieldContainer[DINTower]
    final: MLP
    cold_backoff: ColdBackoff
    crosses: FeatureCrosses
    item_tower: MLP
    def __init__(self, towers: _Optional[_Iterable[_Union[Tower, _Mapping]]] = ..., din_towers: _Optional[_Iterable[_Union[DINTower, _Mapping]]] = ..., final: _Optional[_Union[MLP, _Mapping]] = ..., cold_backoff: _Optional[_Union[ColdBackoff, _Mapping]] = ..., crosses: _Optional[_Union[FeatureCrosses, _Mapping]] = ..., item_tower: _Optional[_Union[MLP, _Mapping]] = ...) -> None: ...

class AUC(_message.Message):
    __slots__ = ("thresholds",)
    THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    thresholds: int
    def __init__(self, thresholds: _Optional[int] = ...) -> None: ...

class MetricConfig(_message.Message):
    __slots__ = ("auc",)
    AUC_FIELD_NUMBER: _ClassVar[int]
    auc: AUC
    def __init__(self, auc: _Optional[_Union[AUC, _Mapping]] = ...) -> None: ...

class BinaryCrossEntropy(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LossConfig(_message.Message):
    __slots__ = ("binary_cross_entropy",)
    BINARY_CROSS_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    binary_cross_entropy: BinaryCrossEntropy
    def __init__(self, binary_cross_entropy: _Optional[_Union[BinaryCrossEntropy, _Mapping]] = ...) -> None: ...

class ModelConfig(_message.Message):
    __slots__ = ("feature_groups", "multi_tower_din", "num_class", "metrics", "losses")
    FEATURE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MULTI_TOWER_DIN_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    feature_groups: _containers.RepeatedCompositeFieldContainer[FeatureGroupConfig]
    multi_tower_din: MultiTowerDIN
    num_class: int
    metrics: _containers.RepeatedCompositeFieldContainer[MetricConfig]
    losses: _containers.RepeatedCompositeFieldContainer[LossConfig]
    def __init__(self, feature_groups: _Optional[_Iterable[_Union[FeatureGroupConfig, _Mapping]]] = ..., multi_tower_din: _Optional[_Union[MultiTowerDIN, _Mapping]] = ..., num_class: _Optional[int] = ..., metrics: _Optional[_Iterable[_Union[MetricConfig, _Mapping]]] = ..., losses: _Optional[_Iterable[_Union[LossConfig, _Mapping]]] = ...) -> None: ...

class EasyRecConfig(_message.Message):
    __slots__ = ("train_input_path", "eval_input_path", "model_dir", "train_config", "eval_config", "data_config", "feature_configs", "model_config", "export_config")
    TRAIN_INPUT_PATH_FIELD_NUMBER: _ClassVar[int]
    EVAL_INPUT_PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    TRAIN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    EVAL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    DATA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    FEATURE_CONFIGS_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    EXPORT_CONFIG_FIELD_NUMBER: _ClassVar[int]
    train_input_path: str
    eval_input_path: str
    model_dir: str
    train_config: TrainConfig
    eval_config: EvalConfig
    data_config: DataConfig
    feature_configs: _containers.RepeatedCompositeFieldContainer[FeatureConfig]
    model_config: ModelConfig
    export_config: ExportConfig
    def __init__(self, train_input_path: _Optional[str] = ..., eval_input_path: _Optional[str] = ..., model_dir: _Optional[str] = ..., train_config: _Optional[_Union[TrainConfig, _Mapping]] = ..., eval_config: _Optional[_Union[EvalConfig, _Mapping]] = ..., data_config: _Optional[_Union[DataConfig, _Mapping]] = ..., feature_configs: _Optional[_Iterable[_Union[FeatureConfig, _Mapping]]] = ..., model_config: _Optional[_Union[ModelConfig, _Mapping]] = ..., export_config: _Optional[_Union[ExportConfig, _Mapping]] = ...) -> None: ...
