"""The WireGuard reconciler: turns the membership view into peer configuration, sans-IO.

Inputs: ``update_view(now, members)`` with the members the device should have as peers (the
caller keeps the live ones and leaves itself out), ``endpoint_rtt`` with RTT measurements the
driver made when asked, and ``resync`` with the peers read back from the device. Outputs:
actions, as data: ``SetPeer`` (add or update), ``RemovePeer``, ``ProbeEndpoints``. The driver
performs them; the reconciler assumes they were applied.

Rules:
- ``current`` is what the reconciler last set on the device, one ``PeerSpec`` per public
  key. Only differences from it become actions, removals before additions; an unchanged
  view yields nothing.
- A peer's allowed IPs are its overlay addresses as host routes (/32, /128). WireGuard routes
  each prefix to a single peer, so when two members claim one address (a collision that
  ``address.choose`` is still resolving) the lower public key gets it, as in ``address``;
  the other member's peer goes without it until it moves.
- A public key names one peer. A member whose key changed (rotation) is a removal of the old
  key and an addition of the new one. Two members advertising one key: the lower peer id
  gets it and the other is left out (listed in ``ignored``).
- Endpoints: a member lists candidate underlay IPs. Before any measurement the first one is
  used. A member with several is probed (``ProbeEndpoints``) when first seen and then at most
  once every ``probe_interval`` seconds, whatever it changes: a changed list waits for the
  interval too, and so does a member that left and came back within it (a probe connects to
  addresses the member chose, so a member rewriting its list in every record would otherwise
  aim every host at them at its own rate). The reconciler switches endpoint only
  on a clear improvement: ``new < current * switch_ratio`` and ``current - new >
  switch_min_gain``, or when the current one failed (RTT None). Hysteresis on both ratio and
  absolute gain keeps two near-equal paths from flapping; an unmeasured current endpoint is
  kept until it is measured, so results arriving out of order cannot cause a switch.
- A member behind a NAT or a firewall names its ``reflexive`` endpoint (attested by two
  members; the driver checks that): it is used instead of its candidates, and since this
  side sends there too, the two punch through each other's NAT.
- Relayed paths (routing/): ``set_relayed`` names, per peer, the relay endpoint ("IP:port"
  on a relay that forwards the pair's packets unchanged) to use instead of the peer's own;
  a peer left out of it goes back to its own endpoint. Endpoint measurements and switching
  go on underneath: the member's own endpoint is still the one chosen among its candidates.
- ``resync`` repairs the device after it lost state (wireguard-go restarted): missing peers
  are set, unknown ones removed, wrong allowed IPs or keepalive rewritten. A device endpoint
  that differs from ours is left alone: WireGuard roams to wherever a peer's authenticated
  packets come from (NAT, a second interface), and fighting that would break the link.
- RTTs are seconds. A NaN, infinite or negative sample is dropped and counted in
  ``rejected_samples``, never raised.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from .endpoint import format_endpoint, split_endpoint

KEY_LEN = 32
DEFAULT_KEEPALIVE = 25  # seconds; wg(8): "a sensible interval that works with a wide variety of firewalls"
SWITCH_RATIO = 0.8  # a new endpoint must be 20 % faster ...
SWITCH_MIN_GAIN = 0.005  # ... and 5 ms faster, so one probe's jitter on a short path cannot move it
PROBE_INTERVAL = 60.0  # paths change on the scale of routing changes; 1000 members x 2 IPs is ~33 probes/s


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerSpec:
    """The desired state of one WireGuard peer. Canonical on construction (allowed IPs sorted
    and normalized, endpoint as WireGuard prints it), so equal specs mean equal config."""

    public: bytes
    endpoint: str | None  # "10.0.0.1:51820" or "[fd00::1]:51820"
    allowed_ips: tuple[str, ...]  # "10.211.3.4/32", "fd12:3456:789a::1/128"
    keepalive: int = DEFAULT_KEEPALIVE  # seconds, 0 = off

    def __post_init__(self) -> None:
        _check_key("peer public key", self.public)
        try:
            nets = {ipaddress.ip_network(ip, strict=False) for ip in self.allowed_ips}
        except ValueError as exc:
            raise ValueError(f"allowed IPs: {exc}") from None
        object.__setattr__(self, "allowed_ips",
                           tuple(str(n) for n in sorted(nets, key=lambda n: (n.version, n))))
        if self.endpoint is not None:
            object.__setattr__(self, "endpoint", format_endpoint(*split_endpoint(self.endpoint)))
        if isinstance(self.keepalive, bool) or not isinstance(self.keepalive, int) \
                or not 0 <= self.keepalive <= 0xFFFF:
            raise ValueError(f"keepalive must be 0..65535 seconds, got {self.keepalive!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Member:
    """What a member's record says about its WireGuard side. Addresses are canonicalized."""

    peer: str  # libp2p peer id
    public: bytes
    addr4: str
    addr6: str | None
    port: int  # its WireGuard listen port
    endpoints: tuple[str, ...]  # candidate underlay IPs, in its order of preference
    # "IP:port" its NAT (or firewall) shows to members, attested by two of them (wg/reach.py):
    # behind a NAT it has no candidates of its own, and both ends sending to each other's
    # reflexive endpoint is the punch
    reflexive: str | None = None

    def __post_init__(self) -> None:
        _check_key(f"member {self.peer} public key", self.public)
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= 0xFFFF:
            raise ValueError(f"member {self.peer} port must be 1..65535, got {self.port!r}")
        where = f"member {self.peer}"
        object.__setattr__(self, "addr4", _ip(ipaddress.IPv4Address, self.addr4, f"{where} addr4", "an IPv4 address"))
        if self.addr6 is not None:
            object.__setattr__(self, "addr6",
                               _ip(ipaddress.IPv6Address, self.addr6, f"{where} addr6", "an IPv6 address"))
        ips = [_ip(ipaddress.ip_address, e, f"{where} endpoints", "IP addresses") for e in self.endpoints]
        object.__setattr__(self, "endpoints", tuple(dict.fromkeys(ips)))
        if self.reflexive is not None:
            object.__setattr__(self, "reflexive", format_endpoint(*split_endpoint(self.reflexive)))


# Actions are built by keyword but matched by position (``case SetPeer(spec):``), so each
# names its ``__match_args__``: kw_only fields are left out of the generated ones.

@dataclass(frozen=True, slots=True, kw_only=True)
class SetPeer:
    __match_args__ = ("spec",)
    spec: PeerSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class RemovePeer:
    __match_args__ = ("public",)
    public: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeEndpoints:
    """Measure the RTT to each candidate IP of ``peer`` and report each with ``endpoint_rtt``."""

    __match_args__ = ("peer", "endpoints")
    peer: str
    endpoints: tuple[str, ...]


Action = SetPeer | RemovePeer | ProbeEndpoints


class Reconciler:
    def __init__(self, me_public: bytes, *, switch_ratio: float = SWITCH_RATIO,
                 switch_min_gain: float = SWITCH_MIN_GAIN, probe_interval: float = PROBE_INTERVAL,
                 keepalive: int = DEFAULT_KEEPALIVE) -> None:
        if not 0 < switch_ratio <= 1:
            raise ValueError(f"switch_ratio must be in (0, 1], got {switch_ratio}")
        if switch_min_gain < 0 or probe_interval <= 0:
            raise ValueError("switch_min_gain must be >= 0 and probe_interval > 0")
        self.me_public = me_public  # the driver replaces it after a key rotation
        self.switch_ratio = switch_ratio
        self.switch_min_gain = switch_min_gain
        self.probe_interval = probe_interval
        self.keepalive = keepalive
        self.current: dict[bytes, PeerSpec] = {}
        self.ignored: tuple[str, ...] = ()
        self.rejected_samples = 0
        self._members: dict[str, Member] = {}
        self._owner: dict[str, bytes] = {}  # allowed IP -> the public key it is routed to
        self._chosen: dict[str, str] = {}  # peer -> the candidate IP in use
        self._rtt: dict[str, dict[str, float | None]] = {}  # peer -> IP -> last RTT, None = failed
        self._probed: dict[str, float] = {}  # peer -> when its endpoints were last probed
        self._relayed: dict[str, str] = {}  # peer -> the relay endpoint its packets go to instead

    # --- inputs -------------------------------------------------------------------------

    def update_view(self, now: float, members: Iterable[Member]) -> list[Action]:
        by_peer: dict[str, Member] = {}
        for m in members:
            if m.public != self.me_public:
                by_peer[m.peer] = m
        by_key: dict[bytes, Member] = {}
        ignored = []
        for peer in sorted(by_peer):
            m = by_peer[peer]
            if m.public in by_key:
                ignored.append(peer)
            else:
                by_key[m.public] = m
        self.ignored = tuple(ignored)
        self._members = {m.peer: m for m in by_key.values()}
        self._owner = {}
        for public in sorted(by_key):
            for ip in _host_routes(by_key[public]):
                self._owner.setdefault(ip, public)
        self._forget_gone(now)

        actions: list[Action] = []
        for peer in sorted(self._members):
            m = self._members[peer]
            if len(m.endpoints) < 2:
                continue
            asked = self._probed.get(peer)
            if asked is None or now - asked >= self.probe_interval:
                self._probed[peer] = now
                actions.append(ProbeEndpoints(peer=peer, endpoints=m.endpoints))
        for m in self._members.values():
            self._keep_endpoint_valid(m)
        desired = {m.public: self._spec(m) for m in self._members.values()}
        return self._apply(desired) + actions

    def endpoint_rtt(self, now: float, peer: str, endpoint: str, rtt: float | None) -> list[Action]:
        """Record a measurement to one of ``peer``'s candidates (a bare IP or "IP:port") and
        switch endpoint if the rules say so."""
        m = self._members.get(peer)
        ip = _endpoint_ip(endpoint)
        if m is None or ip not in m.endpoints:
            return []  # a late result for a member or candidate that is gone
        if rtt is not None and (not math.isfinite(rtt) or rtt < 0):
            self.rejected_samples += 1
            return []
        self._rtt.setdefault(peer, {})[ip] = rtt
        best = self._better_endpoint(m)
        if best is None:
            return []
        self._chosen[peer] = best
        spec = self._spec(m)
        if self.current.get(m.public) == spec:
            return []
        self.current[m.public] = spec
        return [SetPeer(spec=spec)]

    def set_relayed(self, relayed: Mapping[str, str]) -> list[Action]:
        """Send each named peer's packets to a relay endpoint ("IP:port"), every other peer's
        to its own endpoint again. Malformed endpoints raise ValueError (the caller's own data)."""
        self._relayed = {peer: format_endpoint(*split_endpoint(e)) for peer, e in relayed.items()}
        return self._apply({m.public: self._spec(m) for m in self._members.values()})

    def direct_endpoint(self, peer: str) -> str | None:
        """The endpoint ``peer``'s packets go to when not relayed ("IP:port"), None if unknown."""
        m = self._members.get(peer)
        if m is None:
            return None
        ip = self._chosen.get(peer)
        return m.reflexive or (None if ip is None else format_endpoint(ip, m.port))

    def direct_ip(self, peer: str, version: int | None = None) -> str | None:
        """The underlay IP of ``peer`` in use or first to try (never a relay's). With ``version``
        (routing's relays are IPv4 only), one of that IP version: the one in use if it is, else
        the fastest candidate measured alive, else the first not yet measured."""
        chosen = self._chosen.get(peer)
        m = self._members.get(peer)
        if chosen is None and m is not None and m.reflexive is not None:  # behind a NAT: its NAT's address
            ip = split_endpoint(m.reflexive)[0]
            return ip if version is None or ipaddress.ip_address(ip).version == version else None
        if version is None or (chosen is not None and ipaddress.ip_address(chosen).version == version):
            return chosen
        if m is None:
            return None
        rtts = self._rtt.get(peer, {})
        alive = [(rtt, i, ip) for i, ip in enumerate(m.endpoints)
                 if ipaddress.ip_address(ip).version == version and (rtt := rtts.get(ip)) is not None]
        if alive:
            return min(alive)[2]
        return next((ip for ip in m.endpoints if ipaddress.ip_address(ip).version == version and ip not in rtts), None)

    def resync(self, device_peers: Mapping[bytes, PeerSpec]) -> list[Action]:
        """The actions that bring the device, as read back, to ``current``."""
        actions: list[Action] = [RemovePeer(public=k) for k in sorted(device_peers) if k not in self.current]
        for public in sorted(self.current):
            want, have = self.current[public], device_peers.get(public)
            if have is None or have.allowed_ips != want.allowed_ips or have.keepalive != want.keepalive \
                    or (have.endpoint is None and want.endpoint is not None):
                actions.append(SetPeer(spec=want))
        return actions

    # --- the rules ----------------------------------------------------------------------

    def _better_endpoint(self, m: Member) -> str | None:
        """The candidate to switch to, or None to stay."""
        rtts = self._rtt.get(m.peer, {})
        cur = self._chosen.get(m.peer)
        if cur is None or cur not in rtts:
            return None  # current unmeasured: wait for its result before comparing
        cur_rtt = rtts[cur]
        if cur_rtt is None:
            return self._fallback(m)
        best = self._fallback(m)
        best_rtt = rtts.get(best) if best is not None else None
        if best_rtt is not None and best != cur and best_rtt < cur_rtt * self.switch_ratio \
                and cur_rtt - best_rtt > self.switch_min_gain:
            return best
        return None

    def _fallback(self, m: Member) -> str | None:
        """The fastest candidate measured alive, else the first not yet measured."""
        rtts = self._rtt.get(m.peer, {})
        alive = [(rtt, i, ip) for i, ip in enumerate(m.endpoints) if (rtt := rtts.get(ip)) is not None]
        if alive:
            return min(alive)[2]
        return next((ip for ip in m.endpoints if ip not in rtts), None)

    def _spec(self, m: Member) -> PeerSpec:
        endpoint = self._relayed.get(m.peer) or self.direct_endpoint(m.peer)
        return PeerSpec(public=m.public, endpoint=endpoint,
                        allowed_ips=tuple(r for r in _host_routes(m) if self._owner.get(r) == m.public),
                        keepalive=self.keepalive)

    def _keep_endpoint_valid(self, m: Member) -> None:
        """A new member, or one whose chosen endpoint left its list, starts on the fallback:
        with no measurement that is its first candidate."""
        if self._chosen.get(m.peer) in m.endpoints:
            return
        ip = self._fallback(m) or next(iter(m.endpoints), None)
        if ip is None:
            self._chosen.pop(m.peer, None)
        else:
            self._chosen[m.peer] = ip

    def _apply(self, desired: dict[bytes, PeerSpec]) -> list[Action]:
        actions: list[Action] = [RemovePeer(public=k) for k in sorted(self.current) if k not in desired]
        actions += [SetPeer(spec=desired[k]) for k in sorted(desired) if self.current.get(k) != desired[k]]
        self.current = desired
        return actions

    def _forget_gone(self, now: float) -> None:
        for table in (self._chosen, self._rtt, self._relayed):
            for peer in [p for p in table if p not in self._members]:
                del table[peer]
        for peer in [p for p, at in self._probed.items() if p not in self._members and now - at >= self.probe_interval]:
            del self._probed[peer]  # kept until its interval is over: leaving and coming back is no shortcut
        for peer, rtts in self._rtt.items():
            candidates = self._members[peer].endpoints
            for ip in [ip for ip in rtts if ip not in candidates]:
                del rtts[ip]


def _endpoint_ip(endpoint: str) -> str:
    try:
        return str(ipaddress.ip_address(endpoint))
    except ValueError:
        return split_endpoint(endpoint)[0]


def _host_routes(m: Member) -> list[str]:
    routes = [f"{m.addr4}/32"]
    if m.addr6 is not None:
        routes.append(f"{m.addr6}/128")
    return routes


def _ip(parse: Callable[[object], object], value: object, where: str, expected: str) -> str:
    try:
        return str(parse(value))
    except ValueError:
        raise ValueError(f"{where}: expected {expected}, got {value!r}") from None


def _check_key(what: str, key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_LEN:
        raise ValueError(f"{what} must be {KEY_LEN} bytes, got {key!r:.80}")
