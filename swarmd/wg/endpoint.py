"""A WireGuard endpoint's text, one form everywhere: ``IPv4:port`` or ``[IPv6]:port``, IP
literals only (wireguard-go parses endpoints with netip.ParseAddrPort). Sans-IO: the
reconciler, the UAPI and kernel backends and routing's relayed paths all use these two."""

from __future__ import annotations

import ipaddress


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``"10.0.0.1:51820"`` or ``"[fd00::1]:51820"`` -> (canonical IP, port); anything else
    (a name, a port out of 1-65535, an IPv6 address without brackets) is a ValueError."""
    host, sep, port_s = endpoint.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        if not sep or not port_s.isdigit() or not 0 < int(port_s) <= 0xFFFF:
            raise ValueError
        addr = ipaddress.ip_address(host[1:-1] if bracketed else host)
        if (addr.version == 6) != bracketed:
            raise ValueError
    except ValueError:
        raise ValueError(f"endpoint must be IPv4:port or [IPv6]:port, got {endpoint!r}") from None
    return str(addr), int(port_s)


def format_endpoint(ip: str, port: int) -> str:
    addr = ipaddress.ip_address(ip)
    return f"[{addr}]:{port}" if addr.version == 6 else f"{addr}:{port}"
