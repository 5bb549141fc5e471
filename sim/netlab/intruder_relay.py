"""A peer asks a member to relay for it without the right (sim/netlab/intruder.py, relay).

Each request is answered with an error and counted by the relay: an outsider (a foreign
certificate), and a certified member that is not in the relay's view (it never published a
record) asking for a pair with a real member, with a request signed by another key, addressed
to another relay, pairing the relay with itself, issued an hour ago, not a signed blob at all,
and naming an IP that is not an address of the relay.
"""

from __future__ import annotations

import json
import time
from typing import Any

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from nacl.signing import SigningKey

from swarmd.gossip.cert import Cert
from swarmd.p2p.signed import Signer
from swarmd.p2p.streams import request
from swarmd.routing import request as rq


async def attack(*, host: IHost, target: ID, me: str, sign: Signer, swarm: str, member: Cert, foreign: Cert,
                 about: str, relay_ip: str) -> str:
    relay = str(target)
    stranger = SigningKey.generate()

    def req(**change: Any) -> bytes:
        fields = {"swarm": swarm, "peer": me, "relay": relay, "other": about, "via_ip": relay_ip, "op": "relay",
                  "issued": time.time()}
        signer = change.pop("sign", sign)
        fields.update(change)
        return rq.make(signer, **fields)

    asks = {
        "outsider": {"cert": foreign.blob, "req": req()},
        "absent_member": {"cert": member.blob, "req": req()},
        "forged": {"cert": member.blob, "req": req(sign=lambda d: stranger.sign(d).signature)},
        "other_relay": {"cert": member.blob, "req": req(relay=about)},
        "pair_with_relay": {"cert": member.blob, "req": req(other=relay)},
        "stale": {"cert": member.blob, "req": req(issued=time.time() - 3600)},
        "junk": {"cert": member.blob, "req": b"\x93not a request"},
        "not_our_ip": {"cert": member.blob, "req": req(via_ip="192.0.2.7")},
    }
    replies: dict[str, Any] = {}
    for name, payload in asks.items():
        with trio.move_on_after(15):
            try:
                replies[name] = await request(host, target, rq.PROTOCOL, payload)
            except Exception as exc:
                replies[name] = {"error": f"stream: {exc.__class__.__name__}: {exc}"}
    return json.dumps(replies)
