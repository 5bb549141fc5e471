"""pubsub.GatedPubsub / GatedGossipSub: py-libp2p's pubsub serves a peer only once admitted (no
stream, no hello, its subscriptions held, its GRAFT ignored), and forgets it again."""

from __future__ import annotations

from libp2p.pubsub.pb import rpc_pb2
from libp2p.tools.anyio_service import background_trio_service

from swarmd.gossip import pubsub as ps
from swarmd.gossip.host import make_host
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
