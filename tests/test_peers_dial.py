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
from swarmd.p2p.streams import PeerError
from swarmd.testing import SlowHost

RTT = 0.243
PROBE_TIMEOUT = 3 * RTT + 0.1


def peers_on(host: SlowHost, nursery: trio.Nursery | None, view=lambda: {}) -> Peers:
    async def forget(pid) -> None:
        pass

    async def watch(pid, gated) -> None:
        pass

    async def sync(peer) -> None:
        pass

    async def tell_revoked(pid, proof) -> None:
        pass

    shared = SimpleNamespace(host=host, nursery=nursery, view=view, excluded=set())
    return Peers(shared, watch=watch, lost=lambda pid: None, busy=lambda peer: True, sync=sync, forget_ping=forget,
                 proof_of_revocation=lambda peer: [], tell_revoked=tell_revoked)


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
    host = SlowHost(RTT)
    peers = peers_on(host, nursery)
    assert not await probe(peers), "the dial takes longer than one probe"
    await trio.sleep(1.0)  # the next probe period
    assert await probe(peers)
    assert host.dials == 1 and host.cancelled == 0, "one dial, never cut off by a probe"


async def test_without_the_nursery_the_probe_cuts_the_dial_off_every_time(autojump_clock):
    """What the daemon did before: the member stays unreachable, probe after probe."""
    host = SlowHost(RTT)
    peers = peers_on(host, None)
    for _ in range(3):
        assert not await probe(peers)
        await trio.sleep(1.0)
    assert host.dials == 3 and host.cancelled == 3 and not host.connected


async def test_callers_at_once_share_one_dial_and_its_failure(nursery, autojump_clock):
    host = SlowHost(RTT, refuse=True)
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
    host = SlowHost(RTT, hang=True)
    peers = peers_on(host, nursery)
    started = trio.current_time()
    with pytest.raises(PeerError, match=f"no answer within {DIAL_TIMEOUT:g} s"):
        await peers.ensure_connected("far")
    assert trio.current_time() - started == pytest.approx(DIAL_TIMEOUT)
    assert host.cancelled == 1 and not peers._dialing


async def test_hanging_up_on_a_member_cancels_its_dial_under_way(nursery, autojump_clock):
    """A member declared dead (or revoked) while a probe's dial to it runs apart: hang_up ends
    the dial, so it cannot connect us again to a member we just hung up on."""
    host = SlowHost(RTT)
    peers = peers_on(host, nursery)
    assert not await probe(peers)  # the dial goes on after the probe ...
    await peers.hang_up("far")  # ... until we hang up on the member
    await trio.sleep(10 * RTT)  # well past when the dial would have connected
    assert not host.connected and host.dials == 1 and host.cancelled == 1 and not peers._dialing


async def test_a_waiter_whose_dial_fails_after_a_hang_up_hears_why(nursery, autojump_clock):
    host = SlowHost(RTT)
    peers = peers_on(host, nursery)

    async def hang_up_soon() -> None:
        await trio.sleep(RTT)
        await peers.hang_up("far")

    nursery.start_soon(hang_up_soon)
    with pytest.raises(PeerError, match=r"cannot connect \(hung up on\)"):
        await peers.ensure_connected("far")


async def test_a_connection_from_the_member_meanwhile_ends_the_wait(nursery, autojump_clock):
    """The far member dialled us first: the probe waiting for our dial goes on at once."""
    host = SlowHost(RTT, hang=True)
    peers = peers_on(host, nursery)
    nursery.start_soon(peers.events)
    started = trio.current_time()

    async def they_connect() -> None:
        await trio.sleep(0.2)
        host.connected.add("far")
        peers.events_send.send_nowait(("connected", "far"))

    nursery.start_soon(they_connect)
    assert await probe(peers)
    assert trio.current_time() - started == pytest.approx(0.2)


async def test_whatever_a_dial_raises_is_the_waiters_error_and_gossip_goes_on(nursery, autojump_clock):
    def view():
        raise RuntimeError("a view that cannot be read")

    peers = peers_on(SlowHost(RTT), nursery, view=view)
    with pytest.raises(PeerError, match="RuntimeError: a view that cannot be read"):
        await peers.ensure_connected("far")
    assert not peers._dialing  # (and the nursery, gossip's, still runs: this test would fail otherwise)
