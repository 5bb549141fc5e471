"""nft.py: the relay's rules as text (golden), what it refuses to write, and `nft -c` accepting it."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

from swarmd.routing import nft
from swarmd.routing.relay import End, Pair

A = End(peer="A", ip="10.9.1.1", wg_port=5001, via_ip="10.9.1.2", pinned=True)
B = End(peer="B", ip="10.9.2.1", wg_port=5000, via_ip="10.9.2.2", pinned=True)
C = End(peer="C", ip="192.168.7.3", wg_port=51820, via_ip="10.9.1.2")  # behind a NAT: not pinned
LOCAL = ("10.9.1.2", "10.9.2.2")

GOLDEN = """\
# swarmd relay: 2 pairs, cap 12500000 bytes/s
add table ip swarmd_relay_wg0
delete table ip swarmd_relay_wg0
table ip swarmd_relay_wg0 {
  comment "swarmd: ip_forward was off"
  limit cap { rate over 12500000 bytes/second }
  map learned_a {
    type inet_service : ipv4_addr . inet_service
    flags dynamic,timeout
    timeout 180s
    size 100
  }
  map learned_b {
    type inet_service : ipv4_addr . inet_service
    flags dynamic,timeout
    timeout 180s
    size 100
  }
  chain learn {
    type filter hook prerouting priority dstnat - 10; policy accept;
  }
  chain pre {
    type nat hook prerouting priority dstnat; policy accept;
    ip saddr 10.9.1.1 udp sport 5001 ip daddr 10.9.1.2 udp dport 40000 ct mark set 0x53579c40 dnat to 10.9.2.1:5000
    ip saddr 10.9.2.1 udp sport 5000 ip daddr 10.9.2.2 udp dport 40000 ct mark set 0x53579c40 dnat to 10.9.1.1:5001
    ip saddr 192.168.7.3 ip daddr 10.9.1.2 udp dport 40001 ct mark set 0x53579c41 dnat to 10.9.2.1:5000
    # a new flow to a relay port that is no pair's: no conntrack entry either (it would catch
    # the pair's datagrams if the pair came back on this port)
    fib daddr type local udp dport 40000-40099 drop
  }
  chain post {
    type nat hook postrouting priority srcnat; policy accept;
    ct mark 0x53579c40 ip daddr 10.9.2.1 meta l4proto udp snat to 10.9.2.2:40000
    ct mark 0x53579c40 ip daddr 10.9.1.1 meta l4proto udp snat to 10.9.1.2:40000
    ct mark 0x53579c41 ip daddr 192.168.7.3 meta l4proto udp snat to 10.9.1.2:40001
    ct mark 0x53579c41 ip daddr 10.9.2.1 meta l4proto udp snat to 10.9.2.2:40001
  }
  chain forward {
    type filter hook forward priority filter; policy accept;
    ct mark and 0xffff0000 == 0x53570000 jump relayed
    # this daemon turned forwarding on: nothing but the pairs is forwarded
    drop
  }
  chain relayed {
    ct mark 0x53579c40 ip saddr . ip daddr { 10.9.1.1 . 10.9.2.1, 10.9.2.1 . 10.9.1.1 } jump cap
    ct mark 0x53579c41 ip saddr . ip daddr { 10.9.2.1 . 192.168.7.3, 192.168.7.3 . 10.9.2.1 } jump cap
    # a flow of no active pair (its conntrack entry outlived the rules)
    drop
  }
  chain cap {
    limit name "cap" drop
    accept
  }
}
"""
PAIRS = [Pair(40000, A, B), Pair(40001, B, C)]
E1 = End(peer="E1", ip="198.51.100.7", wg_port=40123, via_ip="10.9.1.2", edm=True)  # symmetric NATs: the
E2 = End(peer="E2", ip="198.51.100.8", wg_port=40456, via_ip="10.9.2.2", edm=True)  # proven port is not theirs
PORTS = (40000, 40099)


def render_(*args, **kw) -> str:
    return nft.render(*args, **{"ports": PORTS, "local": LOCAL, **kw})


def test_render_golden():
    assert render_("swarmd_relay_wg0", PAIRS, cap_bytes_per_s=12_500_000, drop_other_forwarding=True) == GOLDEN


def test_forwarding_that_was_on_is_left_alone_and_no_pairs_is_an_empty_table():
    script = render_("t", [], cap_bytes_per_s=1000, drop_other_forwarding=False)
    assert nft.FORWARDING_WAS_OFF not in script
    forward = script[script.index("chain forward"):script.index("chain relayed")]
    assert "drop" not in forward  # only the relayed flows are judged
    assert "dnat" not in script and "snat" not in script
    relayed = script[script.index("chain relayed"):script.index("chain cap")]
    assert relayed.splitlines()[-3:-1] == ["    drop", "  }"]  # stale flows of removed pairs are dropped


def test_pinned_ends_are_matched_on_their_port_and_no_flow_goes_towards_a_natted_end():
    """B (pinned) and C (behind a NAT) above: only C may make their flow, and A's and B's
    flows come only from their WireGuard ports (nobody else at their address can squat the pair)."""
    pre = GOLDEN[GOLDEN.index("chain pre"):GOLDEN.index("chain post")]
    assert "ip saddr 10.9.2.1 udp sport 5000 ip daddr 10.9.2.2 udp dport 40001" not in pre
    unpinned = [End(peer=e.peer, ip=e.ip, wg_port=e.wg_port, via_ip=e.via_ip) for e in (A, B)]
    script = render_("t", [Pair(40000, *unpinned)], cap_bytes_per_s=1000, drop_other_forwarding=False)
    assert "sport" not in script and script.count("dnat to") == 2  # neither pinned: the first sender's flow


def test_a_relay_behind_1_to_1_nat_matches_any_local_address_and_masquerades():
    """A cloud VM announces its public address; the datagrams reach it addressed to its private one,
    and its answers must leave from it (the cloud's NAT turns them into the public one)."""
    public = End(peer="A", ip="10.9.1.1", wg_port=5001, via_ip="203.0.113.2", pinned=True)
    script = render_("t", [Pair(40000, public, B)], cap_bytes_per_s=1000, drop_other_forwarding=False)
    assert ("ip saddr 10.9.1.1 udp sport 5001 fib daddr type local udp dport 40000 ct mark set 0x53579c40 "
            "dnat to 10.9.2.1:5000") in script
    assert "ct mark 0x53579c40 ip daddr 10.9.1.1 meta l4proto udp masquerade to :40000" in script
    assert "ct mark 0x53579c40 ip daddr 10.9.2.1 meta l4proto udp snat to 10.9.2.2:40000" in script  # local
    assert "203.0.113.2" not in script


def test_an_update_refills_no_bucket_it_only_refills_the_rule_chains():
    script = render_("t", PAIRS, cap_bytes_per_s=1000, drop_other_forwarding=True, update=True)
    head = script.splitlines()[1:8]
    assert head == [f"flush chain ip t {c}" for c in ("learn", "pre", "post", "forward", "relayed")] \
        + ["flush map ip t learned_a", "flush map ip t learned_b"]  # a learnt port may be another pair's now
    assert "delete table" not in script and "limit" not in script and "chain cap" not in script
    fresh = render_("t", PAIRS, cap_bytes_per_s=1000, drop_other_forwarding=True)
    body = fresh.split('  limit cap { rate over 1000 bytes/second }\n')[1]
    body = body[body.index("  chain learn {"):]
    cap = '  chain cap {\n    limit name "cap" drop\n    accept\n  }\n'
    assert script.split("table ip t {\n")[1] == body.replace(cap, "")


def test_table_names_and_marks():
    assert nft.table_name("wg-swarm") == "swarmd_relay_wg_swarm"
    assert nft.table_name("a.b") == "swarmd_relay_a_b"
    assert len(nft.table_name("x" * 15)) <= 32
    assert nft.mark(40000) == 0x53579C40
    assert nft.delete("swarmd_relay_wg0") == "add table ip swarmd_relay_wg0\ndelete table ip swarmd_relay_wg0\n"


def end(**kw) -> End:
    return End(**{"peer": "X", "ip": "10.9.3.1", "wg_port": 51820, "via_ip": "10.9.1.2", **kw})


@pytest.mark.parametrize("bad", [
    {"ip": "10.9.3.1 dnat to 1.2.3.4"},
    {"ip": "10.9.3.1;"},
    {"ip": '10.9.3.1" }'},
    {"ip": "fd00::1"},
    {"ip": "127.0.0.1"},
    {"ip": "224.0.0.5"},
    {"ip": 167969537},  # an int is no address here
    {"via_ip": "0.0.0.0"},
    {"wg_port": 0},
    {"wg_port": "51820 accept"},
    {"wg_port": 70000},
    {"wg_port": False},
    {"pinned": "yes"},
])
def test_render_refuses_what_relay_should_have_refused(bad):
    """Defence in depth: a value that slipped past relay.py (or a Pair built by hand) adds no statement."""
    with pytest.raises(ValueError):
        render_("t", [Pair(40000, A, end(**bad))], cap_bytes_per_s=1000, drop_other_forwarding=False)


@pytest.mark.parametrize(("table", "pairs", "cap"), [
    ("t; flush ruleset", [], 1000),
    ("9t", [], 1000),
    ("t" * 33, [], 1000),
    ("t", [], 0),
    ("t", [], 1.5),
    ("t", [], 2**41),
    ("t", [Pair(0, A, B)], 1000),
    ("t", [Pair(40100, A, B)], 1000),  # outside the relay's ports
    ("t", [Pair(40000, A, B), Pair(40000, A, C)], 1000),  # one port twice
    ("t", [Pair(40000, A, End(peer="B", ip="10.9.1.1", wg_port=1, via_ip="10.9.2.2"))], 1000),  # one address
    ("t", [(40000, A, B)], 1000),
])
def test_render_refuses_bad_tables_caps_and_pairs(table, pairs, cap):
    with pytest.raises(ValueError):
        render_(table, pairs, cap_bytes_per_s=cap, drop_other_forwarding=True)
    if table != "t":
        with pytest.raises(ValueError):
            nft.delete(table)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nft") or not shutil.which("ip"),
                    reason="nft -c needs root, nft and ip (a throwaway network namespace)")
def test_nft_accepts_the_script():
    ns = f"swrc{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        natted = [Pair(40002, End(peer="D", ip="10.9.3.1", wg_port=1, via_ip="203.0.113.2"), C),
                  Pair(40003, E1, E2), Pair(40004, A, E1)]
        for drop in (True, False):
            for check, update in (("-c", False), ("", False), ("-c", True)):  # an update needs the table in
                script = render_("swarmd_relay_wg0", PAIRS + natted, cap_bytes_per_s=12_500_000,
                                 drop_other_forwarding=drop, update=update)
                done = subprocess.run(["ip", "netns", "exec", ns, "nft", *([check] if check else []), "-f", "-"],
                                      input=script.encode(), capture_output=True)
                assert done.returncode == 0, done.stderr.decode()
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_no_flow_goes_towards_an_edm_end_at_its_proven_port():
    """A symmetric NAT maps the relay port to another external port than the relay's WireGuard
    port: only the edm end makes the flow, against a pinned or an eim (not pinned) end."""
    for other in (A, C):
        script = render_("t", [Pair(40000, other, E1)], cap_bytes_per_s=1000, drop_other_forwarding=False)
        pre = script[script.index("chain pre"):script.index("chain post")]
        assert "dnat to 198.51.100.7" not in pre and "40123" not in script
        assert pre.count("dnat to") == 1 and f"ip saddr 198.51.100.7 ip daddr {E1.via_ip} udp dport 40000" in pre
        assert "update @" not in script


def test_two_edm_ends_are_paired_by_the_ports_their_own_datagrams_come_from():
    script = render_("t", [Pair(40003, E1, E2)], cap_bytes_per_s=1000, drop_other_forwarding=False)
    learn = script[script.index("chain learn"):script.index("chain pre")]
    pre = script[script.index("chain pre"):script.index("chain post")]
    assert ("ip saddr 198.51.100.7 ip daddr 10.9.1.2 udp dport 40003 update @learned_a "
            "{ udp dport : ip saddr . udp sport }") in learn
    assert ("ip saddr 198.51.100.8 ip daddr 10.9.2.2 udp dport 40003 update @learned_b "
            "{ udp dport : ip saddr . udp sport }") in learn
    assert ("ip saddr 198.51.100.7 ip daddr 10.9.1.2 udp dport 40003 ct mark set 0x53579c43 "
            "dnat ip to udp dport map @learned_b") in pre
    assert ("ip saddr 198.51.100.8 ip daddr 10.9.2.2 udp dport 40003 ct mark set 0x53579c43 "
            "dnat ip to udp dport map @learned_a") in pre
    assert "40123" not in script and "40456" not in script, "the proven ports are not theirs towards the relay port"
    assert "ct mark 0x53579c43 ip saddr . ip daddr { 198.51.100.7 . 198.51.100.8, 198.51.100.8 . 198.51.100.7 }" \
        in script, "the forward check still holds the pair to its two addresses"


def test_an_end_both_pinned_and_edm_is_refused():
    bad = End(peer="X", ip="10.9.5.1", wg_port=1, via_ip="10.9.1.2", pinned=True, edm=True)
    with pytest.raises(ValueError, match="at most one"):
        render_("t", [Pair(40000, bad, B)], cap_bytes_per_s=1000, drop_other_forwarding=False)
