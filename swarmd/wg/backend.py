"""The WireGuard backend interface (the choice between kernel and wireguard-go is
`wg.choose`) and the netlink steps both share.

A backend owns one WireGuard interface in the daemon's network namespace:
- ``start`` creates it with a key, a listen port, overlay addresses (CIDR; the prefix gives
  the overlay route) and an MTU, and brings it up. A leftover interface of the same name (a
  crashed earlier run) is removed first.
- ``set_peers`` applies peer changes (``PeerConfig`` with ``remove=True`` deletes a peer);
  peers not named are left alone. The reconciler sends only differences.
- ``set_addresses`` replaces the overlay addresses (the overlay address moved).
- ``supervise`` runs for the interface's lifetime in the caller's nursery; when the device
  had to be recreated (wireguard-go died) it restores key, port, addresses and MTU, then
  calls ``on_restart`` so the caller re-pushes every peer (the new device has none).
- ``close`` removes the interface and whatever it left behind; it may be called at any time,
  twice, or while cancelled.
Failures raise ``BackendError`` (``BackendUnavailable`` when the backend cannot run here),
whose message names the interface and what went wrong.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Protocol

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from .uapi import DeviceState, PeerConfig

# Importing pyroute2 resets its logger to NOTSET (pyroute2/config/log.py), and it logs every
# netlink message at debug: at the daemon's debug level that drowned our lines.
logging.getLogger("pyroute2").setLevel(logging.WARNING)

PREFERENCES = ("auto", "kernel", "userspace")
IFNAMSIZ = 16  # Linux: names are at most 15 bytes plus the NUL
INSTALL_WG_GO = "apt-get install wireguard-go"
NO_KERNEL_MODULE = ("this kernel has no WireGuard module (/sys/module/wireguard is absent and a "
                    "'wireguard' link cannot be created; try modprobe wireguard)")


class BackendError(Exception):
    """A WireGuard backend operation failed; the message says which interface and why."""


class BackendUnavailable(BackendError):
    """The backend cannot run on this machine (no kernel module, no wireguard-go binary)."""


class Backend(Protocol):
    name: str  # "kernel" or "userspace"
    iface: str

    async def start(self, *, private_key: bytes, listen_port: int, addresses: Sequence[str],
                    mtu: int) -> None: ...

    async def set_peers(self, peers: Iterable[PeerConfig]) -> None: ...

    async def set_addresses(self, addresses: Sequence[str]) -> None: ...

    async def set_private_key(self, key: bytes) -> None: ...

    async def state(self) -> DeviceState: ...

    async def supervise(self, on_restart: Callable[[], Awaitable[object]]) -> None: ...

    async def close(self) -> None: ...


def check_ifname(name: str) -> str:
    """Linux's dev_valid_name, so that a bad name fails here and not deep in netlink."""
    if (not name or len(name.encode()) >= IFNAMSIZ or name in (".", "..")
            or any(c in "/:" or c.isspace() for c in name)):
        raise ValueError(f"interface name must be 1-{IFNAMSIZ - 1} bytes without '/', ':' or "
                         f"spaces, got {name!r}")
    return name


def check_link_settings(listen_port: int, addresses: Sequence[str], mtu: int) -> None:
    if not 0 <= listen_port <= 0xFFFF:
        raise ValueError(f"listen port must be 0..65535, got {listen_port}")
    parsed = check_addresses(addresses)
    # IPv6 needs an MTU of at least 1280 (RFC 8200 section 5); IPv4 at least 576 (RFC 791).
    floor = 1280 if any(p.version == 6 for p in parsed) else 576
    if not floor <= mtu <= 65535:
        raise ValueError(f"MTU must be {floor}..65535 for these addresses, got {mtu}")


def check_addresses(addresses: Sequence[str]) -> list[ipaddress.IPv4Interface | ipaddress.IPv6Interface]:
    if isinstance(addresses, str):
        raise ValueError(f"addresses must be a list of CIDR strings, got the string {addresses!r}")
    parsed = []
    for a in addresses:
        try:
            if not isinstance(a, str) or "/" not in a:
                raise ValueError
            parsed.append(ipaddress.ip_interface(a))
        except ValueError:
            raise ValueError(f"overlay address must be CIDR such as 10.211.3.4/16, got {a!r}") from None
    return parsed


# Netlink steps shared by both backends. Blocking (pyroute2): call them through
# trio.to_thread.run_sync. They act on the calling process's network namespace.

def link_index(iface: str) -> int | None:
    with IPRoute() as ipr:
        found = ipr.link_lookup(ifname=iface)
    return found[0] if found else None


def delete_link(iface: str) -> bool:
    """Delete ``iface`` if it exists; True if something was deleted."""
    with IPRoute() as ipr:
        found = ipr.link_lookup(ifname=iface)
        if not found:
            return False
        try:
            ipr.link("del", index=found[0])
        except NetlinkError as e:
            if e.code == errno.ENODEV:  # went away by itself meanwhile
                return False
            raise BackendError(f"cannot delete the leftover interface {iface}: {e}") from e
    return True


def configure_link(iface: str, addresses: Sequence[str], mtu: int) -> None:
    """Set MTU and addresses (the kernel adds each prefix's route) and bring the link up."""
    with IPRoute() as ipr:
        index = _index(ipr, iface)
        with _netlink_step(f"set MTU {mtu} on {iface}"):
            ipr.link("set", index=index, mtu=mtu)
        _sync_addresses(ipr, index, iface, addresses)
        with _netlink_step(f"bring {iface} up"):
            ipr.link("set", index=index, state="up")


def set_link_addresses(iface: str, addresses: Sequence[str]) -> None:
    """Make the link's addresses exactly ``addresses``, IPv6 link-local ones aside."""
    with IPRoute() as ipr:
        _sync_addresses(ipr, _index(ipr, iface), iface, addresses)


def _index(ipr: IPRoute, iface: str) -> int:
    found = ipr.link_lookup(ifname=iface)
    if not found:
        raise BackendError(f"interface {iface} does not exist (any more)")
    return found[0]


def _sync_addresses(ipr: IPRoute, index: int, iface: str, addresses: Sequence[str]) -> None:
    wanted = {(str(a.ip), a.network.prefixlen): a for a in map(ipaddress.ip_interface, addresses)}
    have = set()
    for msg in ipr.get_addr(index=index):
        ip = ipaddress.ip_address(msg.get_attr("IFA_LOCAL") or msg.get_attr("IFA_ADDRESS"))
        if not ip.is_link_local:  # the kernel's own fe80:: address stays
            have.add((str(ip), msg["prefixlen"]))
    # Remove before adding: deleting an IPv4 primary address also deletes the secondaries in
    # its subnet (unless promote_secondaries is set), the new address among them.
    for ip, prefixlen in have - wanted.keys():
        with _netlink_step(f"remove address {ip}/{prefixlen} from {iface}"):
            ipr.addr("del", index=index, address=ip, prefixlen=prefixlen)
    for (ip, prefixlen), a in wanted.items():
        if (ip, prefixlen) in have:
            continue
        hint = " (is IPv6 disabled here? net.ipv6.conf.*.disable_ipv6)" if a.version == 6 else ""
        with _netlink_step(f"add address {a} to {iface}", hint):
            ipr.addr("add", index=index, address=ip, prefixlen=prefixlen)


@contextlib.contextmanager
def _netlink_step(what: str, hint: str = "") -> Iterator[None]:
    try:
        yield
    except NetlinkError as e:
        reason = e.args[1] if len(e.args) > 1 else str(e)
        raise BackendError(f"cannot {what}: {reason}{hint}") from e
