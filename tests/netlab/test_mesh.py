"""The WireGuard mesh in a lab: real daemons, real wireguard-go, real torch.distributed."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sim.netlab.lab import mesh_interface
from swarmd.gossip import swarmstate
from swarmd.gossip.cert import issue_cert
from swarmd.p2p.signed import peer_bytes
from swarmd.wg import address, keys

from .support import call, in_netns, rank_lines, swarmctl, until

pytestmark = [pytest.mark.netlab, pytest.mark.slow]


def iface(lab, host: str) -> str:
    return mesh_interface(lab.state.name, host)


def mesh(lab, host: str) -> dict:
    return call(lab, host, "mesh")


def wg_peers(lab, host: str) -> dict[str, int]:
    """`wg show IFACE dump` in the host's namespace: peer public key -> latest handshake (unix s)."""
    out = in_netns(lab, host, "wg", "show", iface(lab, host), "dump")
    assert out.returncode == 0, out.stderr
    rows = [line.split("\t") for line in out.stdout.splitlines()[1:]]
    return {r[0]: int(r[4]) for r in rows}


def full_mesh(lab, names: list[str], since: float = 0.0) -> bool:
    for h in names:
        if not call(lab, h, "status")["mesh"].get("up"):
            return False
        peers = wg_peers(lab, h)
        if len(peers) != len(names) - 1 or any(t < since for t in peers.values()):
            return False
    return True


def overlay(lab, host: str) -> str:
    return call(lab, host, "status")["mesh"]["address"]


def ping(lab, src: str, dst_addr: str, count: int = 1) -> bool:
    return in_netns(lab, src, "ping", "-n", "-q", "-c", str(count), "-W", "2", dst_addr).returncode == 0


def gone(lab, host: str) -> bool:
    """Nothing of the host's mesh is left: no interface, no UAPI socket, no wireguard-go."""
    name = iface(lab, host)
    link = in_netns(lab, host, "ip", "link", "show", name)
    proc = subprocess.run(["pgrep", "-f", f"wireguard-go -f {name}$"], capture_output=True)
    return link.returncode != 0 and not Path(f"/var/run/wireguard/{name}.sock").exists() and proc.returncode == 1


def test_four_hosts_full_mesh_follows_membership(lab):
    started = int(time.time()) - 1
    l = lab(4, rtt=10.0, mesh=True)
    names = [h.name for h in l.state.hosts]
    until(lambda: full_mesh(l, names, since=started), 20, "every host has the 3 others as peers, with a handshake",
          detail=lambda: {h: wg_peers(l, h) for h in names})
    addrs = {h: overlay(l, h) for h in names}
    assert len(set(addrs.values())) == 4, addrs
    for a in names:
        for b in names:
            if a != b:
                assert ping(l, a, addrs[b]), f"{a} cannot ping {b}'s overlay address {addrs[b]}"

    # what swarmctl shows: every peer, its overlay address, a direct endpoint, traffic both ways
    rows = mesh(l, "h1")["peers"]
    ids = {h.peer_id: h.name for h in l.state.hosts}
    assert sorted(ids[r["peer"]] for r in rows) == ["h2", "h3", "h4"]
    for r in rows:
        assert r["overlay"] == addrs[ids[r["peer"]]] and r["direct"] and r["rx_bytes"] > 0 and r["tx_bytes"] > 0, r
        assert r["endpoint"].startswith(l.state.host(ids[r["peer"]]).address + ":"), r
    table = subprocess.run(["ip", "netns", "exec", l.state.host("h1").netns, sys.executable, "-m", "swarmctl.main",
                            "--socket", l.state.host("h1").socket, "mesh"], capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "200"})
    assert table.returncode == 0 and all(addrs[h] in table.stdout for h in ("h2", "h3", "h4")), table.stdout

    # kill -9: the others drop it; restart: back, with the same overlay address
    h4_key = call(l, "h4", "status")["mesh"]["public_key"]
    l.kill("h4", signal.SIGKILL)
    until(lambda: all(h4_key not in wg_peers(l, h) for h in ("h1", "h2", "h3")), 10,
          "h4 removed from every other host's peers")
    l.start("h4")
    until(lambda: full_mesh(l, names), 20, "h4 back in everyone's peers")
    assert overlay(l, "h4") == addrs["h4"]
    assert ping(l, "h1", addrs["h4"]) and ping(l, "h4", addrs["h1"])

    # a graceful stop removes the interface, the socket and wireguard-go
    l.kill("h3", signal.SIGTERM)
    assert gone(l, "h3")
    until(lambda: all(len(wg_peers(l, h)) == 2 for h in ("h1", "h2", "h4")), 10, "h3 removed after it left")


ALLREDUCE = """
import json, os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)]); dist.all_reduce(t)
print(json.dumps({"rank": dist.get_rank(), "sum": t.item(), "master": os.environ["MASTER_ADDR"]}))
dist.destroy_process_group()
"""


def test_gloo_all_reduce_over_the_overlay(lab, tmp_path):
    """A job's two ranks on two hosts all-reduce over the mesh. Its ranks, not root's
    processes: in the job sandbox only a job's own sockets answer over the mesh interface."""
    l = lab(2, rtt=10.0, mesh=True)
    names = ["h1", "h2"]
    until(lambda: full_mesh(l, names), 20, "a mesh of two")
    (tmp_path / "job.py").write_text(ALLREDUCE)
    before = {r["peer"]: r["rx_bytes"] for r in mesh(l, "h1")["peers"]}
    r = swarmctl(l, "h1", "jobs", "run", "--nodes", "2", "--workdir", str(tmp_path), "--", "python", "job.py")
    assert r.returncode == 0, r.stdout + r.stderr
    results = [json.loads(texts[-1]) for texts in rank_lines(r.stdout).values()]
    assert sorted(x["sum"] for x in results) == [3.0, 3.0]  # 1 + 2, on both ranks
    assert {x["master"] for x in results} <= {overlay(l, h) for h in names}, "MASTER_ADDR is an overlay address"
    after = {r["peer"]: r["rx_bytes"] for r in mesh(l, "h1")["peers"]}
    assert all(after[p] > before[p] for p in before), "the ranks' traffic went through WireGuard"


def legacy_certs(lab, hosts: list[str], *, offline_owner: bool = False) -> None:
    """Give ``hosts`` (stopped) certificates without an address, as the owner issued them before
    it signed addresses. ``offline_owner``: h1 keeps only a member's certificate and its
    owner key is moved away, so nobody can renew and the certificates stay addressless."""
    owner_dir = Path(lab.state.host("h1").state_dir)
    owner = swarmstate.load(owner_dir, peer_bytes(lab.state.host("h1").peer_id))
    for h in hosts:
        state_dir = Path(lab.state.host(h).state_dir)
        peer = peer_bytes(lab.state.host(h).peer_id)
        m = swarmstate.load(state_dir, peer)
        roles = ("member",) if offline_owner else m.cert.roles
        cert = issue_cert(swarmstate.owner_signer(owner), owner.swarm, peer, now=time.time(), roles=roles)
        swarmstate.save_cert(state_dir, m, cert)
    if offline_owner:
        (owner_dir / swarmstate.OWNER_KEY).rename(owner_dir.parent / "owner.key.offline")


def test_forced_address_collision_is_resolved(lab):
    """Two members whose certificates name no address (from before the owner signed them, with
    the owner offline so neither can renew), made to want one derived address: the lower public
    key keeps it, the other moves."""
    l = lab(2, rtt=10.0, mesh=True)
    until(lambda: full_mesh(l, ["h1", "h2"]), 20, "a mesh of two")
    swarm = call(l, "h1", "status")["swarm"]["id"]
    network = address.IPv4Network("10.212.0.0/24")
    h1_public = base64.b64decode(call(l, "h1", "status")["mesh"]["public_key"])
    contested = next(address.candidates(swarm, h1_public, network))
    while True:  # a key for h2 whose first choice is h1's: ~254 tries
        pair = keys.KeyPair.generate()
        if next(address.candidates(swarm, pair.public, network)) == contested:
            break
    for h in ("h1", "h2"):
        l.kill(h, signal.SIGTERM)
        toml = Path(l.state.host(h).state_dir).parent / "swarmd.toml"
        toml.write_text(f'mesh_network = "{network}"\n')
    legacy_certs(l, ["h1", "h2"], offline_owner=True)
    keys._write(Path(l.state.host("h2").state_dir) / keys.KEY_FILE, pair)
    l.start("h1")
    l.start("h2")
    until(lambda: full_mesh(l, ["h1", "h2"]), 20, "a mesh of two again")
    until(lambda: overlay(l, "h1") != overlay(l, "h2"), 10, "the collision resolved")
    assert all(call(l, h, "status")["swarm"]["cert_addr4"] is None for h in ("h1", "h2"))
    winner, loser = ("h1", "h2") if h1_public < pair.public else ("h2", "h1")
    assert overlay(l, winner) == str(contested)
    assert call(l, loser, "status")["mesh"]["readdressed"] >= 1  # it did claim the address, then moved
    assert address.IPv4Address(overlay(l, loser)) in network
    until(lambda: ping(l, "h1", overlay(l, "h2")) and ping(l, "h2", overlay(l, "h1")), 10,
          "both reach each other at their final addresses")


def test_every_certificate_names_an_address_and_a_legacy_one_is_renewed_at_start(lab):
    """The owner's certificate (from `swarm init`) and the lab's members' (issued as a join
    issues them) name distinct addresses, which the hosts use. A member with a certificate
    from before addresses, whose key is ground so that its first derived address is the
    owner's, never takes that address from the owner: it renews at start and then advertises
    the address its new certificate names."""
    l = lab(2, rtt=10.0, mesh=True)
    until(lambda: full_mesh(l, ["h1", "h2"]), 20, "a mesh of two")
    certs = {h: call(l, h, "status")["swarm"]["cert_addr4"] for h in ("h1", "h2")}
    assert all(certs.values()) and len(set(certs.values())) == 2, certs
    assert {h: overlay(l, h) for h in certs} == certs
    swarm = call(l, "h1", "status")["swarm"]["id"]
    target = address.IPv4Address(certs["h1"])
    while True:  # a key for h2 whose first derived choice is h1's certificate address: ~65,000 tries
        pair = keys.KeyPair.generate()
        if next(address.candidates(swarm, pair.public)) == target:
            break
    l.kill("h2", signal.SIGTERM)
    legacy_certs(l, ["h2"])
    keys._write(Path(l.state.host("h2").state_dir) / keys.KEY_FILE, pair)
    (Path(l.state.host("h2").state_dir) / "wg.addr").unlink(missing_ok=True)  # derive afresh
    l.start("h2")
    # at start: a first try made before h1 is in h2's view fails, and the next comes 10-20 s later
    until(lambda: call(l, "h2", "status")["swarm"]["cert_addr4"], 45, "h2 renewed its certificate at start")
    got = call(l, "h2", "status")["swarm"]["cert_addr4"]
    assert got != certs["h1"]
    until(lambda: overlay(l, "h2") == got, 10, "h2 uses its certificate's address")
    until(lambda: full_mesh(l, ["h1", "h2"]) and ping(l, "h1", got) and ping(l, "h2", certs["h1"]), 20,
          "both reach each other at their certificates' addresses")
    assert overlay(l, "h1") == certs["h1"] and call(l, "h1", "status")["mesh"]["readdressed"] == 0
    rows = {r["peer"]: r["overlay"] for r in mesh(l, "h1")["peers"]}
    assert rows == {l.state.host("h2").peer_id: got}  # what h2 advertises, as h1 sees it
    assert call(l, "h2", "status")["swarm"].get("record_error") is None


def test_key_rotation_keeps_connectivity(lab):
    l = lab(2, rtt=10.0, mesh=True)
    until(lambda: full_mesh(l, ["h1", "h2"]), 20, "a mesh of two")
    target = overlay(l, "h2")
    until(lambda: ping(l, "h1", target), 10, "h1 reaches h2 over the overlay")
    old = call(l, "h2", "status")["mesh"]["public_key"]
    # 60 pings 50 ms apart from h1 to h2 while h2 rotates its key 1 s in
    pinger = subprocess.Popen(["ip", "netns", "exec", l.state.host("h1").netns, "ping", "-n", "-i", "0.05",
                               "-c", "60", "-W", "1", target], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    result = call(l, "h2", "mesh.rotate-key")
    assert result["old"] == old and result["new"] != old
    out, _ = pinger.communicate(timeout=30)
    received = int(out.split(" received")[0].rsplit(" ", 1)[-1])
    # one handshake (a round trip plus the record's gossip) may cost a few pings, not more
    assert received >= 50, out
    until(lambda: set(wg_peers(l, "h1")) == {result["new"]}, 5, "h1 knows only h2's new key")
    assert ping(l, "h1", target)
    assert call(l, "h2", "status")["mesh"]["public_key"] == result["new"]
