"""p2p/multiaddrs.py: one reading of a multiaddr for records, announcements, dials and the
job firewall; what it does not recognise is None (or a ValueError where a caller refuses)."""

from __future__ import annotations

import ipaddress

import pytest

from swarmd.p2p import multiaddrs


def test_parts_gives_the_first_ip_and_every_port_value_unchecked():
    assert multiaddrs.parts("/ip4/192.0.2.1/tcp/4001/p2p/12D3KooW") == (ipaddress.IPv4Address("192.0.2.1"), ["4001"])
    assert multiaddrs.parts("/dns4/example.org/udp/x/quic") == (None, ["x"])
    for bad in ("ip4/192.0.2.1/tcp/1", "/ip4", "/ip4/999.0.0.1/tcp/1", "/ip6/192.0.2.1/tcp/1", "",
                "/ip6/2001:db8::1%eth0/tcp/1"):
        with pytest.raises(ValueError):
            multiaddrs.parts(bad)


@pytest.mark.parametrize("addr, ip", [("/ip4/10.0.0.1/tcp/1", "10.0.0.1"), ("/ip6/fd00::1/tcp/1", "fd00::1"),
                                      ("/ip4/fd00::1/tcp/1", None), ("/ip6/10.0.0.1", None), ("/dns4/a/tcp/1", None),
                                      ("/ip4/010.0.0.1", None), ("x/ip4/10.0.0.1", None), ("/ip4", None),
                                      ("/ip6/2001:db8::1%eth0/tcp/1", None)])
def test_ip_of_reads_only_an_ip_of_the_named_family(addr, ip):
    got = multiaddrs.ip_of(addr)
    assert (None if got is None else str(got)) == ip


@pytest.mark.parametrize("addr, endpoint", [
    ("/ip4/10.0.0.1/tcp/4001/p2p/12D3KooW", ("10.0.0.1", 4001)),
    ("/ip6/FD00:0::1/tcp/65535", ("fd00::1", 65535)),  # canonical, as the firewall compares
    ("/ip4/10.0.0.1/udp/4001", None), ("/ip4/10.0.0.1/tcp/0", None), ("/ip4/10.0.0.1/tcp/65536", None),
    ("/ip4/10.0.0.1/tcp/\u0664\u0660\u0660\u0661", None), ("/ip4/10.0.0.1/tcp/123456", None),
    ("/ip4/10.0.0.1/tcp", None), ("/dns4/a/tcp/1", None)])
def test_tcp_endpoint_is_a_canonical_ip_and_a_port_of_1_to_65535(addr, endpoint):
    assert multiaddrs.tcp_endpoint(addr) == endpoint


def test_is_port_takes_ascii_digits_in_range_only():
    assert [multiaddrs.is_port(v) for v in ("1", "65535", "0", "65536", "\u00b2", "\u0664", "-1", "", "1e3")] == \
        [True, True, False, False, False, False, False, False, False]


def test_tcp_port_is_the_first_addrs_port_or_the_default():
    assert multiaddrs.tcp_port(["/ip4/10.0.0.1/udp/9", "/ip4/10.0.0.1/tcp/4002", "/ip4/10.0.0.2/tcp/4003"], 4001) == 4002
    assert multiaddrs.tcp_port(["/ip4/10.0.0.1/tcp/x"], 4001) == 4001
    assert multiaddrs.tcp_port([], 4001) == 4001
