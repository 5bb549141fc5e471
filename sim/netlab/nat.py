"""NAT routers for the lab: the classes, the `--nat` spec, and each router's nftables ruleset
(pure, unit-tested; `lab.py` applies the text with `nft -f -` inside the router's namespace).

A NATed host hI sits behind a router namespace that holds what the host held on a public
lab: the segment taps, the underlay address 10.200.0.I and the host routes. The host keeps
one veth to its router on the same private subnet as every other NATed host (192.168.1.2,
its router 192.168.1.1), as home networks do; a `firewall` host keeps 10.200.0.I instead
(no translation) and its router routes that address over the veth.

The classes (RFC 4787's mapping and filtering behaviours; RFC 3489's names in brackets):

    class      mapping                      filtering                      nftables
    public     none                         none                           (no router)
    eim        endpoint-independent         endpoint-independent [full]    @eim + @fullcone DNAT
    eim-adf    endpoint-independent         address-dependent [restricted] … + @contacted
    eim-apdf   endpoint-independent         address-and-port-dep. [port-r] … + ct state
    edm        endpoint-dependent, random   address-and-port-dependent     snat … random
    firewall   none                         address-and-port-dependent     ct state

The recipes follow n0-computer/patchbay's (DESIGN, "NAT traversal"): endpoint-independent
filtering is a dynamic map `@fullcone` (external port → inner endpoint) used by a DNAT in
prerouting; address-and-port-dependent filtering admits only what conntrack already holds
(`ct state established,related`); address-dependent filtering adds a `@contacted` set of
the addresses the host has sent to; symmetric mapping is `snat … random`. A `nat prerouting`
chain exists even when empty: without one the kernel does not undo the translation on the
replies.

Endpoint-independent mapping does not come from Linux by itself: `snat` keeps the inner
port while it is free, which is EIM only while no port range is given. `lab nat HOST rebind`
must move the host to new external ports, so the router keeps its own mapping table, `@eim`
(inner protocol, address, port → external address, port), filled after the translation
from what conntrack chose and consulted before it: the first flow from an inner port draws
an external port, every later flow from that port, to any destination, gets the same one.
Rebinding bumps a generation that selects a fresh port range, disjoint from the previous
generation's and never holding 51820 (WireGuard's port, the one a test watches), and the
lab flushes the maps and the router's conntrack entries.

The maps and the `@contacted` set age as conntrack's UDP entries do: each outbound packet
sets an entry's life to the unreplied timeout, or to the stream timeout once its flow is
assured (answered for more than 2 s), so an unrefreshed mapping is gone when conntrack would
forget the flow (the timeouts are the namespace's `nf_conntrack_udp_timeout*` sysctls,
Linux's 30 s and 120 s unless the lab says otherwise). Only outbound packets refresh
(RFC 4787 REQ-6). A TCP flow's mapping ages the same way in the maps, while conntrack keeps
the connection itself for days: an idle connection stays up, a new flow from its port
after the map forgot it gets a new external port.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PUBLIC = "public"
CLASSES = {
    PUBLIC: "no NAT (the default)",
    "eim": "full cone: endpoint-independent mapping and filtering",
    "eim-adf": "address-restricted cone: endpoint-independent mapping, address-dependent filtering",
    "eim-apdf": "port-restricted cone (a home router): endpoint-independent mapping, "
                "address-and-port-dependent filtering",
    "edm": "symmetric: a new random external port per destination, address-and-port-dependent filtering",
    "firewall": "no translation; inbound new connections dropped, replies to outbound allowed",
}
TRANSLATING = ("eim", "eim-adf", "eim-apdf", "edm")

PRIVATE_NET = "192.168.1.0/24"  # the same for every NATed host: home networks all look alike
ROUTER_PRIVATE = "192.168.1.1"
HOST_PRIVATE = "192.168.1.2"
LAN_IF = "lan0"  # the router's end of the veth
HOST_IF = "eth0"  # the host's end

# Rebinding: generation g >= 1 draws external ports from its own block, disjoint from the
# previous generation's; the blocks stay below 51820 so a rebound mapping never lands back
# on WireGuard's port (generation 0 keeps the inner port, as Linux's snat does when free)
PORT_BASE = 2048
PORT_BLOCK = 5000
PORT_BLOCKS = 9  # the last block ends at 47047


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeouts:
    """The router's conntrack UDP timeouts, seconds. Linux's defaults (nf_conntrack_proto_udp.c):
    a flow seen in one direction only is forgotten after 30 s, an assured one (replies for
    more than 2 s) after 120 s."""

    udp: int = 30
    udp_stream: int = 120

    def __post_init__(self) -> None:
        for name, value in (("--nat-udp-timeout", self.udp), ("--nat-udp-stream-timeout", self.udp_stream)):
            if not 1 <= value <= 86_400:
                raise ValueError(f"{name} must be between 1 and 86400 seconds, got {value}")

    def sysctls(self) -> dict[str, str]:
        """Per network namespace since Linux 4.x: set in each router, nowhere else."""
        return {"net.netfilter.nf_conntrack_udp_timeout": str(self.udp),
                "net.netfilter.nf_conntrack_udp_timeout_stream": str(self.udp_stream)}


def parse_spec(spec: str, hosts: Sequence[str]) -> dict[str, str]:
    """`h2=eim,h3=edm` → {host: class}, checked as `check` does."""
    nat: dict[str, str] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        host, sep, cls = item.partition("=")
        host, cls = host.strip(), cls.strip()
        if not sep or not host or not cls:
            raise ValueError(f"--nat: {item!r} is not HOST=CLASS (e.g. h2=eim-apdf)")
        if host in nat:
            raise ValueError(f"--nat: {host} is given twice")
        nat[host] = cls
    return check(nat, hosts)


def check(nat: Mapping[str, str], hosts: Sequence[str]) -> dict[str, str]:
    """Every host's class ({host: class} for all `hosts`, `public` where not named); a
    ValueError naming the first thing wrong."""
    known = set(hosts)
    for host, cls in nat.items():
        if host not in known:
            raise ValueError(f"--nat: no host {host!r} in the lab (hosts: {', '.join(hosts)})")
        if cls not in CLASSES:
            raise ValueError(f"--nat: {host}: unknown NAT class {cls!r} (one of {', '.join(CLASSES)})")
    out = {h: nat.get(h, PUBLIC) for h in hosts}
    if nat and PUBLIC not in out.values():
        raise ValueError("--nat: at least one host must stay public (NATed daemons bootstrap through public ones)")
    return out


def port_range(generation: int) -> tuple[int, int] | None:
    """The external ports of a router's `generation`-th binding; None: the inner port kept."""
    if generation < 0:
        raise ValueError(f"a NAT generation is >= 0, got {generation}")
    if generation == 0:
        return None
    low = PORT_BASE + ((generation - 1) % PORT_BLOCKS) * PORT_BLOCK
    return low, low + PORT_BLOCK - 1


def describe_ports(cls: str, generation: int) -> str | None:
    """Which external ports a host's router gives it, for `lab status`; None: no translation."""
    if cls not in TRANSLATING:
        return None
    ports = port_range(generation)
    where = f"{ports[0]}-{ports[1]}" if ports else None
    if cls == "edm":
        return f"random in {where}" if where else "random"
    return where or "the inner port"


# A router rebinding forwards nothing until its new ruleset is in (it replaces this one)
HOLD = "flush ruleset\ntable inet hold {\n  chain forward { type filter hook forward priority -500; policy drop; }\n}\n"


def ruleset(cls: str, *, external: str, generation: int = 0, timeouts: Timeouts = Timeouts()) -> str:
    """The router's whole nftables ruleset for a host of class `cls` whose public address is
    `external` (10.200.0.I): applied as one transaction that first flushes the old one."""
    if cls not in CLASSES or cls == PUBLIC:
        raise ValueError(f"no router for a host of class {cls!r}")
    out = ["flush ruleset"]
    if cls in TRANSLATING:
        out += _nat_table(cls, external, port_range(generation), timeouts)
    out += _filter_table(cls, timeouts)
    return "\n".join(out) + "\n"


def _nat_table(cls: str, external: str, ports: tuple[int, int] | None, timeouts: Timeouts) -> list[str]:
    outbound = f'oifname != "{LAN_IF}" ip saddr {PRIVATE_NET}'
    to = f"{external}:{ports[0]}-{ports[1]}" if ports else external
    lines = ["table ip nat {"]
    if cls == "edm":
        prerouting: list[str] = []  # nothing comes in unasked; the chain undoes snat on the replies
        postrouting = [f"{outbound} meta l4proto {{ tcp, udp }} snat ip to {to} random",
                       f"{outbound} snat ip to {external}"]
        mappings: list[str] = []
    else:
        lines += _dynamic("map", "eim", "inet_proto . ipv4_addr . inet_service : ipv4_addr . inet_service",
                          timeouts.udp_stream)
        lines += _dynamic("map", "fullcone", "inet_proto . inet_service : ipv4_addr . inet_service",
                          timeouts.udp_stream)
        prerouting = [f'iifname != "{LAN_IF}" ip daddr {external} meta l4proto {{ tcp, udp }} '
                      f"dnat ip to meta l4proto . th dport map @fullcone"]
        postrouting = [f"{outbound} meta l4proto {{ tcp, udp }} snat ip to meta l4proto . ip saddr . th sport map @eim",
                       f"{outbound} meta l4proto {{ tcp, udp }} snat ip to {to}",
                       f"{outbound} snat ip to {external}"]
        # after the translation (srcnat + 1) the packet carries the external port conntrack chose;
        # each outbound packet refreshes the mapping for as long as conntrack keeps its flow
        # (UDP's timeouts: an unanswered flow's, then an assured one's)
        original = "meta l4proto . ct original ip saddr . ct original proto-src"
        outbound = f'oifname != "{LAN_IF}" ct original ip saddr {PRIVATE_NET} meta l4proto {{ tcp, udp }}'
        mappings = [f"{outbound}{cond} "
                    f"update @eim {{ {original} timeout {ttl}s : ip saddr . th sport }} "
                    f"update @fullcone {{ meta l4proto . th sport timeout {ttl}s : "
                    f"ct original ip saddr . ct original proto-src }}"
                    for cond, ttl in (("", timeouts.udp), (" ct status assured", timeouts.udp_stream))]
    lines += _chain("prerouting", "type nat hook prerouting priority dstnat; policy accept;", prerouting)
    lines += _chain("postrouting", "type nat hook postrouting priority srcnat; policy accept;", postrouting)
    if mappings:
        lines += _chain("mappings", "type filter hook postrouting priority srcnat + 1; policy accept;", mappings)
    return lines + ["}"]


def _filter_table(cls: str, timeouts: Timeouts) -> list[str]:
    if cls == "eim":
        return []  # full cone: whatever reaches a mapped port goes in
    inbound = f'oifname "{LAN_IF}"'
    forward = [f"{inbound} ct state established,related accept"]
    lines = ["table ip filter {"]
    postrouting: list[str] = []
    if cls == "eim-adf":
        lines += _dynamic("set", "contacted", "ipv4_addr", timeouts.udp_stream)
        forward.append(f"{inbound} ip saddr @contacted accept")
        postrouting = [f'oifname != "{LAN_IF}"{cond} update @contacted {{ ip daddr timeout {ttl}s }}'
                       for cond, ttl in (("", timeouts.udp), (" ct status assured", timeouts.udp_stream))]
    forward.append(f"{inbound} drop")
    lines += _chain("forward", "type filter hook forward priority filter; policy accept;", forward)
    if postrouting:
        lines += _chain("postrouting", "type filter hook postrouting priority filter; policy accept;", postrouting)
    return lines + ["}"]


def _dynamic(kind: str, name: str, type_: str, ttl: int) -> list[str]:
    return [f"    {kind} {name} {{", f"        type {type_}", "        flags dynamic,timeout",
            f"        timeout {ttl}s", "        size 65536", "    }"]


def _chain(name: str, hook: str, rules: list[str]) -> list[str]:
    return [f"    chain {name} {{", f"        {hook}", *(f"        {r}" for r in rules), "    }"]
