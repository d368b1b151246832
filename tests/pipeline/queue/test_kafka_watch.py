"""StuckClientWatch: when a Kafka consumer's client is rebuilt. Time the broker was down never
counts against the client; a client silent with the broker up is rebuilt after the bound."""

from __future__ import annotations

from itertools import pairwise

import pytest

from pipeline.queue.kafka import StuckClientWatch


class Broker:
    def __init__(self, down: tuple[float, float] | None = None) -> None:
        self.down = down  # [start, end) on the test's clock
        self.now = 0.0
        self.probes: list[float] = []

    def reachable(self) -> bool:
        self.probes.append(self.now)
        return self.down is None or not (self.down[0] <= self.now < self.down[1])


def run(watch: StuckClientWatch, broker: Broker, *, until: float, start: float = 0.0,
        heard_at=lambda t: 0.0, revoked_at=lambda t: None, step: float = 0.02) -> float | None:
    """Check every `step` (the intake's poll cadence) from `start`; the time of the first
    rebuild, or None."""
    t = start
    while t < until:
        broker.now = t
        if watch.stuck(t, heard_at(t), revoked_at(t), broker.reachable):
            return t
        t = round(t + step, 6)
    return None


def watch() -> StuckClientWatch:
    return StuckClientWatch(stuck_after_s=25.0, probe_after_s=8.0)  # the test settings': 20 s session


@pytest.mark.parametrize("back_at", [12.0, 24.5, 25.5, 60.0])
def test_an_outage_does_not_count_against_the_client(back_at):
    # the broker killed at 0 (heartbeats stop then), back at `back_at` (after a kill -9: a 10 s
    # wait and a ~16 s restart): before, the single probe after 25 s of silence found a broker
    # back at 24.5 up, and the client was rebuilt
    w, broker = watch(), Broker(down=(0.0, back_at))
    assert run(w, broker, until=back_at + 1.0) is None
    # the client is heard again a second after: no rebuild however long it runs on
    assert run(w, broker, start=back_at + 1.0, until=back_at + 90.0, heard_at=lambda t: t - t % 4) is None


def test_a_client_never_heard_after_an_outage_is_rebuilt_the_bound_after_its_end():
    w, broker = watch(), Broker(down=(0.0, 25.5))
    rebuilt = run(w, broker, until=120.0)
    assert rebuilt is not None and 25.5 + 25.0 - 1.0 <= rebuilt <= 25.5 + 25.0 + 1.1
    # probed once a second through the outage: its end seen within a second
    during = [t for t in broker.probes if 8.0 <= t <= 26.5]
    assert all(b - a <= 1.0 + 1e-9 for a, b in pairwise(during)) and during[-1] >= 25.5


def test_a_silent_client_with_the_broker_up_is_rebuilt_after_the_bound():
    w, broker = watch(), Broker()
    rebuilt = run(w, broker, until=60.0)
    assert rebuilt is not None and 25.0 <= rebuilt <= 26.1
    assert broker.probes[0] >= 8.0  # probed from 8 s of silence on, once a second
    assert all(b - a >= 1.0 - 1e-9 for a, b in pairwise(broker.probes))


def test_a_revocation_with_no_assignment_is_rebuilt_after_the_bound():
    w, broker = watch(), Broker()
    rebuilt = run(w, broker, until=60.0, heard_at=lambda t: t - t % 3, revoked_at=lambda t: 0.0)
    assert rebuilt is not None and 25.0 <= rebuilt <= 26.1


def test_no_probe_while_heartbeats_are_answered():
    w, broker = watch(), Broker()
    assert run(w, broker, until=60.0, heard_at=lambda t: t - t % 4) is None
    assert broker.probes == []
