"""The ping stream of far members (p2p/streams.Pinger), on trio's MockClock.

A stream takes about two round trips to open. Wrapped in the probe's 0.5 s deadline, a
243 ms member's stream used to open in 0.49 s, start its echo, be cut off 10 ms later and
be reset with it, at every probe: that member was never measured. The opening now runs
apart and a probe left with too little time does not start the echo."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from swarmd.p2p.streams import PeerError, Pinger
from swarmd.testing import SlowHost

RTT = 0.243
OPEN = 2 * RTT + 0.004  # a stream's opening as seen: two round trips and a little (0.49 s)


async def probe(pinger: Pinger, timeout: float = 0.5) -> float | None:
    with trio.move_on_after(timeout):
        try:
            return await pinger.ping("far")
        except PeerError:
            return None
    return None


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def test_a_far_member_is_measured_from_the_second_probe_on(nursery, autojump_clock):
    host = SlowHost(RTT, open_s=OPEN)
    pinger = Pinger(host)
    pinger.start(nursery)
    assert await probe(pinger) is None  # the opening takes the first probe's time
    await trio.sleep(1.0)
    assert await probe(pinger) is not None  # (timed on the wall clock, not the mock one)
    assert await probe(pinger) is not None  # (timed on the wall clock, not the mock one)
    assert len(host.opened) == 1 and host.opened[0].resets == 0, "one stream, never thrown away"


async def test_a_probe_that_waited_for_the_opening_keeps_time_for_the_echo_when_it_has_it(nursery, autojump_clock):
    """A near member (the opening quick, time left over) is measured by the first probe."""
    host = SlowHost(RTT, open_s=OPEN)
    pinger = Pinger(host)
    pinger.start(nursery)
    assert await probe(pinger, timeout=2.0) is not None  # (timed on the wall clock, not the mock one)
    assert len(host.opened) == 1
