"""The trio driver of routing: ``Routing``, on ``node.routing``.

It owns three sans-IO cores and feeds them from the daemon:
- coordinates.Client: each RTT our probes measure (gossip's ``Above.rtt_observed``, wired by node.py), with the
  peer's coordinate from its record; our own coordinate goes into our record.
- paths.Paths: once a second (and when a relay session changes) a ``PathView`` built from
  the membership snapshot, our own recent RTTs and the records' reports, and (issue 25) the
  records' wg.nat / wg.reflexive, who is publicly reachable, and which direct paths have shown
  no WireGuard handshake since they were set up (``_shaken``, from Mesh.peer_rows); its ``UsePath``
  actions start or end relay sessions (sessions.py), its ``Measure`` actions are pings, its
  ``AskLegs`` requests on the coordinate exchange (a peer's RTTs to relays). The
  pairs we choose a relay for go into our record (``via``), which the other ends follow.
- relay.Relay (when ``relay = "auto"`` and this host can: root, nftables, the mesh): the
  relay side, served by server.py, its rules kept in the kernel by forwarder.py.
The mesh gets the endpoints of active relayed paths (``Mesh.set_relayed``).

Everyone else reads routing through immutable snapshots (readout.py: ``Snap``, replaced at
each evaluation): ``rtt_function`` (placement, from a worker thread), ``peer_rtt``,
``path_row``, ``explain``, ``status`` (the control API).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import structlog
import trio
from prometheus_client import Counter, Gauge

from ..gossip.membership import State, View
from ..p2p.transport import Transport
from ..gossip.rtts import MAX_RTTS, tag_index
from ..vivaldi import Client, Coordinate
from ..wg.endpoint import split_endpoint
from . import direct, exchange, icmp
from . import request as rq
from .paths import AskLegs, Measure, Paths, PathView, UsePath
from .readout import Readout, Snap, estimator
from .relay import unmap
from .sessions import Sessions

log = structlog.get_logger("swarmd.routing")

EVALUATE_EVERY = 1.0  # seconds between path evaluations (paths.py counts its rounds in them)
WINDOW = 5  # our RTT to a peer: the least of its last WINDOW samples (rises again when a path slows)
MEASURE_TIMEOUT = 2.0
REASSERT_FOR = 10.0  # seconds after a path change its endpoint is written again each evaluation (roaming)
REPORT_CHANGE = 0.2  # a measured RTT this much off what our record says is news worth a record
# A pair whose WireGuard traffic (both directions) exceeds this is busy (paths.py: not moved for
# latency, its RTTs rising with its own queues; sessions.py: lost pings forgiven while its packets
# arrive through the relay): 8 Mbit/s, far above what the mesh carries for an idle pair (keepalives,
# both ends' 1 s echoes: about 0.5 KB/s) or a job's control traffic, and where a transfer starts to
# queue on a WAN link (the lab's case: 40 Mbit/s links).
BUSY_BYTES_PER_S = 1024 * 1024
TRAFFIC_WINDOW = 0.9  # seconds: the least span a rate is computed over (evaluations rerun at once on changes)
CARRIED_FRESH = 1.5  # seconds a reading of where a peer's packets arrive from is good for (sessions tick each 1 s)
# Seconds a proven WireGuard endpoint (Routing.proven) stays good without being proven again: an idle
# peer's packets are its keepalives (reconciler.DEFAULT_KEEPALIVE, 25 s), so a few chances to renew
PROVEN_FOR = 120.0
# A direct path is judged within direct.GRACE_S on its handshakes or the peer's packets arriving,
# but an idle pair sends nothing but keepalives (25 s apart for a member not yet found behind a
# NAT), and after a move back from a relay the session made through it needs no new handshake. So
# each evaluation sends one overlay echo to each peer whose direct path is unproven (its reply, or
# the peer's own echo, is the proof; a first packet makes the handshake), at most this many at once.
NUDGES = 16
NUDGE_TIMEOUT = 1.0


class Routing(Readout):
    def __init__(self, *, gossip: Any, mesh: Any, config: Any, metrics: Any, transport: Transport,
                 refusals: Any = None) -> None:
        self.g = gossip
        self.transport = transport  # what routing's protocols run on
        self._refusals = refusals  # p2p.rejects.Refusals, from node.py; without one gossip's counts (tests)
        self.mesh = mesh
        self.config = config
        self.client = Client(seed=gossip.me)
        self.paths = Paths(gossip.me)
        self.sessions = Sessions(self)
        self.exchange = exchange.Exchange(self)
        self.nursery: trio.Nursery | None = None
        self.server: Any = None  # server.RelayServer while this node relays for others
        self.relay_off: str | None = "starting"  # why this node does not relay, if it does not
        self._samples: dict[str, deque[float]] = {}
        self._snap = Snap(view=gossip.view(), me=gossip.me)
        self._announced: dict[str, str] = {}
        self._relayed: dict[str, str] = {}
        # peer -> (when, rx + tx, rx, endpoint, the mesh's device writes at that reading or None)
        self._traffic: dict[str, tuple[float, int, int, str | None, int | None]] = {}
        self._proven: dict[str, tuple[str, float]] = {}  # peer -> (its proven WireGuard endpoint, when): proven()
        self._carried: dict[str, tuple[str, float]] = {}  # peer -> (the endpoint its packets kept arriving
        # from, when that was read): _read_traffic
        self._busy: frozenset[str] = frozenset()  # peers with heavy traffic now (paths.PathView.busy)
        self._switched: dict[str, float] = {}  # peer -> when its endpoint last changed (relayed or back)
        self._direct_since: dict[str, float] = {}  # peer -> wall time it went back to direct, until proven there
        self._unshaken: frozenset[str] = frozenset()  # peers whose direct path shows no handshake (PathView)
        self._nudging: set[str] = set()  # peers an echo is under way to (_nudge)
        self._nudged: dict[str, float] = {}  # peer -> when it was last sent one
        self.nudges = 0  # counter: echoes sent to unproven direct paths
        self.nudge_off: str | None = None  # why none can be sent here (no raw ICMP socket)
        self._wake = trio.Event()
        self.errors = 0
        self._last_error: str | None = None
        registry = metrics.registry
        self.metrics_pairs = Gauge("swarmd_relay_pairs", "Pairs this node relays for (both ends asked)",
                                   registry=registry)
        self.metrics_switches = Counter("swarmd_path_switches", "Paths moved to a relay or back to direct",
                                        registry=registry)
        Gauge("swarmd_paths_relayed", "Peers this node reaches through a relay", registry=registry
              ).set_function(lambda: len(self._relayed))
        Gauge("swarmd_vivaldi_error", "This node's Vivaldi error estimate", registry=registry
              ).set_function(lambda: self.client.coordinate.error)
        self._reported: dict[str, float] = {}  # our RTTs as our record last carried them

    # --- inputs -------------------------------------------------------------------------

    def recent_rtts(self) -> dict[str, float]:
        """Our own recent RTTs (peer -> ms) for our record."""
        return dict(self._snap.own)

    def rtt_observed(self, peer: str, rtt: float, *, probe: bool = True) -> None:
        """An RTT (seconds) our pings measured to ``peer``."""
        view = self.g.view()
        m = view.get(peer)
        if m is None or not 0 < rtt < 10:
            return
        self._samples.setdefault(peer, deque(maxlen=WINDOW)).append(rtt * 1000)
        now = trio.current_time()
        stale = time.time() - m.record.issued > exchange.FRESH
        if probe and stale and self.nursery is not None and self.exchange.due(peer, now):
            self.nursery.start_soon(self.contained, self.exchange.fetch, peer, rtt)
        elif m.record.coord is not None:
            self.update_coordinate(peer, m.record.coord, rtt)

    def update_coordinate(self, peer: str, coord: Coordinate, rtt: float) -> None:
        self.client.update(peer, coord, rtt)

    def legs_for(self, peers: list[str]) -> dict[str, float]:
        """Our recent RTT (ms) to each of ``peers`` that is a relay (a member offering to relay,
        alive or suspect: what path choice asks about) and that we measured: a member's answer
        to legs asked for. Our RTTs to other members are not answered (nobody maps us with it)."""
        snap = self._snap
        return {p: snap.own[p] for p in peers if p in snap.own and (m := snap.view.get(p)) is not None
                and m.state in (State.ALIVE, State.SUSPECT) and m.record.relay}

    def record_fields(self) -> dict[str, Any]:
        """What our record says about routing: our coordinate, whether we relay, our choices."""
        return {"coord": self.client.coordinate, "relay": self.server is not None, "via": self.paths.announced()}

    def paths_changed(self) -> None:
        self._wake.set()

    def reject(self, reason: str, peer: str, detail: str) -> None:
        """A peer's input routing refuses (exchange.py, server.py): counted under "routing", logged once."""
        (self._refusals or self.g).reject(reason, peer, detail)

    def own_ips(self) -> list[str]:
        info = self.mesh.info() if self.mesh is not None else None
        return [ip for ip in (info.endpoints if info else ()) if "." in ip]

    def in_overlay(self, ip: str) -> bool:
        """``ip`` is inside the mesh's network (a connection over the overlay; relay.unmap'd)."""
        network = getattr(self.mesh, "network", None)
        try:
            return network is not None and ipaddress.ip_address(unmap(ip)) in ipaddress.ip_network(network)
        except (TypeError, ValueError):
            return False

    def overlay_address(self, peer: str) -> str | None:
        m = self.g.view().get(peer)
        return None if m is None or m.record.wg is None else m.record.wg.addr4

    def relay_ip(self, relay: str) -> str | None:
        """The relay's IPv4 address we send its pairs' packets to: the one our libp2p connection
        to it reaches (proven by TCP: a relay cannot point us at another host by listing it
        first), if its record lists it; else the mesh's endpoint for it."""
        listed = set()
        m = self.g.view().get(relay)
        if m is not None and m.record.wg is not None:
            listed = set(m.record.wg.endpoints)
        for ip in self.transport.remote_ips(relay):
            if ip in listed and "." in ip:
                return ip
        return self.direct_ip(relay)

    def direct_ip(self, peer: str) -> str | None:
        ip = self.mesh.direct_ip(peer, 4) if self.mesh is not None else None  # relays are IPv4 only
        return ip if ip is not None and "." in ip else None

    # --- lifecycle ----------------------------------------------------------------------

    async def run(self) -> None:
        self.transport.serve(exchange.PROTOCOL, self.exchange.handle, reject=self.reject)
        await self.g.joined.wait()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            nursery.start_soon(self.sessions.run)
            nursery.start_soon(self.contained, self._start_relay, nursery)
            while True:
                with trio.move_on_after(EVALUATE_EVERY):
                    await self._wake.wait()
                self._wake = trio.Event()
                await self.contained(self._evaluate, nursery)

    async def contained(self, fn: Callable[..., Any], *args: Any) -> None:
        """Routing is an optimisation: a bug or a failing backend in it must never take the
        daemon (and its jobs) down. Logged once per distinct error, counted, and tried again
        at the next evaluation."""
        try:
            await fn(*args)
        except Exception as exc:
            self.errors += 1
            text = f"{exc.__class__.__name__}: {exc}"
            if text != self._last_error:
                self._last_error = text
                log.exception("routing step failed; the daemon goes on", step=fn.__name__, error=text)

    async def _start_relay(self, nursery: trio.Nursery) -> None:
        why = self._relay_unavailable()
        if why is None:
            while not self.mesh.started:
                await trio.sleep(0.5)
            from .forwarder import Forwarder
            from .nft import table_name
            from .relay import Relay
            from .server import RelayServer

            forwarder = Forwarder(table_name(self.mesh.interface), cap_bytes_per_s=self.config.relay_max_mbit * 125_000,
                                  ports=self.config.relay_ports)
            try:
                await forwarder.start()
            except Exception as exc:
                why = f"cannot install forwarding rules ({exc.__class__.__name__}: {exc})"
                await self._quietly(forwarder.close)  # the table may be in already
        if why is not None:
            self.relay_off = why
            log.info("not relaying for others", why=why)
            await self._clean_leftovers()
            return
        relay = Relay(self.g.me, is_member=self._alive_member, addresses=self.own_ips(),
                      exclude=(str(self.mesh.network),), ports=self.config.relay_ports)
        self.server = RelayServer(self, relay, forwarder)
        self.transport.serve(rq.PROTOCOL, self.server.handle, reject=self.reject)
        self.relay_off = None
        self.g.readvertise()
        log.info("relaying for members", ports="%d-%d" % self.config.relay_ports, cap_mbit=self.config.relay_max_mbit)
        nursery.start_soon(self.contained, self.server.run)

    async def _clean_leftovers(self) -> None:
        """A crashed run's relay table (and the ip_forward it turned on) when this one does not relay."""
        if self.mesh is None or os.geteuid() != 0 or shutil.which("nft") is None:
            return
        from .forwarder import Forwarder
        from .nft import table_name

        await self._quietly(Forwarder(table_name(self.mesh.interface), cap_bytes_per_s=125_000,
                                      ports=self.config.relay_ports).close)

    @staticmethod
    async def _quietly(fn: Callable[[], Any]) -> None:
        try:
            await fn()
        except Exception as exc:
            log.warning("relay clean-up failed", error=f"{exc.__class__.__name__}: {exc}")

    def _relay_unavailable(self) -> str | None:
        if self.config.relay == "off":
            return "off in the configuration"
        if self.mesh is None:
            return "the WireGuard mesh is off"
        if os.geteuid() != 0:
            return "needs root to install nftables rules"
        if shutil.which("nft") is None:
            return "nft (Debian package nftables) is not installed"
        return None

    def _alive_member(self, peer: str) -> bool:
        # suspect counts (server.IN_SERVICE): anyone can make a member suspect for a moment
        m = self.g.view().get(peer)
        return m is not None and m.state in (State.ALIVE, State.SUSPECT) and self.g.is_member(peer)

    # --- the evaluation -----------------------------------------------------------------

    def _path_view(self, view: View, own: Mapping[str, float]) -> PathView:
        targets = self.mesh.peers() if self.mesh is not None else set()
        # a suspect member keeps its paths (anyone can accuse for a moment; our own pings of a relay
        # decide whether it is gone, and membership removes a dead one from the mesh)
        peers = frozenset(m.peer for m in view if m.state in (State.ALIVE, State.SUSPECT) and m.peer in targets)
        relays = frozenset(p for p in peers if view.get(p).record.relay)
        info = self.mesh.info() if self.mesh is not None else None
        mine = (getattr(info, "nat", None), getattr(info, "reflexive", None))

        def reach(peer: str) -> tuple[str | None, str | None]:
            if peer == self.g.me:
                return mine
            m = view.get(peer)
            wg = m.record.wg if m is not None else None
            return (None, None) if wg is None else (getattr(wg, "nat", None), getattr(wg, "reflexive", None))

        def public(peer: str) -> bool:
            """Anyone can reach it unasked: measured public, or not measured (an older node, or
            too few observers yet) and announcing addresses."""
            nat = reach(peer)[0]
            return nat == "public" or (nat is None and bool(getattr(view.get(peer).record, "addrs", ())))

        names = tag_index((self.g.me, *peers))  # a record's RTTs name members by tag (gossip/rtts.py)

        def reports(peer: str) -> Mapping[str, float]:
            m = view.get(peer)
            return m.record.rtts.named(names) if m is not None else {}

        def announced(peer: str) -> str | None:
            m = view.get(peer)
            return m.record.via.get(self.g.me) if m is not None else None

        return PathView(me=self.g.me, peers=peers, relays=relays, own=own, reports=reports,
                        estimate=estimator(view, self.g.me, self.client.coordinate), announced=announced,
                        failing=self.sessions.failing(), refused=self.sessions.refused(), busy=self._busy,
                        reach=reach, public=frozenset(p for p in relays if public(p)),
                        unshaken=self._unshaken & peers,
                        target=getattr(self.mesh, "direct_endpoint", lambda peer: None))

    async def _read_traffic(self) -> None:
        """From the mesh's WireGuard counters, over at least ``TRAFFIC_WINDOW`` seconds (an
        evaluation rerun a moment after a change keeps the last results; a failed read keeps
        ``_busy`` and drops ``_carried``):
        - ``_busy``: the peers whose bytes (rx + tx) grew faster than ``BUSY_BYTES_PER_S``;
        - ``_carried``: peer -> the endpoint its packets kept arriving from (rx grew, the endpoint
          the same at both readings: WireGuard counts, and takes as the peer's endpoint, only
          packets that authenticate, so only the peer's own packets, held back or not, move them).
        - ``_proven``: the same, when moreover no write of ours of this peer (``Mesh.writes`` as it
          was last written, the row's ``written``) started from the first reading to the second
          (and no write at all overlapped a reading): the endpoint read is then where the peer's
          last authenticated packet came from, not one we wrote from its record (its claim); or at
          once when WireGuard moved the endpoint away from the one we wrote (``roamed``). Kept
          ``PROVEN_FOR`` seconds, until proven again or elsewhere.
        Counters that went backwards (the backend restarted) start a new baseline."""
        now = trio.current_time()
        writes = getattr(self.mesh, "writes", None)
        try:
            rows = await self.mesh.peer_rows() if self.mesh is not None else []
        except Exception:  # the backend restarting: the pairs stay as busy as they were
            self._carried = {}
            return
        if writes is None or getattr(self.mesh, "writes", None) != writes:
            writes = None  # a write overlapped the reading: it proves nothing
        self._proven = {p: found for p, found in self._proven.items() if now - found[1] <= PROVEN_FOR}
        seen, busy, carried, unshaken, wall = {}, set(), {}, set(), time.time()
        for row in rows:
            peer, rx, endpoint = row.get("peer"), row.get("rx_bytes", 0), row.get("endpoint")
            if peer is None:
                continue
            total = rx + row.get("tx_bytes", 0)
            last = self._traffic.get(peer)
            if not self._shaken(peer, row, last, wall):
                unshaken.add(peer)
            if last is not None and now - last[0] < TRAFFIC_WINDOW:  # too short a window to judge a rate
                seen[peer] = last
                if peer in self._busy:
                    busy.add(peer)
                if peer in self._carried:
                    carried[peer] = self._carried[peer]
                continue
            seen[peer] = (now, total, rx, endpoint, writes)
            if row.get("roamed") and endpoint is not None:
                self._proven[peer] = (endpoint, now)  # WireGuard moved it: an authenticated packet came from there
            if last is None or total < last[1] or rx < last[2]:
                continue
            if (total - last[1]) / (now - last[0]) > BUSY_BYTES_PER_S:
                busy.add(peer)
            if rx > last[2] and endpoint is not None and endpoint == last[3]:
                carried[peer] = (endpoint, now)
                if writes is not None and last[4] is not None and row.get("written", writes) <= last[4]:
                    self._proven[peer] = (endpoint, now)  # no write of this peer's since the first reading
        self._traffic, self._busy, self._carried = seen, frozenset(busy), carried
        self._unshaken = frozenset(unshaken)
        self._direct_since = {p: t for p, t in self._direct_since.items() if p in seen}

    def _nudge(self, nursery: trio.Nursery) -> None:
        """One overlay echo to each peer whose direct path is unproven (``NUDGES``, the longest
        unnudged first; none to a peer one is still under way to)."""
        if self.nudge_off is not None:
            return
        self._nudged = {p: t for p, t in self._nudged.items() if p in self._traffic}
        due = sorted((p for p in self._unshaken if p not in self._relayed and p not in self._nudging),
                     key=lambda p: self._nudged.get(p, float("-inf")))
        for peer in due[:max(0, NUDGES - len(self._nudging))]:
            address = self.overlay_address(peer)
            if address is not None:
                self._nudging.add(peer)
                self._nudged[peer] = trio.current_time()
                nursery.start_soon(self.contained, self._nudge_one, peer, address)

    async def _nudge_one(self, peer: str, address: str) -> None:
        try:
            self.nudges += 1
            await icmp.echo(address, NUDGE_TIMEOUT)
        except icmp.Unavailable as exc:  # then handshakes come with traffic and keepalives alone
            self.nudge_off = str(exc)
        finally:
            self._nudging.discard(peer)

    def _shaken(self, peer: str, row: Mapping[str, Any], last: tuple | None, wall: float) -> bool:
        """``peer``'s direct WireGuard path has shown that it works since it was set up
        (direct.shaken); a relayed one is not judged: True. After a move back from a relay
        (``_direct_since``) its packets arriving at its direct or reflexive endpoint count too
        (WireGuard counts, and roams to, authenticated packets only; a session made through the
        relay is kept across the move, so its handshake proves nothing of the direct path), or at
        the endpoint WireGuard roamed to when that is no other member's: a NATed member not yet
        measured announces only its private addresses, and its packets come from its NAT's."""
        if peer in self._relayed:
            return True
        since = self._direct_since.get(peer)
        arrived = last is not None and row.get("rx_bytes", 0) > last[2] and row.get("endpoint") == last[3] \
            and bool(row.get("direct") or row.get("reflexive") or (row.get("roamed") and not row.get("elsewhere")))
        if not direct.shaken(row, since=since, wall=wall, arrived=arrived):
            return False
        self._direct_since.pop(peer, None)
        return True

    def proven(self, peer: str) -> tuple[str, int] | None:
        """(IP, port) ``peer``'s WireGuard packets were last proven to come from (``_proven``):
        its WireGuard socket, or the NAT mapping in front of it, the one place the relay may
        aim a pair's packets at (server.py). None when not proven within ``PROVEN_FOR``."""
        found = self._proven.get(peer)
        if found is None or trio.current_time() - found[1] > PROVEN_FOR:
            return None
        try:
            return split_endpoint(found[0])
        except ValueError:
            return None

    async def proven_now(self, peer: str) -> tuple[str, int] | None:
        """``proven``, else what our device shows of ``peer`` now when that is proven there
        (``Mesh.observed_endpoint``: roamed from what we wrote, a handshake since our last write
        of it, or bytes since a reading after it): a NATed member's endpoint, equal to the one
        written from its record and its keepalive 25 s apart, would otherwise wait up to a minute
        for two traffic readings before a relay forwards for it."""
        found = self.proven(peer)
        if found is not None or self.mesh is None:
            return found
        try:
            endpoint = await self.mesh.observed_endpoint(peer)
            return None if endpoint is None else split_endpoint(endpoint)
        except Exception:  # the backend restarting, or a malformed endpoint: not proven
            return None

    def carried(self, peer: str) -> str | None:
        """The endpoint ``peer``'s WireGuard packets kept arriving from in the last reading, if
        that reading is fresh (within ``CARRIED_FRESH``) and the pair is busy (sessions.py
        forgives a lost ping or echo only then: an idle pair's own echoes would always make it
        look carried)."""
        found = self._carried.get(peer)
        if found is None or peer not in self._busy or trio.current_time() - found[1] > CARRIED_FRESH:
            return None
        return found[0]

    async def _evaluate(self, nursery: trio.Nursery) -> None:
        view = self.g.view()
        for peer in [p for p in self._samples if p not in view]:
            del self._samples[peer]
            self.client.forget(peer)
            self.exchange.forget(peer)
        own = {p: min(s) for p, s in self._samples.items()}
        await self._read_traffic()
        self._nudge(nursery)
        pv = self._path_view(view, own)
        for action in self.paths.evaluate(trio.current_time(), pv):
            match action:
                case UsePath(peer=peer, relay=relay):
                    log.info("path changes", peer=peer, path="direct" if relay is None else f"via {relay}")
                    self.metrics_switches.inc()
                    self.sessions.use(peer, relay)
                case Measure(peers=peers):
                    for peer in peers:
                        nursery.start_soon(self.contained, self._measure, peer)
                case AskLegs(peer=peer, relays=relays):
                    nursery.start_soon(self.contained, self.exchange.ask_legs, peer, relays)
        for peer, what in self.paths.direct.take_changes():
            row = self.paths.direct.row(trio.current_time(), peer)
            log.info("direct path", peer=peer, now=what, reason=row["reason"], failures=row["failures"],
                     retry_in_s=row["retry_in_s"], nat_here=row["nat_here"], nat_peer=row["nat_peer"])
        if self.server is not None:
            self.server.view_changed()
        if (announced := self.paths.announced()) != self._announced or self._report_due(own):
            self._announced = announced
            self._reported = dict(own)
            self.g.readvertise()
        relayed = {p: e for p, e in self.sessions.endpoints().items() if self.paths.path(p) is not None}
        now = trio.current_time()
        if relayed != self._relayed and self.mesh is not None:
            await self.mesh.set_relayed(relayed)  # raises while the backend is down: tried again next round
            for peer in set(relayed) ^ set(self._relayed) | {p for p in relayed if self._relayed.get(p) != relayed[p]}:
                self._switched[peer] = now
            for peer in set(self._relayed) - set(relayed):
                self._direct_since[peer] = time.time()  # direct again: judged on handshakes after this
            self._relayed = relayed
        self._switched = {p: t for p, t in self._switched.items() if now - t < REASSERT_FOR}
        if self._switched and self.mesh is not None:
            await self.mesh.reassert(self._switched)
        path_ms = {}
        for peer, relay in self.paths.paths().items():
            if peer not in relayed:
                continue
            echoed = (self.sessions.row(peer) or {}).get("path_rtt_ms")
            if echoed is not None:  # through the relay, end to end
                path_ms[peer] = echoed
            elif (leg := self.paths.leg(relay, peer, pv)) is not None and relay in own:
                path_ms[peer] = own[relay] + leg
        self._snap = Snap(view=view, me=self.g.me, own=own, coord=self.client.coordinate, path_ms=path_ms)

    def _report_due(self, own: Mapping[str, float]) -> bool:
        """Our record's RTTs are others' legs (paths.py): re-advertise when a member is measured
        for the first time or an RTT moved by more than REPORT_CHANGE (the core rate-limits)."""
        for peer, ms in sorted(own.items(), key=lambda kv: kv[1])[:MAX_RTTS]:  # what the record carries
            old = self._reported.get(peer)
            if old is None or abs(ms - old) > REPORT_CHANGE * old + 1.0:
                return True
        return False

    async def _measure(self, peer: str) -> None:
        rtt = await self.g.ping(peer, MEASURE_TIMEOUT)
        if rtt is not None:
            self.rtt_observed(peer, rtt, probe=False)
