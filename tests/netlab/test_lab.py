"""swarm-sim lab with real namespaces, vde2 links and swarmd daemons."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sim.netlab import lab as labmod

from .support import call, until

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


def _tcp_with(lab, host: str, addr: str) -> list[str]:
    """The states of `host`'s TCP connections with `addr` (ss's names: ESTAB, CLOSE-WAIT, …)."""
    out = subprocess.run(["ip", "netns", "exec", lab.state.host(host).netns, "ss", "-Htna"],
                         capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines()]  # state, recv-q, send-q, local, peer
    return [row[0] for row in rows if len(row) >= 5 and row[4].rpartition(":")[0] == addr]


def _member_events(log: str, peer: str) -> list[tuple[str, str]]:
    """(event, reason) of the membership changes a daemon's JSON log records about `peer`."""
    events = []
    for line in Path(log).read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("member") == peer and str(entry.get("event", "")).startswith("member "):
            events.append((entry["event"], entry.get("reason", "")))
    return events


def test_crash_is_a_silent_power_off_and_revive_brings_the_host_back(lab):
    l = lab(3, 10.0, mesh=True)
    l.wait_formed()
    name, h3 = l.state.name, l.state.host("h3")
    # a rank-like process tree of the lab user in h3's namespace, out of our session
    tree = subprocess.Popen(["ip", "netns", "exec", h3.netns, "setsid", "runuser", "-u", "nobody", "--",
                             "sh", "-c", "sleep 600 & exec sleep 600"])
    ns = f"/run/netns/{h3.netns}"
    until(lambda: len(labmod.netns_pids(ns)) >= len(l._taps_of("h3")) + 4, 10,
          "the daemon, wireguard-go and the sleeps in h3's namespace")
    taps = set(l._taps_of("h3"))
    assert len(taps) == 2
    for survivor in ("h1", "h2"):
        assert "ESTAB" in _tcp_with(l, survivor, h3.address), f"{survivor} has no connection with h3 to watch"

    crashed_at = time.monotonic()
    proc = sim(name, "crash", "h3")
    assert proc.returncode == 0, proc.stderr
    assert "h3 crashed" in proc.stdout
    # every process of h3 is gone but the lab's taps (ip's own listing, not the lab's)
    listed = subprocess.run(["ip", "netns", "pids", h3.netns], capture_output=True, text=True).stdout.split()
    assert {int(p) for p in listed} == taps
    tree.wait(5)
    # silent: nothing closed the survivors' connections (a FIN leaves CLOSE-WAIT, a RST removes them)
    for survivor in ("h1", "h2"):
        states = _tcp_with(l, survivor, h3.address)
        assert "ESTAB" in states and "CLOSE-WAIT" not in states, f"{survivor}: {states}"
    assert ping(l, "h1", h3.address, 2) is None
    status = json.loads(sim(name, "status", "--json").stdout)
    assert {h["host"]: h["daemon"] for h in status["hosts"]}["h3"] == "crashed"
    assert {(k["a"], k["b"]) for k in status["links"] if k["cut"]} == {("h1", "h3"), ("h2", "h3")}
    assert sim(name, "crash", "h3").returncode == 2  # twice makes no sense
    assert sim(name, "start", "h3").returncode == 2  # a crashed host comes back by revive

    def state_of_h3(host: str) -> str | None:
        rows = {p["peer"]: p["state"] for p in call(l, host, "peers")["peers"]}
        return rows.get(h3.peer_id)

    until(lambda: all(state_of_h3(s) == "dead" for s in ("h1", "h2")), 30, "h1 and h2 declare h3 dead")
    took = time.monotonic() - crashed_at
    for survivor in ("h1", "h2"):  # found out by the failure detector, not told by h3 or its TCP stack
        events = _member_events(l.state.host(survivor).log, h3.peer_id)
        assert ("member dead", "suspicion timed out") in events, events
        assert not any(event == "member left" for event, _ in events), events
    print(f"h3 declared dead by both survivors within {took:.1f} s of the crash")

    assert sim(name, "revive", "h2").returncode == 2  # not crashed
    proc = sim(name, "revive", "h3")
    assert proc.returncode == 0, proc.stderr
    status = json.loads(sim(name, "status", "--json").stdout)
    assert {h["host"]: h["daemon"] for h in status["hosts"]}["h3"] == "running"
    assert not any(k["cut"] for k in status["links"]) and all(k["loss_pct"] == 0 for k in status["links"])
    assert call(l, "h3", "status")["peer_id"] == h3.peer_id  # the same identity and state dir
    until(lambda: all(state_of_h3(s) == "alive" for s in ("h1", "h2")), 60, "h1 and h2 see h3 alive again")
    until(l.formed, 60, "the swarm formed again, h3 meshed with both")
