"""The control socket's methods on a node whose parts are fakes: the rows `swarmctl peers`,
`mesh` and `route` draw, with routing running (a fake with exactly the interface of
routing.service.Routing: peer_rtt, path_row, explain, rtt_ms, status) and without it."""

from __future__ import annotations

import time
from types import MappingProxyType, SimpleNamespace
from typing import Any

import pytest
import trio

from swarmd import api
from swarmd.gossip.membership import MemberView, State, View
from swarmd.gossip.rtts import Rtts
from swarmd.rpc.protocol import Access, Caller, ErrorCode, RpcError
from swarmd.testing import FakeMesh

ME = "12D3KooWK99VoVxNE7XzyBwXEzW7xhK7Gpv85r9F3V3fyKSUKPH5"
H2 = "12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq"
H3 = "12D3KooWRndVhVZPCiQwHBBBdg769GyrPUW13zxwqQyf9r3ANaba"
H4 = "12D3KooWPT98FXMfDQYavZm66EeVjTqP9Nnehn1gyaydqV8L8BQw"
CALLER = Caller(pid=1, uid=0, gid=0, access=Access.ADMIN)


class FakeRouting:
    """Answers from tables, as routing.service.Routing's snapshot interface does."""

    def __init__(self, *, rtts: dict[str, tuple[float, str]] | None = None, paths: dict[str, dict] | None = None,
                 explained: dict[str, dict] | None = None, pairs: dict[frozenset[str], float] | None = None) -> None:
        self.rtts, self.paths, self.explained, self.pairs = rtts or {}, paths or {}, explained or {}, pairs or {}

    def peer_rtt(self, peer: str) -> tuple[float, str] | None:
        return self.rtts.get(peer)

    def path_row(self, peer: str) -> dict[str, Any]:
        return self.paths[peer]

    def explain(self, peer: str) -> dict[str, Any]:
        return self.explained[peer]

    def rtt_ms(self, a: str, b: str) -> float | None:
        return self.pairs.get(frozenset((a, b)))

    def status(self) -> dict[str, Any]:
        return {"relay": {"mode": "auto", "pairs": 0}}


def record(peer: str) -> SimpleNamespace:
    resources = SimpleNamespace(to_wire=lambda: {"cpu_count": 2}, summary=lambda: "2 CPUs")
    return SimpleNamespace(peer=peer, resources=resources, labels={}, addrs=(), seq=1, issued=time.time(),
                           rtts=Rtts(), jobs=None, wg=None, coord=None)


def view(members: dict[str, float | None]) -> View:
    """Alive members, each with this node's own probe EWMA (seconds) or none."""
    return View(version=1, me=ME, members=MappingProxyType({
        p: MemberView(peer=p, state=State.ALIVE, stale=False, record=record(p), since=0.0,
                      expires=1e9, rtt_ewma=rtt, rtt_min=rtt) for p, rtt in members.items()}))


def node(v: View, routing: FakeRouting | None, mesh: FakeMesh | None = None, **extra: Any) -> SimpleNamespace:
    gossip = SimpleNamespace(view=lambda: v, me=ME, swarm=SimpleNamespace(swarm="s1"),
                             own_record=extra.pop("own", None))
    return SimpleNamespace(gossip=gossip, routing=routing, mesh=mesh, config=SimpleNamespace(state_dir=None), log=None,
                           **{"mesh_off": None, **extra})


def call(n: SimpleNamespace, method: str, **params: Any) -> Any:
    handler = {m.name: m for m in api.methods(n)}[method].handler

    async def main() -> Any:
        return await handler(params, CALLER)
    return trio.run(main)


def test_peers_show_measured_and_estimated_rtts_with_their_source():
    routing = FakeRouting(rtts={H2: (42.123, "measured"), H3: (118.04, "estimated")})
    rows = {r["peer"]: r for r in call(node(view({H2: 0.05, H3: None, H4: None}), routing), "peers")["peers"]}
    assert (rows[H2]["rtt_ms"], rows[H2]["rtt_source"]) == (42.12, "measured")
    assert (rows[H3]["rtt_ms"], rows[H3]["rtt_source"]) == (118.04, "estimated")
    assert (rows[H4]["rtt_ms"], rows[H4]["rtt_source"]) == (None, None), "no probe and no coordinate"


def test_without_routing_peers_show_this_nodes_own_probes():
    rows = {r["peer"]: r for r in call(node(view({H2: 0.0421, H3: None}), None), "peers")["peers"]}
    assert (rows[H2]["rtt_ms"], rows[H2]["rtt_source"]) == (42.1, "measured")
    assert (rows[H3]["rtt_ms"], rows[H3]["rtt_source"]) == (None, None)


def test_peers_say_how_each_member_is_reached_as_its_record_says():
    v = view({H2: None, H3: None})
    v.members[H2].record.wg = SimpleNamespace(nat="eim", reflexive="203.0.113.5:40000")
    rows = {r["peer"]: r for r in call(node(v, None), "peers")["peers"]}
    assert (rows[H2]["nat"], rows[H2]["reflexive"]) == ("eim", "203.0.113.5:40000")
    assert (rows[H3]["nat"], rows[H3]["reflexive"]) == (None, None), "no mesh side"


def test_peers_give_each_members_network_coordinate_and_this_nodes_own_row_for_a_map():
    v = view({H2: None, H3: None})
    v.members[H2].record.coord = SimpleNamespace(to_wire=lambda: [12.5, -3.0, 0.1, 0.4, 0.0])
    own = record(ME)
    own.coord = SimpleNamespace(to_wire=lambda: [0.0, 1.0, 0.1, 0.2, 0.0])
    result = call(node(v, None, own=own), "peers")
    rows = {r["peer"]: r for r in result["peers"]}
    assert rows[H2]["coord"] == [12.5, -3.0, 0.1, 0.4, 0.0] and rows[H3]["coord"] is None
    assert result["me"]["peer"] == ME and result["me"]["coord"] == [0.0, 1.0, 0.1, 0.2, 0.0]
    assert ME not in rows, "the others only: `swarmctl peers` lists them"
    assert call(node(v, None), "peers")["me"] is None, "before this node's first record"


def test_mesh_rows_carry_the_path_its_rtt_the_direct_rtt_and_the_estimate():
    relayed = {"path": f"via {H3[-8:]}", "relay": H3, "relay_state": "active", "path_rtt_ms": 50.456,
               "direct_rtt_ms": 120.0, "estimate_ms": 117.9}
    routing = FakeRouting(paths={H2: relayed})
    result = call(node(view({H2: 0.12, H3: 0.02}), routing, FakeMesh([H2, H3, None])), "mesh")
    rows = {r["peer"]: r for r in result["peers"]}
    assert rows[H2] | relayed | {"path_rtt_ms": 50.46} == rows[H2] and rows[H2]["endpoint"] == "192.0.2.3:51820"
    assert rows[H3]["path"] is None and rows[H3]["path_rtt_ms"] is None, "a peer routing does not know: no path"
    assert rows[None]["path"] is None, "a device key no member owns"


def test_without_routing_every_mesh_path_is_direct_at_the_probed_rtt():
    rows = call(node(view({H2: 0.031}), None, FakeMesh([H2])), "mesh")["peers"]
    assert [(r["path"], r["path_rtt_ms"], r["direct_rtt_ms"], r["estimate_ms"], r["relay"]) for r in rows] == \
        [("direct", 31.0, 31.0, None, None)]


EXPLAINED = {"role": "chooser", "current": H3, "relay_state": "active", "direct_ms": 120.0,
             "candidates": [{"relay": H3, "leg1_ms": 20.0, "leg2_ms": 30.0, "total_ms": 50.0, "estimate_ms": 55.0}],
             "hysteresis": {"candidate": None, "rounds": 0, "needed": 3}}


@pytest.mark.parametrize("name", [H2, H2[:12], H2[-8:], f"  {H2[-6:]} "])
def test_route_names_a_peer_by_id_or_an_unambiguous_start_or_end(name):
    routing = FakeRouting(explained={H2: EXPLAINED})
    assert call(node(view({H2: 0.1, H3: 0.02}), routing, FakeMesh([])), "route", peer=name) == {"peer": H2, **EXPLAINED}


@pytest.mark.parametrize("name, message", [
    ("ASuq", "too short to name a peer: give at least 6 characters"),
    ("12D3KooW", "names 2 members"),  # every id starts so
    ("nobody", "no member's peer id starts or ends with 'nobody'"),
    (ME, "that is this node itself"),
    (H4, "is not a member this node has a path to"),  # a well-formed id outside the view
    (H3[-8:], "is not a member this node has a path to"),  # in the view, but routing has no path (dead, no mesh)
])
def test_route_refuses_a_peer_it_cannot_name_with_the_reason(name, message):
    routing = FakeRouting(explained={H2: EXPLAINED})
    with pytest.raises(RpcError) as err:
        call(node(view({H2: 0.1, H3: 0.02}), routing, FakeMesh([])), "route", peer=name)
    assert err.value.code == ErrorCode.INVALID_PARAMS and message in err.value.message, err.value.message


def test_route_without_routing_says_so():
    with pytest.raises(RpcError) as err:
        call(node(view({H2: 0.1}), None, FakeMesh([])), "route", peer=H2)
    assert err.value.code == ErrorCode.OPERATION_FAILED
    assert err.value.message == "route: path choice is not running on this node"


def test_route_needs_the_mesh():
    with pytest.raises(RpcError) as err:
        call(node(view({H2: 0.1}), FakeRouting(explained={H2: EXPLAINED}), mesh_off="mesh = off"), "route", peer=H2)
    assert err.value.code == ErrorCode.OPERATION_FAILED
    assert err.value.message == "route: the WireGuard mesh is off on this node (mesh = off)"


def test_route_is_a_read_method_with_a_required_peer():
    route = {m.name: m for m in api.methods(node(view({}), None))}["route"]
    assert route.access is Access.READ and route.params["peer"].required and route.params["peer"].type is str
