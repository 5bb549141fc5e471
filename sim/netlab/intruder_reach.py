"""The intruder's attacks on reachability, as a certified member (see intruder.py).

  false-reflexive  keep publishing, for --seconds, a record that says we are behind a NAT
                   whose reflexive endpoint is --victim-endpoint (IP:port, someone else's),
                   with attestations we made up: our own, one in a real member's name
                   (--about) that we signed, one by a key that is no member's. Members must
                   not send their WireGuard handshakes there
  reach-flood      ask the target, --count times at once and then in a loop for --seconds,
                   how it sees us, each time asking it to dial back --port: the dial-backs it
                   makes go only to our own address, and only a few of them

Each returns one line of JSON saying what it sent and what came back.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from nacl.signing import SigningKey

from swarmd.gossip import swarmstate
from swarmd.gossip.capacity import Resources
from swarmd.gossip.cert import issue_cert
from swarmd.gossip.wire import MeshInfo, make_record, wg_proof_message
from swarmd.mesh import reach as reach_driver
from swarmd.p2p.signed import peer_bytes, peer_from_key, peer_str
from swarmd.p2p.streams import request
from swarmd.wg import address, keys, reach

ATTACKS = ("false-reflexive", "reach-flood")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--victim-endpoint", help="IP:port that false-reflexive claims as its reflexive endpoint")
    parser.add_argument("--port", type=int, default=4001, help="the port reach-flood asks to be dialled back at")


async def attack(name: str, *, args: argparse.Namespace, ident: Any, owner: swarmstate.SwarmMembership,
                 host: Any, target: Any, gossip: Callable[[list[bytes]], Awaitable[None]]) -> str:
    me = str(ident.peer_id)
    wg = keys.KeyPair.generate()
    own_addr = str(next(iter(address.candidates(owner.swarm, wg.public))))
    cert = issue_cert(swarmstate.owner_signer(owner), owner.swarm, peer_bytes(me), now=time.time(), ttl=3600.0,
                      addr4=own_addr)
    seq = time.time_ns() // 1000

    def record(n: int, **mesh_fields: Any) -> bytes:
        proof = keys.prove(wg.private, wg_proof_message(owner.swarm, me, wg.public))
        mesh = MeshInfo(public=wg.public, addr4=own_addr, addr6=None, port=51820, endpoints=(), proof=proof,
                        **mesh_fields)
        return make_record(ident.sign, swarm=owner.swarm, peer=me, seq=seq + n, issued=time.time(), ttl=60.0,
                           addrs=[], resources=Resources(cpu_count=1, cpu_free=1.0, memory_total_mb=1,
                                                         memory_free_mb=1), labels={}, wg=mesh, cert=cert)

    match name:
        case "false-reflexive":
            victim = args.victim_endpoint
            stranger = SigningKey.generate()

            def attest(observer: str, sign: Callable[[bytes], bytes]) -> bytes:
                return reach.seal_seen(sign, swarm=owner.swarm, observer=observer, about=me, wgpub=wg.public,
                                       wg=victim, ip=None, dial=False, at=time.time())

            deadline = trio.current_time() + args.seconds
            sent = 0
            while trio.current_time() < deadline:
                seen = (attest(me, ident.sign), attest(args.about, ident.sign),
                        attest(peer_str(peer_from_key(bytes(stranger.verify_key))),
                               lambda d: stranger.sign(d).signature))
                await gossip([record(sent, nat="eim", reflexive=victim, seen=seen, tcp=4001)])
                sent += 1
                await trio.sleep(2.0)
            return json.dumps({"records": sent, "reflexive": victim})
        case "reach-flood":
            answers: dict[str, Any] = {"dialled": 0, "not_dialled": 0, "error": 0, "errors": {}}
            await gossip([record(0)])  # in the target's view with a mesh side: it answers members only
            await trio.sleep(2.0)

            async def ask() -> None:
                try:
                    with trio.fail_after(15):
                        reply = await request(host, target.peer_id, reach_driver.PROTOCOL,
                                              {"cert": cert.blob, "port": args.port}, reach_driver.MAX_FRAME)
                    seen = reach.open_seen(reply["seen"], swarm=owner.swarm, about=me, now=time.time())
                    answers["dialled" if seen.dial is not None else "not_dialled"] += 1
                except Exception as exc:  # refused, reset, or no answer: counted by kind, for the test's message
                    answers["error"] += 1
                    kind = f"{type(exc).__name__}: {str(exc)[:80]}"
                    answers["errors"][kind] = answers["errors"].get(kind, 0) + 1

            async def reconnect() -> None:  # a burst's resets may take the connection down with them
                if target.peer_id not in host.get_connected_peers():
                    with trio.move_on_after(5):
                        try:
                            await host.connect(target)
                        except Exception:  # the next ask counts the failure
                            pass

            async with trio.open_nursery() as nursery:
                for _ in range(args.count):
                    nursery.start_soon(ask)
            deadline = trio.current_time() + args.seconds
            while trio.current_time() < deadline:
                await reconnect()
                await ask()
                await trio.sleep(0.2)
            return json.dumps(answers)
    raise AssertionError(name)
