"""The last hour of each pool's samples (the dashboard's chart)."""

from __future__ import annotations

from stoker.control.history import History, PoolSample


def sample(at: float, hot: int = 0) -> PoolSample:
    return PoolSample(
        at=at, warm_target=2, desired_warm=2, demand=0, warm=2, hot=hot, hot_idle=0, spawning=0
    )


def test_each_pool_keeps_one_span_of_samples() -> None:
    history = History(interval_s=10, span_s=60)
    for n in range(10):
        history.add("demo", sample(n * 10.0, hot=n))
    history.add("db", sample(95.0))
    samples = history.samples()
    assert list(samples) == ["db", "demo"]
    # 60 s at one sample every 10 s: the last six.
    assert [s.hot for s in samples["demo"]] == [4, 5, 6, 7, 8, 9]


def test_samples_since() -> None:
    history = History(interval_s=1)
    for n in range(5):
        history.add("demo", sample(float(n)))
    assert [s.at for s in history.samples(since=2.0)["demo"]] == [3.0, 4.0]
