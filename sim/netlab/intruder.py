"""A misbehaving peer, for tests of a swarm's defences: run it inside a lab namespace.

    python -m sim.netlab.intruder ATTACK --target /ip4/…/tcp/4001/p2p/12D3… --owner-dir DIR [--file F]

Attacks (each is what a real attacker could send; none needs anything but the network):
  no-cert   gossip a record and ask for a sync with a certificate from a foreign owner
  listen-outsider  connect, subscribe to the swarm's topic, count what arrives for --seconds
  listen-member    the same after a member's sync hello (for a revoked member: --state)
  forged    gossip a record whose signature does not verify (a member's cert, a flipped byte)
  capture   save the records the target holds (sync as a member) to --file
  replay    gossip the records saved by `capture` again, verbatim
  oversize  sync a 10 MB record to the target as a member
  garbage   open each swarmd stream protocol and send junk: bytes, a huge length, half a frame
  job       ask the target to reserve a job slot with a foreign certificate
  job-ids   (member) job requests whose ids are paths, dots, oversize or look-alikes
  job-no-commit  (member) reserve a slot, then start ranks without committing it
  job-foreign    (member) start, cancel and release another coordinator's job (--job ID)
  job-ranks (member) reserve one rank, then start eight
  job-no-read    (member) start a rank that prints without end and never read its
            output, for --seconds
  addr-hijack, key-hijack, revoked, expired: (member) claims on another member's overlay
            address or WireGuard key, a revoked member, an expired certificate (see
            intruder_admission.py)
  incarnation    (member) rumors and a sync claim about the target at incarnations up to 2^64-1
  false-dead     (member) a burst of --count dead rumors about a healthy member (--about, --inc)
  presync-oversize  a 16 MiB sync frame before any certificate
  streams   (member) --count concurrent sync streams from one peer, held --seconds
            (these four: intruder_gossip.py)
  false-reflexive, reach-flood: (member) a reflexive endpoint that is a victim's, with made-up
            attestations; reach requests asking for dial-backs in a flood (intruder_reach.py)
  serve-hijack  (member) a backdated claim on --service and replicas of it announced here, one
            under the real controller's (--about) name (intruder_serve.py)
  relay     relay requests from an outsider and from a member the relay's view lacks, forged,
            misaddressed, stale, junk (--about: the pair's other end; intruder_relay.py);
            prints the replies as one JSON line

``--owner-dir`` is the swarm owner's state directory: the intruder reads the swarm id from it
and, for the attacks that play a rogue member, issues itself a certificate with the owner
key (a member turned bad). It prints one line saying what it sent, and exits 0 once sent.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import trio
from multiaddr import Multiaddr
from nacl.signing import SigningKey

from swarmd.compute.host.service import JOB_PROTOCOL
from swarmd.gossip import pubsub as ps
from swarmd.gossip import swarmstate
from swarmd.gossip.capacity import Resources
from swarmd.gossip.cert import issue_cert
from swarmd.p2p.host import make_host
from swarmd.p2p.signed import peer_bytes
from swarmd.gossip.protocols import JOIN_PROTOCOL, MAX_SYNC_FRAME, PROBE_PROTOCOL, SYNC_PROTOCOL
from swarmd.p2p.streams import encode_frame, request
from swarmd.gossip.wire import make_record
from swarmd.identity import load_or_create

from . import intruder_admission, intruder_reach, intruder_serve

OVERSIZE = 10 * 1024 * 1024
JOB_ATTACKS = ("job-ids", "job-no-commit", "job-foreign", "job-ranks", "job-no-read")
GOSSIP_ATTACKS = ("incarnation", "false-dead", "presync-oversize", "streams")  # intruder_gossip.py
OUTSIDER_ATTACKS = ("no-cert", "garbage", "job", "presync-oversize", "listen-outsider", "relay")  # no member's hello first
ATTACKS = ("no-cert", "listen-outsider", "listen-member", "forged", "capture", "replay", "oversize", "garbage",
           "job", *JOB_ATTACKS, *intruder_admission.ATTACKS, *GOSSIP_ATTACKS, "relay", *intruder_reach.ATTACKS,
           *intruder_serve.ATTACKS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.netlab.intruder", description=__doc__.split("\n")[0])
    parser.add_argument("attack", choices=ATTACKS)
    parser.add_argument("--target", required=True, help="the victim's /ip4/…/tcp/…/p2p/… address")
    parser.add_argument("--owner-dir", required=True, type=Path, help="the swarm owner's state directory")
    parser.add_argument("--file", type=Path, help="where `capture` writes and `replay` reads")
    parser.add_argument("--job", help="a real job's id, for job-foreign")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long job-no-read holds its stream")
    parser.add_argument("--state", type=Path, help="keep the intruder's identity here (default: a new one)")
    intruder_admission.add_arguments(parser)
    intruder_reach.add_arguments(parser)
    parser.add_argument("--service", default="web", help="the service serve-hijack claims")
    parser.add_argument("--about", help="the member false-dead accuses (a peer id)")
    parser.add_argument("--inc", type=int, help="the incarnation false-dead's rumors name")
    parser.add_argument("--count", type=int, default=50, help="rumors for false-dead, streams for streams")
    args = parser.parse_args(argv)
    if args.attack in ("capture", "replay") and args.file is None:
        parser.error(f"{args.attack} needs --file")
    with tempfile.TemporaryDirectory() as tmp:
        print(trio.run(_attack, args, Path(tmp)))
    return 0


async def _attack(args: argparse.Namespace, tmp: Path) -> str:
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.tools.anyio_service import background_trio_service

    ident, _ = load_or_create(args.state or tmp / "state")
    me = str(ident.peer_id)
    owner = swarmstate.load(args.owner_dir, peer_bytes(_owner_peer(args.owner_dir)))
    assert owner is not None and owner.owner_key is not None, f"{args.owner_dir} holds no owner key"
    member_cert = issue_cert(swarmstate.owner_signer(owner), owner.swarm, peer_bytes(me), now=time.time())
    foreign = SigningKey.generate()
    foreign_cert = issue_cert(lambda d: foreign.sign(d).signature, owner.swarm, peer_bytes(me), now=time.time())
    target = info_from_p2p_addr(Multiaddr(args.target))

    def record(cert, seq: int = 1) -> bytes:
        return make_record(ident.sign, swarm=owner.swarm, peer=me, seq=seq, issued=time.time(), ttl=120.0,
                           addrs=[], resources=Resources(cpu_count=1, cpu_free=1.0, memory_total_mb=1,
                                                         memory_free_mb=1), labels={}, wg=None, cert=cert)

    host = make_host(ident, ["/ip4/0.0.0.0/tcp/0"])
    async with host.run([Multiaddr("/ip4/0.0.0.0/tcp/0")]):
        pubsub, router = ps.make_pubsub(host, gated=False)  # an attacker talks to anyone
        async with background_trio_service(pubsub), background_trio_service(router):
            await pubsub.wait_until_ready()
            topic = ps.topic(owner.swarm)
            subscription = await pubsub.subscribe(topic)
            with trio.fail_after(20):  # after pubsub is up, so that it greets the target
                await host.connect(target)
            host.get_peerstore().add_addrs(target.peer_id, target.addrs, 3600)  # to dial again once hung up on
            if args.attack not in OUTSIDER_ATTACKS:  # a member's sync hello: the target's pubsub serves us
                from .intruder_gossip import sync_exchange

                theirs = None
                with trio.move_on_after(10):
                    try:
                        _, theirs = await sync_exchange(host, target.peer_id, {"cert": member_cert.blob},
                                                        {"records": [], "claims": []})
                    except Exception:
                        pass
                with trio.move_on_after(5 if theirs is not None else 0):  # its subscription, to publish to it
                    while target.peer_id not in pubsub.peer_topics.get(topic, set()):
                        await trio.sleep(0.05)
            # it does not greet a peer that showed no certificate: push to it all the same
            pubsub.peer_topics.setdefault(topic, set()).add(target.peer_id)
            router.mesh.setdefault(topic, set()).add(target.peer_id)

            async def gossip(blobs: list[bytes]) -> None:
                for blob in blobs:
                    await pubsub.publish(topic, blob)
                with trio.move_on_after(5):  # until handed to the socket
                    while any(len(q) for q in pubsub.peer_queues.values()):
                        await trio.sleep(0.01)
                await trio.sleep(0.2)

            async def sync(payload: dict) -> object:
                """A sync as a member runs it (protocol 3): certificate first, then our records."""
                from .intruder_gossip import sync_exchange

                with trio.fail_after(30):
                    answer, theirs = await sync_exchange(host, target.peer_id, {"cert": payload["cert"]},
                                                         {k: v for k, v in payload.items() if k != "cert"})
                return theirs if theirs is not None else answer

            match args.attack:
                case "no-cert":
                    await gossip([record(foreign_cert)])
                    reply = await sync({"cert": foreign_cert.blob, "records": [], "claims": []})
                    return f"sent a record and a sync request with a foreign certificate; reply: {reply}"
                case "listen-outsider" | "listen-member":
                    got = 0
                    with trio.move_on_after(args.seconds):
                        while True:
                            await subscription.get()
                            got += 1
                    connected = target.peer_id in host.get_connected_peers()
                    return f"received {got} messages in {args.seconds:g} s; still connected: {connected}"
                case "forged":
                    body, sig = msgpack.unpackb(record(member_cert), raw=False)
                    await gossip([msgpack.packb([body, sig[:-1] + bytes([sig[-1] ^ 1])], use_bin_type=True)])
                    return "sent a record with a flipped signature byte"
                case "capture":
                    reply = await sync({"cert": member_cert.blob, "records": [], "claims": []})
                    records = reply.get("records", []) if isinstance(reply, dict) else []
                    args.file.write_bytes(msgpack.packb(records, use_bin_type=True))
                    return f"captured {len(records)} records"
                case "replay":
                    records = msgpack.unpackb(args.file.read_bytes(), raw=False)
                    await gossip(records)
                    return f"replayed {len(records)} records"
                case "garbage":
                    junk = [os.urandom(64), (1 << 31).to_bytes(4, "big"), encode_frame({"cert": 1})[:-1],
                            encode_frame({"cert": member_cert.blob, "target": b"x", "timeout": "soon"}),
                            encode_frame(["not", "a", "map"])]
                    for protocol in (PROBE_PROTOCOL, SYNC_PROTOCOL, JOIN_PROTOCOL, JOB_PROTOCOL):
                        for data in junk:
                            stream = await host.new_stream(target.peer_id, [protocol])
                            await stream.write(data)
                            with trio.move_on_after(0.5):
                                try:
                                    await stream.read(1 << 16)
                                except Exception:
                                    pass
                            await stream.reset()
                    return f"sent {4 * len(junk)} junk requests"
                case "job":
                    with trio.fail_after(30):
                        reply = await request(host, target.peer_id, JOB_PROTOCOL,
                                              {"op": "reserve", "job": "intruder", "gpus": 0, "lease": 60.0,
                                               "cert": foreign_cert.blob}, MAX_SYNC_FRAME)
                    return f"asked for a job slot with a foreign certificate; reply: {reply}"
                case name if name in intruder_admission.ATTACKS:
                    return await intruder_admission.attack(name, args=args, ident=ident, owner=owner, host=host,
                                                           target=target, gossip=gossip)
                case name if name in intruder_reach.ATTACKS:
                    return await intruder_reach.attack(name, args=args, ident=ident, owner=owner, host=host,
                                                       target=target, gossip=gossip)
                case name if name in intruder_serve.ATTACKS:
                    return await intruder_serve.attack(name, args=args, ident=ident, owner=owner, gossip=gossip)
                case name if name in GOSSIP_ATTACKS:
                    from .intruder_gossip import attack as gossip_attack

                    return await gossip_attack(name, host=host, target=target.peer_id, me=me, sign=ident.sign,
                                               swarm=owner.swarm, cert=member_cert, gossip=gossip, args=args)
                case name if name in JOB_ATTACKS:
                    from .intruder_jobs import attack

                    return await attack(name, host, target.peer_id, member_cert.blob, args)
                case "relay":
                    from .intruder_relay import attack as relay_attack

                    return await relay_attack(host=host, target=target.peer_id, me=me, sign=ident.sign,
                                              swarm=owner.swarm, member=member_cert, foreign=foreign_cert,
                                              about=args.about, relay_ip=str(Multiaddr(args.target)
                                                                             .value_for_protocol("ip4")))
                case "oversize":
                    await sync({"cert": member_cert.blob, "records": [os.urandom(OVERSIZE)], "claims": []})
                    return f"sent a {OVERSIZE}-byte record"
    raise AssertionError(args.attack)


def _owner_peer(owner_dir: Path) -> str:
    ident, _ = load_or_create(owner_dir)
    return str(ident.peer_id)


if __name__ == "__main__":
    sys.exit(main())
