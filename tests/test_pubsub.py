"""pubsub.GatedPubsub / GatedGossipSub: py-libp2p's pubsub serves a peer only once admitted (no
stream, no hello, its subscriptions held, its GRAFT ignored), and forgets it again."""

from __future__ import annotations

from libp2p.pubsub.pb import rpc_pb2
from libp2p.tools.anyio_service import background_trio_service

from swarmd.gossip import pubsub as ps
from swarmd.p2p.host import make_host
from swarmd.identity import load_or_create

TOPIC = ps.topic("cd6729c4c1074bd6")


async def test_a_peer_gets_nothing_from_pubsub_until_admitted(tmp_path):
    ident, _ = load_or_create(tmp_path / "me")
    other, _ = load_or_create(tmp_path / "other")
    x = other.peer_id
    pubsub, router = ps.make_pubsub(make_host(ident, ["/ip4/127.0.0.1/tcp/0"]))
    async with background_trio_service(pubsub), background_trio_service(router):
        await pubsub.wait_until_ready()
        await pubsub.subscribe(TOPIC)

        await pubsub._handle_new_peer_with_retry(x)  # what a new connection runs
        assert x in pubsub._waiting and x not in pubsub.peers, "no stream opened, so no hello and no messages"
        pubsub.handle_subscription(x, rpc_pb2.RPC.SubOpts(subscribe=True, topicid=TOPIC))
        assert x not in pubsub.peer_topics.get(TOPIC, set()), "its subscription is held back"
        graft = rpc_pb2.RPC(control=rpc_pb2.ControlMessage(graft=[rpc_pb2.ControlGraft(topicID=TOPIC)]))
        await router.handle_rpc(graft, x)
        assert x not in router.mesh.get(TOPIC, set()), "a GRAFT does not put it in the mesh"

        pubsub.admit(x)
        assert x in pubsub.peer_topics[TOPIC], "admitted: the held subscription applies"
        pubsub.forget(x)
        assert x not in pubsub.peer_topics.get(TOPIC, set())


async def test_ungated_pubsub_behaves_as_py_libp2p():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        ident, _ = load_or_create(Path(tmp) / "me")
        other, _ = load_or_create(Path(tmp) / "other")
    pubsub, _ = ps.make_pubsub(make_host(ident, ["/ip4/127.0.0.1/tcp/0"]), gated=False)
    async with background_trio_service(pubsub):
        await pubsub.wait_until_ready()
        pubsub.handle_subscription(other.peer_id, rpc_pb2.RPC.SubOpts(subscribe=True, topicid=TOPIC))
        assert other.peer_id in pubsub.peer_topics[TOPIC]


async def test_messages_arriving_while_pubsub_stops_do_not_crash_the_host(tmp_path):
    """py-libp2p's read loop schedules each message on pubsub's task nursery; one that arrives
    while the service stops found that nursery closed, and the RuntimeError escaped through the
    host's connection (a lab intruder, and a daemon's shutdown, exited 1)."""
    import trio
    from multiaddr import Multiaddr

    from libp2p.peer.peerinfo import PeerInfo

    a_ident, _ = load_or_create(tmp_path / "a")
    b_ident, _ = load_or_create(tmp_path / "b")
    a_host = make_host(a_ident, ["/ip4/127.0.0.1/tcp/0"])
    b_host = make_host(b_ident, ["/ip4/127.0.0.1/tcp/0"])
    async with a_host.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]), b_host.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        a_pubsub, a_router = ps.make_pubsub(a_host, gated=False)
        async with background_trio_service(a_pubsub), background_trio_service(a_router):
            await a_pubsub.wait_until_ready()
            await a_pubsub.subscribe(TOPIC)
            for round_ in range(8):
                b_pubsub, b_router = ps.make_pubsub(b_host, gated=False)
                async with background_trio_service(b_pubsub), background_trio_service(b_router):
                    await b_pubsub.wait_until_ready()
                    sub = await b_pubsub.subscribe(TOPIC)
                    await b_host.connect(PeerInfo(a_host.get_id(), a_host.get_addrs()))
                    got = 0

                    async def flood() -> None:
                        n = 0
                        while True:
                            await a_pubsub.publish(TOPIC, f"{round_}-{n}".encode())
                            n += 1
                            await trio.sleep(0)

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(flood)
                        with trio.fail_after(20):
                            while got < 20:
                                await sub.get()
                                got += 1
                        nursery.cancel_scope.cancel()
                    for _ in range(50):  # keep A's queue full as B's pubsub stops
                        await a_pubsub.publish(TOPIC, b"late")
                await b_host.disconnect(a_host.get_id())
