"""nft.py: the relay's rules as text (golden), what it refuses to write, and `nft -c` accepting it."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

from swarmd.routing import nft
from swarmd.routing.relay import End, Pair

A = End(peer="A", ip="10.9.1.1", wg_port=5001, via_ip="10.9.1.2")
B = End(peer="B", ip="10.9.2.1", wg_port=5000, via_ip="10.9.2.2")
C = End(peer="C", ip="192.168.7.3", wg_port=51820, via_ip="10.9.1.2")

GOLDEN = """\
# swarmd relay: 2 pairs, cap 12500000 bytes/s
add table ip swarmd_relay_wg0
delete table ip swarmd_relay_wg0
table ip swarmd_relay_wg0 {
  comment "swarmd: ip_forward was off"
  chain pre {
    type nat hook prerouting priority dstnat; policy accept;
    ip saddr 10.9.1.1 ip daddr 10.9.1.2 udp dport 40000 ct mark set 0x53579c40 dnat to 10.9.2.1:5000
    ip saddr 10.9.2.1 ip daddr 10.9.2.2 udp dport 40000 ct mark set 0x53579c40 dnat to 10.9.1.1:5001
    ip saddr 10.9.2.1 ip daddr 10.9.2.2 udp dport 40001 ct mark set 0x53579c41 dnat to 192.168.7.3:51820
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
    limit rate over 12500000 bytes/second drop
    accept
  }
}
"""
PAIRS = [Pair(40000, A, B), Pair(40001, B, C)]
PORTS = (40000, 40099)


def render_(*args, **kw) -> str:
    return nft.render(*args, **{"ports": PORTS, **kw})


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
        for drop in (True, False):
            script = render_("swarmd_relay_wg0", PAIRS, cap_bytes_per_s=12_500_000, drop_other_forwarding=drop)
            done = subprocess.run(["ip", "netns", "exec", ns, "nft", "-c", "-f", "-"], input=script.encode(),
                                  capture_output=True)
            assert done.returncode == 0, done.stderr.decode()
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
