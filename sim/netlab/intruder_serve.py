"""The intruder's attacks on services, as a certified member (see intruder.py).

  serve-hijack  keep publishing, for --seconds, a record that claims service --service (its
                creation backdated to 1970, its replicas assigned to ourselves) and announces
                two replicas of it here: one under our own claim, one under the real
                controller's (--about) that it never assigned us. Gateways must keep routing
                every request to the service's real replicas

Returns one line of JSON saying what it sent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from swarmd.gossip import swarmstate
from swarmd.gossip.capacity import Resources
from swarmd.gossip.cert import issue_cert
from swarmd.gossip.registry import ReplicaEntry, ServiceClaim
from swarmd.gossip.wire import MeshInfo, make_record, wg_proof_message
from swarmd.p2p.signed import peer_bytes
from swarmd.wg import address, keys

ATTACKS = ("serve-hijack",)


async def attack(name: str, *, args: Any, ident: Any, owner: swarmstate.SwarmMembership,
                 gossip: Callable[[list[bytes]], Awaitable[None]]) -> str:
    assert name == "serve-hijack"
    me = str(ident.peer_id)
    wg = keys.KeyPair.generate()
    own_addr = str(next(iter(address.candidates(owner.swarm, wg.public))))
    cert = issue_cert(swarmstate.owner_signer(owner), owner.swarm, peer_bytes(me), now=time.time(), ttl=3600.0,
                      addr4=own_addr)
    claim = ServiceClaim(name=args.service, created=1.0, access="public", token_sha256=None, health="/",
                         assigned=((0, me), (1, me)))
    entries = (ReplicaEntry(service=args.service, index=0, controller=me, port=30000, healthy=True),
               ReplicaEntry(service=args.service, index=1, controller=args.about, port=30001, healthy=True))
    proof = keys.prove(wg.private, wg_proof_message(owner.swarm, me, wg.public))
    mesh = MeshInfo(public=wg.public, addr4=own_addr, addr6=None, port=51820, endpoints=(), proof=proof)
    seq, sent = time.time_ns() // 1000, 0
    deadline = trio.current_time() + args.seconds
    while trio.current_time() < deadline:
        await gossip([make_record(ident.sign, swarm=owner.swarm, peer=me, seq=seq + sent, issued=time.time(),
                                  ttl=60.0, addrs=[], resources=Resources(cpu_count=1, cpu_free=1.0,
                                                                          memory_total_mb=1, memory_free_mb=1),
                                  labels={}, wg=mesh, cert=cert, services=(claim,), replicas=entries)])
        sent += 1
        await trio.sleep(1.0)
    return json.dumps({"records": sent, "peer": me, "service": args.service})
