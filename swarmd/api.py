"""The daemon's control-socket methods: what swarmctl can ask of a node.

Each package offers its own methods in its api.py (compute: jobs; gossip: the swarm and
labels; mesh: its key; routing: `route`); this module puts them together with what joins
several packages or the daemon itself (status, version, the log level, `peers` and `mesh`,
whose rows carry routing's path columns). Each handler reads the node's state and returns
plain data (msgpack-able); the method table says who may call each (`rpc.protocol.Access`):
anyone who can open the socket reads status, peers, the mesh and its routes; changing the
node or the swarm needs root or the daemon's user.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

import trio

from . import __version__, log
from .compute import api as compute_api
from .config import LOG_LEVELS
from .gossip import api as gossip_api
from .gossip.rtts import tag_index
from .mesh import api as mesh_api
from .routing import api as routing_api
from .rpc.protocol import Access, Caller, ErrorCode, Method, Param, RpcError
from .serve import api as serve_api

if TYPE_CHECKING:
    from .gossip.membership import MemberView, View

MIN_WATCH_INTERVAL = 0.1


class Node(Protocol):
    """What the control API reads of the daemon (node.Node is the one; node.py builds the
    methods with itself, so this module never imports it)."""

    config: Any
    identity: Any
    gossip: Any
    mesh: Any
    mesh_off: str | None
    routing: Any
    jobs: Any
    services: Any
    rejects: Any  # p2p.rejects.Rejects: what every subsystem refused
    log: Any
    log_level: str

    def status(self) -> dict[str, Any]: ...


def methods(node: Node) -> list[Method]:
    async def status(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return node.status()

    async def version(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        from importlib.metadata import version as dist_version

        return {"version": __version__, "python": platform.python_version(),
                "libp2p": dist_version("libp2p"), "pid": os.getpid()}

    async def watch(params: dict[str, Any], caller: Caller) -> AsyncIterator[dict[str, Any]]:
        interval = float(params.get("interval", 1.0))
        if interval < MIN_WATCH_INTERVAL:
            raise RpcError(ErrorCode.INVALID_PARAMS,
                           f"status.watch: 'interval' must be at least {MIN_WATCH_INTERVAL} s")
        count = params.get("count")
        sent = 0
        while count is None or sent < count:
            if sent:
                await trio.sleep(interval)
            yield node.status()
            sent += 1

    async def set_log_level(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        level = params["level"].lower()
        if level not in LOG_LEVELS:
            raise RpcError(ErrorCode.INVALID_PARAMS,
                           f"log.level: 'level' must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
        previous, node.log_level = node.log_level, level
        log.set_level(level)
        node.log.info("log level changed", level=level, previous=previous, by_uid=caller.uid)
        return {"level": level, "previous": previous}

    async def peers(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return {"swarm": node.gossip.swarm.swarm if node.gossip.swarm else None, "peers": peer_rows(node),
                "me": own_row(node)}

    async def mesh(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        m = mesh_api.up(node.mesh, node.mesh_off, "mesh")
        rows, view = await m.peer_rows(), node.gossip.view()
        return {**m.status(), "peers": [row | path_columns(node, view, row["peer"]) for row in rows]}

    return [*compute_api.methods(lambda: node.jobs if node.gossip.swarm is not None else None),
            *serve_api.methods(lambda: node.services if node.gossip.swarm is not None else None, lambda: node.jobs),
        *gossip_api.methods(node.gossip, state_dir=node.config.state_dir, log=node.log),
        *mesh_api.methods(node.mesh, node.mesh_off, log=node.log),
        *routing_api.methods(node.routing, node.gossip.view,
                             mesh_up=lambda method: mesh_api.up(node.mesh, node.mesh_off, method)),
        Method(name="status", handler=status, access=Access.READ, doc="this node: identity, addresses, uptime"),
        Method(name="version", handler=version, access=Access.READ, doc="daemon and library versions"),
        Method(name="status.watch", handler=watch, access=Access.READ, streams=True,
               doc="status every `interval` seconds, `count` times (forever when absent)",
               params={"interval": Param(type=float, doc="seconds between snapshots"),
                       "count": Param(type=int, doc="snapshots to send")}),
        Method(name="log.level", handler=set_log_level, access=Access.ADMIN,
               doc="change the daemon's log level at run time",
               params={"level": Param(type=str, required=True, doc=" | ".join(LOG_LEVELS))}),
        Method(name="peers", handler=peers, access=Access.READ, doc="every member in this node's view"),
        Method(name="mesh", handler=mesh, access=Access.READ, doc="this node's WireGuard interface and its peers"),
    ]


def peer_rows(node: Node) -> list[dict[str, Any]]:
    now_mono, now = trio.current_time(), time.time()
    rows, view = [], node.gossip.view()
    names = tag_index((view.me, *(m.peer for m in view)))  # a record's RTTs name members by tag
    for m in sorted(view, key=lambda m: m.peer):
        r = m.record
        rtt, source = peer_rtt(node, m)
        rows.append({
            "peer": m.peer, "state": m.state.value, "stale": m.stale, "since_s": round(now_mono - m.since, 3),
            "rtt_ms": rtt, "rtt_source": source,
            "rtt_min_ms": None if m.rtt_min is None else round(m.rtt_min * 1000, 2),
            "resources": r.resources.to_wire(), "summary": r.resources.summary(), "labels": r.labels,
            "addrs": list(r.addrs), "seq": r.seq, "record_age_s": round(now - r.issued, 3),
            "rtts_ms": r.rtts.named(names), "jobs": None if r.jobs is None else r.jobs.to_wire(),
            # how members reach it (issue 25), as its record says: wg.nat, wg.reflexive
            "nat": None if r.wg is None else r.wg.nat, "reflexive": None if r.wg is None else r.wg.reflexive,
            "coord": None if r.coord is None else r.coord.to_wire(),  # [*vec, height, error, adjustment]
        })
    return rows


def own_row(node: Node) -> dict[str, Any] | None:
    """This node as `peers` lists the others (what its own record says), for a map of the swarm
    that has it too; None before its first record."""
    r = node.gossip.own_record
    if r is None:
        return None
    return {"peer": r.peer, "state": "alive", "resources": r.resources.to_wire(), "summary": r.resources.summary(),
            "labels": r.labels, "seq": r.seq, "jobs": None if r.jobs is None else r.jobs.to_wire(),
            "nat": None if r.wg is None else r.wg.nat, "coord": None if r.coord is None else r.coord.to_wire()}


def peer_rtt(node: Node, m: MemberView[Any]) -> tuple[float | None, str | None]:
    """The RTT `swarmctl peers` shows, and where it comes from: routing's ("measured" where this
    node probes the peer, else "estimated" from network coordinates); without routing, this
    node's own probes."""
    routing = node.routing
    if routing is not None:
        got = routing.peer_rtt(m.peer)
        return (None, None) if got is None else (_ms(got[0]), got[1])
    return (None, None) if m.rtt_ewma is None else (_ms(m.rtt_ewma * 1000), "measured")


NO_PATH = {"path": None, "relay": None, "relay_state": None, "path_rtt_ms": None, "direct_rtt_ms": None,
           "estimate_ms": None}


def path_columns(node: Node, view: View[Any], peer: str | None) -> dict[str, Any]:
    """A mesh row's path (routing.path_row): `direct` or `via <peer>`, the relay session's
    state, the path's RTT, the direct RTT and the coordinate estimate. Without routing every
    path is direct and its RTT is this node's own probes; a device peer no member owns (a key
    being replaced) has none."""
    if peer is None:
        return NO_PATH
    routing = node.routing
    if routing is None:
        m = view.get(peer)
        rtt = None if m is None or m.rtt_ewma is None else _ms(m.rtt_ewma * 1000)
        return {**NO_PATH, "path": "direct", "path_rtt_ms": rtt, "direct_rtt_ms": rtt}
    try:
        row = routing.path_row(peer)
    except KeyError:
        return NO_PATH
    return {key: _ms(row.get(key)) if key.endswith("_ms") else row.get(key) for key in NO_PATH}




def _ms(value: float | None) -> float | None:
    return None if value is None else round(float(value), 2)


def swarm_status(node: Node) -> dict[str, Any]:
    swarm = node.gossip.swarm
    if swarm is None:
        return {"swarm": None}
    own = node.gossip.own_record
    return {
        "swarm": {"id": swarm.swarm, "owner": swarm.is_owner, "cert_expires": swarm.cert.expires,
                  "members": node.gossip.view().counts(), "record_error": node.gossip.record_error,
                  **node.gossip.admission.status()},
        "gossip": {**{k: node.gossip.traffic.counts[k] for k in ("messages_in", "messages_out", "bytes_in",
                                                                  "bytes_out", "dropped")},
                   "received_by_kind": node.gossip.traffic.by_kind(),
                   "rejected": dict(node.rejects.rejected)},  # every subsystem's, by reason
        "rejected": {subsystem: dict(counts) for subsystem, counts in node.rejects.by_subsystem.items()},
        "record": None if own is None else {
            "seq": own.seq, "addrs": list(own.addrs), "labels": own.labels,
            "resources": own.resources.to_wire(), "summary": own.resources.summary()},
    }


def uptime(started: float) -> float:
    return round(time.monotonic() - started, 3)
