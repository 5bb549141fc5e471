"""A connection's remote address (p2p/host.remote_ip, remote_ips): the one place it is read,
for the relay's requester, the relay we send through, and the job firewall's known hosts."""

from __future__ import annotations

from types import SimpleNamespace

from libp2p.peer.id import ID

from swarmd.p2p.host import remote_ip, remote_ips


def conn(remote):
    def address():
        if isinstance(remote, Exception):
            raise remote
        return remote
    return SimpleNamespace(get_remote_address=address)


def test_the_remote_ip_is_canonical_and_a_mapped_ipv4_is_the_ipv4_it_is():
    assert remote_ip(conn(("192.0.2.7", 4001))) == "192.0.2.7"
    assert remote_ip(conn(("::ffff:192.0.2.7", 4001))) == "192.0.2.7"
    assert remote_ip(conn(("2001:DB8:0:0::1", 4001))) == "2001:db8::1"


def test_a_connection_without_an_ip_has_none():
    assert remote_ip(conn(None)) is None
    assert remote_ip(conn(())) is None
    assert remote_ip(conn(("not an address", 1))) is None
    assert remote_ip(conn(OSError("closed"))) is None
    assert remote_ip(SimpleNamespace()) is None, "a transport without addresses"


def test_remote_ips_of_every_live_connection_and_none_for_a_peer_id_that_does_not_parse():
    peer = ID(b"\x00\x04peer")
    conns = {peer: [SimpleNamespace(muxed_conn=conn(("192.0.2.7", 4001))),
                    SimpleNamespace(muxed_conn=conn(None)),
                    SimpleNamespace(muxed_conn=conn(("::ffff:198.51.100.1", 4001)))]}
    host = SimpleNamespace(get_network=lambda: SimpleNamespace(get_connections=lambda pid: conns.get(pid, [])))
    assert remote_ips(host, peer.to_base58()) == ["192.0.2.7", "198.51.100.1"]
    assert remote_ips(host, "not a peer id") == []
    assert remote_ips(host, ID(b"\x00\x04else").to_base58()) == []
