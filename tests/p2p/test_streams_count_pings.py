"""Pings counted both ways on two real libp2p hosts (p2p/streams.count_pings, Pinger.received):
libp2p's own handler still echoes through the counting stream, and each side counts 32 bytes
a ping (what `status`'s gossip.received_by_kind calls probes)."""

from __future__ import annotations

import trio
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr

from swarmd.identity import load_or_create
from swarmd.p2p.host import make_host
from swarmd.p2p.streams import PING_SIZE, Pinger, count_pings


async def test_pings_a_peer_sends_us_are_answered_and_counted_and_so_are_our_echoes(tmp_path):
    a_ident, _ = load_or_create(tmp_path / "a")
    b_ident, _ = load_or_create(tmp_path / "b")
    a_host = make_host(a_ident, ["/ip4/127.0.0.1/tcp/0"])
    b_host = make_host(b_ident, ["/ip4/127.0.0.1/tcp/0"])
    inbound: list[int] = []
    echoes: list[int] = []
    async with a_host.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]), b_host.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        count_pings(a_host, inbound.append)
        await b_host.connect(PeerInfo(a_host.get_id(), a_host.get_addrs()))
        pinger = Pinger(b_host)
        pinger.received = echoes.append
        with trio.fail_after(20):
            rtts = [await pinger.ping(a_host.get_id()) for _ in range(5)]
        await pinger.forget(a_host.get_id())
    assert all(0 < rtt < 5 for rtt in rtts), rtts
    assert echoes == [PING_SIZE] * 5
    assert sum(inbound) == 5 * PING_SIZE, inbound
