"""swarm-sim lab with real namespaces, vde2 links and swarmd daemons."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sim.netlab import lab as labmod

pytestmark = [pytest.mark.netlab, pytest.mark.slow]
SIM = [sys.executable, "-m", "sim.cli", "lab"]


def ping(lab, src: str, dst_addr: str, count: int = 4) -> tuple[float, float] | None:
    """(min, avg) RTT in ms, or None when nothing came back."""
    proc = subprocess.run(["ip", "netns", "exec", lab.state.host(src).netns, "ping", "-n", "-q", "-c", str(count),
                           "-i", "0.2", "-W", "1", dst_addr], capture_output=True, text=True)
    m = re.search(r"= ([\d.]+)/([\d.]+)/", proc.stdout)
    return (float(m.group(1)), float(m.group(2))) if m else None


def sim(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SIM, *args, "--name", name] if args[0] != "exec" else
                          [*SIM, args[0], "--name", name, *args[1:]], capture_output=True, text=True, timeout=120)


def test_measured_rtt_matches_the_matrix(lab):
    asked = {frozenset(("h1", "h2")): 10, frozenset(("h1", "h3")): 30, frozenset(("h1", "h4")): 60,
             frozenset(("h2", "h3")): 100, frozenset(("h2", "h4")): 4, frozenset(("h3", "h4")): 45}
    l = lab(4, lambda a, b: asked[frozenset((a.name, b.name))], daemons=False)
    for link in l.state.links:
        got = ping(l, link.a, l.state.host(link.b).address)
        assert got is not None, f"{link.a}->{link.b} unreachable"
        want = link.rtt_ms
        assert abs(got[0] - want) <= max(2.0, 0.2 * want), f"{link.a}-{link.b}: asked {want} ms, measured {got}"


def test_five_country_hosts_answer_status_and_obey_link_and_kill(lab):
    l = lab(5, countries=["DE", "US", "JP", "BR", "IN"])
    name = l.state.name
    for h in l.state.hosts:
        proc = sim(name, "exec", h.name, "--", "swarmctl", "status", "--json")
        assert proc.returncode == 0, proc.stderr
        status = json.loads(proc.stdout)
        assert status["peer_id"] == h.peer_id
    # the exit code of the command is the lab's exit code
    assert sim(name, "exec", "h1", "--", "sh", "-c", "exit 7").returncode == 7

    # link changes take effect
    h2 = l.state.host("h2").address
    assert sim(name, "link", "h1", "h2", "--rtt-ms", "150").returncode == 0
    assert abs(ping(l, "h1", h2, 3)[0] - 150) < 30
    assert sim(name, "link", "h1", "h2", "--down").returncode == 0
    assert ping(l, "h1", h2, 2) is None
    assert ping(l, "h1", l.state.host("h3").address, 2) is not None  # only that link
    assert sim(name, "link", "h1", "h2", "--up").returncode == 0
    assert ping(l, "h1", h2, 2) is not None

    # kill -9 and start: the same identity comes back
    assert sim(name, "kill", "h3", "--signal", "KILL").returncode == 0
    status = json.loads(sim(name, "status", "--json").stdout)
    assert {h["host"]: h["daemon"] for h in status["hosts"]}["h3"] == "dead"
    assert sim(name, "exec", "h3", "--", "swarmctl", "status").returncode == 3
    assert sim(name, "start", "h3").returncode == 0
    proc = sim(name, "exec", "h3", "--", "swarmctl", "status", "--json")
    assert json.loads(proc.stdout)["peer_id"] == l.state.host("h3").peer_id


def test_down_leaves_nothing_behind(lab):
    l = lab(3)
    name, directory = l.state.name, l.state.dir
    sockets = [h.socket for h in l.state.hosts]
    assert sim(name, "down").returncode == 0
    assert f"sl-{name}-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert labmod._pids_mentioning(directory + "/") == []
    assert not any(os.path.exists(s) for s in sockets)
    assert not Path(directory).exists()
    assert sim(name, "down").returncode == 0  # twice is harmless


def test_down_cleans_a_lab_whose_up_crashed(lab):
    l = lab(2, daemons=False)
    name = l.state.name
    Path(l.state.dir, "lab.json").unlink()  # as if `up` died before writing its state
    assert labmod.down(name)
    assert f"sl-{name}-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert labmod._pids_mentioning(l.state.dir + "/") == []


def test_commands_on_a_missing_lab_or_host_say_so(lab):
    proc = sim("nosuchlab", "status")
    assert proc.returncode == 2 and "no lab named 'nosuchlab'" in proc.stderr
    l = lab(2, daemons=False)
    proc = sim(l.state.name, "kill", "h9")
    assert proc.returncode == 2 and "no host 'h9'" in proc.stderr


def test_not_root_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(labmod.LabError) as err:
        labmod.preflight()
    assert err.value.status == 2 and "needs root" in str(err.value)


def test_missing_tool_names_the_package(monkeypatch):
    monkeypatch.setattr(labmod.shutil, "which", lambda tool: None if tool == "wirefilter" else "/usr/bin/" + tool)
    with pytest.raises(labmod.LabError, match="install the Debian package vde2"):
        labmod.preflight()
