"""Dialling a member apart from the probe that wanted it (gossip/peers.Peers.ensure_connected),
on trio's MockClock.

A dial takes several round trips (TCP, multistream-select, Noise, the muxer): about 1.2 s
to a member 243 ms away, more than a probe's timeout (3 RTT + 0.1 s = 0.83 s). Dialled
inside the probe, the dial was cancelled with it and started over at the next one: a far
member whose connection dropped was never probed directly again. The dial now runs apart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio
import trio.testing

from swarmd.gossip.peers import DIAL_TIMEOUT, Peers
from swarmd.gossip.streams import PeerError

RTT = 0.243
PROBE_TIMEOUT = 3 * RTT + 0.1


class SlowHost:
    """``connect`` takes five round trips; ``refuse`` makes it fail, ``hang`` never answer."""

    def __init__(self, *, refuse: bool = False, hang: bool = False) -> None:
        self.connected: set = set()
        self.dials = 0
        self.cancelled = 0
        self.refuse, self.hang = refuse, hang

    def get_connected_peers(self) -> list:
        return list(self.connected)

    def get_peerstore(self):
        return SimpleNamespace(clear_addrs=lambda peer: None)

    async def connect(self, info) -> None:
        self.dials += 1
        try:
            await trio.sleep(float("inf") if self.hang else 5 * RTT)
        except trio.Cancelled:
            self.cancelled += 1
            raise
        if self.refuse:
            raise ConnectionRefusedError("refused")
        self.connected.add(info.peer_id)


def peers_on(host: SlowHost, nursery: trio.Nursery | None) -> Peers:
    return Peers(SimpleNamespace(host=host, nursery=nursery, view=lambda: {}))


async def probe(peers: Peers, peer: str = "far") -> bool:
    with trio.move_on_after(PROBE_TIMEOUT):
        try:
            await peers.ensure_connected(peer)
            return True
        except PeerError:
            return False
    return False


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def test_a_far_members_dial_outlives_the_probe_and_the_next_probe_finds_the_connection(nursery, autojump_clock):
    host = SlowHost()
    peers = peers_on(host, nursery)
    assert not await probe(peers), "the dial takes longer than one probe"
    await trio.sleep(1.0)  # the next probe period
    assert await probe(peers)
    assert host.dials == 1 and host.cancelled == 0, "one dial, never cut off by a probe"


async def test_without_the_nursery_the_probe_cuts_the_dial_off_every_time(autojump_clock):
    """What the daemon did before: the member stays unreachable, probe after probe."""
    host = SlowHost()
    peers = peers_on(host, None)
    for _ in range(3):
        assert not await probe(peers)
        await trio.sleep(1.0)
    assert host.dials == 3 and host.cancelled == 3 and not host.connected


async def test_callers_at_once_share_one_dial_and_its_failure(nursery, autojump_clock):
    host = SlowHost(refuse=True)
    peers = peers_on(host, nursery)
    errors: list[str] = []

    async def caller() -> None:
        try:
            await peers.ensure_connected("far")
        except PeerError as exc:
            errors.append(str(exc))

    async with trio.open_nursery() as callers:
        for _ in range(3):
            callers.start_soon(caller)
    assert host.dials == 1
    assert errors == ["cannot connect (ConnectionRefusedError: refused)"] * 3, errors
    assert not peers._dialing, "a finished dial is forgotten: the next caller dials again"
    with pytest.raises(PeerError):
        await peers.ensure_connected("far")
    assert host.dials == 2


async def test_a_dial_that_never_answers_ends_after_its_own_timeout(nursery, autojump_clock):
    host = SlowHost(hang=True)
    peers = peers_on(host, nursery)
    started = trio.current_time()
    with pytest.raises(PeerError, match=f"no answer within {DIAL_TIMEOUT:g} s"):
        await peers.ensure_connected("far")
    assert trio.current_time() - started == pytest.approx(DIAL_TIMEOUT)
    assert host.cancelled == 1 and not peers._dialing
