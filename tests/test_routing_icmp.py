"""routing/icmp.py: the overlay echo that checks a relayed path end to end. The packet codec
(checksum, the request, recognising our reply among everything a raw socket hands over) and,
as root, one real echo over loopback."""

from __future__ import annotations

import os
import struct

import pytest
import trio

from swarmd.routing import icmp


def ipv4_header(ihl: int = 5) -> bytes:
    """A raw IPv4 socket's packets start with the IP header (``ihl`` 32-bit words, options included)."""
    return bytes([0x40 | ihl]) + bytes(ihl * 4 - 1)


def message(kind: int, ident: int, seq: int, payload: bytes = icmp.PAYLOAD) -> bytes:
    header = struct.pack("!BBHHH", kind, 0, 0, ident, seq)
    return struct.pack("!BBHHH", kind, 0, icmp.checksum(header + payload), ident, seq) + payload


def test_checksum_is_the_internet_checksum():
    assert icmp.checksum(bytes.fromhex("0001f203f4f5f6f7")) == 0x220D  # RFC 1071's example
    assert icmp.checksum(b"") == 0xFFFF
    assert icmp.checksum(b"\xff\xff") == 0x0000
    assert icmp.checksum(b"\x01") == icmp.checksum(b"\x01\x00")  # an odd length is padded with a zero byte
    assert icmp.checksum(b"\x80\x00" * 2) == 0xFFFE  # 0x10000: the carry is folded back in
    assert icmp.checksum(b"\xff\xff" * 3) == 0x0000
    assert icmp.checksum(b"\x00\x01" * 40_000) == ~40_000 & 0xFFFF


@pytest.mark.parametrize("ident, seq", [(0, 0), (1, 2), (0xFFFF, 0xFFFF), (os.getpid() & 0xFFFF, 4242)],
                         ids=["zero", "small", "top", "our-pid"])  # named: the pid differs per process
def test_an_echo_request_is_well_formed(ident, seq):
    packet = icmp.echo_request(ident, seq)
    kind, code, _, got_ident, got_seq = struct.unpack("!BBHHH", packet[:8])
    assert (kind, code, got_ident, got_seq) == (icmp.ECHO_REQUEST, 0, ident, seq)
    assert packet[8:] == icmp.PAYLOAD
    assert icmp.checksum(packet) == 0  # a correct checksum sums the packet to zero


@pytest.mark.parametrize("ihl", [5, 6, 15])
def test_our_reply_is_recognised_after_any_ip_header(ihl):
    assert icmp.is_reply(ipv4_header(ihl) + message(icmp.ECHO_REPLY, 7, 9), 7, 9)
    assert icmp.is_reply(ipv4_header(ihl) + message(icmp.ECHO_REPLY, 7, 9)[:8], 7, 9)  # the header is enough


@pytest.mark.parametrize("packet", [
    ipv4_header() + message(icmp.ECHO_REPLY, 8, 9),  # another process's (or another check's) echo
    ipv4_header() + message(icmp.ECHO_REPLY, 7, 10),  # an earlier or later echo of ours
    ipv4_header() + message(icmp.ECHO_REQUEST, 7, 9),  # our own request (loopback hands it over too)
    ipv4_header() + message(3, 7, 9),  # destination unreachable
    ipv4_header() + message(11, 7, 9),  # time exceeded
    b"", ipv4_header()[:19], ipv4_header(), ipv4_header() + message(icmp.ECHO_REPLY, 7, 9)[:7],
    ipv4_header(6)[:20] + message(icmp.ECHO_REPLY, 7, 9)[:7],  # header length says 24: the reply is cut
    bytes([0x40]) + bytes(30),  # an IHL of 0
])
def test_anything_else_is_not_our_reply(packet):
    assert not icmp.is_reply(packet, 7, 9)


@pytest.mark.skipif(os.geteuid() != 0, reason="a raw ICMP socket needs root")
async def test_an_echo_to_loopback_is_answered_with_its_rtt():
    rtt = await icmp.echo("127.0.0.1", 2.0)
    assert isinstance(rtt, float) and 0 <= rtt < 2.0


@pytest.mark.skipif(os.geteuid() != 0, reason="a raw ICMP socket needs root")
async def test_an_echo_whose_reply_is_not_ours_gives_none_at_its_timeout(monkeypatch):
    # loopback answers, but for another identifier: that reply (and our own request, which the raw
    # socket sees too) is not taken for ours
    real = icmp.echo_request
    monkeypatch.setattr(icmp, "echo_request", lambda ident, seq: real(ident ^ 1, seq))
    start = trio.current_time()
    assert await icmp.echo("127.0.0.1", 0.3) is None
    assert 0.3 <= trio.current_time() - start < 1.0


async def test_without_a_raw_socket_an_echo_says_it_cannot_check(monkeypatch):
    # not an unanswered echo: under a unit without CAP_NET_RAW every relayed path would be "broken"
    def no_raw_socket(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(icmp.trio.socket, "socket", no_raw_socket)
    with pytest.raises(icmp.Unavailable, match="no raw ICMP socket"):
        await icmp.echo("127.0.0.1", 0.3)
