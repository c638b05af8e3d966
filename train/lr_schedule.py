"""Learning-rate schedules of the sparse and dense optimizers, as TorchEasyRec's.

``train_config.{sparse,dense}_optimizer`` take tzrec's ``learning_rate`` oneof
(``protos/pipeline.proto``): ``constant_learning_rate``, ``exponential_decay_learning_rate``,
``manual_step_learning_rate``, ``cosine_annealing_learning_rate`` and
``cosine_annealing_warm_restarts_learning_rate``. The formulas are those of
``tzrec/optim/lr_scheduler.py`` at 54cac3165a2a (alibaba/TorchEasyRec); with ``base`` the
optimizer's configured ``lr`` and ``k`` the optimizer steps taken before this one (the epochs
finished, with ``by_epoch``):

- warmup (exponential and both cosines), for ``k < warmup_size``:
  ``warmup_learning_rate + (base - warmup_learning_rate) * k / warmup_size``;
- exponential: ``max(base * decay_factor ** p, min_learning_rate)``, ``p = (k - warmup_size) /
  decay_size``, floored when ``staircase``;
- manual steps: ``learning_rates[i - 1]`` where ``i = bisect_left(schedule_sizes, k) > 0``; before
  the first size ``base``, or with ``warmup`` linear from ``base`` to ``learning_rates[0]``;
- cosine: ``min + (base - min) * (1 + cos(pi * t / T_max)) / 2``, ``t = min(k - warmup_size,
  T_max)``; with warm restarts ``t`` runs over periods ``T_0, T_0·T_mult, ...``;
- a ``base`` of 0 stays 0 (tzrec's ``BaseLR.get_lr``).

One difference, on purpose: the rate is a function of the trainer's global step and epoch, so a
run resumed from a checkpoint continues the schedule where it stopped. tzrec's schedulers start
again at step 0 after a restore (its ``main.py`` does not step them over the skipped steps).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from protos import pipeline_pb2

Optimizer = pipeline_pb2.SparseOptimizer | pipeline_pb2.DenseOptimizer
Settings = (
    pipeline_pb2.ExponentialDecayLR
    | pipeline_pb2.ManualStepLR
    | pipeline_pb2.CosineAnnealingLR
    | pipeline_pb2.CosineAnnealingWarmRestartsLR
)


@dataclass(frozen=True)
class Schedule:
    """The rate of one optimizer over training: :meth:`rate` at a step and epoch."""

    base: float  # the optimizer's configured lr
    settings: Settings | None = None  # None: constant
    field: str = ""  # e.g. "train_config.dense_optimizer.cosine_annealing_learning_rate"

    @property
    def constant(self) -> bool:
        return self.settings is None

    def rate(self, step: int, epoch: int) -> float:
        """The rate of the optimizer step that follows ``step`` steps (in ``epoch``, 0-based)."""
        s = self.settings
        if s is None or self.base == 0:
            return self.base
        k = epoch if s.by_epoch else step
        if isinstance(s, pipeline_pb2.ManualStepLR):
            return _manual_step(self.base, s, k)
        if k < s.warmup_size:
            return s.warmup_learning_rate + (self.base - s.warmup_learning_rate) * (
                k / s.warmup_size
            )
        if isinstance(s, pipeline_pb2.ExponentialDecayLR):
            p = (k - s.warmup_size) / s.decay_size
            if s.staircase:
                p = math.floor(p)
            return max(self.base * math.pow(s.decay_factor, p), s.min_learning_rate)
        if isinstance(s, pipeline_pb2.CosineAnnealingLR):
            t, period = min(k - s.warmup_size, s.T_max), s.T_max
        else:
            t, period = _restart_position(k - s.warmup_size, s.T_0, s.T_mult)
        lo = s.min_learning_rate
        return lo + (self.base - lo) * 0.5 * (1 + math.cos(math.pi * t / period))


def schedule_of(optimizer: Optimizer, base: float, field: str) -> Schedule:
    """The schedule ``optimizer`` (the config message at ``field``, e.g.
    ``train_config.sparse_optimizer``) sets for its rate ``base``; ValueError naming the field
    for settings no schedule can run with."""
    which = optimizer.WhichOneof("learning_rate")
    if which in (None, "constant_learning_rate"):
        return Schedule(base)
    settings: Settings = getattr(optimizer, which)
    where = f"{field}.{which}"
    _check(settings, where)
    return Schedule(base, settings, where)


def _check(s: Settings, where: str) -> None:
    def bad(name: str, why: str) -> ValueError:
        return ValueError(f"{where}.{name}: {why}")

    if isinstance(s, pipeline_pb2.ManualStepLR):
        sizes, rates = list(s.schedule_sizes), list(s.learning_rates)
        if not sizes or len(sizes) != len(rates):
            raise bad(
                "schedule_sizes",
                f"{len(sizes)} sizes for {len(rates)} learning_rates: give one rate per size, "
                "at least one",
            )
        if sizes != sorted(sizes):
            raise bad("schedule_sizes", f"{sizes} must be ascending")
        if s.warmup and sizes[0] == 0:
            raise bad("schedule_sizes", "the first size must be > 0 with warmup (its length)")
        return
    if isinstance(s, pipeline_pb2.ExponentialDecayLR) and s.decay_size <= 0:
        raise bad("decay_size", "must be > 0 (the steps, or epochs, of one decay_factor)")
    if isinstance(s, pipeline_pb2.CosineAnnealingLR) and s.T_max <= 0:
        raise bad("T_max", "must be > 0 (the steps, or epochs, of the cosine)")
    if isinstance(s, pipeline_pb2.CosineAnnealingWarmRestartsLR):
        if s.T_0 <= 0:
            raise bad("T_0", "must be > 0 (the steps, or epochs, of the first period)")
        if s.T_mult < 1:
            raise bad("T_mult", "must be >= 1")


def _manual_step(base: float, s: pipeline_pb2.ManualStepLR, k: int) -> float:
    sizes = list(s.schedule_sizes)
    i = bisect.bisect_left(sizes, k)
    if i > 0:
        return float(s.learning_rates[i - 1])
    if s.warmup:
        return (s.learning_rates[0] - base) * (k / sizes[0]) + base
    return base


def _restart_position(elapsed: int, t0: int, mult: int) -> tuple[int, int]:
    """(steps into the current period, its length) after ``elapsed`` steps of periods t0,
    t0·mult, t0·mult², ... (tzrec's CosineAnnealingWarmRestartsLR)."""
    if mult == 1:
        return elapsed % t0, t0
    n = math.floor(math.log(elapsed / t0 * (mult - 1) + 1, mult))
    length = t0 * mult**n
    start = t0 * (mult**n - 1) // (mult - 1)
    return elapsed - start, length
