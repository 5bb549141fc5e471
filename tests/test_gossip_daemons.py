"""Real daemons on loopback form a swarm: init, invite, join, peers, labels, kill, restart, leave."""

from __future__ import annotations

import signal

import pytest

from conftest import short_lived_invite, wait_until
from swarmd.rpc.client import RemoteError

pytestmark = pytest.mark.slow


def states(daemon) -> dict[str, str]:
    return {p["peer"]: p["state"] for p in daemon.call("peers")["peers"]}


def peer_id(daemon) -> str:
    return daemon.call("status")["peer_id"]


@pytest.fixture
def swarm(make_daemon):
    owner = make_daemon("a")
    owner.call("swarm.init")
    token = owner.call("swarm.invite", uses=2)["token"]  # one token, two nodes
    others = [make_daemon(name, args=["--join", token]) for name in ("b", "c")]
    return [owner, *others]


def test_members_see_each_other_with_their_capacity(swarm):
    ids = [peer_id(d) for d in swarm]
    for d, me in zip(swarm, ids):
        wait_until(lambda: states(d) == {p: "alive" for p in ids if p != me}, 15, f"{me} sees the others alive")
    def measured():
        peers = swarm[0].call("peers")["peers"]
        # rtt_ms (routing's) can come before the membership probes gave rtt_min_ms
        return peers if all(p["rtt_ms"] is not None and p["rtt_min_ms"] is not None for p in peers) else None
    peers = wait_until(measured, 5, "RTTs from probes")
    for p in peers:
        assert p["resources"]["cpu_count"] >= 1
        assert p["resources"]["memory_total_mb"] > 0
        # two measurements: the membership's probes (their minimum) and routing's own (its latest
        # smoothed RTT, or a coordinate estimate): either may be the lower one on a busy machine
        assert 0 < p["rtt_min_ms"] < 1000 and 0 < p["rtt_ms"] < 1000, p
    status = swarm[1].call("status")
    assert status["swarm"]["id"] == swarm[0].call("status")["swarm"]["id"]

    def relayed():  # b's record reports its RTT to c: a coordinator at a can rank the pair b-c
        rows = {p["peer"]: p for p in swarm[0].call("peers")["peers"]}
        return ids[2] in rows[ids[1]]["rtts_ms"] and rows[ids[1]]["jobs"]["slots"] >= 1
    wait_until(relayed, 15, "b's record carrying its RTT to c and its job slots")
    assert status["swarm"]["members"] == {"alive": 2, "suspect": 0, "dead": 0, "left": 0}
    # what the membership received, by kind, as the simulator counts it: b's record came by
    # gossip, the joins synced, the probes echoed
    got = swarm[0].call("status")["gossip"]["received_by_kind"]
    assert set(got) == {"probes", "gossip", "duplicates", "ihave", "syncs"}, got
    assert got["probes"] > 0 and got["gossip"] > 0 and got["syncs"] > 0, got


def test_a_label_change_reaches_the_others(swarm):
    b = peer_id(swarm[1])
    wait_until(lambda: b in states(swarm[0]), 15, "a knows b")
    swarm[1].call("labels.set", labels={"region": "eu"})

    def seen():
        return {p["peer"]: p["labels"] for p in swarm[0].call("peers")["peers"]}.get(b) == {"region": "eu"}
    wait_until(seen, 2, "the new label at a")
    swarm[1].call("labels.rm", keys=["region"])
    wait_until(lambda: not {p["peer"]: p["labels"] for p in swarm[0].call("peers")["peers"]}[b], 2,
               "the label removed at a")


def test_killed_is_dead_restarted_is_alive_stopped_has_left(swarm):
    a, b, c = swarm
    ids = {d.socket: peer_id(d) for d in swarm}
    for d in swarm:
        wait_until(lambda: list(states(d).values()) == ["alive", "alive"], 15, "all alive")
    c.kill()
    wait_until(lambda: states(a)[ids[c.socket]] == "dead" and states(b)[ids[c.socket]] == "dead", 5,
               "c dead everywhere")
    c.start()  # no --join: the certificate and the bootstrap peers are in its state dir
    assert peer_id(c) == ids[c.socket]
    wait_until(lambda: states(a)[ids[c.socket]] == "alive" and states(b)[ids[c.socket]] == "alive", 10,
               "c alive again")
    assert b.stop(signal.SIGTERM) == 0
    wait_until(lambda: states(a)[ids[b.socket]] == "left" and states(c)[ids[b.socket]] == "left", 2,
               "b left everywhere")


def test_a_node_without_swarm_says_so(make_daemon):
    d = make_daemon("lonely")
    with pytest.raises(RemoteError, match="swarm"):
        d.call("swarm.invite")
    assert d.call("peers")["peers"] == []
    assert d.call("status")["swarm"] is None


def test_a_node_whose_certificate_expired_stays_up_and_says_it_publishes_nothing(make_daemon):
    import subprocess
    import sys
    import time

    owner = make_daemon("owner")
    owner.call("swarm.init")
    # 12 s, not the minute `swarm invite` gives at least: due for renewal after 8 s
    b = make_daemon("b", args=["--join", short_lived_invite(owner, cert_ttl=12)])
    expires = wait_until(lambda: (b.call("status")["swarm"] or {}).get("cert_expires"), 20, "b joined")
    pid = b.call("status")["pid"]
    owner.stop()  # the owner unreachable for the whole renewal window: the certificate lapses
    assert b.call("status")["swarm"]["cert_expires"] == expires, "b renewed before the owner stopped"
    assert b.call("status")["swarm"]["record_error"] is None, "b publishes while its certificate is valid"
    wait_until(lambda: b.call("status")["swarm"].get("record_error"), expires - time.time() + 60,
               "b stops publishing once its certificate expired")
    status = b.call("status")
    assert status["pid"] == pid and time.time() > expires, "the same daemon, still up"
    assert "expired" in status["swarm"]["record_error"]
    shown = subprocess.run([sys.executable, "-m", "swarmctl.main", "--socket", str(b.socket), "status"],
                           capture_output=True, text=True, timeout=60)
    assert "NOT PUBLISHING" in shown.stdout and "EXPIRED" in shown.stdout, shown.stdout
