"""`lab crash` / `lab revive`, the parts that need no lab: what a cut link's wirefilter is
told, which processes share a network namespace, and the refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sim import cli
from sim.netlab import lab as labmod
from sim.netlab import topology
from sim.netlab.state import HostState, LabState


def _link(**kw) -> topology.Link:
    return topology.Link(**{"a": "h1", "b": "h2", "pair": 0, "a_addr": "10.250.0.1", "b_addr": "10.250.0.2",
                            "rtt_ms": 10.0, "loss_pct": 2.5, "bandwidth_mbit": 8.0} | kw)


def test_a_cut_link_loses_everything_and_keeps_its_settings():
    link = _link()
    assert labmod.wirefilter_commands(link) == ["delay 5", "loss 2.5", "bandwidth 1000000"]
    assert labmod.wirefilter_commands(link, cut=True) == ["delay 5", "loss 100", "bandwidth 1000000"]
    assert (link.loss_pct, link.up) == (2.5, True)  # what revive restores
    assert labmod.wirefilter_commands(_link(up=False)) == ["delay 5", "loss 100", "bandwidth 1000000"]
    assert labmod.wirefilter_commands(_link(bandwidth_mbit=None, loss_pct=0.0)) == ["delay 5", "loss 0", "bandwidth 0"]


def test_netns_pids_are_the_processes_of_that_namespace():
    mine = labmod.netns_pids("/proc/self/ns/net")
    assert os.getpid() in mine
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in labmod.netns_pids(f"/proc/{os.getpid()}/ns/net")
    finally:
        child.kill()
        child.wait()
    assert child.pid not in labmod.netns_pids("/proc/self/ns/net")  # gone (and reaped): not listed


def test_a_zombie_has_no_namespace_and_is_not_listed():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        while not Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            os.sched_yield()  # exits on its own; not reaped yet
        assert child.pid not in labmod.netns_pids("/proc/self/ns/net")
    finally:
        child.wait()


def _lab(tmp_path: Path, crashed: str | None = None) -> labmod.Lab:
    hosts, links = topology.plan(3, topology.uniform(10.0))
    state = LabState(name="unit", dir=str(tmp_path), links=links)
    for h in hosts:
        state.hosts.append(HostState(name=h.name, index=h.index, address=h.address, netns=f"sl-unit-{h.name}",
                                     state_dir="", socket="", log="", peer_id="", crashed=h.name == crashed))
    return labmod.Lab(state)


def test_crash_and_revive_refuse_what_makes_no_sense(tmp_path):
    with pytest.raises(labmod.LabError, match="h3 is already crashed: `swarm-sim lab revive h3`") as err:
        _lab(tmp_path, crashed="h3").crash("h3")
    assert err.value.status == 2
    with pytest.raises(labmod.LabError, match="h2 is not crashed") as err:
        _lab(tmp_path, crashed="h3").revive("h2")
    assert err.value.status == 2
    with pytest.raises(labmod.LabError, match="h3 is crashed: `swarm-sim lab revive h3`"):
        _lab(tmp_path, crashed="h3").start("h3")
    with pytest.raises(KeyError, match="no host 'h9'"):
        _lab(tmp_path).crash("h9")


def test_status_shows_a_crashed_host_and_its_cut_links(tmp_path):
    status = _lab(tmp_path, crashed="h3").status()
    assert {h["host"]: h["daemon"] for h in status["hosts"]}["h3"] == "crashed"
    assert {(l["a"], l["b"]): l["cut"] for l in status["links"]} == {
        ("h1", "h2"): False, ("h1", "h3"): True, ("h2", "h3"): True}


def test_crash_and_revive_parse():
    args = cli.parse(["lab", "crash", "h3", "--name", "q"])
    assert (args.command, args.host, args.name) == ("crash", "h3", "q")
    args = cli.parse(["lab", "revive", "h2"])
    assert (args.command, args.host, args.name) == ("revive", "h2", "lab")


def test_crash_on_a_missing_lab_says_so(capsys):
    assert cli.main(["lab", "crash", "--name", "no-such-lab-here", "h1"]) == 2
    assert "no lab named 'no-such-lab-here'" in capsys.readouterr().err
