"""The mesh driver: keeps this node's WireGuard interface in step with the membership view.

Inputs: the gossip view (woken by ``Gossip.view_changed``, and a periodic tick), endpoint
RTT measurements, and the device's own state read back through the backend. Outputs: the
backend calls that the sans-IO ``Reconciler`` asks for, and this node's ``MeshInfo`` in its
record. When this node's certificate names an overlay address (the owner allocated it), that
is the address, always. Otherwise (an older certificate) the address follows ``address.choose``
the first time and is kept after that (in the state directory, across restarts and key
rotations); only when a member with precedence claims it (a lower key, or a certificate that
names it) do we move to our next free candidate and re-advertise. A member whose certificate
names no address never displaces one whose certificate does: it is left out of the mesh
while it claims such an address. The record carries a proof that we hold our key.
"""

from __future__ import annotations

import ipaddress
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import structlog
import trio
from multiaddr import Multiaddr

from ..atomic import write_atomically
from ..gossip.membership import State
from ..gossip.wire import MeshInfo, wg_proof_message
from ..wg import address, choose, keys, reach
from ..wg.backend import Backend, BackendUnavailable
from ..wg.reconciler import DEFAULT_KEEPALIVE, Member, ProbeEndpoints, Reconciler, RemovePeer, SetPeer
from ..wg.uapi import PeerConfig

log = structlog.get_logger("swarmd.wg")

CAP_NET_ADMIN = 12  # linux/capability.h
ADDR_FILE = "wg.addr"
TICK = 1.0  # the view is also re-read this often: records can change without a state change
RESYNC = 10.0  # the device is read back and repaired this often
PROBE_TIMEOUT = 2.0
# Two peers that add each other at the same moment both send a handshake initiation; each
# consumes the other's, neither can complete its own, and WireGuard retries only after
# REKEY_TIMEOUT (5 s; measured: half the new pairs in a lab took 5 s to connect). So for a
# new peer only the side with the lower public key starts at once; the other turns its
# keepalive (which is what sends the first initiation) on this much later.
KEEPALIVE_DEFER = 1.0
NAT_KEEPALIVE = 5  # seconds, when members found us behind a NAT or a firewall (else the reconciler's 25)
BEHIND = ("eim", "edm", "firewall")


def from_config(config: Any, gossip: Any) -> tuple[Mesh | None, str | None]:
    """The mesh the config asks for, or (None, why not).

    ``auto`` gives way quietly where interfaces cannot be made (no root or CAP_NET_ADMIN: a
    developer's laptop, a test); a backend asked for by name, or a privileged ``auto`` with no
    backend at all, is an error at start (BackendUnavailable), never a failure later.
    """
    if config.mesh == "off":
        return None, "off in the configuration"
    if not can_admin_network():
        why = "needs root or CAP_NET_ADMIN to create the WireGuard interface"
        if config.mesh == "auto":
            return None, why
        raise BackendUnavailable(f"mesh = {config.mesh!r} {why}; run swarmd as root (the systemd unit does) "
                                 "or set mesh = \"off\"")
    backend = choose(config.mesh, config.mesh_interface)
    return Mesh(backend=backend, gossip=gossip, state_dir=config.state_dir, interface=config.mesh_interface,
                network=config.mesh_network, port=config.mesh_port, mtu=config.mesh_mtu), None


def can_admin_network() -> bool:
    if os.geteuid() == 0:
        return True
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
    except OSError:
        pass
    return False


class Mesh:
    def __init__(self, *, backend: Backend, gossip: Any, state_dir: Path, interface: str, network: str,
                 port: int, mtu: int) -> None:
        self.backend = backend
        self.gossip = gossip
        self.state_dir = state_dir
        self.interface = interface
        self.network = ipaddress.IPv4Network(network)
        self.port = port
        self.mtu = mtu
        self.keys = keys.load_or_create(state_dir)
        self.addr4: ipaddress.IPv4Address | None = None
        self.addr6: ipaddress.IPv6Address | None = None
        self.reconciler = Reconciler(self.keys.public)
        self.started = False
        self.error: str | None = None  # the last failure of the backend, shown in status
        self.readdressed = 0
        self._members: dict[str, Member] = {}
        self._relayed: dict[str, str] = {}  # routing's: peer -> relay endpoint
        self.writes = 0  # grows when a write of peers to the device starts and when it ends (_set_peers)
        self._configured: set[bytes] = set()  # peers set on the device since it started
        self._proof: tuple[bytes, bytes] | None = None  # (our key, its proof)
        self._warned_network = False
        # how this node is reached (wg/reach.Verdict), from the reach driver; None: not measured
        self.reach: Callable[[], Any] | None = None
        self.reject: Callable[[str, str, str], None] | None = None  # reach's refusals (node.py wires it)
        self.tcp_port: int | None = None  # libp2p's TCP port, dialled at our overlay address when we are NATed
        self._written_at: dict[bytes, float] = {}  # peer key -> wall time we last wrote its config
        self._rx_base: dict[bytes, tuple[float, int]] = {}  # peer key -> (when, rx bytes) read after a write
        # peer key -> (``writes`` as its last write started, the endpoint written): routing proves
        # an endpoint per peer (a write to another peer proves nothing about this one)
        self._written: dict[bytes, tuple[int, str | None]] = {}
        self._attested: dict[tuple[str, str, tuple[bytes, ...]], tuple[bool, float]] = {}  # confirmed() cache

    # --- what the record says -----------------------------------------------------------

    def advertised(self) -> MeshInfo | None:
        """What this node's record says of the mesh: its MeshInfo while the interface is up."""
        return self.info() if self.started else None

    def info(self) -> MeshInfo | None:
        if self.addr4 is None:
            return None
        if self._proof is None or self._proof[0] != self.keys.public:
            message = wg_proof_message(self.gossip.swarm.swarm, self.gossip.me, self.keys.public)
            self._proof = (self.keys.public, keys.prove(self.keys.private, message))
        verdict = self.reach() if self.reach is not None else None
        kind = verdict.kind if verdict is not None and verdict.kind in reach.KINDS else None
        behind = kind not in (None, "public")
        return MeshInfo(public=self.keys.public, addr4=str(self.addr4), addr6=str(self.addr6), port=self.port,
                        endpoints=tuple(self._underlay_ips()), proof=self._proof[1], nat=kind,
                        reflexive=verdict.reflexive if behind else None, seen=verdict.seen if behind else (),
                        tcp=self.tcp_port if behind else None)

    def _cert_addr4(self) -> ipaddress.IPv4Address | None:
        """The address our certificate names, if any. It is used even outside the configured
        network (the owner allocated it from its own: a record with any other address is
        refused by every member), with a warning that the two configurations differ."""
        swarm = self.gossip.swarm
        addr = swarm.cert.addr4 if swarm is not None else None
        if addr is None:
            return None
        addr = ipaddress.IPv4Address(addr)
        if addr not in self.network and not self._warned_network:
            self._warned_network = True
            log.warning("the certificate's overlay address is outside the configured mesh_network: the owner's "
                        "differs from this node's", address=str(addr), network=str(self.network))
        return addr

    def _underlay_ips(self) -> list[str]:
        ips = []
        for addr in self.gossip.addrs():
            for proto in ("ip4", "ip6"):
                try:
                    ip = Multiaddr(addr).value_for_protocol(proto)
                except Exception:
                    continue
                if ip and ip not in ips:
                    ips.append(ip)
        return ips

    # --- lifecycle ----------------------------------------------------------------------

    async def run(self) -> None:
        await self.gossip.joined.wait()
        swarm = self.gossip.swarm.swarm
        self.addr6 = address.ula(swarm, self.gossip.me.encode())  # the identity's: survives key rotation
        kept = self._saved_addr4()
        bound = self._cert_addr4()
        if bound is not None:
            self._set_addr4(bound)
        elif kept is not None and not address.conflicts(self.keys.public, kept, self._claims(), self._bound()):
            self.addr4 = kept
        else:
            self._set_addr4(address.choose(swarm, self.keys.public, self._claims(), self.network, self._bound()))
        self.reconciler = Reconciler(self.keys.public)  # a new device has no peers yet
        self.reconciler.set_relayed(self._relayed)  # routing's relayed paths outlive a restart of the mesh
        self._configured: set[bytes] = set()
        await self.backend.start(private_key=self.keys.private, listen_port=self.port,
                                 addresses=self._cidrs(), mtu=self.mtu)
        self.started, self.error = True, None
        self.gossip.readvertise()
        log.info("mesh up", interface=self.interface, backend=self.backend.name, address=str(self.addr4),
                 address6=str(self.addr6), public_key=self.keys.public_b64)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.backend.supervise, self._backend_restarted)
            nursery.start_soon(self._resync_loop)
            while True:
                with trio.move_on_after(TICK):
                    await self.gossip.view_changed.wait()
                await self._reconcile(nursery)

    async def close(self) -> None:
        """Remove the interface (and, for wireguard-go, its process and UAPI socket)."""
        was_up, self.started = self.started, False
        with trio.CancelScope(shield=True):
            await self.backend.close()
        if was_up:
            log.info("mesh down", interface=self.interface)

    def _saved_addr4(self) -> ipaddress.IPv4Address | None:
        """The address this node last held, if it is in the configured network: a node keeps
        its address across restarts and key rotations unless a member with precedence claims it."""
        try:
            addr = ipaddress.IPv4Address((self.state_dir / ADDR_FILE).read_text().strip())
        except (OSError, ValueError):
            return None
        return addr if addr in self.network and addr not in (self.network.network_address,
                                                              self.network.broadcast_address) else None

    def _set_addr4(self, addr: ipaddress.IPv4Address) -> None:
        self.addr4 = addr
        write_atomically(self.state_dir / ADDR_FILE, f"{addr}\n".encode(), mode=0o644)

    def _cidrs(self) -> list[str]:
        return [f"{self.addr4}/{self.network.prefixlen}", f"{self.addr6}/64"]

    # --- reconciling --------------------------------------------------------------------

    def _view(self) -> list[tuple[str, MeshInfo]]:
        """Members in service (up, their record within its ttl) that advertise a mesh side."""
        return [(m.peer, m.record.wg) for m in self.gossip.view() if m.in_service and m.record.wg is not None]

    def _claims(self) -> dict[bytes, ipaddress.IPv4Address]:
        return {wg.public: ipaddress.IPv4Address(wg.addr4) for _, wg, _ in self._bound_view()}

    def _bound_view(self) -> list[tuple[str, MeshInfo, bool]]:
        """(peer, mesh info, whether its certificate names its address); a member that claims an
        address another's certificate names is left out (the certificate wins)."""
        certs = self._cert_addrs()
        mine = self._cert_addr4()
        named = set(certs.values()) | ({str(mine)} if mine is not None else set())
        view = []
        for peer, wg in self._view():
            bound = certs.get(peer) == wg.addr4
            if not bound and wg.addr4 in named:
                continue
            view.append((peer, wg, bound))
        return view

    def _cert_addrs(self) -> dict[str, str]:
        return {m.peer: m.record.cert.addr4 for m in self.gossip.view()
                if m.state in (State.ALIVE, State.SUSPECT) and getattr(m.record.cert, "addr4", None)}

    def _bound(self) -> set[ipaddress.IPv4Address]:
        """Addresses other members' certificates name: never ours to take (unless ours names it)."""
        return {ipaddress.IPv4Address(a) for a in self._cert_addrs().values()}

    async def _reconcile(self, nursery: trio.Nursery) -> None:
        swarm = self.gossip.swarm.swarm
        claims = self._claims()
        bound = self._cert_addr4()
        if bound is not None and bound != self.addr4:  # a renewal gave us an address
            wanted: ipaddress.IPv4Address | None = bound
        elif bound is None and self.addr4 is not None and address.conflicts(
                self.keys.public, self.addr4, claims, self._bound()):
            wanted = address.choose(swarm, self.keys.public, claims, self.network, self._bound())
        else:
            wanted = None
        if wanted is not None:
            log.warning("overlay address changes", old=str(self.addr4), new=str(wanted),
                        why="the certificate names it" if bound else "taken by a member with precedence")
            self._set_addr4(wanted)
            self.readdressed += 1
            await self.backend.set_addresses(self._cidrs())
            self.gossip.readvertise()
        members = [Member(peer=peer, public=wg.public, addr4=wg.addr4, addr6=wg.addr6, port=wg.port,
                          endpoints=wg.endpoints, reflexive=self._reflexive(peer, wg))
                   for peer, wg, _ in self._bound_view() if wg.public != self.keys.public]
        self._members = {m.peer: m for m in members}
        verdict = self.reach() if self.reach is not None else None
        # behind a NAT or a firewall our keepalives hold the mappings open and are how a peer
        # that cannot send to us first learns where we are: well under the 30 s an unreplied
        # UDP mapping lasts (Linux, most home routers), and well under routing's 10 s grace for a direct
        # path (a symmetric NAT's peer cannot send first: it waits for our packets to roam to us)
        self.reconciler.keepalive = NAT_KEEPALIVE if verdict is not None and verdict.kind in BEHIND \
            else DEFAULT_KEEPALIVE
        await self._perform(self.reconciler.update_view(time.monotonic(), members), nursery)

    def _reflexive(self, peer: str, wg: MeshInfo) -> str | None:
        """The endpoint we send a NATed member's direct packets to: its attested reflexive one. A
        symmetric NAT's port is the one its last observers saw (a new one every reach round) and
        only a first hint for us: its packets roam our device to its port for us. While the IP
        stays, the endpoint stays, so the device is not rewritten away from the port that works."""
        reflexive = self._attested_reflexive(peer, wg)
        before = self._members.get(peer)
        if reflexive is not None and wg.nat == "edm" and before is not None and before.reflexive is not None \
                and before.reflexive.rsplit(":", 1)[0] == reflexive.rsplit(":", 1)[0]:
            return before.reflexive
        return reflexive

    def _attested_reflexive(self, peer: str, wg: MeshInfo) -> str | None:
        """A member's reflexive endpoint, if two other members attest it (reach.confirmed): only
        then do we send its WireGuard handshakes there. Checked once per (member, endpoint,
        attestations) for 30 s, a refusal for 5 s."""
        if wg.reflexive is None:
            return None
        now = time.time()
        key = (peer, wg.reflexive, wg.seen)
        cached = self._attested.get(key)
        if cached is not None and now < cached[1]:
            return wg.reflexive if cached[0] else None
        members = {m.peer for m in self.gossip.view() if m.state in (State.ALIVE, State.SUSPECT)} | {self.gossip.me}
        ok = reach.confirmed(wg.seen, wg.reflexive, swarm=self.gossip.swarm.swarm, about=peer, wgpub=wg.public,
                             now=now, is_member=members.__contains__)
        if len(self._attested) > 4 * max(64, len(members)):
            self._attested.clear()
        # a refusal is checked again soon: at start-up the attesting members may not be in our view yet
        self._attested[key] = (ok, now + (30.0 if ok else 5.0))
        if not ok and cached is None and self.reject is not None:  # counted and logged there, once
            self.reject("unattested", peer, f"reflexive endpoint {wg.reflexive} not attested by two members: "
                                            "not sent to")
        return wg.reflexive if ok else None

    async def observed_endpoint(self, peer: str) -> str | None:
        """Where ``peer``'s WireGuard packets come from, as our device authenticated them: its
        endpoint read back, when a handshake with it completed after we last wrote its config
        or bytes from it arrived since a reading taken after that write (before either, the
        endpoint may be the one we wrote from its record: its claim). None while the pair is
        relayed, or the endpoint is at another member's address (a relay's): what the reach
        protocol attests must be the peer's own mapping."""
        m = self._members.get(peer)
        if m is None or not self.started or peer in self._relayed:
            return None  # relayed: its packets come from the relay's address, not the peer's
        state = await self.backend.state()
        p = state.peers.get(m.public)
        if p is None or p.endpoint is None or self._at_another_member(peer, p.endpoint):
            return None
        written = self._written_at.get(m.public, 0.0)
        if self._roamed(m.public, p.endpoint) or (p.last_handshake and p.last_handshake > written):
            return p.endpoint
        # No handshake since: packets of the session that authenticate after our write move
        # the endpoint too (WireGuard roams on each), so bytes received since a reading taken
        # after the write prove it as well (its keepalive, every 25 s, at the latest).
        base = self._rx_base.get(m.public)
        if base is None or base[0] <= written:
            self._rx_base[m.public] = (time.time(), p.rx_bytes)
            return None
        return p.endpoint if p.rx_bytes > base[1] else None

    def _at_another_member(self, peer: str, endpoint: str) -> bool:
        """``endpoint`` is at an address another member announces: a relay's (the peer's end just
        moved onto it, roaming us there before our own move), never the peer's own. (Members behind
        one NAT share its address, but announce none: only public members announce endpoints.)"""
        ip = endpoint.rsplit(":", 1)[0].strip("[]")
        return any(other != peer and ip in m.endpoints for other, m in self._members.items())

    def _roamed(self, public: bytes, endpoint: str | None) -> bool:
        """The device holds an endpoint for this peer other than the one we last wrote: WireGuard
        moved it there, which it does only on a packet that authenticated as the peer's."""
        written = self._written.get(public)
        return written is not None and endpoint is not None and written[1] != endpoint

    async def _perform(self, actions: Iterable[Any], nursery: trio.Nursery) -> None:
        configs = []
        for action in actions:
            match action:
                case SetPeer(spec):
                    first_time = spec.public not in self._configured
                    self._configured.add(spec.public)
                    if first_time and spec.keepalive and spec.public < self.keys.public:
                        configs.append(_config(spec, keepalive=0))
                        nursery.start_soon(self._keepalive_later, spec)
                    else:
                        configs.append(_config(spec))
                case RemovePeer(public):
                    self._configured.discard(public)
                    self._written_at.pop(public, None)
                    self._rx_base.pop(public, None)
                    self._written.pop(public, None)
                    configs.append(PeerConfig(public=public, remove=True))
                case ProbeEndpoints(peer, endpoints):
                    nursery.start_soon(self._probe_endpoints, peer, endpoints, nursery)
        if configs:
            await self._set_peers(configs)

    async def _set_peers(self, configs: list[PeerConfig]) -> None:
        """Every write of peers to the device goes through here, counted in ``writes`` as it
        starts and as it ends: a peer's endpoint read back is where its last authenticated
        packet came from only if no write of ours (an endpoint from a record, which a member
        chose) happened since (routing's proven endpoints, relay.py)."""
        self.writes += 1
        now = time.time()
        for config in configs:
            self._written_at[config.public] = now
            self._written[config.public] = (self.writes, config.endpoint)
        try:
            await self.backend.set_peers(configs)
        finally:
            self.writes += 1

    async def set_relayed(self, relayed: dict[str, str]) -> None:
        """Routing's relayed paths: peer -> the relay endpoint ("IP:port") its packets go to;
        every peer not named goes back to its own endpoint."""
        self._relayed = dict(relayed)
        if not self.started:
            return
        actions = self.reconciler.set_relayed(relayed)
        configs = [_config(a.spec) for a in actions if isinstance(a, SetPeer)]
        if configs:
            await self._set_peers(configs)

    async def reassert(self, peers: Iterable[str]) -> None:
        """Write these peers' endpoints to the device again, as the reconciler has them: WireGuard
        roams a peer's endpoint to wherever its last packet came from, and just after a path
        change the other end may still send the old way (routing calls this for a few seconds)."""
        if not self.started:
            return
        wanted = {m.public for p in peers if (m := self._members.get(p)) is not None}
        if not wanted:
            return
        device = (await self.backend.state()).peers
        relayed = {m.public for p, m in self._members.items() if p in self._relayed}
        configs = [_config(spec) for public, spec in self.reconciler.current.items()
                   if public in wanted and not _arrived_there(spec.endpoint, device.get(public), public in relayed)]
        if configs:
            await self._set_peers(configs)

    def peers(self) -> set[str]:
        """The members this node's WireGuard device has as peers."""
        return set(self._members)

    def direct_endpoint(self, peer: str) -> str | None:
        """The endpoint ("IP:port") ``peer``'s packets go to when not relayed (Reconciler.direct_endpoint)."""
        return self.reconciler.direct_endpoint(peer)

    def direct_ip(self, peer: str, version: int | None = None) -> str | None:
        """The underlay IP we reach ``peer``'s WireGuard at directly (never a relay's), of ``version``
        if given (Reconciler.direct_ip)."""
        return self.reconciler.direct_ip(peer, version)

    async def _keepalive_later(self, spec: Any) -> None:
        await trio.sleep(KEEPALIVE_DEFER)
        current = self.reconciler.current.get(spec.public)
        if current is not None and self.started:
            await self._set_peers([_config(current)])

    async def _probe_endpoints(self, peer: str, endpoints: tuple[str, ...], nursery: trio.Nursery) -> None:
        """RTT to each candidate endpoint: a TCP connect to the member's libp2p port on that IP
        (WireGuard itself answers nothing to a stranger, by design)."""
        m = self.gossip.view().get(peer)
        ports = {}
        for addr in (m.record.addrs if m else ()):
            try:
                ma = Multiaddr(addr)
                ip = ma.value_for_protocol("ip4") if "/ip4/" in addr else ma.value_for_protocol("ip6")
                ports[ip] = int(ma.value_for_protocol("tcp"))
            except Exception:
                continue
        for ip in endpoints:
            rtt = None
            if ip in ports:
                with trio.move_on_after(PROBE_TIMEOUT):
                    t0 = time.monotonic()
                    try:
                        stream = await trio.open_tcp_stream(ip, ports[ip])
                        rtt = time.monotonic() - t0
                        await stream.aclose()
                    except OSError:
                        pass
            await self._perform(self.reconciler.endpoint_rtt(time.monotonic(), peer, ip, rtt), nursery)

    async def _resync_loop(self) -> None:
        while True:
            await trio.sleep(RESYNC)
            await self._resync()

    async def _resync(self) -> None:
        from ..wg.reconciler import PeerSpec

        try:
            state = await self.backend.state()
        except Exception as exc:
            log.warning("cannot read the WireGuard device", error=f"{exc.__class__.__name__}: {exc}")
            return
        device = {pub: PeerSpec(public=pub, endpoint=p.endpoint, allowed_ips=tuple(p.allowed_ips),
                                keepalive=p.keepalive or 0) for pub, p in state.peers.items()}
        actions = self.reconciler.resync(device)
        if actions:
            log.info("repairing the WireGuard device", changes=len(actions))
            async with trio.open_nursery() as nursery:
                await self._perform(actions, nursery)

    async def _backend_restarted(self) -> None:
        await self._resync()

    # --- key rotation and status --------------------------------------------------------

    async def rotate_key(self) -> dict[str, str]:
        old, new = keys.rotate(self.state_dir)
        await self.backend.set_private_key(new.private)
        # Peers as new: no session or half-done handshake left from the old key (measured:
        # with them kept, one rotation in six left a pair unable to talk for over 8 s).
        peers = list(self.reconciler.current.values())
        await self._set_peers([PeerConfig(public=p.public, remove=True) for p in peers])
        await self._set_peers([_config(p) for p in peers])
        self.keys = new
        self.reconciler = _rekeyed(self.reconciler, new.public)
        self.gossip.readvertise()
        log.info("WireGuard key rotated", old=old.public_b64, new=new.public_b64)
        return {"old": old.public_b64, "new": new.public_b64}

    async def peer_rows(self) -> list[dict[str, Any]]:
        state = await self.backend.state()
        now = time.time()
        by_key = {m.public: m for m in self._members.values()}
        rows = []
        for pub, p in state.peers.items():
            m = by_key.get(pub)
            host = None if p.endpoint is None else p.endpoint.rsplit(":", 1)[0].strip("[]")
            punched = bool(m and m.reflexive is not None and host == m.reflexive.rsplit(":", 1)[0].strip("[]"))
            rows.append({
                "peer": m.peer if m else None, "public_key": keys.b64(pub),
                "overlay": m.addr4 if m else None, "overlay6": m.addr6 if m else None,
                "endpoint": p.endpoint, "direct": bool(m and (host in m.endpoints or punched)),
                # at its NAT's address: punched (a symmetric NAT's port differs from the hint)
                "reflexive": punched,
                # at another member's address: WireGuard roamed to a relay (routing: no proof of the direct path)
                "elsewhere": bool(m and p.endpoint is not None and self._at_another_member(m.peer, p.endpoint)),
                # proof of the endpoint, for routing: the write counter as this peer was last
                # written (no write since a reading: what it reads came from the peer), and
                # whether WireGuard moved the endpoint from what we wrote (an authenticated packet)
                "written": self._written.get(pub, (0, None))[0], "roamed": self._roamed(pub, p.endpoint),
                "handshake_age_s": None if not p.last_handshake else round(now - p.last_handshake, 1),
                "rx_bytes": p.rx_bytes, "tx_bytes": p.tx_bytes,
            })
        return sorted(rows, key=lambda r: r["overlay"] or "")

    def status(self) -> dict[str, Any]:
        return {"interface": self.interface, "backend": self.backend.name,
                "address": None if self.addr4 is None else str(self.addr4),
                "address6": None if self.addr6 is None else str(self.addr6),
                "network": str(self.network), "public_key": self.keys.public_b64, "port": self.port,
                "mtu": self.mtu, "up": self.started, "peers": len(self.reconciler.current),
                "readdressed": self.readdressed, "error": self.error}


def _arrived_there(want: str | None, have: Any, relayed: bool) -> bool:
    """The device's endpoint for a peer is already where its packets should go: the one wanted,
    or, on the direct path, one at the same IP (a symmetric NAT maps the peer's packets to us from
    a port of its own, not the one its record names; WireGuard roamed there on an authenticated
    packet: writing the record's port back would cut the path that just proved itself)."""
    if want is None or have is None or have.endpoint is None:
        return False
    if have.endpoint == want:
        return True
    return not relayed and have.endpoint.rsplit(":", 1)[0] == want.rsplit(":", 1)[0]


def _config(spec: Any, *, keepalive: int | None = None) -> PeerConfig:
    return PeerConfig(public=spec.public, endpoint=spec.endpoint, allowed_ips=spec.allowed_ips,
                      keepalive=spec.keepalive if keepalive is None else keepalive)


def _rekeyed(old: Reconciler, public: bytes) -> Reconciler:
    """The reconciler keeps the device's peers; only our own key (never a peer of ours) changes."""
    old.me_public = public
    return old
