"""Random delays and counts for the simulated cluster, drawn from one seeded generator.

Every distribution draws from the `random.Random` it is handed, never from a global one,
so a simulation seeded once is reproducible draw for draw. They are frozen dataclasses:
a config can hold them, compare them and print them.

`distribution_from` reads the forms a YAML scenario uses: a bare number is a constant;
a mapping names its `kind` and parameters, e.g. `{kind: lognormal, median: 60, sigma: 0.35}`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from stoker.domain.errors import ConfigError


class Distribution(Protocol):
    """A source of non-negative reals (seconds, counts) drawn from an injected generator."""

    def sample(self, rng: random.Random) -> float:
        """One draw."""
        ...

    @property
    def mean(self) -> float:
        """The expected value (for sizing: expected replicas, expected lifetime)."""
        ...


@dataclass(frozen=True, slots=True)
class Constant:
    """Always `value`; draws nothing from the generator."""

    value: float

    def __post_init__(self) -> None:
        _non_negative("constant value", self.value)

    def sample(self, rng: random.Random) -> float:
        """`value`."""
        return self.value

    @property
    def mean(self) -> float:
        """`value`."""
        return self.value


@dataclass(frozen=True, slots=True)
class Uniform:
    """Uniform on [low, high]."""

    low: float
    high: float

    def __post_init__(self) -> None:
        _non_negative("uniform low", self.low)
        if self.high < self.low:
            raise ConfigError(f"uniform: high {self.high} < low {self.low}")

    def sample(self, rng: random.Random) -> float:
        """One uniform draw."""
        return rng.uniform(self.low, self.high)

    @property
    def mean(self) -> float:
        """The midpoint."""
        return (self.low + self.high) / 2


@dataclass(frozen=True, slots=True)
class Exponential:
    """Exponential with the given mean: memoryless lifetimes and Poisson inter-arrivals."""

    mean_value: float

    def __post_init__(self) -> None:
        if self.mean_value <= 0:
            raise ConfigError(f"exponential mean must be > 0, got {self.mean_value}")

    def sample(self, rng: random.Random) -> float:
        """One exponential draw."""
        return rng.expovariate(1.0 / self.mean_value)

    @property
    def mean(self) -> float:
        """The configured mean."""
        return self.mean_value


@dataclass(frozen=True, slots=True)
class LogNormal:
    """Log-normal given by its median and the sigma of the underlying normal.

    The shape of latencies: most draws near the median, a long right tail. The p99 is
    `median * exp(2.326 * sigma)`; `cap` (if set) truncates pathological draws.
    """

    median: float
    sigma: float
    cap: float | None = None

    def __post_init__(self) -> None:
        if self.median <= 0:
            raise ConfigError(f"lognormal median must be > 0, got {self.median}")
        _non_negative("lognormal sigma", self.sigma)
        if self.cap is not None and self.cap < self.median:
            raise ConfigError(f"lognormal cap {self.cap} is below its median {self.median}")

    def sample(self, rng: random.Random) -> float:
        """One draw, truncated at `cap`."""
        value = rng.lognormvariate(math.log(self.median), self.sigma)
        return value if self.cap is None else min(value, self.cap)

    @property
    def mean(self) -> float:
        """`median * exp(sigma² / 2)`, ignoring the cap."""
        return self.median * math.exp(self.sigma * self.sigma / 2)


@dataclass(frozen=True, slots=True)
class Bucket:
    """One bucket of a `Buckets` distribution: integers in [low, high] with a weight."""

    weight: float
    low: int
    high: int


@dataclass(frozen=True, slots=True)
class Buckets:
    """A weighted choice of an integer range, then a uniform integer inside it.

    This is how bigfleet's load-driver sizes workloads (`sizing.go`: replica buckets
    55:[1,5], 30:[6,25], 12:[26,100], 3:[101,400]); `cap` clamps a draw, as its
    `StatefulReplicaCap = 25` does for StatefulSets.
    """

    buckets: tuple[Bucket, ...]
    cap: int | None = None

    def __post_init__(self) -> None:
        if not self.buckets:
            raise ConfigError("buckets: at least one bucket is needed")
        for bucket in self.buckets:
            if bucket.weight <= 0 or bucket.low < 0 or bucket.high < bucket.low:
                raise ConfigError(f"buckets: invalid bucket {bucket}")
        if self.cap is not None and self.cap < 1:
            raise ConfigError("buckets: cap must be >= 1")

    def sample(self, rng: random.Random) -> float:
        """One integer draw (returned as a float, like every distribution)."""
        total = sum(bucket.weight for bucket in self.buckets)
        point = rng.random() * total
        chosen = self.buckets[-1]
        for bucket in self.buckets:
            point -= bucket.weight
            if point < 0:
                chosen = bucket
                break
        value = rng.randint(chosen.low, chosen.high)
        return float(value if self.cap is None else min(value, self.cap))

    @property
    def mean(self) -> float:
        """The expected draw, the cap included."""
        total = sum(bucket.weight for bucket in self.buckets)
        expected = 0.0
        for bucket in self.buckets:
            values = range(bucket.low, bucket.high + 1)
            capped = [v if self.cap is None else min(v, self.cap) for v in values]
            expected += bucket.weight / total * (sum(capped) / len(capped))
        return expected


#: bigfleet's replica-count buckets (`test/scaletest/.../sizing.go`).
BIGFLEET_REPLICAS = Buckets(
    (Bucket(55, 1, 5), Bucket(30, 6, 25), Bucket(12, 26, 100), Bucket(3, 101, 400))
)
#: The same buckets clamped at bigfleet's `StatefulReplicaCap = 25`.
BIGFLEET_STATEFUL_REPLICAS = Buckets(BIGFLEET_REPLICAS.buckets, cap=25)


def distribution_from(spec: object, *, what: str = "distribution") -> Distribution:
    """Build a distribution from a number (a constant) or a mapping with a `kind`.

    Kinds: `constant {value}`, `uniform {low, high}`, `exponential {mean}`,
    `lognormal {median, sigma, cap?}`, `buckets {buckets: [[weight, low, high], ...], cap?}`.
    """
    if isinstance(spec, bool):
        raise ConfigError(f"{what}: expected a number or a mapping, got {spec!r}")
    if isinstance(spec, int | float):
        return Constant(float(spec))
    if isinstance(spec, Constant | Uniform | Exponential | LogNormal | Buckets):
        return spec
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{what}: expected a number or a mapping, got {spec!r}")
    params = dict(spec)
    kind = params.pop("kind", None)
    try:
        built = _build(kind, params, what)
    except KeyError as missing:
        raise ConfigError(f"{what}: {kind} needs {missing}") from None
    if params:
        raise ConfigError(f"{what}: unknown keys {sorted(params)} for {kind}")
    return built


def _build(kind: object, params: dict[object, object], what: str) -> Distribution:
    """The distribution of `kind`, popping its parameters from `params`."""
    if kind == "constant":
        return Constant(_number(params.pop("value")))
    if kind == "uniform":
        return Uniform(_number(params.pop("low")), _number(params.pop("high")))
    if kind == "exponential":
        return Exponential(_number(params.pop("mean")))
    if kind == "lognormal":
        cap = params.pop("cap", None)
        return LogNormal(
            _number(params.pop("median")),
            _number(params.pop("sigma")),
            None if cap is None else _number(cap),
        )
    if kind == "buckets":
        raw = params.pop("buckets")
        cap = params.pop("cap", None)
        if not isinstance(raw, Sequence) or isinstance(raw, str):
            raise ConfigError(f"{what}: buckets must be a list of [weight, low, high]")
        buckets = tuple(_bucket(item, what) for item in raw)
        return Buckets(buckets, None if cap is None else int(_number(cap)))
    raise ConfigError(
        f"{what}: unknown kind {kind!r}; one of constant, uniform, exponential, lognormal, buckets"
    )


def _bucket(item: object, what: str) -> Bucket:
    if not isinstance(item, Sequence) or isinstance(item, str) or len(item) != 3:
        raise ConfigError(f"{what}: a bucket is [weight, low, high], got {item!r}")
    weight, low, high = item
    return Bucket(_number(weight), int(_number(low)), int(_number(high)))


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"expected a number, got {value!r}")
    return float(value)


def _non_negative(what: str, value: float) -> None:
    if value < 0 or math.isnan(value):
        raise ConfigError(f"{what} must be >= 0, got {value}")
