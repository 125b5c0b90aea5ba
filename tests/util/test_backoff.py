"""The one retry schedule of reads and writes: how many retries, how long each wait, the deadline."""

from __future__ import annotations

import pytest

from unshardfs.util.backoff import Backoff


def waits(backoff: Backoff, deadline: float = 1e9) -> list[float]:
    retries = backoff.schedule()
    out = []
    while (wait := retries.wait(0.0, deadline)) is not None:
        out.append(wait)
    return out


@pytest.mark.parametrize("retries", [0, 1, 5, 12])
def test_every_retry_and_no_more(retries: int) -> None:
    assert len(waits(Backoff(0.25, 8.0, retries))) == retries


def test_each_wait_doubles_up_to_the_most_and_is_jittered_by_half() -> None:
    for _ in range(50):
        got = waits(Backoff(0.25, 2.0, 7))
        bases = [0.25, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0]
        assert all(0.5 * base <= wait <= 1.5 * base for wait, base in zip(got, bases, strict=True)), got


def test_no_wait_ends_at_or_past_the_deadline() -> None:
    """With 1.9 s left the first waits (at most 0.375 s, 0.75 s) may fit; a wait that would end
    at the deadline is never granted, and after the first refusal none is."""
    retries = Backoff(0.25, 8.0, 10).schedule()
    now, deadline = 0.0, 1.9
    while (wait := retries.wait(now, deadline)) is not None:
        now += wait
        assert now < deadline
    assert retries.made < 10
    assert retries.wait(now, deadline) is None


def test_a_server_s_retry_after_makes_the_next_wait_no_shorter() -> None:
    retries = Backoff(0.25, 8.0, 3).schedule()
    retries.at_least(4.0)
    wait = retries.wait(0.0, 100.0)
    assert wait is not None and 2.0 <= wait <= 6.0
    retries.at_least(1.0)  # shorter than what the schedule reached: no effect
    wait = retries.wait(0.0, 100.0)
    assert wait is not None and 4.0 <= wait <= 12.0
