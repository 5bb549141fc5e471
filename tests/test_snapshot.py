"""The one door to the membership (DESIGN principle 7): an immutable, versioned snapshot.

Mesh, placement (in a worker thread), the control API and the gossip driver read ``View``;
nobody outside the core touches its live ``members`` dict."""

from __future__ import annotations

import ast
import dataclasses
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from swarmd.gossip.membership import Membership, MemberView, State, Timing, View
from swarmd.gossip.wire import Record, Rumor


INFINITE_CERT = SimpleNamespace(expires=float("inf"))


def record(peer: str, seq: int, addrs: tuple[str, ...] = ("/ip4/10.0.0.1/tcp/4001",)) -> Record:
    return Record(swarm="s", peer=peer, seq=seq, issued=0.0, ttl=120.0, addrs=addrs, resources=None,  # type: ignore[arg-type]
                  labels={}, wg=None, cert=INFINITE_CERT, blob=b"")  # type: ignore[arg-type]


ROOT = Path(__file__).resolve().parent.parent
# attributes named `members` that are not the core's: (file, the expression's source)
NOT_THE_CORE = {("swarmd/metrics.py", "self.members"),
                ("swarmd/compute/workdir.py", "tar.members")}  # tarfile's list of headers read
# the trio driver of the membership core: Gossip (service.py) and its modules
DRIVER = {f"swarmd/gossip/{m}.py"
          for m in ("service", "state", "loop", "inbound", "probes", "sync", "peers", "gate", "records")}


def test_nobody_outside_the_core_reads_its_members():
    offenders = []
    for path in sorted((ROOT / "swarmd").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel == "swarmd/gossip/membership.py":
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and node.attr == "members":
                expr = ast.get_source_segment(source, node)
                if (rel, expr) not in NOT_THE_CORE:
                    offenders.append(f"{rel}:{node.lineno}: {expr}")
    assert not offenders, "read gossip.view() instead of the core's live dict:\n" + "\n".join(offenders)


def test_only_the_driver_holds_the_core():
    offenders = []
    for path in sorted((ROOT / "swarmd").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel in DRIVER or rel == "swarmd/gossip/membership.py":
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and node.attr == "core":
                offenders.append(f"{rel}:{node.lineno}: {ast.get_source_segment(source, node)}")
    assert not offenders, "read gossip.view(), not gossip.core:\n" + "\n".join(offenders)


def node_with(*peers: str) -> Membership:
    node = Membership("me", 1 << 32, Timing.wan(), random.Random(1), 0.0)
    for p in peers:
        node.receive_record(0.0, record(p, 10))
    node.take_actions()
    return node


def test_a_snapshot_is_immutable():
    view = node_with("x").view()
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.version = 7  # type: ignore[misc]
    with pytest.raises(TypeError):
        view.members["y"] = view.members["x"]  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.get("x").state = State.DEAD  # type: ignore[misc, union-attr]
    assert not hasattr(view.get("x"), "__dict__"), "slotted"


def test_the_same_snapshot_until_something_changes():
    node = node_with("x", "y")
    first = node.view()
    assert node.view() is first
    assert node.receive_record(1.0, record("x", 10)) == "duplicate"
    assert node.receive_record(1.0, record("x", 9)) == "old"
    assert node.view() is first, "nothing changed"

    node.receive_record(2.0, record("x", 11))
    second = node.view()
    assert second is not first and second.version > first.version
    assert first.get("x").record.seq == 10 and second.get("x").record.seq == 11, "the old one did not move"

    node.rtt_sample("y", 0.05)
    third = node.view()
    assert third.version > second.version and third.get("y").rtt_min == 0.05 and second.get("y").rtt_min is None

    node.receive_rumor(3.0, Rumor(kind="suspect", swarm="s", sender="z", about="x", incarnation=11, issued=0.0, blob=b""))
    assert node.view().get("x").state is State.SUSPECT and third.get("x").state is State.ALIVE


def test_a_snapshot_is_consistent_with_the_core():
    node = node_with("a", "b", "c")
    node.receive_rumor(1.0, Rumor(kind="left", swarm="s", sender="c", about="c", incarnation=10, issued=0.0, blob=b""))
    view = node.view()
    assert {m.peer for m in view} == set(node.members) and len(view) == 3
    for m in view:
        live = node.members[m.peer]
        assert (m.state, m.record, m.since, m.stale) == (live.state, live.record, live.since, live.stale)
    assert view.counts() == {"alive": 2, "suspect": 0, "dead": 0, "left": 1}
    assert {m.peer for m in view.in_service()} == {"a", "b"}
    assert isinstance(view, View) and all(isinstance(m, MemberView) for m in view)
    assert "a" in view and "zz" not in view and view.get("zz") is None


def test_an_empty_view_before_any_swarm():
    view = View.empty("me")
    assert len(view) == 0 and view.counts()["alive"] == 0 and view.version == 0


def test_a_stale_member_leaves_the_mesh_and_placement_until_it_publishes():
    from types import SimpleNamespace

    from swarmd.compute.coordinator.coordinator import Jobs, _rtt_ms
    from swarmd.gossip.wire import MeshInfo
    from swarmd.mesh import Mesh

    node = Membership("me", 1 << 32, Timing.wan(), random.Random(1), 0.0)
    wg = MeshInfo(public=bytes(32), addr4="10.211.0.2", addr6=None, port=51820, endpoints=())
    for p in ("x", "y"):
        node.receive_record(0.0, dataclasses.replace(record(p, 10), ttl=10.0 if p == "x" else 120.0, wg=wg))
    node.rtt_sample("x", 0.02)
    node.handle_timeout(10.0)
    view = node.view()
    gossip = SimpleNamespace(view=lambda: view, own_record=None, me="me")
    assert [peer for peer, _ in Mesh._view(SimpleNamespace(gossip=gossip))] == ["y"]
    assert {p: state for p, (state, _) in Jobs._records(SimpleNamespace(gossip=gossip), view).items()} == \
        {"x": "stale", "y": "alive"}
    assert _rtt_ms(view, "me", "x") == pytest.approx(20.0), "what we measured stays known"
    node.receive_record(11.0, dataclasses.replace(record("x", 11), wg=wg))
    assert node.view().get("x").in_service
