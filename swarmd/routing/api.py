"""The control socket's routing method: ``route PEER``, why traffic to a member goes direct or
through a relay (its RTTs, the relays considered, the hysteresis), as ``Routing.explain`` has
it. The peer is named by its full id or an unambiguous part of one, at least
``MIN_PEER_PART`` characters (the tables show the last 8); anything else is refused naming
what is wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..gossip.membership import View
from ..gossip.revocation import resolve_peer
from ..rpc.protocol import Access, Caller, ErrorCode, Method, Param, RpcError

MIN_PEER_PART = 6  # characters of a peer id `route` takes: the tables show the last 8


def methods(routing: Any, view: Callable[[], View[Any]], *, mesh_up: Callable[[str], Any]) -> list[Method]:
    """``route`` on ``routing`` (service.Routing; None where path choice does not run), naming
    members of ``view()``; ``mesh_up(method)`` raises the error to answer when the mesh is not
    up (paths are the mesh's)."""

    async def route(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        mesh_up("route")
        if routing is None:
            raise RpcError(ErrorCode.OPERATION_FAILED, "route: path choice is not running on this node")
        peer = route_peer(params["peer"], view())
        try:
            explained = routing.explain(peer)
        except KeyError:
            raise RpcError(ErrorCode.INVALID_PARAMS, f"route: {peer} is not a member this node has a path to "
                                                     "(alive, in the mesh; see `swarmctl peers`)") from None
        return {"peer": peer, **explained}

    return [
        Method(name="route", handler=route, access=Access.READ,
               doc="why traffic to a peer goes direct or through a relay: RTTs, relays considered, hysteresis",
               params={"peer": Param(type=str, required=True,
                                     doc=f"peer id, or at least {MIN_PEER_PART} characters of its start or end")}),
    ]


def route_peer(text: str, view: View[Any]) -> str:
    """The member `route` is asked about: a full id, or an unambiguous start or end of one."""
    text = text.strip()
    if text not in view and len(text) < MIN_PEER_PART:
        raise RpcError(ErrorCode.INVALID_PARAMS, f"route: {text!r} is too short to name a peer: give at least "
                                                 f"{MIN_PEER_PART} characters of its id (`swarmctl peers` shows "
                                                 "the last 8)")
    try:
        peer = resolve_peer(text, [m.peer for m in view])
    except ValueError as exc:
        raise RpcError(ErrorCode.INVALID_PARAMS, f"route: {exc}") from None
    if peer == view.me:
        raise RpcError(ErrorCode.INVALID_PARAMS, "route: that is this node itself")
    return peer
