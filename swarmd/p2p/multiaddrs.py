"""A multiaddr's text, read one way everywhere (records, announcements, dials, the job
firewall): the shapes swarmd uses, ``/ip4|ip6/ADDR[/tcp|udp/PORT[/...]]``. Sans-IO; the
record's own checks (gossip/wire.py) decide what a member may advertise, these only read."""

from __future__ import annotations

import ipaddress
import re

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
_PORT = re.compile(r"[0-9]{1,5}")  # ASCII digits only (str.isdigit takes any script's)


def parts(addr: str) -> tuple[IP | None, list[str]]:
    """(its first IP if it names one, the values of its tcp/udp components, unchecked);
    ValueError when it is no multiaddr or its IP does not parse."""
    fields = addr.split("/")
    if len(fields) < 3 or fields[0] != "":
        raise ValueError(f"{addr!r} is not a multiaddr")
    ip, ports = None, []
    for proto, value in zip(fields[1:], fields[2:]):
        if proto in ("ip4", "ip6") and ip is None:
            if "%" in value:  # a zone names an interface of the host that wrote it: no address of ours
                raise ValueError(f"{addr!r} names an IPv6 zone")
            ip = ipaddress.IPv4Address(value) if proto == "ip4" else ipaddress.IPv6Address(value)
        elif proto in ("tcp", "udp"):
            ports.append(value)
    return ip, ports


def is_port(value: str) -> bool:
    """A TCP or UDP port written in ASCII digits, 1-65535 (str.isdigit would take "²", which
    int() then refuses)."""
    return bool(_PORT.fullmatch(value)) and 0 < int(value) < 65536


def ip_of(addr: str) -> IP | None:
    """The IP an ``/ip4/...`` or ``/ip6/...`` multiaddr starts with; None for anything else."""
    fields = addr.split("/")
    if len(fields) < 3 or fields[0] != "" or fields[1] not in ("ip4", "ip6") or "%" in fields[2]:
        return None
    try:
        return ipaddress.IPv4Address(fields[2]) if fields[1] == "ip4" else ipaddress.IPv6Address(fields[2])
    except ValueError:
        return None


def tcp_endpoint(addr: str) -> tuple[str, int] | None:
    """(canonical IP, port) of ``/ip4|ip6/IP/tcp/PORT[/...]`` with a port of 1-65535; None
    for anything else."""
    fields = addr.split("/")
    ip = ip_of(addr)
    if ip is None or len(fields) < 5 or fields[3] != "tcp" or not _PORT.fullmatch(fields[4]):
        return None
    port = int(fields[4])
    return (str(ip), port) if 0 < port < 65536 else None


def tcp_port(addrs: list[str], default: int) -> int:
    """The TCP port of the first of `addrs` that has one, else `default`."""
    for addr in addrs:
        fields = addr.split("/")
        for proto, value in zip(fields[1:], fields[2:]):
            if proto == "tcp" and _PORT.fullmatch(value):
                return int(value)
    return default
