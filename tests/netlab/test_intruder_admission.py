"""Admission attacks by a certified member in a lab, and revocation, with real daemons and mesh.

Each attack test asserts that the attack is refused, that its counter grows (from `swarmctl
status --json`), and that the victim and the swarm stay healthy: the victim keeps its
overlay address and WireGuard key in every member's `swarmctl mesh`, and pings over the
mesh still work. The attacks share one meshed lab (each leaves the swarm healthy for the
next); the revocation of a host, which changes the swarm for good, has its own.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sim.netlab.lab import SWARMD_PORT
from swarmd.identity import load_or_create

from .support import call, in_netns, three_hosts, until

pytestmark = [pytest.mark.netlab, pytest.mark.slow]


def intruder_argv(l, attack: str, *extra: str, target: str = "h1", from_host: str | None = None) -> list[str]:
    t = l.state.host(target)
    src = l.state.host(from_host or l.state.hosts[-1].name)
    return ["ip", "netns", "exec", src.netns, sys.executable, "-m", "sim.netlab.intruder", attack,
            "--target", f"/ip4/{t.address}/tcp/{SWARMD_PORT}/p2p/{t.peer_id}",
            "--owner-dir", l.state.host("h1").state_dir, *extra]


def intruder(l, attack: str, *extra: str, **kw) -> str:
    proc = subprocess.run(intruder_argv(l, attack, *extra, **kw), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def status(l, host: str) -> dict:
    """What `swarmctl status --json` shows on ``host``."""
    h = l.state.host(host)
    out = subprocess.run(["ip", "netns", "exec", h.netns, sys.executable, "-m", "swarmctl.main", "--socket",
                          h.socket, "--json", "status"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def rejected(l, host: str) -> dict[str, int]:
    return status(l, host)["gossip"]["rejected"]


def peers(l, host: str) -> dict[str, str]:
    return {p["peer"]: p["state"] for p in call(l, host, "peers")["peers"]}


def all_alive(l, names: list[str]) -> bool:
    ids = {n: l.state.host(n).peer_id for n in names}
    return all(peers(l, h) == {ids[o]: "alive" for o in names if o != h} for h in names)


def mesh_rows(l, host: str) -> dict[str, dict]:
    """peer id -> its row in ``host``'s `swarmctl mesh`."""
    return {r["peer"]: r for r in call(l, host, "mesh")["peers"] if r["peer"]}


def full_mesh(l, names: list[str]) -> bool:
    for h in names:
        st = call(l, h, "status")["mesh"]
        if not st.get("up"):
            return False
        rows = call(l, h, "mesh")["peers"]
        if len(rows) != len(names) - 1 or any(r["handshake_age_s"] is None for r in rows):
            return False
    return True


def ping(l, src: str, addr: str) -> bool:
    return in_netns(l, src, "ping", "-n", "-q", "-c", "1", "-W", "2", addr).returncode == 0


def victim_intact(l, victim: str, addr: str, key: str, names: list[str]) -> bool:
    """Every other member's mesh has the victim at its address with its key, and reaches it."""
    pid = l.state.host(victim).peer_id
    for h in names:
        if h == victim:
            continue
        row = mesh_rows(l, h).get(pid)
        if row is None or row["overlay"] != addr or row["public_key"] != key or not ping(l, h, addr):
            return False
    return True


def grew(l, host: str, reason: str, before: dict[str, int]) -> bool:
    return rejected(l, host).get(reason, 0) > before.get(reason, 0)


@pytest.fixture(scope="module")
def shared():
    with three_hosts("a", mesh=True) as lab:
        yield lab


@pytest.fixture
def mesh_lab(shared):
    names = [h.name for h in shared.state.hosts]
    until(lambda: full_mesh(shared, names), 30, "a mesh of three")
    return shared, names


def test_overlay_address_hijack_is_refused(mesh_lab):
    l, names = mesh_lab
    victim = call(l, "h2", "status")["mesh"]
    before = rejected(l, "h1")
    out = intruder(l, "addr-hijack", "--victim-addr", victim["address"])
    assert victim["address"] in out
    until(lambda: grew(l, "h1", "addr_mismatch", before), 10, "the hijacking record refused (addr_mismatch)")
    until(lambda: victim_intact(l, "h2", victim["address"], victim["public_key"], names), 10,
          "h2 keeps its address and key everywhere, reachable over the mesh")
    assert call(l, "h2", "status")["mesh"]["readdressed"] == 0
    assert all_alive(l, names)


def test_wireguard_key_hijack_is_refused(mesh_lab):
    l, names = mesh_lab
    victim = call(l, "h2", "status")["mesh"]
    before = rejected(l, "h1")
    key_file = str(Path(l.state.host("h2").state_dir) / "wg.key")  # even a stolen copy of the key file
    intruder(l, "key-hijack", "--victim-key", victim["public_key"], "--victim-key-file", key_file)
    until(lambda: grew(l, "h1", "wg_proof", before), 10, "the record without a valid proof refused (wg_proof)")
    until(lambda: grew(l, "h1", "wg_key_taken", before), 10,
          "the record with the stolen key refused: the first holder keeps it (wg_key_taken)")
    until(lambda: victim_intact(l, "h2", victim["address"], victim["public_key"], names), 10,
          "h2 keeps its address and key everywhere, reachable over the mesh")
    assert all_alive(l, names)


def test_revoked_member_is_refused(mesh_lab, tmp_path):
    l, names = mesh_lab
    until(lambda: all_alive(l, names), 15, "everyone alive")
    ident, _ = load_or_create(tmp_path / "intruder")
    revoked = str(ident.peer_id)
    before_revocations = {h: status(l, h)["swarm"]["revocations"] for h in names}
    assert l.exec("h1", ["swarmctl", "swarm", "revoke", revoked, "--reason", "lab test"]) == 0
    until(lambda: all(status(l, h)["swarm"]["revocations"] == before_revocations[h] + 1 for h in names), 10,
          "the revocation everywhere")
    before = rejected(l, "h1")
    out = intruder(l, "revoked", "--state", str(tmp_path / "intruder"))
    assert out.count("revoked by the swarm's owner") >= 3, out  # sync, job and renewal each told why
    until(lambda: rejected(l, "h1").get("revoked", 0) >= before.get("revoked", 0) + 4, 10,
          "its record, sync, job request and renewal refused (revoked)")
    assert revoked not in peers(l, "h1")
    # subscribed to the swarm's topic, it hears nothing, and is hung up on
    out = intruder(l, "listen-member", "--seconds", "8", "--state", str(tmp_path / "intruder"))
    assert "received 0 messages" in out and "still connected: False" in out, out
    assert all_alive(l, names)


def test_expired_certificate_leaves_views_and_is_refused(mesh_lab):
    l, names = mesh_lab
    until(lambda: all_alive(l, names), 15, "everyone alive")
    before = rejected(l, "h1")
    proc = subprocess.Popen(intruder_argv(l, "expired", "--cert-ttl", "8", "--seconds", "16"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def intruders(host: str) -> list[str]:
            ours = {l.state.host(n).peer_id for n in names}
            return [p for p in peers(l, host) if p not in ours]
        until(lambda: intruders("h1") and intruders("h2"), 6, "the member in the views while its certificate holds")
        # it keeps answering pings and publishing records: expiry alone must remove it
        until(lambda: not intruders("h1") and not intruders("h2") and not intruders("h3"), 12,
              "the member gone from every view once its certificate expired")
        out, err = proc.communicate(timeout=60)
        until(lambda: grew(l, "h1", "cert", before) or grew(l, "h1", "not_member", before), 10,
              "its records or its sync after expiry refused", detail=lambda: (rejected(l, "h1"), out, err[-2000:]))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)
    assert proc.returncode == 0, err[-3000:]
    assert "not a member" in out and "expired" in out, out  # its sync after expiry: refused with the reason
    assert all_alive(l, names)


def test_revoke_removes_a_member_from_every_view_and_mesh_and_survives_a_restart(lab):
    l = lab(3, rtt=10.0, mesh=True)
    names = [h.name for h in l.state.hosts]
    until(lambda: full_mesh(l, names), 30, "a mesh of three")
    h3 = l.state.host("h3").peer_id
    h2_addr = call(l, "h2", "status")["mesh"]["address"]
    assert ping(l, "h3", h2_addr)

    assert l.exec("h1", ["swarmctl", "swarm", "revoke", h3[-8:], "--reason", "lab test"]) == 0
    took = until(lambda: all(h3 not in peers(l, h) and h3 not in mesh_rows(l, h) for h in ("h1", "h2")), 10,
                 "h3 gone from every other member's peers and mesh")
    assert took < 10
    # told by the members that drop it (before they hang up), not at its next sync they refuse
    # after its failure detector declared them dead, which took over 10 s once under load
    until(lambda: status(l, "h3")["swarm"]["revoked"], 5, "h3 learns it is revoked")
    assert "REVOKED" in subprocess.run(
        ["ip", "netns", "exec", l.state.host("h3").netns, sys.executable, "-m", "swarmctl.main", "--socket",
         l.state.host("h3").socket, "status"], capture_output=True, text=True, timeout=30).stdout
    until(lambda: not ping(l, "h3", h2_addr), 10, "h3's mesh traffic no longer reaches h2")

    l.kill("h2", signal.SIGTERM)
    l.start("h2")
    until(lambda: l.state.host("h1").peer_id in peers(l, "h2") and mesh_rows(l, "h2"), 30, "h2 back in the swarm")
    assert h3 not in peers(l, "h2") and h3 not in mesh_rows(l, "h2")
    assert status(l, "h2")["swarm"]["revocations"] == 1  # from its own disk, and the others' syncs
    assert not ping(l, "h3", h2_addr)
    assert ping(l, "h1", h2_addr)
