"""The intruder's attacks on admission and mesh identities, as a certified member (see intruder.py).

  addr-hijack  a record advertising the victim's overlay address (--victim-addr), while the
               intruder's certificate names another one
  key-hijack   a record advertising the victim's WireGuard key (--victim-key, base64) with a
               proof made by the intruder's own key; with --victim-key-file (a stolen copy of
               the victim's wg.key) also one with a valid proof: the first holder keeps it
  revoked      a revoked member (--state, revoked beforehand) gossips a record, asks for a
               sync, a job slot and a certificate renewal
  expired      a member whose certificate expires in --cert-ttl seconds publishes a record
               every second and answers pings, for --seconds

Each returns one line saying what it sent and what came back.
"""

from __future__ import annotations

import argparse
import base64
import ipaddress
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from swarmd.compute.host.service import JOB_PROTOCOL
from swarmd.gossip import swarmstate
from swarmd.gossip.capacity import Resources
from swarmd.gossip.cert import Cert, issue_cert
from swarmd.p2p.signed import peer_bytes
from swarmd.gossip.protocols import JOIN_PROTOCOL, SYNC_PROTOCOL
from swarmd.p2p.streams import MAX_SMALL_FRAME, request
from swarmd.gossip.wire import MeshInfo, make_record, wg_proof_message
from swarmd.wg import address, keys

ATTACKS = ("addr-hijack", "key-hijack", "revoked", "expired")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--victim-addr", help="the victim's overlay IPv4 address, for addr-hijack")
    parser.add_argument("--victim-key", help="the victim's WireGuard public key (base64), for key-hijack")
    parser.add_argument("--victim-key-file", help="a copy of the victim's wg.key, for key-hijack")
    parser.add_argument("--cert-ttl", type=float, default=5.0, help="the certificate's lifetime, for expired")


async def attack(name: str, *, args: argparse.Namespace, ident: Any, owner: swarmstate.SwarmMembership,
                 host: Any, target: Any, gossip: Callable[[list[bytes]], Awaitable[None]]) -> str:
    me = str(ident.peer_id)
    sign = swarmstate.owner_signer(owner)
    wg = keys.KeyPair.generate()
    own_addr = str(next(a for a in address.candidates(owner.swarm, wg.public) if str(a) != args.victim_addr))

    def cert(ttl: float = 3600.0, addr4: str | None = None) -> Cert:
        return issue_cert(sign, owner.swarm, peer_bytes(me), now=time.time(), ttl=ttl, addr4=addr4)

    def record(c: Cert, *, seq: int, public: bytes | None = None, addr4: str | None = None,
               private: bytes | None = None, ttl: float = 120.0) -> bytes:
        public = wg.public if public is None else public
        proof = keys.prove(wg.private if private is None else private, wg_proof_message(owner.swarm, me, public))
        mesh = MeshInfo(public=public, addr4=addr4 or own_addr, addr6=None, port=51820, endpoints=(), proof=proof)
        return make_record(ident.sign, swarm=owner.swarm, peer=me, seq=seq, issued=time.time(), ttl=ttl, addrs=[],
                           resources=Resources(cpu_count=1, cpu_free=1.0, memory_total_mb=1, memory_free_mb=1),
                           labels={}, wg=mesh, cert=c)

    async def ask(protocol: str, payload: dict) -> Any:
        try:
            with trio.fail_after(20):
                await host.connect(target)  # the target may have hung up on us (revoked, expired)
                return await request(host, target.peer_id, protocol, payload, MAX_SMALL_FRAME)
        except Exception as exc:
            return f"{exc.__class__.__name__}: {exc}"

    seq = time.time_ns() // 1000  # above anything an earlier run of this identity sent
    match name:
        case "addr-hijack":
            assert args.victim_addr, "addr-hijack needs --victim-addr"
            ipaddress.IPv4Address(args.victim_addr)
            await gossip([record(cert(addr4=own_addr), seq=seq, addr4=args.victim_addr)])
            return f"gossiped a record claiming {args.victim_addr}; its certificate names {own_addr}"
        case "key-hijack":
            victim = base64.b64decode(args.victim_key)
            c = cert(addr4=own_addr)
            await gossip([record(c, seq=seq, public=victim)])
            sent = "a record with the victim's key and a proof by our own"
            if args.victim_key_file:
                private = base64.b64decode(Path(args.victim_key_file).read_text().strip())
                await gossip([record(c, seq=seq + 1, public=victim, private=private)])
                sent += ", then one with the stolen key's valid proof"
            return "gossiped " + sent
        case "revoked":
            c = cert(addr4=own_addr)
            await gossip([record(c, seq=seq)])
            synced = await ask(SYNC_PROTOCOL, {"cert": c.blob})
            job = await ask(JOB_PROTOCOL, {"op": "reserve", "job": "0" * 12, "gpus": 0, "lease": 60.0,
                                           "cert": c.blob})
            renewed = await ask(JOIN_PROTOCOL, {"renew": c.blob})
            return f"revoked member tried; sync: {synced}; job: {job}; renew: {renewed}"
        case "expired":
            c = cert(ttl=args.cert_ttl, addr4=own_addr)
            deadline = trio.current_time() + args.seconds
            n = 0
            while trio.current_time() < deadline:
                if target.peer_id not in host.get_connected_peers():  # hung up on at expiry: come back
                    with trio.move_on_after(2):
                        try:
                            await host.connect(target)
                        except Exception:
                            pass
                await gossip([record(c, seq=seq + n, ttl=30.0)])
                n += 1
                await trio.sleep(1.0)
            synced = await ask(SYNC_PROTOCOL, {"cert": c.blob})
            return f"published {n} records with a certificate that expired after {args.cert_ttl} s; sync: {synced}"
    raise AssertionError(name)
