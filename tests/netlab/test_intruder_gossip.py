"""A certified member attacks membership (issue 11): each attack is refused and counted, and the
victim host and the swarm stay healthy: the same daemon (same pid) still running, the victim
alive in every other member's `swarmctl peers`, nobody lost from anyone's view. One lab for
the module (a lab's start costs more than most attacks): each attack meets the swarm the ones
before it left, and must leave it healthy too.

The intruder (sim/netlab/intruder.py, intruder_gossip.py) runs inside h3's namespace with a
certificate it issued itself with the owner key: a member turned bad."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time

import pytest

from sim.netlab.lab import SWARMD_PORT

from .support import call, three_hosts, until

pytestmark = [pytest.mark.netlab, pytest.mark.slow]
MAX_SEQ = 2**63


def states(l, host: str) -> dict[str, str]:
    names = {h.peer_id: h.name for h in l.state.hosts}
    return {names.get(p["peer"], p["peer"]): p["state"] for p in call(l, host, "peers")["peers"]}


def all_alive(l, names: list[str]) -> bool:
    return all(states(l, h) == {o: "alive" for o in names if o != h} for h in names)


def rejected(l, host: str) -> dict[str, int]:
    return call(l, host, "status")["gossip"]["rejected"]


def pids(l, names: list[str]) -> dict[str, int]:
    return {h: call(l, h, "status")["pid"] for h in names}


def intruder_argv(l, attack: str, *extra: str, target: str = "h1", inside: str = "h3") -> list[str]:
    t, owner = l.state.host(target), l.state.host("h1")
    return ["ip", "netns", "exec", l.state.host(inside).netns, sys.executable, "-m", "sim.netlab.intruder", attack,
            "--target", f"/ip4/{t.address}/tcp/{SWARMD_PORT}/p2p/{t.peer_id}", "--owner-dir", owner.state_dir, *extra]


def intruder(l, attack: str, *extra: str, target: str = "h1") -> str:
    proc = subprocess.run(intruder_argv(l, attack, *extra, target=target), capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def gl():
    with three_hosts("g", mesh=False) as lab:
        yield lab


@pytest.fixture
def swarm(gl):
    names = [h.name for h in gl.state.hosts]
    until(lambda: all_alive(gl, names), 15, "everyone alive")
    return gl, names, pids(gl, names)


MARKS = itertools.count()  # each check's label value is new: a value an earlier test set proves nothing


def still_healthy(l, names: list[str], before: dict[str, int]) -> None:
    until(lambda: all_alive(l, names), 15, "every member alive in every other's view again",
          detail=lambda: {h: states(l, h) for h in names})
    assert pids(l, names) == before, "a daemon restarted"
    # and it still works: a change on the victim reaches the others (its record still encodes and spreads)
    mark = f"attack{next(MARKS)}"
    assert l.exec("h1", ["swarmctl", "labels", "set", f"after={mark}"]) == 0
    until(lambda: all(next(p for p in call(l, h, "peers")["peers"] if p["peer"] == l.state.host("h1").peer_id)
                      ["labels"].get("after") == mark for h in names if h != "h1"), 5, "h1's new record everywhere")


def test_incarnation_at_2_64_rumor_and_sync_claim_are_refused(swarm):
    l, names, before_pids = swarm
    seq = call(l, "h1", "status")["record"]["seq"]
    before = rejected(l, "h1")
    out = intruder(l, "incarnation")
    assert "certificate came back: True" in out, out

    def grew(reason: str, n: int = 1) -> bool:
        return rejected(l, "h1").get(reason, 0) >= before.get(reason, 0) + n

    # 2^64-2 fails the wire's range check; 2^63-1 and 2^63-2 (rumors) and both claims reach the core and are lies
    until(lambda: grew("malformed") and grew("future_incarnation", 4), 10, "the rumors and the claims refused",
          detail=lambda: rejected(l, "h1"))
    record = call(l, "h1", "status")["record"]
    assert seq <= record["seq"] < seq + 10, f"h1's seq jumped: {seq} -> {record['seq']}"
    still_healthy(l, names, before_pids)
    assert call(l, "h1", "status")["record"]["seq"] < MAX_SEQ


def test_a_burst_of_false_dead_rumors_evicts_nobody(swarm):
    l, names, before_pids = swarm
    accused = l.state.host("h2")
    inc = call(l, "h2", "status")["record"]["seq"] + (1 << 20)  # ahead of its record: others must take it seriously
    before = {h: rejected(l, h) for h in names}
    proc = subprocess.Popen(intruder_argv(l, "false-dead", "--about", accused.peer_id, "--inc", str(inc),
                                          "--count", "80"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[str, str] = {}
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:  # watch every view while the burst lands
        for h in ("h1", "h3"):
            state = states(l, h).get("h2")
            if state not in ("alive", "suspect"):
                seen[h] = str(state)
        time.sleep(0.05)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    assert "80 dead rumors" in out, out
    for _ in range(40):  # and a while after
        for h in ("h1", "h3"):
            state = states(l, h).get("h2")
            if state not in ("alive", "suspect"):
                seen[h] = str(state)
        time.sleep(0.05)
    assert not seen, f"the accused left someone's view: {seen}"
    until(lambda: rejected(l, "h1").get("accusation_rate", 0) > before["h1"].get("accusation_rate", 0), 10,
          "h1 dropped the accuser's excess", detail=lambda: rejected(l, "h1"))
    until(lambda: rejected(l, "h2").get("future_incarnation", 0) > before["h2"].get("future_incarnation", 0), 10,
          "h2 refused rumors about an incarnation it never had")
    still_healthy(l, names, before_pids)
    for h in l.state.hosts:
        with open(h.log) as log:
            assert not [line for line in log if '"event": "member dead"' in line], f"{h.name} declared a death"


def test_an_outsider_gets_nothing_and_a_16_mib_frame_before_any_certificate_costs_nothing(swarm):
    l, names, before_pids = swarm
    before = rejected(l, "h1")
    out = intruder(l, "presync-oversize")
    until(lambda: rejected(l, "h1").get("too_large", 0) > before.get("too_large", 0), 10, "the frame refused",
          detail=lambda: rejected(l, "h1"))
    assert "records" not in out, f"the view went to an outsider: {out[:300]}"
    out = intruder(l, "no-cert")  # a well-formed sync with a foreign owner's certificate
    assert "not a member" in out and "records" not in out, f"an outsider got more than a refusal: {out[:300]}"
    still_healthy(l, names, before_pids)


def listen(l, attack: str, *extra: str) -> str:
    """Run a listening intruder for 8 s while h1 publishes record after record (label changes)."""
    proc = subprocess.Popen(intruder_argv(l, attack, "--seconds", "8", *extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    n = 0
    while proc.poll() is None:  # each swarmctl call paces the next
        l.exec("h1", ["swarmctl", "labels", "set", f"gen={n}"])
        n += 1
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    return out


def test_an_outsider_subscribed_to_the_swarm_topic_gets_no_records_and_is_disconnected(swarm):
    l, names, before_pids = swarm
    out = listen(l, "listen-member")  # the control: a member that showed its certificate hears h1
    assert "received 0 messages" not in out and "still connected: True" in out, out
    before = rejected(l, "h1")
    out = listen(l, "listen-outsider")
    assert "received 0 messages" in out and "still connected: False" in out, out
    until(lambda: rejected(l, "h1").get("unchecked", 0) > before.get("unchecked", 0), 10,
          "the outsider counted as unchecked", detail=lambda: rejected(l, "h1"))
    still_healthy(l, names, before_pids)


def test_500_concurrent_streams_from_one_peer_are_capped(swarm):
    l, names, before_pids = swarm
    before = rejected(l, "h1")
    out = intruder(l, "streams", "--count", "500", "--seconds", "3")
    refused = rejected(l, "h1").get("too_many_streams", 0) - before.get("too_many_streams", 0)
    assert refused >= 400, (refused, out)
    assert "handler" not in rejected(l, "h1")
    still_healthy(l, names, before_pids)
