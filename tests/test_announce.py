from types import SimpleNamespace

from swarmd.p2p.host import announce_addrs
from swarmd.gossip.wire import only_loopback


def host(*addrs):
    return SimpleNamespace(get_addrs=lambda: list(addrs))


def test_loopback_and_link_local_listen_addresses_are_not_announced_beside_reachable_ones():
    # members refuse a record naming them (wire.Verifier), so announcing one would hide the node
    got = announce_addrs(host("/ip4/127.0.0.1/tcp/4001", "/ip4/10.200.0.2/tcp/4001", "/ip6/fe80::1/tcp/4001",
                              "/ip6/::1/tcp/4001"), ())
    assert got == ["/ip4/10.200.0.2/tcp/4001"]


def test_a_node_on_loopback_only_announces_loopback_and_accepts_it():
    got = announce_addrs(host("/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWx"), ())
    assert got == ["/ip4/127.0.0.1/tcp/4001"] and only_loopback(got)


def test_configured_announce_addresses_are_used_as_given():
    assert announce_addrs(host("/ip4/127.0.0.1/tcp/1"), ["/ip4/203.0.113.7/tcp/4001"]) == ["/ip4/203.0.113.7/tcp/4001"]
