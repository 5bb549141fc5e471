"""What the rest of the daemon reads of routing: immutable snapshots, from any thread.

``Readout`` is the read side of ``service.Routing`` (its mixin): placement's ``rtt_function``
(called for every pair of a placement from a worker thread: bound to one snapshot), the
control API's ``peer_rtt``, ``path_row`` (its ``path``: ``direct`` or ``via <relay> (<reason>)``),
``explain`` and ``status``. Everything here reads
``_Snap``, replaced whole at each evaluation and never changed, or the cores' own queries.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import trio

from ..gossip.membership import View
from ..p2p.signed import short
from ..vivaldi import Coordinate


@dataclass(frozen=True, slots=True)
class Snap:
    """What readers from other threads see: replaced whole, never changed."""

    view: View
    me: str
    own: Mapping[str, float] = field(default_factory=dict)  # peer -> ms, our recent measurements
    coord: Coordinate | None = None
    path_ms: Mapping[str, float] = field(default_factory=dict)  # relayed peers -> the path's RTT, ms


def estimator(view: View, me: str, mine: Coordinate | None) -> Callable[[str, str], float | None]:
    """The coordinate estimate of RTT(a, b) in ms, from the records' coordinates (ours for ``me``)."""
    def estimate(a: str, b: str) -> float | None:
        ca = mine if a == me else (m.record.coord if (m := view.get(a)) is not None else None)
        cb = mine if b == me else (m.record.coord if (m := view.get(b)) is not None else None)
        return None if ca is None or cb is None else ca.distance_to(cb) * 1000
    return estimate


class Readout:
    _snap: Snap
    paths: Any
    sessions: Any
    client: Any
    config: Any
    server: Any
    exchange: Any
    relay_off: str | None
    errors: int
    _last_error: str | None

    def rtt_ms(self, a: str, b: str) -> float | None:
        """The RTT a job between ``a`` and ``b`` will see, ms (``rtt_function``'s, on the snapshot now)."""
        return self.rtt_function()(a, b)

    def rtt_function(self) -> Callable[[str, str], float | None]:
        """``rtt(a, b)`` in ms on one snapshot (placement calls it for every pair, from a worker
        thread: one placement never mixes two snapshots): the path in use where this node is an
        end (relayed or direct, measured), else what either end's record reports, else the
        coordinate estimate; None when nothing is known."""
        snap = self._snap
        view = snap.view
        coords = {m.peer: m.record.coord for m in view if m.record.coord is not None}
        if snap.coord is not None:
            coords[snap.me] = snap.coord

        def rtt(a: str, b: str) -> float | None:
            if snap.me in (a, b):
                other = b if a == snap.me else a
                if other in snap.path_ms:
                    return snap.path_ms[other]
                if other in snap.own:
                    return snap.own[other]
            else:
                for x, y in ((a, b), (b, a)):
                    m = view.get(x)
                    if m is not None and y in m.record.rtts:
                        return m.record.rtts[y]
            ca, cb = coords.get(a), coords.get(b)
            return None if ca is None or cb is None else ca.distance_to(cb) * 1000
        return rtt

    def peer_rtt(self, peer: str) -> tuple[float, str] | None:
        snap = self._snap
        if peer in snap.own:
            return round(snap.own[peer], 2), "measured"
        est = estimator(snap.view, snap.me, snap.coord)(snap.me, peer)
        return None if est is None else (round(est, 2), "estimated")

    def path_row(self, peer: str) -> dict[str, Any]:
        snap = self._snap
        relay = self.paths.path(peer)
        session = self.sessions.row(peer)
        est = estimator(snap.view, snap.me, snap.coord)(snap.me, peer)
        direct = snap.own.get(peer)
        in_use = relay if peer in snap.path_ms else None
        reason = self.paths.reason(peer)  # direct.REASONS: "faster", "no direct path", "symmetric NAT"
        return {"path": "direct" if in_use is None else f"via {short(in_use)} ({reason})", "relay": relay,
                "reason": reason,
                "relay_state": None if session is None else session["state"],
                "path_rtt_ms": _r(snap.path_ms.get(peer, direct)), "direct_rtt_ms": _r(direct),
                "estimate_ms": _r(est)}

    def explain(self, peer: str) -> dict[str, Any]:
        snap = self._snap
        out = self.paths.explain(peer, self._path_view(snap.view, snap.own), now=trio.current_time())
        out["session"] = self.sessions.row(peer)
        out["in_use"] = "direct" if peer not in snap.path_ms else f"via {self.paths.path(peer)}"
        return out

    def status(self) -> dict[str, Any]:
        c = self.client
        relay = {"mode": self.config.relay, "offered": self.server is not None, "off": self.relay_off,
                 "ports": "%d-%d" % self.config.relay_ports, "cap_mbit": self.config.relay_max_mbit}
        if self.server is not None:
            relay.update(self.server.status())
        return {"coordinate": {"vec_ms": [round(x * 1000, 3) for x in c.coordinate.vec],
                               "height_ms": round(c.coordinate.height * 1000, 3),
                               "error": round(c.coordinate.error, 3)},
                "vivaldi": {"updates": c.updates, "rejected": c.rejected, "rejections": dict(c.rejections),
                            "resets": c.resets,
                            "fetched": self.exchange.fetched, "fetch_failed": self.exchange.failed},
                "legs": {"asked": self.exchange.legs_asked, "taken": self.paths.legs_taken,
                         "dropped": self.paths.legs_dropped, "failed": self.exchange.legs_failed,
                         "served": self.exchange.legs_served, "refused": self.exchange.legs_refused},
                "relayed_paths": {p: r for p, r in self.paths.paths().items() if p in self._snap.path_ms},
                "errors": self.errors, "last_error": self._last_error, "unchecked": self.sessions.unchecked,
                "relay_answers_rejected": dict(self.sessions.rejected),
                "relay_unproven_asks": self.sessions.unproven, "relay": relay,
                "direct_echoes": {"sent": self.nudges, "off": self.nudge_off}}


def _r(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 2)
