"""Admission between real daemons on loopback: single-use invites, addresses in certificates,
renewal, and revocation (kept on disk, spread by gossip and sync)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import short_lived_invite, wait_until

pytestmark = pytest.mark.slow


def states(daemon) -> dict[str, str]:
    return {p["peer"]: p["state"] for p in daemon.call("peers")["peers"]}


def swarmctl(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarmctl.main", "--socket", str(daemon.socket), *args],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def owner(make_daemon):
    d = make_daemon("owner")
    d.call("swarm.init")
    return d


def test_an_invite_admits_one_node_and_a_retry_gets_the_same_certificate(owner, make_daemon):
    token = owner.call("swarm.invite")["token"]
    b = make_daemon("b")
    assert b.call("swarm.join", token=token)
    first = b.call("status")["swarm"]
    assert first["cert_addr4"] and first["cert_addr4"].startswith("10.211.")  # the owner gave it an address

    c = make_daemon("c")
    refused = swarmctl(c, "swarm", "join", token)
    assert refused.returncode == 1 and "used 1 time(s) already" in refused.stderr, refused.stderr
    assert owner.call("status")["gossip"]["rejected"].get("join_refused", 0) >= 1

    # b lost the reply (here: its swarm file) and joins again with the same token: no use consumed
    b.stop()
    (b.state_dir / "swarm.json").unlink()
    b.start()
    assert b.call("swarm.join", token=token)
    assert b.call("status")["swarm"]["cert_addr4"] == first["cert_addr4"]

    two = owner.call("swarm.invite", uses=2)["token"]
    assert c.call("swarm.join", token=two)
    d = make_daemon("d")
    assert d.call("swarm.join", token=two)
    addrs = {x.call("status")["swarm"]["cert_addr4"] for x in (b, c, d)}
    assert len(addrs) == 3, addrs


def test_renewal_keeps_roles_and_address_and_status_warns_before_expiry(owner, make_daemon):
    token = owner.call("swarm.invite", cert_ttl=3600)["token"]
    b = make_daemon("b")
    b.call("swarm.join", token=token)
    before = b.call("status")["swarm"]
    assert before["cert_expiring"] and 3500 < before["cert_expires_in_s"] <= 3600
    shown = swarmctl(b, "status")
    assert "WARNING: this node's certificate expires in" in shown.stdout, shown.stdout
    renewed = json.loads(swarmctl(b, "--json", "swarm", "renew").stdout)
    assert renewed["expires"] > before["cert_expires"] and renewed["addr4"] == before["cert_addr4"]
    assert b.call("status")["swarm"]["cert_expires"] == renewed["expires"]
    b.stop()
    b.start()  # saved to swarm.json
    assert b.call("status")["swarm"]["cert_expires"] == renewed["expires"]


def test_revoked_member_is_dropped_everywhere_and_stays_out_after_a_restart(owner, make_daemon):
    token = owner.call("swarm.invite", uses=2)["token"]
    b, c = make_daemon("b", args=["--join", token]), make_daemon("c", args=["--join", token])
    ids = {name: d.call("status")["peer_id"] for name, d in (("owner", owner), ("b", b), ("c", c))}
    wait_until(lambda: all(len(states(d)) == 2 and set(states(d).values()) == {"alive"} for d in (owner, b, c)),
               20, "three members alive everywhere")

    refused = swarmctl(b, "swarm", "revoke", ids["c"])
    assert refused.returncode == 1 and "only the node that ran `swarm init`" in refused.stderr
    done = swarmctl(owner, "swarm", "revoke", ids["b"][-8:], "--reason", "test")
    assert done.returncode == 0 and ids["b"] in done.stdout, done.stderr

    wait_until(lambda: ids["b"] not in states(owner) and ids["b"] not in states(c), 5, "b gone from every view")
    wait_until(lambda: b.call("status")["swarm"]["revoked"], 5, "b learns it is revoked")
    assert "REVOKED" in swarmctl(b, "status").stdout
    wait_until(lambda: c.call("status")["gossip"]["rejected"].get("revoked", 0) > 0
               or owner.call("status")["gossip"]["rejected"].get("revoked", 0) > 0, 15,
               "b's records or streams refused as revoked")
    assert [r["peer"] for r in c.call("swarm.revocations")["revocations"]] == [ids["b"]]

    c.stop()
    c.start()
    wait_until(lambda: ids["owner"] in states(c), 15, "c back in the swarm")
    assert ids["b"] not in states(c)
    assert c.call("status")["swarm"]["revocations"] == 1


def test_a_member_renews_its_certificate_by_itself_before_it_expires(owner, make_daemon):
    # 15 s, not the minute `swarm invite` gives at least
    b = make_daemon("b", args=["--join", short_lived_invite(owner, cert_ttl=15)])
    first = wait_until(lambda: (b.call("status")["swarm"] or {}).get("cert_expires"), 20, "b joined")
    b_id = b.call("status")["peer_id"]
    # due a third of its lifetime ahead: 5 s before expiry
    wait_until(lambda: b.call("status")["swarm"]["cert_expires"] > first, 50, "b renewed by itself")
    renewed = b.call("status")["swarm"]
    assert renewed["cert_expires"] - first < 120 and renewed["renewal_error"] is None
    wait_until(lambda: owner.call("status")["swarm"]["id"] and states(owner).get(b_id) == "alive", 10, "b alive")
    wait_until(lambda: time.time() > first + 2, 40, "the first certificate's expiry passed")
    assert states(owner).get(b_id) == "alive", "the renewed member is still a member"


def test_a_node_revoked_while_away_learns_it_when_it_comes_back(owner, make_daemon):
    token = owner.call("swarm.invite")["token"]
    b = make_daemon("b", args=["--join", token])
    b_id = wait_until(lambda: b.call("status")["swarm"] and b.call("status")["peer_id"], 20, "b joined")
    wait_until(lambda: b_id in states(owner), 15, "the owner sees b")
    b.stop()
    assert owner.call("swarm.revoke", peer=b_id, reason="lost laptop")["peer"] == b_id
    b.start()
    got = wait_until(lambda: b.call("status")["swarm"]["revoked"], 20, "b told it is revoked by the owner's refusal")
    assert got["reason"] == "lost laptop"
    assert b_id not in states(owner)


def test_a_member_away_during_a_revocation_learns_it_by_sync(owner, make_daemon):
    token = owner.call("swarm.invite", uses=2)["token"]
    b, c = make_daemon("b", args=["--join", token]), make_daemon("c", args=["--join", token])
    b_id = wait_until(lambda: b.call("status")["swarm"] and b.call("status")["peer_id"], 20, "b joined")
    wait_until(lambda: b_id in states(c), 20, "c sees b")
    c.stop()
    owner.call("swarm.revoke", peer=b_id)
    wait_until(lambda: b.call("status")["swarm"]["revoked"], 10, "b learns it")
    b.stop()  # and c, coming back, hears of it from nobody's gossip: only a sync can tell it
    c.start()
    wait_until(lambda: c.call("status")["swarm"]["revocations"] == 1, 20, "c learns the revocation by sync")
    assert b_id not in states(c)


def test_a_damaged_revocation_file_is_moved_aside_not_fatal(owner):
    owner.stop()
    (owner.state_dir / "revoked.json").write_text("{")
    owner.start()
    wait_until(lambda: (owner.state_dir / "revoked.json.damaged").exists(), 10, "the damaged file moved aside")
    assert owner.call("status")["swarm"]["revocations"] == 0


def test_certificates_from_before_addresses_are_renewed_at_start_and_get_one(owner, make_daemon):
    """A swarm made before the owner signed addresses: the owner's and a member's certificates
    name none. Each node renews at once when it starts (not a third of a year later), and the
    owner gives each a distinct address from its registry."""
    from swarmd.gossip import swarmstate
    from swarmd.gossip.cert import issue_cert
    from swarmd.p2p.signed import peer_bytes
    from swarmd.identity import load_or_create

    owner_id = owner.call("status")["peer_id"]
    assert owner.call("status")["swarm"]["cert_addr4"]  # `swarm init` gives the owner's own one
    owner.stop()
    m = swarmstate.load(owner.state_dir, peer_bytes(owner_id))
    sign = swarmstate.owner_signer(m)
    swarmstate.save_cert(owner.state_dir, m, issue_cert(sign, m.swarm, peer_bytes(owner_id), now=time.time(),
                                                        roles=m.cert.roles, ttl=365 * 86400.0))
    (owner.state_dir / swarmstate.MEMBERS_FILE).unlink()  # as before, when the owner kept no addresses
    owner.start()
    wait_until(lambda: owner.call("status")["swarm"]["cert_addr4"], 15, "the owner renewed its own certificate")
    owner_addr = owner.call("status")["swarm"]["cert_addr4"]

    b = make_daemon("b", start=False)
    b_id = str(load_or_create(b.state_dir)[0].peer_id)
    listen = next(a for a in owner.call("status")["listen_addrs"] if "/tcp/" in a)
    bootstrap = listen if "/p2p/" in listen else f"{listen}/p2p/{owner_id}"
    legacy = issue_cert(sign, m.swarm, peer_bytes(b_id), now=time.time(), ttl=365 * 86400.0)
    assert legacy.addr4 is None
    swarmstate.save_joined(b.state_dir, m.owner_public, legacy, (bootstrap,))
    b.start()
    got = wait_until(lambda: b.call("status")["swarm"]["cert_addr4"], 20, "b renewed its certificate at start")
    assert got.startswith("10.211.") and got != owner_addr
    assert b.call("status")["swarm"]["renewal_error"] is None
    registry = json.loads((owner.state_dir / swarmstate.MEMBERS_FILE).read_text())
    assert {p: v["addr4"] for p, v in registry.items()} == {owner_id: owner_addr, b_id: got}
    b.stop()
    b.start()  # saved: no second renewal needed for the address
    assert b.call("status")["swarm"]["cert_addr4"] == got
