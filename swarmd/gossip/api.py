"""The control socket's swarm methods: make a swarm, invite, revoke, renew, join; this
node's labels.

Changing the swarm or this node's record needs root or the daemon's user
(`rpc.protocol.Access.ADMIN`); the list of revocations is readable by anyone who can open
the socket. Every parameter is checked here (ranges, types, lengths) and refused with an
error naming it; what gossip does with a valid one is service.Gossip's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..p2p.signed import Invalid, peer_bytes
from ..rpc.protocol import Access, Caller, ErrorCode, Method, Param, RpcError
from . import swarmstate
from .cert import DEFAULT_CERT_TTL, DEFAULT_INVITE_TTL, DEFAULT_INVITE_USES, MAX_INVITE_USES, make_token, parse_token
from .revocation import MAX_REASON, resolve_peer
from .service import Gossip, JoinError
from .swarmstate import owner_signer
from .wire import check_labels


def methods(gossip: Gossip, *, state_dir: Path, log: Any) -> list[Method]:
    """The swarm and labels methods of the node whose gossip is ``gossip``, keeping its state
    in ``state_dir``, logging who changed what to ``log``."""

    async def swarm_init(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        try:
            # the owner's own address comes from the network joins are allocated from (mesh_network)
            swarm = swarmstate.create(state_dir, peer_bytes(gossip.me), network=gossip.admission.network)
        except swarmstate.SwarmStateError as exc:
            raise RpcError(ErrorCode.OPERATION_FAILED, f"swarm init: {exc}") from None
        gossip.adopt(swarm)
        log.info("swarm created", swarm=swarm.swarm, by_uid=caller.uid)
        return {"swarm": swarm.swarm}

    async def swarm_invite(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        swarm = gossip.swarm
        if swarm is None or not swarm.is_owner:
            raise RpcError(ErrorCode.OPERATION_FAILED, "swarm invite: only the node that ran `swarm init` holds the owner "
                                             "key and can invite")
        expires = float(params.get("expires", DEFAULT_INVITE_TTL))
        cert_ttl = float(params.get("cert_ttl", DEFAULT_CERT_TTL))
        uses = params.get("uses", DEFAULT_INVITE_USES)
        if not 60 <= expires <= 365 * 86400 or not 60 <= cert_ttl <= 10 * 365 * 86400:
            raise RpcError(ErrorCode.INVALID_PARAMS, "swarm invite: 'expires' must be 1 min to 365 d "
                                                     "and 'cert_ttl' 1 min to 10 years")
        if isinstance(uses, bool) or not isinstance(uses, int) or not 1 <= uses <= MAX_INVITE_USES:
            raise RpcError(ErrorCode.INVALID_PARAMS, f"swarm invite: 'uses' must be 1 to {MAX_INVITE_USES}")
        addrs = [f"{a}/p2p/{gossip.me}" for a in gossip.addrs()]
        token = make_token(owner_signer(swarm), swarm.owner_public, addrs, now=time.time(),
                           expires_in=expires, cert_ttl=cert_ttl, uses=uses)
        try:
            gossip.admission.record_invite(token.ticket, uses)
        except (swarmstate.SwarmStateError, ValueError) as exc:
            raise RpcError(ErrorCode.OPERATION_FAILED, f"swarm invite: {exc}") from None
        log.info("invite issued", expires=round(token.expires), uses=uses, by_uid=caller.uid)
        return {"token": token.encode(), "swarm": swarm.swarm, "expires": token.expires, "uses": uses,
                "addrs": addrs}

    async def swarm_revoke(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        swarm = gossip.swarm
        if swarm is None or not swarm.is_owner:
            raise RpcError(ErrorCode.OPERATION_FAILED, "swarm revoke: only the node that ran `swarm init` holds the "
                                                       "owner key and can revoke")
        reason = params.get("reason", "")
        if not isinstance(reason, str) or len(reason) > MAX_REASON:
            raise RpcError(ErrorCode.INVALID_PARAMS, f"swarm revoke: 'reason' must be at most {MAX_REASON} characters")
        try:
            peer = resolve_peer(params["peer"], [m.peer for m in gossip.view()])
        except ValueError as exc:
            raise RpcError(ErrorCode.INVALID_PARAMS, f"swarm revoke: {exc}") from None
        if peer == gossip.me:
            raise RpcError(ErrorCode.INVALID_PARAMS, "swarm revoke: this is the owner's own node")
        r = gossip.admission.revoke(peer, reason)
        log.warning("member revoked", peer=peer, reason=reason, by_uid=caller.uid)
        return {"peer": r.peer, "issued": r.issued, "reason": r.reason, "swarm": swarm.swarm}

    async def swarm_revocations(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return {"revocations": [r.to_dict() for r in gossip.admission.revocations.all()]}

    async def swarm_renew(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        if gossip.swarm is None:
            raise RpcError(ErrorCode.OPERATION_FAILED, "swarm renew: this node is in no swarm")
        if not await gossip.admission.renew():
            raise RpcError(ErrorCode.OPERATION_FAILED,
                           f"swarm renew: {gossip.admission.renewal['error']}")
        cert = gossip.swarm.cert
        return {"expires": cert.expires, "addr4": cert.addr4}

    async def swarm_join(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        if gossip.swarm is not None:
            raise RpcError(ErrorCode.OPERATION_FAILED, f"swarm join: this node is already in swarm {gossip.swarm.swarm}")
        try:
            token = parse_token(params["token"])
        except ValueError as exc:
            raise RpcError(ErrorCode.INVALID_PARAMS, f"swarm join: {exc}") from None
        try:
            swarm = await gossip.join(token, state_dir)
        except (JoinError, swarmstate.SwarmStateError) as exc:
            raise RpcError(ErrorCode.OPERATION_FAILED, f"swarm join: {exc}") from None
        return {"swarm": swarm.swarm}

    async def labels_set(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return change_labels(params["labels"], [], caller)

    async def labels_rm(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        keys = params["keys"]
        if not all(isinstance(k, str) for k in keys):
            raise RpcError(ErrorCode.INVALID_PARAMS, "labels.rm: 'keys' must be strings")
        return change_labels({}, keys, caller)

    def change_labels(set_: dict[str, Any], remove: list[str], caller: Caller) -> dict[str, Any]:
        try:
            check_labels(set_, "labels")
        except Invalid as exc:
            raise RpcError(ErrorCode.INVALID_PARAMS, exc.detail) from None
        labels = {k: v for k, v in gossip.labels.items() if k not in remove} | set_
        try:
            check_labels(labels, "labels")
        except Invalid as exc:
            raise RpcError(ErrorCode.INVALID_PARAMS, exc.detail) from None
        swarmstate.change_labels(state_dir, set_, remove)
        gossip.set_labels(labels)
        log.info("labels changed", labels=labels, by_uid=caller.uid)
        return {"labels": labels}

    return [
        Method(name="swarm.init", handler=swarm_init, access=Access.ADMIN,
               doc="make a new swarm, owned by this node"),
        Method(name="swarm.invite", handler=swarm_invite, access=Access.ADMIN,
               doc="an invite token for a new member (owner only)",
               params={"expires": Param(type=(int, float), doc="seconds the token is valid (default 1 day)"),
                       "cert_ttl": Param(type=(int, float), doc="seconds the member's certificate is valid"),
                       "uses": Param(type=int, doc="how many nodes the token admits (default 1)")}),
        Method(name="swarm.revoke", handler=swarm_revoke, access=Access.ADMIN,
               doc="revoke a member for good (owner only); the swarm drops it within seconds",
               params={"peer": Param(type=str, required=True, doc="peer id, or an unambiguous part of one"),
                       "reason": Param(type=str, doc="for the record and the logs")}),
        Method(name="swarm.revocations", handler=swarm_revocations, access=Access.READ,
               doc="the revoked peers this node knows of"),
        Method(name="swarm.renew", handler=swarm_renew, access=Access.ADMIN,
               doc="renew this node's certificate from the owner now"),
        Method(name="swarm.join", handler=swarm_join, access=Access.ADMIN, doc="join a swarm with an invite token",
               params={"token": Param(type=str, required=True, doc="from `swarmctl swarm invite`")}),
        Method(name="labels.set", handler=labels_set, access=Access.ADMIN, doc="set labels on this node's record",
               params={"labels": Param(type=dict, required=True, doc="{key: value}")}),
        Method(name="labels.rm", handler=labels_rm, access=Access.ADMIN, doc="remove labels from this node's record",
               params={"keys": Param(type=list, required=True, doc="[key, ...]")}),
    ]
