"""The relay's side for members behind NATs (swarmd/routing/server.py, relay.py): a request over
the overlay is pinned by the proven endpoint, a symmetric NAT's end is marked, and outsiders or
non-members naming a NATed end are refused and counted."""

from __future__ import annotations

from types import SimpleNamespace

from swarmd.gossip.membership import State
from swarmd.routing.relay import End, Grant, Refused, Relay
from test_routing_driver import A, B, C, IP, OVERLAY, R, ask, relay_server, serving, stream_from


def natted(routing, peer: str, mapping: tuple[str, int], nat: str) -> None:
    """``peer`` behind a NAT: no endpoints in its record, its class, its proven mapping."""
    m = routing.g.view().get(peer)
    m.record.wg = SimpleNamespace(port=m.record.wg.port, endpoints=(), nat=nat, reflexive=f"{mapping[0]}:{mapping[1]}")
    routing.wg_from[peer] = mapping


async def test_a_request_over_the_overlay_is_pinned_by_the_proven_endpoint(autojump_clock):
    srv, routing = relay_server()
    natted(routing, A, ("203.0.113.9", 61000), "eim")
    async with serving(srv):
        await srv.answer(ask(A, other=B), A, stream_from(A, remote=(OVERLAY[A], 4001)))
        assert (await srv.answer(ask(B, other=A), B, stream_from(B)))["active"]
    (pair,) = srv.relay.active()
    ends = {end.peer: end for end in (pair.a, pair.b)}
    assert (ends[A].ip, ends[A].wg_port, ends[A].pinned, ends[A].edm) == ("203.0.113.9", 61000, False, False)


async def test_over_the_overlay_without_a_proven_endpoint_is_refused(autojump_clock):
    srv, routing = relay_server()
    natted(routing, A, ("203.0.113.9", 61000), "eim")
    routing.wg_from.pop(A)
    reply = await srv.answer(ask(A, other=B), A, stream_from(A, remote=(OVERLAY[A], 4001)))
    assert reply["reason"] == "unproven" and routing.rejected("unproven") == 1 and srv.relay.pairs == 0


async def test_a_symmetric_nats_end_is_marked_edm(autojump_clock):
    srv, routing = relay_server()
    natted(routing, A, ("203.0.113.9", 61000), "edm")
    natted(routing, B, ("203.0.113.10", 62000), "edm")
    async with serving(srv):
        await srv.answer(ask(A, other=B), A, stream_from(A, remote=(OVERLAY[A], 4001)))
        assert (await srv.answer(ask(B, other=A), B, stream_from(B, remote=("203.0.113.10", 5555))))["active"]
    (pair,) = srv.relay.active()
    assert pair.a.edm and pair.b.edm and not pair.a.pinned and not pair.b.pinned


async def test_a_pinned_end_is_never_edm_whatever_its_record_says(autojump_clock):
    srv, routing = relay_server()
    m = routing.g.view().get(A)
    m.record.wg = SimpleNamespace(port=m.record.wg.port, endpoints=(IP[A],), nat="edm", reflexive=None)
    async with serving(srv):
        await srv.answer(ask(A, other=B), A, stream_from(A))
        await srv.answer(ask(B, other=A), B, stream_from(B))
    (pair,) = srv.relay.active()
    end = pair.a if pair.a.peer == A else pair.b
    assert end.pinned and not end.edm


async def test_an_outsider_naming_a_natted_end_is_refused_and_counted(autojump_clock):
    srv, routing = relay_server()
    natted(routing, A, ("203.0.113.9", 61000), "eim")
    outsider = "12D3KooWOutsiderOutsiderOutsiderOutsiderOutsider1"
    routing.wg_from[outsider] = ("203.0.113.50", 51820)
    reply = await srv.answer(ask(A, other=B), outsider, stream_from(A, remote=("203.0.113.50", 4001)))
    assert "port" not in reply and reply.get("reason") and srv.relay.pairs == 0
    assert sum(srv.rejected.values()) == 1 and routing.rejected(reply["reason"]) == 1


async def test_a_member_naming_a_natted_end_that_is_no_member_here_is_refused(autojump_clock):
    srv, routing = relay_server(a=State.ALIVE, b=State.ALIVE, r=State.ALIVE)
    natted(routing, A, ("203.0.113.9", 61000), "edm")
    reply = await srv.answer(ask(A, other=C), A, stream_from(A, remote=(OVERLAY[A], 4001)))
    assert reply["reason"] == "not_member" and routing.rejected("not_member") == 1 and srv.relay.pairs == 0


def test_the_core_forwards_a_natted_pair_only_for_members():
    members = {A, B}
    relay = Relay(R, is_member=members.__contains__, addresses=[IP[R]], exclude=("10.211.0.0/16",))
    nat_end = End(peer=A, ip="203.0.113.9", wg_port=61000, via_ip=IP[R], edm=True)
    stranger = End(peer="stranger", ip="203.0.113.50", wg_port=51820, via_ip=IP[R])
    refused = relay.request(0.0, stranger, A)
    assert isinstance(refused, Refused) and refused.reason == "not_member"
    refused = relay.request(0.0, nat_end, "stranger")
    assert isinstance(refused, Refused) and refused.reason == "not_member"
    assert relay.pairs == 0
    granted = relay.request(0.0, nat_end, B)
    assert isinstance(granted, Grant) and not granted.active
    both = End(peer=B, ip="203.0.113.8", wg_port=1, via_ip=IP[R], pinned=True, edm=True)
    refused = relay.request(0.0, both, A)
    assert isinstance(refused, Refused) and refused.reason == "malformed"
    bad = End(peer=B, ip="203.0.113.8", wg_port=1, via_ip=IP[R], edm="yes")  # type: ignore[arg-type]
    assert relay.request(0.0, bad, A).reason == "malformed"
