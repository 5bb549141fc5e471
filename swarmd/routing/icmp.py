"""One ICMP echo over the overlay: does a relayed path carry the pair's packets?

A relay session's libp2p pings reach the relay, not through it. Whether the pair's WireGuard
packets really get through (the relay's rules in place, no firewall dropping forwarded
packets, no NAT in the way, an honest relay) shows only end to end: an echo to the peer's
overlay address, which its kernel answers through WireGuard, hence through the relay.
A raw ICMP socket (the daemon is root wherever relayed paths exist: the mesh needs it),
IPv4; the reply is matched by identifier and sequence. Returns the RTT in seconds, or
None when no reply came within ``timeout``; raises ``Unavailable`` when no raw socket can be
had (no CAP_NET_RAW, as under a unit whose capability set leaves it out): the path cannot be
checked, which says nothing about the path.
"""

from __future__ import annotations

import os
import socket
import struct
import time

import trio

ECHO_REQUEST, ECHO_REPLY = 8, 0
PAYLOAD = b"swarmd path check"


class Unavailable(OSError):
    """No raw ICMP socket here: echoes cannot be sent (not an unanswered echo)."""


def checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def echo_request(ident: int, seq: int) -> bytes:
    header = struct.pack("!BBHHH", ECHO_REQUEST, 0, 0, ident, seq)
    return struct.pack("!BBHHH", ECHO_REQUEST, 0, checksum(header + PAYLOAD), ident, seq) + PAYLOAD


def is_reply(packet: bytes, ident: int, seq: int) -> bool:
    """``packet`` as a raw IPv4 socket hands it over (IP header first) is our echo's reply."""
    if len(packet) < 20:
        return False
    start = (packet[0] & 0x0F) * 4
    if len(packet) < start + 8:
        return False
    kind, _, _, got_ident, got_seq = struct.unpack("!BBHHH", packet[start:start + 8])
    return kind == ECHO_REPLY and got_ident == ident and got_seq == seq


async def echo(address: str, timeout: float = 1.0) -> float | None:
    ident, seq = os.getpid() & 0xFFFF, int.from_bytes(os.urandom(2), "big")
    try:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    except OSError as exc:
        raise Unavailable(f"no raw ICMP socket ({exc.__class__.__name__}: {exc})") from None
    with sock:
        started = time.monotonic()
        with trio.move_on_after(timeout):
            try:
                await sock.sendto(echo_request(ident, seq), (address, 0))
                while True:
                    packet, (source, _) = await sock.recvfrom(2048)
                    if source == address and is_reply(packet, ident, seq):
                        return time.monotonic() - started
            except OSError:
                return None
    return None
