"""The gossip driver (service.Gossip) on its own, without a network: its own record when the
certificate expired or was renewed with an address, the read loop surviving a failing disk,
per-publisher rate limits, the peerstore replacing a record's addresses; and limits.py."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from nacl.signing import SigningKey
from libp2p.peer.id import ID
from libp2p.peer.peerstore import PeerStore

from swarmd.gossip import swarmstate
from swarmd.p2p.limits import Recent, TokenBuckets
from swarmd.gossip.membership import Membership, Timing
from swarmd.gossip.revocation import make_revocation
from swarmd.gossip.inbound import RECORD_BURST
from swarmd.gossip.service import Above, Gossip
from swarmd.gossip.cert import issue_cert
from swarmd.p2p.signed import peer_from_key, peer_str
from swarmd.gossip.swarmstate import SwarmMembership
from swarmd.gossip.wire import MeshInfo, Verifier, make_record, make_rumor, wg_proof_message
from swarmd.metrics import Metrics
from swarmd.wg.address import ula
from swarmd.wg.keys import KeyPair, prove

from test_wire import NODE, OTHER, OTHER_PEER, OWNER, OWNER_PUBLIC, PEER, RES, SWARM, cert_for, signer

ME = peer_str(PEER)
WG_KEY = KeyPair.from_private(bytes(range(32)))


def mesh(addr4: str) -> MeshInfo:
    return MeshInfo(public=WG_KEY.public, addr4=addr4, addr6=str(ula(SWARM, ME.encode())), port=51820,
                    endpoints=("192.0.2.1",), proof=prove(WG_KEY.private, wg_proof_message(SWARM, ME, WG_KEY.public)))


def gossip(cert, peerstore=None, above: Above = Above()) -> Gossip:
    swarm = SwarmMembership(swarm=SWARM, owner_public=OWNER_PUBLIC, cert=cert, bootstrap=())
    host = SimpleNamespace(get_peerstore=lambda: peerstore, get_connected_peers=lambda: [])
    g = Gossip(host=host, sign=signer(NODE), peer=ME, swarm=swarm, timing=Timing.local(), labels={},
               addrs=lambda: ["/ip4/192.0.2.1/tcp/4001"], seq=1 << 32,
               metrics=Metrics(version="test", peer_id=ME), rng=random.Random(1), above=above)
    g.verifier = Verifier(SWARM, OWNER_PUBLIC)
    return g


def published(g: Gossip) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(g.loop.publish_recv.receive_nowait())
        except trio.WouldBlock:
            return out


def flush(g: Gossip, later: float) -> None:
    """Let the core's deadlines up to ``later`` s from now pass (own records are paced)."""
    g.core.handle_timeout(trio.current_time() + later)
    g.loop.perform()


async def running(g: Gossip, nursery: trio.Nursery) -> None:
    g.nursery = nursery
    g.core = Membership(g.me, g.seq, g.timing, random.Random(1), trio.current_time())


def other_record(seq: int, addrs: list[str]) -> bytes:
    return make_record(signer(OTHER), swarm=SWARM, peer=peer_str(OTHER_PEER), seq=seq, issued=time.time(), ttl=120.0,
                       addrs=addrs, resources=RES, labels={}, wg=None,
                       cert=cert_for(OTHER_PEER, issued=time.time() - 10, ttl=3600))


# --- finding 1: our own record ---------------------------------------------------------------

async def test_an_expired_certificate_stops_our_records_and_says_so_instead_of_raising():
    g = gossip(cert_for(issued=time.time() - 120, ttl=60))
    async with trio.open_nursery() as nursery:
        await running(g, nursery)
        g.readvertise()  # the refresh that used to raise Invalid("cert expired") out of the swarm task
        flush(g, 1000)
        assert published(g) == []
        assert "certificate expired" in g.record_error
        nursery.cancel_scope.cancel()


async def test_a_renewal_that_gives_a_legacy_certificate_an_address_keeps_publishing():
    mesh_addr = ["10.211.3.4"]  # the mesh's derived address
    g = gossip(cert_for(issued=time.time() - 10, ttl=3600),  # no addr4: a legacy certificate
               above=Above(mesh_info=lambda: mesh(mesh_addr[0])))
    async with trio.open_nursery() as nursery:
        await running(g, nursery)
        g.readvertise()
        flush(g, 10)
        assert g.own_record.wg.addr4 == "10.211.3.4" and published(g)
        woken = g.view_changed
        renewed = issue_cert(signer(OWNER), SWARM, PEER, now=time.time(), ttl=3600, addr4="10.211.9.9")
        g.admission.adopt_cert(renewed)  # -> readvertise with the old mesh address: must not raise
        flush(g, 20)
        assert g.record_error is None and published(g), "a record is still published"
        assert g.own_record.wg is None, "without the mesh side until the mesh moves to the certificate's address"
        assert woken.is_set(), "the mesh is woken to re-address"
        mesh_addr[0] = "10.211.9.9"  # the mesh moved and re-advertises
        g.readvertise()
        flush(g, 30)
        assert g.own_record.wg.addr4 == "10.211.9.9"
        nursery.cancel_scope.cancel()


# --- finding 13: the read loop survives one message ------------------------------------------

class Subscription:
    def __init__(self, blobs: list[bytes]) -> None:
        self.send, self.recv = trio.open_memory_channel(len(blobs))
        for b in blobs:
            self.send.send_nowait(SimpleNamespace(data=b))

    async def get(self):
        return await self.recv.receive()


async def test_the_gossip_read_loop_goes_on_when_saving_a_revocation_fails(tmp_path, monkeypatch):
    g = gossip(cert_for(issued=time.time() - 10, ttl=3600), peerstore=PeerStore())
    g.admission.state_dir = tmp_path

    def broken_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(swarmstate, "save_revocations", broken_disk)
    someone = peer_str(peer_from_key(bytes(SigningKey(b"\x03" * 32).verify_key)))
    revocation = make_revocation(signer(OWNER), SWARM, someone, now=time.time(), reason="test")
    sub = Subscription([revocation.blob, other_record(5, ["/ip4/192.0.2.7/tcp/4001"])])
    async with trio.open_nursery() as nursery:
        await running(g, nursery)
        nursery.start_soon(g.inbound.read, sub)
        with trio.fail_after(5):
            while peer_str(OTHER_PEER) not in g.view():
                await trio.sleep(0.01)
        assert g.rejected["handler"] == 1, "the failure is counted"
        nursery.cancel_scope.cancel()


async def test_the_timer_loop_goes_on_after_an_exception(monkeypatch):
    g = gossip(cert_for(issued=time.time() - 10, ttl=3600))
    async with trio.open_nursery() as nursery:
        await running(g, nursery)
        calls = []
        real = g.core.handle_timeout

        def flaky(now):
            calls.append(now)
            if len(calls) == 1:
                raise OSError("disk")
            real(now)

        monkeypatch.setattr(g.core, "handle_timeout", flaky)
        nursery.start_soon(g.loop.timers)
        with trio.fail_after(5):
            while len(calls) < 2:
                g.loop.wake()
                await trio.sleep(0.05)
        assert g.rejected["internal"] == 1
        nursery.cancel_scope.cancel()


# --- finding 10: rate of records, addresses replaced ----------------------------------------

async def test_records_over_a_publishers_rate_are_dropped_quietly_and_counted():
    g = gossip(cert_for(issued=time.time() - 10, ttl=3600))
    blobs = [other_record(10 + i, ["/ip4/192.0.2.7/tcp/4001"]) for i in range(int(RECORD_BURST) + 5)]
    dropped = [g.inbound.quiet_drop(ID(b"x"), SimpleNamespace(data=b)) for b in blobs]
    assert dropped.count(False) == RECORD_BURST and dropped[-5:] == [True] * 5
    assert g.rejected["record_rate"] == 5
    await trio.sleep(1.0)  # 4 tokens a second come back
    assert g.inbound.quiet_drop(ID(b"x"), SimpleNamespace(data=other_record(99, []))) is False


async def test_a_lie_about_us_relayed_by_an_honest_member_is_dropped_without_blaming_the_relay():
    """A member's burst of rumors about an incarnation of ours we never issued reaches us
    through honest relays: failing the validator would cost each relay 10 points per rumor,
    and 80 of them graylisted the relays (the swarm's gossip mesh split; a lab test saw a
    label change stop spreading). Dropped before validation, counted against the liar."""
    g = gossip(cert_for(issued=time.time() - 10, ttl=3600))
    async with trio.open_nursery() as nursery:
        await running(g, nursery)
        lie = make_rumor(signer(OTHER), kind="dead", swarm=SWARM, sender=peer_str(OTHER_PEER), about=ME,
                         incarnation=g.core.seq + (1 << 20), issued=time.time(),
                         cert=cert_for(OTHER_PEER, issued=time.time() - 10, ttl=3600))
        msg = SimpleNamespace(data=lie)
        relay = ID(b"honest relay")
        assert g.inbound.quiet_drop(relay, msg) is True, "dropped and not passed on"
        assert g.inbound.validate(relay, msg) is True, "nothing in the message itself is invalid"
        assert g.rejected["future_incarnation"] == 1 and sum(g.rejected.values()) == 1
        nursery.cancel_scope.cancel()


async def test_a_new_record_replaces_the_addresses_of_the_old_one():
    store = PeerStore()
    g = gossip(cert_for(issued=time.time() - 10, ttl=3600), peerstore=store)
    async with trio.open_nursery() as nursery:
        await running(g, nursery)
        pid = ID.from_base58(peer_str(OTHER_PEER))
        g.inbound.accept(g.verifier.decode(other_record(5, ["/ip4/192.0.2.7/tcp/4001"]), time.time()))
        g.inbound.accept(g.verifier.decode(other_record(6, ["/ip4/192.0.2.8/tcp/4001"]), time.time()))
        assert [str(a) for a in store.addrs(pid)] == ["/ip4/192.0.2.8/tcp/4001"]
        nursery.cancel_scope.cancel()


def test_token_buckets_refill_and_stay_bounded():
    b = TokenBuckets(rate=4.0, burst=20.0, size=100)
    assert all(b.allow("p", 0.0) for _ in range(20)) and not b.allow("p", 0.0)
    assert b.allow("p", 0.25) and not b.allow("p", 0.25)
    for i in range(1000):
        b.allow(i, 1.0)
    assert len(b) == 100


# --- finding 14: rejections keep being logged ------------------------------------------------

def test_recent_logs_again_after_its_window_and_stays_bounded():
    r = Recent(size=100, window=3600.0)
    assert r.first(("bad", "p"), 0.0) and not r.first(("bad", "p"), 10.0)
    assert r.first(("bad", "p"), 3600.0), "logged again an hour later"
    for i in range(10_000):
        r.first(("bad", i), 4000.0)
    assert len(r) == 100
    assert r.first(("new", "q"), 4001.0), "a new rejection is still logged after a flood"


def test_a_message_is_verified_once_for_the_rate_check_and_the_validator(monkeypatch):
    from libp2p.pubsub.pb import rpc_pb2

    g = gossip(cert_for(issued=time.time() - 10, ttl=3600))
    msg = rpc_pb2.Message(data=other_record(5, ["/ip4/192.0.2.7/tcp/4001"]))
    calls = []
    real = g.verifier.decode
    monkeypatch.setattr(g.verifier, "decode", lambda blob, now: calls.append(1) or real(blob, now))

    async def check():
        assert g.inbound.quiet_drop(ID(b"x"), msg) is False and g.inbound.validate(ID(b"x"), msg) is True

    trio.run(check)
    assert len(calls) == 1


async def test_a_message_is_verified_once_from_the_rate_check_to_its_merge(monkeypatch):
    """Pubsub validates each message in its own task, and the subscription is read later:
    the read merges what the validator decoded, with no second signature check, for each of
    several messages validated before the first is read."""
    from libp2p.pubsub.pb import rpc_pb2

    g = gossip(cert_for(issued=time.time() - 10, ttl=3600))
    blobs = [other_record(5 + i, [f"/ip4/192.0.2.{7 + i}/tcp/4001"]) for i in range(10)]
    calls = []
    real = g.verifier.decode
    monkeypatch.setattr(g.verifier, "decode", lambda blob, now: calls.append(1) or real(blob, now))

    class Drained(Exception):
        pass

    class Subscription:  # hands out a new Message (new bytes) for each, as protobuf does
        def __init__(self):
            self.left = [rpc_pb2.Message(data=bytes(bytearray(b))) for b in blobs]

        async def get(self):
            if not self.left:
                raise Drained
            return self.left.pop(0)

    async with trio.open_nursery() as nursery:
        await running(g, nursery)
        for b in blobs:
            msg = rpc_pb2.Message(data=b)
            assert g.inbound.quiet_drop(ID(b"x"), msg) is False and g.inbound.validate(ID(b"x"), msg) is True
        with pytest.raises(Drained):
            await g.inbound.read(Subscription())
        nursery.cancel_scope.cancel()
    assert len(calls) == len(blobs)
    assert g.view().get(peer_str(OTHER_PEER)).record.seq == 14, "every record was merged"


def test_the_same_bytes_arriving_again_later_are_checked_afresh(monkeypatch):
    """The decode kept for the validator's read lasts DECODED_FOR seconds: a record replayed
    after it expired is refused, not taken from what was kept when it was fresh."""
    from libp2p.pubsub.pb import rpc_pb2

    from swarmd.gossip import inbound

    g = gossip(cert_for(issued=time.time() - 10, ttl=3600))
    blob = other_record(5, ["/ip4/192.0.2.7/tcp/4001"])
    clock = [1000.0]
    monkeypatch.setattr(inbound.time, "monotonic", lambda: clock[0])

    async def check():
        assert g.inbound.validate(ID(b"x"), rpc_pb2.Message(data=blob)) is True
        clock[0] += inbound.DECODED_FOR + 1
        later = time.time() + 300  # the record (ttl 120 s) has expired by then, its certificate not
        monkeypatch.setattr(inbound.time, "time", lambda: later)
        assert g.inbound.validate(ID(b"x"), rpc_pb2.Message(data=blob)) is False

    trio.run(check)
    assert g.rejected.get("stale") == 1, g.rejected


# --- refute, then sync again (the core's Sync(by)) -------------------------------------------

async def test_a_sync_that_made_us_refute_runs_once_more_and_no_more():
    """The peer holds us dead: the merge refutes and the core asks for a sync with it, which
    runs right after the one under way, so the peer gets our new record at once. A peer that
    keeps claiming us dead at every incarnation gets one more sync, not a loop."""
    for liar in (False, True):
        g = gossip(cert_for(issued=time.time() - 10, ttl=3600))
        other = peer_str(OTHER_PEER)
        async with trio.open_nursery() as nursery:
            await running(g, nursery)
            first = g.core.seq
            runs = []

            async def connected(pid):
                pass

            async def once(pid):
                runs.append(str(pid))
                claim = [ME, "dead", g.core.seq if liar else first]
                return "refuted" if g.syncs.merge({"records": [], "claims": [claim]}, pid) else "done"

            g.syncs._connect, g.syncs._once = connected, once
            await g.syncs.sync(other)
            assert runs == [other, other], "once more after the refute, then no more"
            assert g.core.seq == first + (2 if liar else 1) and g.own_record.seq == g.core.seq
            assert not g.syncs.busy(other)
            nursery.cancel_scope.cancel()


async def test_a_sync_request_that_made_us_refute_starts_a_sync_back():
    """As the responder: the requester's payload holds us suspect, so our answer (already
    sent) carried the record it refuted; we start a sync with it."""
    g = gossip(cert_for(issued=time.time() - 10, ttl=3600))
    other = peer_str(OTHER_PEER)
    async with trio.open_nursery() as nursery:
        await running(g, nursery)
        started = []

        async def sync(peer):
            started.append(peer)

        g.syncs.sync = sync
        assert g.syncs.merge({"records": [], "claims": [[ME, "suspect", g.core.seq]]}, ID.from_base58(other))
        await trio.testing.wait_all_tasks_blocked()
        assert started == [other]
        assert not g.syncs.merge({"records": [], "claims": [[ME, "alive", g.core.seq]]}, ID.from_base58(other))
        await trio.testing.wait_all_tasks_blocked()
        assert started == [other], "no refute, no sync"
        nursery.cancel_scope.cancel()


async def test_a_refused_sync_claim_is_counted_with_what_it_claimed():
    g = gossip(cert_for(issued=time.time() - 10, ttl=3600))
    async with trio.open_nursery() as nursery:
        await running(g, nursery)
        lie = [ME, "dead", g.core.seq + 5]
        assert not g.syncs.merge({"records": [], "claims": [[ME, "alive", 1], lie, "junk"]},
                                 ID.from_base58(peer_str(OTHER_PEER)))
        assert g.rejected == {"future_incarnation": 1, "malformed": 1}
        nursery.cancel_scope.cancel()


def record_with_key(key: SigningKey, seq: int) -> bytes:
    """A member's record advertising WG_KEY as its WireGuard key."""
    peer = peer_str(peer_from_key(bytes(key.verify_key)))
    wg = MeshInfo(public=WG_KEY.public, addr4="10.211.7.7", addr6=str(ula(SWARM, peer.encode())), port=51820,
                  endpoints=("192.0.2.9",), proof=prove(WG_KEY.private, wg_proof_message(SWARM, peer, WG_KEY.public)))
    return make_record(signer(key), swarm=SWARM, peer=peer, seq=seq, issued=time.time(), ttl=120.0, addrs=[],
                       resources=RES, labels={}, wg=wg,
                       cert=cert_for(peer_from_key(bytes(key.verify_key)), issued=time.time() - 10, ttl=3600))


async def test_within_one_sync_the_first_holder_of_a_wireguard_key_keeps_it():
    """Two members advertising the same WireGuard key in one sync payload: the first is taken,
    the second refused and counted, as when they arrive one after the other by gossip."""
    g = gossip(cert_for(issued=time.time() - 10, ttl=3600), peerstore=PeerStore())
    third = SigningKey(b"\x03" * 32)
    async with trio.open_nursery() as nursery:
        await running(g, nursery)
        payload = {"records": [record_with_key(OTHER, 5), record_with_key(third, 5)], "claims": []}
        assert not g.syncs.merge(payload, ID.from_base58(peer_str(OTHER_PEER)))
        assert [m.peer for m in g.view()] == [peer_str(OTHER_PEER)]
        assert g.rejected == {"wg_key_taken": 1}
        nursery.cancel_scope.cancel()


async def test_a_digest_gets_only_the_records_its_sender_lacks_and_asks_only_for_newer_ones():
    """Sync protocol 3 on the driver: a member's digest names OTHER at seq 5 (we hold 5) and a
    third member at seq 9 (we hold 3): we send nothing of OTHER, want the third, and send our
    own record (the digest lacks it). Its hostile entries are counted, not obeyed."""
    g = gossip(cert_for(issued=time.time() - 10, ttl=3600), peerstore=PeerStore())
    third = SigningKey(b"\x03" * 32)
    third_peer, other = peer_str(peer_from_key(bytes(third.verify_key))), peer_str(OTHER_PEER)
    async with trio.open_nursery() as nursery:
        await running(g, nursery)
        flush(g, 1.0)
        third_record = make_record(signer(third), swarm=SWARM, peer=third_peer, seq=3, issued=time.time(), ttl=120.0,
                                   addrs=[], resources=RES, labels={}, wg=None,
                                   cert=cert_for(peer_from_key(bytes(third.verify_key)), issued=time.time() - 10,
                                                 ttl=3600))
        g.syncs.merge({"records": [other_record(5, []), third_record], "claims": []}, ID.from_base58(other))
        assert sorted(m.peer for m in g.view()) == sorted([other, third_peer])
        digest = [[other, 5], [third_peer, 9], ["../etc", 1], [other, True]]
        offer = g.syncs.offer({"digest": digest, "claims": []}, ID.from_base58(other))
        own = g.syncs.held()[-1]
        assert own.peer == ME and offer["records"] == [own.blob]
        assert offer["want"] == [third_peer]
        assert g.rejected == {"sync_digest": 1}

        answer = g.syncs.answer({"want": [third_peer, third_peer, "nobody", 7] + [other] * 50},
                                ID.from_base58(other))
        assert answer == {"records": [third_record]}
        assert g.rejected == {"sync_digest": 1, "sync_want": 1}
        nursery.cancel_scope.cancel()


# --- what the floors above read of Gossip exists on it ---------------------------------------

def test_what_routing_and_the_jobs_read_of_gossip_is_there_on_the_real_driver():
    """Routing's helpers and the jobs read Gossip through narrow ports, faked in their tests:
    a name the real driver lacks (routing signed its relay requests with ``g.sign`` after a
    refactor dropped it) would fail only in a lab. Every attribute compute's Swarm port
    declares, and every ``g.<name>`` routing reads, must exist on a real Gossip."""
    import ast
    import typing
    from pathlib import Path

    from swarmd.compute.ports import Swarm

    g = gossip(cert_for(issued=time.time() - 10, ttl=3600))
    declared = {name for name in vars(Swarm) if not name.startswith("_")} | set(typing.get_type_hints(Swarm))
    read = set()
    for path in (Path(__file__).parents[1] / "swarmd" / "routing").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and (
                    (isinstance(node.value, ast.Name) and node.value.id == "g")
                    or (isinstance(node.value, ast.Attribute) and node.value.attr == "g")):
                read.add(node.attr)
    assert read >= {"view", "me", "sign", "swarm"}, "the scan finds routing's reads"
    assert [name for name in sorted(declared | read) if not hasattr(g, name)] == []
