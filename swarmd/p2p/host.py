"""The libp2p host, configured the way DESIGN requires, and the bootstrap dialer.

Security: Noise is the only security transport offered; py-libp2p's default would also
accept /plaintext/2.0.0. Muxer: yamux only. ``remote_ip`` and ``remote_ips``: the one place
a connection's remote address is read (its TCP peer: what Noise authenticated came from
there, unlike any address a record or a frame claims).
"""

from __future__ import annotations

import ipaddress
import random
from collections.abc import Sequence
from typing import Any

import structlog
import trio
from libp2p import create_yamux_muxer_option, new_host
from libp2p.abc import IHost
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from multiaddr import Multiaddr

from ..identity import Identity
from . import multiaddrs

log = structlog.get_logger("swarmd.gossip")

BOOTSTRAP_RETRY_MAX = 30.0  # seconds; a provider's peer may be down for minutes
BOOTSTRAP_CHECK = 5.0  # how often a connected bootstrap peer is checked
# py-libp2p 0.8.1 refuses every dial to a peer for 60 s once all its addresses failed. Our
# failure detector decides when to try a peer again (probes, reconnects to dead members);
# a minute-long refusal kept the two sides of a healed partition apart, measured in netlab.
DIAL_BLOCK = 0.5


def make_host(identity: Identity, listen: Sequence[str]) -> IHost:
    noise = NoiseTransport(identity.key_pair, noise_privkey=new_x25519_pair().private_key)
    host = new_host(
        key_pair=identity.key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt=create_yamux_muxer_option(),
        listen_addrs=[Multiaddr(a) for a in listen],
    )
    host.get_network()._negative_peer_cache._ttl = DIAL_BLOCK  # no public knob in 0.8.1
    _refuse_unspecified(host.get_peerstore())
    return host


def _refuse_unspecified(peerstore) -> None:
    """Keep 0.0.0.0 and :: out of the address book. Identify and gossipsub's peer exchange
    copy a peer's *listen* addresses into it, and a daemon listening on 0.0.0.0 is dialled
    there, which reaches ourselves: the Noise handshake fails on the peer id, and a dial
    that tries that address too fails as a whole (measured: a healed partition stayed split
    for 15-30 s). Records carry announce addresses, which is what we dial."""
    add = peerstore.add_addrs

    def add_addrs(peer_id, addrs, ttl: int = 0) -> None:
        add(peer_id, [a for a in addrs if not _unspecified(a)], ttl)

    peerstore.add_addrs = add_addrs


def _unspecified(addr: Multiaddr) -> bool:
    text = str(addr)
    return text.startswith(("/ip4/0.0.0.0/", "/ip6/::/"))


def announce_addrs(host: IHost, announce: Sequence[str], overlay: str | None = None) -> list[str]:
    """What peers should dial: the configured addresses, else the listen addresses with
    0.0.0.0 expanded to this host's non-loopback IPv4 addresses (a peer cannot dial 0.0.0.0),
    leaving out the WireGuard overlay's (`overlay`, a network): those ride on the mesh, which
    itself needs these addresses to form. A listen address on loopback or link-local is left
    out unless there is nothing else: members refuse a record with one (wire.Verifier), unless
    they are on loopback only themselves."""
    if announce:
        return list(announce)
    out: list[str] = []
    for addr in host.get_addrs():
        text = str(addr).split("/p2p/")[0]
        if text.startswith("/ip4/0.0.0.0/"):
            rest = text[len("/ip4/0.0.0.0"):]
            out += [f"/ip4/{ip}{rest}" for ip in local_ipv4(overlay)]
        else:
            out.append(text)
    reachable = [a for a in out if not _host_only(a)]
    return (reachable or out)[:16]


def _host_only(addr: str) -> bool:
    """A loopback or link-local multiaddr: nobody else can dial it."""
    ip = multiaddrs.ip_of(addr)
    return ip is not None and (ip.is_loopback or ip.is_link_local)


def local_ipv4(overlay: str | None) -> list[str]:
    import ipaddress
    import socket

    import psutil

    skip = ipaddress.IPv4Network(overlay) if overlay else None
    ips = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
           if a.family == socket.AF_INET and not a.address.startswith(("127.", "169.254."))
           and not (skip and ipaddress.IPv4Address(a.address) in skip)]
    return sorted(set(ips)) or ["127.0.0.1"]


async def mdns_connector(host: IHost, addrs: list[str]) -> None:
    """Advertise ``addrs`` over mDNS and dial the peers it discovers.

    py-libp2p's own mDNS (``enable_mDNS``) advertises the listen addresses as they are, so a
    daemon listening on 0.0.0.0 told its neighbours to dial 0.0.0.0, which is themselves
    (measured: every dial failed its Noise handshake). We give it the announce addresses.
    """
    from libp2p.discovery.events.peerDiscovery import peerDiscovery
    from libp2p.discovery.mdns.mdns import MDNSDiscovery

    port = multiaddrs.tcp_port(addrs, 4001)
    mdns = await trio.to_thread.run_sync(lambda: MDNSDiscovery(host.get_network(), port=port, listen_addrs=addrs))

    send, receive = trio.open_memory_channel[PeerInfo](64)
    token = trio.lowlevel.current_trio_token()

    def found(info: PeerInfo) -> None:
        def put() -> None:
            try:
                send.send_nowait(info)
            except trio.WouldBlock:
                log.debug("mdns: too many discoveries at once; dropping one", peer=str(info.peer_id))
        token.run_sync_soon(put)

    peerDiscovery.register_peer_discovered_handler(found)
    mdns.start()
    try:
        async for info in receive:
            if info.peer_id != host.get_id() and info.peer_id not in host.get_connected_peers():
                with trio.move_on_after(10):
                    try:
                        await host.connect(info)
                        log.info("mdns peer connected", peer=str(info.peer_id))
                    except Exception as exc:
                        log.debug("mdns peer unreachable", peer=str(info.peer_id), error=str(exc))
    finally:
        peerDiscovery.unregister_peer_discovered_handler(found)
        mdns.stop()


def retry_delay(attempt: int, rng: random.Random) -> float:
    """Exponential backoff from 0.5 s, capped, with full jitter (AWS architecture blog)."""
    return rng.uniform(0, min(BOOTSTRAP_RETRY_MAX, 0.5 * 2 ** attempt))


async def keep_connected(host: IHost, addr: str, rng: random.Random) -> None:
    """Dial a bootstrap peer until connected, and again whenever the connection drops."""
    info = info_from_p2p_addr(Multiaddr(addr))
    attempt = 0
    while True:
        if info.peer_id in host.get_connected_peers():
            attempt = 0
            await trio.sleep(BOOTSTRAP_CHECK)
            continue
        try:
            await host.connect(info)
            log.info("bootstrap peer connected", peer=str(info.peer_id), addr=addr)
            attempt = 0
        except Exception as exc:  # libp2p raises many types for an unreachable peer
            delay = retry_delay(attempt, rng)
            log.debug("bootstrap dial failed", addr=addr, error=str(exc), retry_in=round(delay, 2))
            attempt += 1
            await trio.sleep(delay)


def remote_ip(muxed_conn: Any) -> str | None:
    """The IP address a connection (``stream.muxed_conn``, a connection's ``muxed_conn``)
    comes from, canonical, an IPv4-mapped one as the IPv4 address it is (how a dual-stack
    listener shows an IPv4 peer); None where the transport has none."""
    try:
        ip = ipaddress.ip_address(str(muxed_conn.get_remote_address()[0]))
    except Exception:  # no address (a transport without one), or not an IP
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def remote_ips(host: IHost, peer: str) -> list[str]:
    """The remote addresses of our live connections to ``peer``, in the network's order;
    none for a peer id that does not parse."""
    try:
        conns = host.get_network().get_connections(ID.from_base58(peer))
    except Exception:
        return []
    return [ip for conn in conns if (ip := remote_ip(conn.muxed_conn)) is not None]
