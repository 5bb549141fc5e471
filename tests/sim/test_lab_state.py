"""The lab's state with NAT routers, and the daemons' command lines behind them (no root needed)."""

from __future__ import annotations

import json

import pytest

from sim.netlab import lab as labmod
from sim.netlab import state as statemod
from sim.netlab.state import HostState, LabState


def host(i: int, nat: str = "public") -> HostState:
    return HostState(name=f"h{i}", index=i, address=f"10.200.0.{i}", netns=f"sl-t-h{i}", state_dir=f"/x/h{i}/state",
                     socket=f"/x/h{i}/swarmd.sock", log=f"/x/h{i}/swarmd.log", peer_id=f"12D3Koo{i}", nat=nat,
                     router=None if nat == "public" else labmod.router_netns("t", i),
                     private_address="192.168.1.2" if nat not in ("public", "firewall") else None)


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setattr(statemod, "ROOT", tmp_path)
    return tmp_path


def test_a_nat_lab_survives_a_save_and_load(root):
    state = LabState(name="t", dir=str(root / "t"), hosts=[host(1), host(2, "eim-apdf"), host(3, "firewall")],
                     nat_udp_timeout=4, nat_udp_stream_timeout=60)
    state.hosts[1].nat_generation = 3
    (root / "t").mkdir()
    state.save()
    assert LabState.load("t") == state
    assert [h.edge for h in state.hosts] == ["sl-t-h1", "sl-t-r2", "sl-t-r3"]  # where the taps are


def test_a_state_file_from_before_nat_loads_as_all_public(root):
    (root / "old").mkdir()
    old = {"name": "old", "dir": str(root / "old"), "links": [],
           "hosts": [{"name": "h1", "index": 1, "address": "10.200.0.1", "netns": "sl-old-h1", "state_dir": "s",
                      "socket": "k", "log": "l", "peer_id": "p", "country": None, "pid": None, "crashed": False}]}
    (root / "old" / "lab.json").write_text(json.dumps(old))
    state = LabState.load("old")
    assert state.hosts[0].nat == "public" and state.hosts[0].router is None and state.hosts[0].edge == "sl-old-h1"
    assert (state.nat_udp_timeout, state.nat_udp_stream_timeout) == (30, 120)


def test_router_namespaces_share_the_labs_prefix_that_down_removes():
    assert labmod.router_netns("lab", 4) == "sl-lab-r4"


def test_natted_daemons_announce_nothing_and_everyone_bootstraps_through_public_hosts(monkeypatch):
    monkeypatch.setattr(labmod, "job_user", lambda: "nobody")
    lab = labmod.Lab(LabState(name="t", dir="/x", hosts=[host(1), host(2, "eim-apdf"), host(3, "firewall"), host(4)]))

    def flags(name: str, h: HostState) -> list[str]:
        argv = lab.daemon_argv(h)
        return [argv[i + 1] for i, word in enumerate(argv) if word == name]
    h1, h2, h3, h4 = lab.state.hosts
    assert flags("--announce", h1) == ["/ip4/10.200.0.1/tcp/4001"]
    assert flags("--announce", h2) == flags("--announce", h3) == []
    assert flags("--bootstrap", h1) == ["/ip4/10.200.0.4/tcp/4001/p2p/12D3Koo4"]
    for h in (h2, h3):
        assert flags("--bootstrap", h) == ["/ip4/10.200.0.1/tcp/4001/p2p/12D3Koo1",
                                           "/ip4/10.200.0.4/tcp/4001/p2p/12D3Koo4"]
    assert lab.daemon_argv(h2)[1] == "--net=/run/netns/sl-t-h2"  # the host's namespace, not its router's


def test_a_bad_nat_is_refused_before_anything_is_made(monkeypatch):
    monkeypatch.setattr(labmod, "preflight", lambda **kw: pytest.fail("checked after the spec"))
    from sim.netlab import topology
    hosts, links = topology.plan(2, topology.uniform(1.0))
    with pytest.raises(labmod.LabError, match="unknown NAT class 'nope'") as err:
        labmod.Lab.up("t", hosts, links, nat={"h2": "nope"})
    assert err.value.status == 2
