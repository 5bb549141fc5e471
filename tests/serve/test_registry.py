"""The registry table (swarmd/serve/registry.py): claims joined with hosts' announcements, a
name kept by its first controller, orphaned replicas, and what a misbehaving member gets."""

from dataclasses import dataclass, field

from swarmd.gossip.registry import ReplicaEntry, ServiceClaim
from swarmd.serve.registry import MAX_SERVICES, ORPHAN_S, Registry

C, D, H1, H2, H3 = "ctrl", "other", "h1", "h2", "h3"


@dataclass(frozen=True)
class Wg:
    addr4: str


@dataclass(frozen=True)
class Rec:
    services: tuple = ()
    replicas: tuple = ()
    wg: Wg | None = Wg("10.0.0.9")


@dataclass(frozen=True)
class M:
    peer: str
    record: Rec = field(default_factory=Rec)
    in_service: bool = True


def claim(name="embed", created=100.0, assigned=((0, H1), (1, H2))):
    return ServiceClaim(name=name, created=created, access="members", token_sha256=None, health="/healthz",
                        assigned=assigned)


def entry(index, controller=C, name="embed", port=31000, healthy=True):
    return ReplicaEntry(service=name, index=index, controller=controller, port=port, healthy=healthy)


def host(peer, *entries, addr="10.0.0.1"):
    return M(peer, Rec(replicas=entries, wg=Wg(addr)))


def test_replicas_are_the_hosts_announcements_that_the_controllers_claim_assigns():
    view = [M(C, Rec(services=(claim(),))), host(H1, entry(0), addr="10.0.0.1"),
            host(H2, entry(1, port=31001), addr="10.0.0.2")]
    s = Registry().update(0.0, view).get("embed")
    assert s.controller == C and not s.orphaned
    assert [(r.index, r.host, r.address, r.port) for r in s.replicas] == [(0, H1, "10.0.0.1", 31000),
                                                                          (1, H2, "10.0.0.2", 31001)]
    assert s.row()["replicas"][1]["port"] == 31001


def test_a_host_announcing_a_replica_it_was_not_assigned_gets_no_traffic():
    view = [M(C, Rec(services=(claim(),))), host(H1, entry(0)),
            host(H3, entry(1), entry(0, port=31002), entry(5, port=31003)),  # H2's index, H1's, and none
            host(H2, entry(0, controller=D))]  # under a controller that claims nothing
    t = Registry().update(0.0, view)
    assert [r.host for r in t.get("embed").replicas] == [H1]
    assert t.unassigned == 4


def test_a_name_stays_with_its_first_controller_while_it_lives():
    reg = Registry()
    reg.update(0.0, [M(C, Rec(services=(claim(created=100.0),))), host(H1, entry(0))])
    # a member claims the same name, backdated, and assigns itself
    view = [M(C, Rec(services=(claim(created=100.0),))), host(H1, entry(0)),
            M(D, Rec(services=(claim(created=1.0, assigned=((0, D),)),), replicas=(entry(0, controller=D),)))]
    s = reg.update(1.0, view).get("embed")
    assert s.controller == C and s.contenders == (D,) and [r.host for r in s.replicas] == [H1]
    # a node that sees both for the first time takes the oldest claim
    assert Registry().update(0.0, view).get("embed").controller == D


def test_replicas_serve_on_while_their_controller_is_gone_then_the_name_is_free():
    reg = Registry()
    reg.update(0.0, [M(C, Rec(services=(claim(),))), host(H1, entry(0))])
    s = reg.update(10.0, [host(H1, entry(0))]).get("embed")  # the controller crashed
    assert s.orphaned and [r.host for r in s.replicas] == [H1]
    late = [host(H1, entry(0)), M(D, Rec(services=(claim(assigned=((0, D),)),)))]
    assert reg.update(ORPHAN_S, late).get("embed").controller == C, "not taken while it lasts"
    assert reg.update(ORPHAN_S + 1, late).get("embed").controller == D
    assert Registry().update(0.0, [host(H1, entry(0))]).get("embed") is None, "no claim ever seen: no service"
    assert reg.update(ORPHAN_S + 2, []).services == {}


def test_hosts_out_of_service_are_not_routed_to_and_a_host_without_a_mesh_has_no_address():
    view = [M(C, Rec(services=(claim(),))), M(H1, Rec(replicas=(entry(0),)), in_service=False),
            M(H2, Rec(replicas=(entry(1),), wg=None))]
    assert [(r.host, r.address) for r in Registry().update(0.0, view).get("embed").replicas] == [(H2, None)]


def test_claims_beyond_the_bound_are_ignored_and_counted():
    controllers = [M(f"c{i}", Rec(services=tuple(claim(f"s{i}-{j}") for j in range(16))))
                   for i in range(MAX_SERVICES // 16 + 2)]
    t = Registry().update(0.0, controllers)
    assert len(t.services) == MAX_SERVICES and t.ignored == 32
