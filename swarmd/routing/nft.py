"""The relay's nftables rules, as text (pure): relay.py's active pairs in, one script out.

Theory of operation (IPv4 only). The relay R forwards the pair {A, B} on its UDP port P:
A sends its WireGuard datagrams to R_a:P (R_a: the address of R that A uses, its
`via_ip`), the kernel rewrites them to go to B's WireGuard port with R_b:P as their source,
and B's datagrams to R_b:P go to A the same way. The payload is never touched: the
pair's WireGuard session is end to end, the relay sees only ciphertext. One table,
`table ip <name>`, holds it all:
- chain `pre` (nat, prerouting): the first datagram of a flow from A to R_a:P sets the
  conntrack mark MARK | P and is DNATed to B's port (and B's to R_b:P to A's). Conntrack
  makes every later datagram, both ways, part of that flow: B's answers are the flow's
  replies and reach A at the address and port A really sends from.
  A new flow to a relay port of this host that matches no pair is dropped there: it leaves
  no conntrack entry behind that would hold the port's datagrams once the pair is back.
- Whoever makes the first flow owns the pair's mapping (one SNAT port per pair), so: a
  *pinned* end (not NATed, relay.End.pinned) is matched on its source port too (its
  WireGuard port, as the relay's WireGuard proved it): nobody else at its address (another
  process, a spoofer, a host behind the same NAT) can make the flow. Towards an end that is
  not pinned (behind a NAT: the port its packets to this relay port come from may differ
  from the one proven, by the NAT's mapping) a pinned end makes no flow: it would go to the
  proven port, which the NAT may not forward from this port, and then hold the mapping
  against the end's real flow. That end speaks first (its WireGuard keepalive at the
  latest), the flow is its, and the pinned end's datagrams are its replies. Two ends that
  are both not pinned: the first sender's flow (to the other's proven port), as before.
  Either way a flow goes to an end's proven WireGuard port or back to where the end itself
  sent from, never to a port an end's record names (relay.py).
- An end behind a symmetric NAT (relay.End.edm, its record's wg.nat): its NAT maps each
  destination to a new external port, so the port its WireGuard packets to the relay's own
  WireGuard came from (the proven one) is not the one its packets to R:P come from. Nobody
  makes a flow towards it at the proven port: against a pinned or an eim end, the edm end
  makes the pair's flow (its datagrams to R:P), the other end's are its replies. Two edm
  ends: each end's source port towards R:P is learnt from its own datagrams (chain `learn`,
  a filter hook before the DNAT: the dynamic maps `learned_a` / `learned_b`, relay port ->
  address . port, for the pair's end a / b, refreshed by every datagram, forgotten after
  LEARNED_S without one), and the other end's datagrams are DNATed to it; the first end's
  datagrams before the second has sent match nothing and are dropped (no conntrack entry),
  and WireGuard sends again. What this trusts: a learnt port is where a datagram from the
  end's address came from, so a host sharing the end's public address (behind the same
  NAT) could take its place, as it can make a not-pinned end's flow above.
- The relay behind a 1:1 NAT (a cloud VM announcing its public address, which no local
  interface holds): the datagrams arrive addressed to the private address. An end's
  `via_ip` that is a local address is matched as the destination; one that is not is
  matched as "any local address" (`fib daddr type local`).
- chain `post` (nat, postrouting): a marked flow is SNATed to R's address on the far side
  and port P, so B sees R_b:P, the endpoint it sends to; when R_b is not local (1:1 NAT),
  to port P of the address the route to B leaves from (`masquerade to :P`), which the NAT
  in front turns into R_b.
- chain `forward` (filter, forward): a marked packet goes to `relayed`; everything else is
  dropped when this daemon turned forwarding on (`drop_other_forwarding`: the host had
  net.ipv4.ip_forward off and must not become a router for anything but the pairs), and
  left alone otherwise.
- chain `relayed`: a packet passes only between the two addresses of an active pair with
  that pair's mark, then through one byte rate limit for all pairs (the relay's bandwidth
  cap, the named limit `cap`: above it packets are dropped, WireGuard's inner TCP slows
  down). One pair can take the whole cap: there is no per-pair share (a policer is not
  work-conserving, so a split of the cap by pairs would waste an idle pair's part, and
  fair queueing is tc's, not nftables'). A marked packet of
  any other flow is dropped: conntrack entries outlive the rules that made them (UDP flows
  last while packets keep coming), so a pair that was removed (a member revoked, a lease
  expired) or a port that now belongs to another pair must be stopped here.

A script is one transaction, so a rule set is never half applied. The first one (and one
that changes the cap or the forwarding policy) replaces the whole table (`add table` so
that the `delete table` finds one; then the new table). Later ones (`update=True`) flush
the rule chains and add their rules again, leaving the table and its named limit in place:
the limit's bucket is not refilled by a pair coming or going (else toggling a pair, which
any two members can do, would lift the cap for everyone).
Everything written is validated again here, whatever relay.py checked: addresses through
`ipaddress` (unicast IPv4 hosts), ports as ints in range, the table name against a strict
pattern, the cap as an int in range. No value can add a statement.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

from .relay import PORTS, Pair, check_host, parse_ipv4, port_number

MARK = 0x53570000  # "SW" in the high 16 bits, the port in the low 16: the flow of the pair on that port
MARK_MASK = 0xFFFF0000
# Seconds a learnt source port of an edm end is kept without a datagram from it: Linux forgets an
# assured UDP mapping after 120 s (DESIGN, NAT traversal), and WireGuard's keepalives come every 25 s
LEARNED_S = 180
LEARNED = ("learned_a", "learned_b")  # the pairs' end a's and end b's learnt source (relay port -> ip . port)
MAX_CAP = 2**40  # bytes/s, far above any link; nft takes a 64-bit rate
_TABLE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")
FORWARDING_WAS_OFF = "swarmd: ip_forward was off"  # the table's comment when it drops other forwarding


def mark(port: int) -> int:
    return MARK | port_number(port, "port")


def table_name(ifname: str) -> str:
    """The relay table of the daemon whose mesh interface is `ifname` (several daemons may
    share a network namespace, each with its own interface)."""
    return ("swarmd_relay_" + re.sub(r"[^A-Za-z0-9_]", "_", ifname))[:32]


RULE_CHAINS = ("learn", "pre", "post", "forward", "relayed")  # what an update flushes and fills again


def render(table: str, pairs: Iterable[Pair], *, ports: tuple[int, int] = PORTS, cap_bytes_per_s: int,
           drop_other_forwarding: bool, local: Iterable[str] = (), update: bool = False) -> str:
    """The script that puts the rules for `pairs` (relay.Relay.active()), whose ports are in the
    relay's range `ports`, in `table`: the whole table replaced, or with `update` its rule chains
    only (the table, made by the same arguments but the pairs, must be there). `local`: this
    host's own IPv4 addresses (an end's via_ip that is not one of them is behind a 1:1 NAT)."""
    _check_table(table)
    local_ips = {parse_ipv4(ip, "local address") for ip in local}
    low, high = (port_number(p, "ports") for p in ports)
    if low > high:
        raise ValueError(f"ports: {low}-{high} is empty")
    if not isinstance(cap_bytes_per_s, int) or isinstance(cap_bytes_per_s, bool) \
            or not 1 <= cap_bytes_per_s <= MAX_CAP:
        raise ValueError(f"cap_bytes_per_s: {cap_bytes_per_s!r:.20} is not a rate of 1-{MAX_CAP} bytes/s")
    pre, post, relayed, learn = [], [], [], []
    seen = set()
    for pair in pairs:
        if not isinstance(pair, Pair):
            raise ValueError(f"not a Pair: {pair!r:.60}")
        m = f"0x{mark(pair.port):08x}"
        if pair.port in seen or not low <= pair.port <= high:
            raise ValueError(f"port {pair.port} twice or outside {low}-{high}")
        seen.add(pair.port)
        a, a_port, a_via, a_pinned, a_edm = _end(pair.a, "a")
        b, b_port, b_via, b_pinned, b_edm = _end(pair.b, "b")
        if a == b:
            raise ValueError(f"pair on port {pair.port}: both ends at {a}")
        p = pair.port
        both_edm = a_edm and b_edm
        for src, s_port, s_via, s_pinned, s_edm, s_map, dst, d_port, d_pinned, d_edm, d_map in (
                (a, a_port, a_via, a_pinned, a_edm, LEARNED[0], b, b_port, b_pinned, b_edm, LEARNED[1]),
                (b, b_port, b_via, b_pinned, b_edm, LEARNED[1], a, a_port, a_pinned, a_edm, LEARNED[0])):
            sport = f" udp sport {s_port}" if s_pinned else ""
            daddr = f"ip daddr {s_via}" if s_via in local_ips else "fib daddr type local"
            match = f"ip saddr {src}{sport} {daddr} udp dport {p}"
            if both_edm:  # each end's source towards this port, learnt: the other's datagrams go there
                learn.append(f"    {match} update @{s_map} {{ udp dport : ip saddr . udp sport }}")
                pre.append(f"    {match} ct mark set {m} dnat ip to udp dport map @{d_map}")
                continue
            if (s_pinned and not d_pinned) or d_edm:
                continue  # no flow towards a NATed end (nor an edm one): it makes the pair's flow, from its real port
            pre.append(f"    {match} ct mark set {m} dnat to {dst}:{d_port}")
        for dst, d_via in ((b, b_via), (a, a_via)):
            snat = f"snat to {d_via}:{p}" if d_via in local_ips else f"masquerade to :{p}"
            post.append(f"    ct mark {m} ip daddr {dst} meta l4proto udp {snat}")
        relayed += [f"    ct mark {m} ip saddr . ip daddr {{ {a} . {b}, {b} . {a} }} jump cap"]
    lines = [f"# swarmd relay: {len(seen)} pairs, cap {cap_bytes_per_s} bytes/s"]
    if update:
        lines += [f"flush chain ip {table} {chain}" for chain in RULE_CHAINS]
        lines += [f"flush map ip {table} {name}" for name in LEARNED]  # a port may be another pair's now
        lines.append(f"table ip {table} {{")
    else:
        lines += [f"add table ip {table}", f"delete table ip {table}", f"table ip {table} {{"]
        if drop_other_forwarding:
            lines.append(f'  comment "{FORWARDING_WAS_OFF}"')
        lines.append(f"  limit cap {{ rate over {cap_bytes_per_s} bytes/second }}")
        for name in LEARNED:
            lines += [f"  map {name} {{", "    type inet_service : ipv4_addr . inet_service",
                      "    flags dynamic,timeout", f"    timeout {LEARNED_S}s", f"    size {high - low + 1}", "  }"]
    lines += [
        "  chain learn {",
        "    type filter hook prerouting priority dstnat - 10; policy accept;",
        *learn,
        "  }",
        "  chain pre {",
        "    type nat hook prerouting priority dstnat; policy accept;",
        *pre,
        "    # a new flow to a relay port that is no pair's: no conntrack entry either (it would catch",
        "    # the pair's datagrams if the pair came back on this port)",
        f"    fib daddr type local udp dport {low}-{high} drop",
        "  }",
        "  chain post {",
        "    type nat hook postrouting priority srcnat; policy accept;",
        *post,
        "  }",
        "  chain forward {",
        "    type filter hook forward priority filter; policy accept;",
        f"    ct mark and 0x{MARK_MASK:08x} == 0x{MARK:08x} jump relayed",
        *(["    # this daemon turned forwarding on: nothing but the pairs is forwarded", "    drop"]
          if drop_other_forwarding else []),
        "  }",
        "  chain relayed {",
        *relayed,
        "    # a flow of no active pair (its conntrack entry outlived the rules)",
        "    drop",
        "  }",
    ]
    if not update:
        lines += ["  chain cap {", '    limit name "cap" drop', "    accept", "  }"]
    lines.append("}")
    return "\n".join(lines) + "\n"


def delete(table: str) -> str:
    """The script that removes `table` (no error when it is not there)."""
    _check_table(table)
    return f"add table ip {table}\ndelete table ip {table}\n"


def _check_table(table: object) -> None:
    if not isinstance(table, str) or not _TABLE.fullmatch(table):
        raise ValueError(f"bad nftables table name {table!r:.40}")


def _end(end: object, name: str) -> tuple[ipaddress.IPv4Address, int, ipaddress.IPv4Address, bool, bool]:
    ip = parse_ipv4(getattr(end, "ip", None), f"{name}.ip")
    via = parse_ipv4(getattr(end, "via_ip", None), f"{name}.via_ip")
    check_host(ip, f"{name}.ip")
    check_host(via, f"{name}.via_ip")
    pinned, edm = getattr(end, "pinned", None), getattr(end, "edm", None)
    if not isinstance(pinned, bool) or not isinstance(edm, bool) or (pinned and edm):
        raise ValueError(f"{name}.pinned, .edm: {pinned!r:.20}, {edm!r:.20} are not two bools, at most one true")
    return ip, port_number(getattr(end, "wg_port", None), f"{name}.wg_port"), via, pinned, edm
