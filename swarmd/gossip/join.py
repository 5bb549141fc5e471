"""Joining a swarm with an invite: the joiner's side (the owner's is admission.py).

The invite (cert.Token) names the swarm, its owner's key, a one-time ticket and the
addresses of inviting nodes. Each address is tried in turn: dial, send ``{ticket}`` on the
join protocol, and take the ``{cert}`` answered only if it is a valid certificate of that
swarm, from its owner, for this node. A node that answers ``{error}`` (the ticket used up,
expired, unknown) ends the join: another address would say the same. The certificate and
the swarm are saved before the join returns.
"""

from __future__ import annotations

import time
from pathlib import Path

import structlog
import trio
from libp2p.abc import IHost
from libp2p.peer.peerinfo import info_from_p2p_addr
from multiaddr import Multiaddr

from ..p2p.signed import Invalid, peer_bytes
from ..p2p.streams import request
from .cert import Cert, Token, check_cert
from .protocols import JOIN_PROTOCOL
from .swarmstate import SwarmMembership, save_joined

log = structlog.get_logger("swarmd.gossip")

JOIN_TIMEOUT = 10.0


class JoinError(Exception):
    pass


async def join(host: IHost, me: str, token: Token, state_dir: Path) -> SwarmMembership:
    """Join the swarm of ``token`` as ``me``; the swarm saved in ``state_dir``."""
    errors = []
    for addr in token.addrs:
        try:
            info = info_from_p2p_addr(Multiaddr(addr))
            with trio.fail_after(JOIN_TIMEOUT):
                await host.connect(info)
                reply = await request(host, info.peer_id, JOIN_PROTOCOL, {"ticket": token.ticket})
        except Exception as exc:  # any dial or protocol failure
            errors.append(f"{addr}: {exc.__class__.__name__}: {exc}")
            continue
        if not isinstance(reply, dict) or "cert" not in reply:
            reason = reply.get("error") if isinstance(reply, dict) else "a malformed answer"
            raise JoinError(f"{addr} refused: {reason}")
        try:
            cert: Cert = check_cert(reply["cert"], owner_public=token.owner_public, swarm=token.swarm,
                                    peer=peer_bytes(me), now=time.time())
        except Invalid as exc:
            raise JoinError(f"{addr} sent a bad certificate: {exc.detail}") from None
        swarm = save_joined(state_dir, token.owner_public, cert, token.addrs)
        log.info("joined swarm", swarm=swarm.swarm, via=addr)
        return swarm
    raise JoinError("no inviting node answered: " + "; ".join(errors))

