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

RTT = 0.243


class EchoStream:
    """libp2p's ping protocol: what is written comes back one RTT later."""

    def __init__(self) -> None:
        self.pending = bytearray()
        self.resets = 0

    async def write(self, data: bytes) -> None:
        self.pending += data

    async def read(self, n: int) -> bytes:
        await trio.sleep(RTT)
        out, self.pending = bytes(self.pending[:n]), self.pending[n:]
        return out

    async def reset(self) -> None:
        self.resets += 1


class SlowHost:
    """Opening a stream costs two round trips (multistream-select)."""

    def __init__(self) -> None:
        self.opened: list[EchoStream] = []

    async def new_stream(self, peer, protocols) -> EchoStream:
        await trio.sleep(2 * RTT + 0.004)
        self.opened.append(EchoStream())
        return self.opened[-1]


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
    host = SlowHost()
    pinger = Pinger(host)
    pinger.start(nursery)
    assert await probe(pinger) is None  # the opening takes the first probe's time
    await trio.sleep(1.0)
    assert await probe(pinger) is not None  # (timed on the wall clock, not the mock one)
    assert await probe(pinger) is not None  # (timed on the wall clock, not the mock one)
    assert len(host.opened) == 1 and host.opened[0].resets == 0, "one stream, never thrown away"


async def test_a_probe_that_waited_for_the_opening_keeps_time_for_the_echo_when_it_has_it(nursery, autojump_clock):
    """A near member (the opening quick, time left over) is measured by the first probe."""
    host = SlowHost()
    pinger = Pinger(host)
    pinger.start(nursery)
    assert await probe(pinger, timeout=2.0) is not None  # (timed on the wall clock, not the mock one)
    assert len(host.opened) == 1
