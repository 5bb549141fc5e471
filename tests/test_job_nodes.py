"""service.job_nodes: a coordinator's `node_ips` open a job's egress only to what membership
vouches for. A certified member listing the provider's LAN, or an address it merely put in its
own record, gets nothing opened."""

from __future__ import annotations

from types import SimpleNamespace

from swarmd.compute.service import job_nodes


def member(peer: str, addr4: str | None, addrs: tuple[str, ...]) -> SimpleNamespace:
    wg = SimpleNamespace(addr4=addr4) if addr4 else None
    return SimpleNamespace(peer=peer, wg=wg, addrs=addrs)


def gossip(records, own) -> SimpleNamespace:
    views = [SimpleNamespace(record=r) for r in records]
    return SimpleNamespace(view=lambda: SimpleNamespace(in_service=lambda: views), own_record=own, me=own.peer)


def connections(ips: dict[str, str]):
    """Transport.remote_ips over these live connections (peer -> the address it comes from)."""
    return lambda peer: [ips[peer]] if peer in ips else []


ME = "12D3KooWEdBirCjWzeQP47EVJnyFirU4agfMYgkFLuaY3BknE5ty"
OTHER = "12D3KooWQufxqKx7zQbv8bF1SDZqZt32fdAZFPdYoNgy4VzHuuLb"


def test_with_the_mesh_up_only_members_overlay_addresses_are_opened():
    liar = member(OTHER, "10.211.0.2", ("/ip4/192.168.1.10/tcp/4001",))  # claims the provider's LAN box
    g = gossip([liar], member(ME, "10.211.0.1", ("/ip4/203.0.113.5/tcp/4001",)))
    got = job_nodes(g, ("10.211.0.1", "10.211.0.2", "192.168.1.10", "169.254.169.254"), mesh_up=True,
                    connected=connections({}))
    assert got.addresses == ("10.211.0.1", "10.211.0.2")


def test_without_the_mesh_only_addresses_a_member_is_connected_from_with_daemon_ports_closed():
    liar = member(OTHER, None, ("/ip4/192.168.1.10/tcp/4001", "/ip4/10.0.0.2/tcp/4001"))
    g = gossip([liar], member(ME, None, ("/ip4/10.0.0.1/tcp/4001",)))
    got = job_nodes(g, ("10.0.0.1", "10.0.0.2", "192.168.1.10"), mesh_up=False,
                    connected=connections({OTHER: "10.0.0.2"}))
    assert got.addresses == ("10.0.0.1", "10.0.0.2"), "the record's LAN claim is not opened"
    assert got.daemon_ports == (("10.0.0.1", 4001), ("10.0.0.2", 4001), ("192.168.1.10", 4001))


def test_every_members_daemon_port_is_closed_to_jobs_whatever_their_nodes_mesh_or_not():
    # issue 23 finding 11: with job_egress = internet a job reached any member's libp2p port
    # (a member not among its nodes, or any member's public address with the mesh up)
    far = member(OTHER, "10.211.0.2", ("/ip4/198.51.7.9/tcp/4001", "/ip6/2001:DB8::1/tcp/4002/p2p/x",
                                       "/ip4/1.2.3.4/tcp/\u00b2", "/ip4/not-an-ip/tcp/1", "/ip6/1.2.3.4/tcp/5",
                                       "/ip4/1.2.3.4/tcp/70000", "/dns4/example.org/tcp/4001"))
    own = member(ME, "10.211.0.1", ("/ip4/203.0.113.5/tcp/4001",))
    for mesh_up in (True, False):
        got = job_nodes(gossip([far], own), ("10.211.0.1",), mesh_up=mesh_up, connected=connections({}))
        # and at their overlay addresses, where daemons answer members behind NATs (issue 25)
        assert got.daemon_ports == (("10.211.0.1", 4001), ("10.211.0.2", 4001), ("10.211.0.2", 4002),
                                    ("198.51.7.9", 4001), ("2001:db8::1", 4002), ("203.0.113.5", 4001)), mesh_up


def test_a_nated_members_daemon_port_at_its_overlay_address_is_closed_to_jobs():
    natted = member(OTHER, "10.211.0.2", ())  # announces no address: dialled at its overlay address
    natted.wg.tcp = 4001
    got = job_nodes(gossip([natted], member(ME, "10.211.0.1", ("/ip4/203.0.113.5/tcp/4001",))), ("10.211.0.2",),
                    mesh_up=True, connected=connections({}))
    assert got.addresses == ("10.211.0.2",) and ("10.211.0.2", 4001) in got.daemon_ports
