"""Tests for rayslice._deadline.Deadline with an injected fake clock and sleep."""

from __future__ import annotations

import math

import pytest

from rayslice._deadline import Deadline, DeadlineExceeded


class FakeTime:
    """A clock that only moves when the code under test sleeps (or the test says)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def t() -> FakeTime:
    return FakeTime()


def deadline(t: FakeTime, timeout_s: float | None) -> Deadline:
    return Deadline(timeout_s, clock=t.clock, sleep=t.sleep)


def test_fresh_deadline(t):
    d = deadline(t, 10.0)
    assert (d.start, d.end, d.timeout_s) == (1000.0, 1010.0, 10.0)
    assert d.elapsed == 0.0
    assert d.remaining == 10.0
    assert not d.expired


def test_remaining_elapsed_and_expired_follow_the_clock(t):
    d = deadline(t, 10.0)
    t.advance(3.5)
    assert (d.elapsed, d.remaining, d.expired) == (3.5, 6.5, False)
    t.advance(6.5)
    assert (d.elapsed, d.remaining, d.expired) == (10.0, 0.0, True)  # expired exactly at end
    t.advance(5.0)
    assert (d.elapsed, d.remaining, d.expired) == (15.0, 0.0, True)  # never negative


def test_sleep_or_raise_sleeps_the_interval(t):
    d = deadline(t, 10.0)
    d.sleep_or_raise(2.0, "waiting")
    assert t.sleeps == [2.0]
    assert d.elapsed == 2.0


def test_sleep_or_raise_caps_the_sleep_at_what_is_left(t):
    d = deadline(t, 10.0)
    t.advance(9.0)
    d.sleep_or_raise(5.0, "waiting")
    assert t.sleeps == [1.0]
    assert d.expired


def test_sleep_or_raise_raises_once_expired(t):
    d = deadline(t, 10.0)
    t.advance(12.0)
    with pytest.raises(DeadlineExceeded) as info:
        d.sleep_or_raise(1.0, "slice s never became free")
    assert str(info.value) == "slice s never became free (after 12.0 s)"
    assert t.sleeps == []  # no sleep once expired


def test_polling_loop_ends_at_the_deadline(t):
    d = deadline(t, 1.0)
    with pytest.raises(DeadlineExceeded, match=r"^still waiting \(after 1\.0 s\)$"):
        for _ in range(100):
            d.sleep_or_raise(0.3, "still waiting")
    assert t.sleeps == pytest.approx([0.3, 0.3, 0.3, 0.1])
    assert sum(t.sleeps) == pytest.approx(1.0)


def test_deadline_exceeded_is_a_timeout_error(t):
    assert issubclass(DeadlineExceeded, TimeoutError)
    d = deadline(t, 0.0)
    with pytest.raises(TimeoutError):
        d.sleep_or_raise(1.0, "x")


def test_zero_timeout_is_expired_at_once(t):
    d = deadline(t, 0.0)
    assert d.expired and d.remaining == 0.0


def test_none_timeout_never_expires(t):
    d = deadline(t, None)
    assert d.end is None and d.timeout_s is None
    t.advance(1e9)
    assert not d.expired
    assert d.remaining == math.inf
    assert d.elapsed == 1e9
    d.sleep_or_raise(2.5, "forever")
    assert t.sleeps == [2.5]


@pytest.mark.parametrize("bad", [-1.0, -0.001, -10])
def test_negative_timeout_raises(t, bad):
    with pytest.raises(ValueError, match=rf"^timeout_s={bad} must be a number >= 0, or None$"):
        deadline(t, bad)


def test_clock_read_at_construction(t):
    t.advance(5.0)
    d = deadline(t, 1.0)
    assert d.start == 1005.0 and d.end == 1006.0


def test_default_clock_is_real_and_monotonic():
    d = Deadline(60.0)
    assert not d.expired
    assert 0.0 < d.remaining <= 60.0
    assert d.elapsed >= 0.0


def test_nan_timeout_raises(t):
    with pytest.raises(ValueError):
        deadline(t, float("nan"))
