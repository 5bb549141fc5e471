"""Overlay addresses without a coordinator: each member derives its own from its WireGuard key.

Theory of operation:
- IPv4. A member's candidates are a deterministic, endless sequence of host addresses in the
  overlay network (``DEFAULT_NETWORK`` unless configured): candidate ``i`` is the host at
  offset ``int(sha256(b"swarmd wg addr\\0" + swarm + public + i)[:8]) mod size``, where
  ``swarm`` is the swarm id in UTF-8 and ``i`` is 8 bytes big-endian; the network and
  broadcast addresses are skipped. Everyone can compute anyone's sequence.
- Collision rule: when two members claim one IPv4 address, the one whose public key is lower
  (bytes comparison) keeps it and the other moves to its next candidate. So a member's
  address is its first candidate not claimed by a member with a lower key (``choose``); what
  members with higher keys claim is ignored, as they are the ones to move.
- Convergence: the lowest key never moves; once the k lowest keys are settled the (k+1)-th
  settles on its next re-choice. With n members re-choosing from each other's claims, all
  addresses are distinct after at most n - 1 rounds, and in practice after one: in a /16 a
  collision needs two members among a few hundred to draw the same of 65,534 hosts.
- The rule is stateless: a member that moved returns to an earlier candidate once the member
  with precedence leaves the view.
- Addresses the owner signed into members' certificates (``bound``) have precedence over
  every derived claim: ``choose`` never picks one and ``conflicts`` moves us off one. A member
  with such a certificate does not derive at all. Every certificate the owner issues names
  one; the derived rule serves only certificates from before, whose holders renew them at
  start (``cert.renew_due``) and derive meanwhile.
- IPv6. ``ula`` is an RFC 4193 unique local address: fd00::/8, a 40-bit global id from
  sha256 of the swarm id (one /48 per swarm), subnet 0, and a 64-bit interface id from sha256
  of the public key. 64 bits make collisions negligible, so there is no rule for them.
"""

from __future__ import annotations

import hashlib
import ipaddress
import itertools
from collections.abc import Iterable, Iterator, Mapping
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

DEFAULT_NETWORK = IPv4Network("10.211.0.0/16")  # 10/8 is RFC 1918; .211 is unlikely to be a LAN's
ADDR_DOMAIN = b"swarmd wg addr\0"
ULA_DOMAIN = b"swarmd wg ula\0"
IID_DOMAIN = b"swarmd wg iid\0"
MAX_PREFIXLEN = 30  # a /30 has two hosts; /31 and /32 have no network and broadcast to skip


class NetworkFull(ValueError):
    """Every host address of the overlay network is held by a member with precedence."""


def candidates(swarm: str, public: bytes, network: IPv4Network = DEFAULT_NETWORK) -> Iterator[IPv4Address]:
    """This member's IPv4 candidates in order of preference; endless, and may repeat in a
    small network."""
    network = _check_network(network)
    size = network.num_addresses
    base = int(network.network_address)
    prefix = ADDR_DOMAIN + swarm.encode("utf-8") + public
    for counter in itertools.count():
        digest = hashlib.sha256(prefix + counter.to_bytes(8, "big")).digest()
        offset = int.from_bytes(digest[:8], "big") % size
        if offset in (0, size - 1):
            continue
        yield IPv4Address(base + offset)


def choose(swarm: str, me: bytes, claims: Mapping[bytes, IPv4Address],
           network: IPv4Network = DEFAULT_NETWORK, bound: Iterable[IPv4Address] = ()) -> IPv4Address:
    """This member's address: its first candidate not claimed by another member with a lower
    public key, nor named in another member's certificate (``bound``). ``claims`` maps each
    member's public key to its advertised address (ours may be among them; it is ignored)."""
    network = _check_network(network)
    ends = (network.network_address, network.broadcast_address)
    claimed = {ipaddress.IPv4Address(addr) for key, addr in claims.items() if key < me}
    claimed |= {ipaddress.IPv4Address(addr) for addr in bound}
    blocked = {a for a in claimed if a in network and a not in ends}
    if len(blocked) >= network.num_addresses - 2:
        raise NetworkFull(
            f"overlay network {network} has {network.num_addresses - 2} host addresses, all held by "
            "members with precedence: configure a larger overlay network")
    for addr in candidates(swarm, me, network):
        if addr not in blocked:
            return addr
    raise AssertionError("unreachable: candidates() is endless")


def conflicts(me: bytes, my_addr: IPv4Address, claims: Mapping[bytes, IPv4Address],
              bound: Iterable[IPv4Address] = ()) -> bool:
    """True when this member must move: a member with a lower key claims ``my_addr``, or
    another member's certificate names it."""
    mine = ipaddress.IPv4Address(my_addr)
    if any(ipaddress.IPv4Address(a) == mine for a in bound):
        return True
    return any(key < me and ipaddress.IPv4Address(addr) == mine for key, addr in claims.items())


def ula_prefix(swarm: str) -> IPv6Network:
    """The swarm's /48: fd00::/8 plus a 40-bit global id (RFC 4193 section 3.2)."""
    global_id = int.from_bytes(hashlib.sha256(ULA_DOMAIN + swarm.encode("utf-8")).digest()[:5], "big")
    return IPv6Network(((0xFD << 120) | (global_id << 80), 48))


def ula(swarm: str, public: bytes) -> IPv6Address:
    """This member's address in the swarm's /48: subnet 0, interface id from the key."""
    iid = int.from_bytes(hashlib.sha256(IID_DOMAIN + public).digest()[:8], "big")
    return IPv6Address(int(ula_prefix(swarm).network_address) | iid)


def _check_network(network: IPv4Network) -> IPv4Network:
    if not isinstance(network, IPv4Network):
        raise TypeError(f"overlay network must be an IPv4Network, got {network!r}")
    if network.prefixlen > MAX_PREFIXLEN:
        raise ValueError(f"overlay network {network} has no host addresses: use a /{MAX_PREFIXLEN} "
                         "or larger (the default is /16)")
    return network
