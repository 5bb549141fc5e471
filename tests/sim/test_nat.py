"""sim/netlab/nat.py: the `--nat` spec and each class's router ruleset (no root needed; the lab
test tests/netlab/test_nat_lab.py checks what the rules do)."""

from __future__ import annotations

import pytest

from sim.netlab import nat

HOSTS = ["h1", "h2", "h3", "h4"]


def test_a_spec_names_each_hosts_class_and_the_rest_stay_public():
    assert nat.parse_spec("h2=eim, h3=edm,h4=firewall", HOSTS) == {
        "h1": "public", "h2": "eim", "h3": "edm", "h4": "firewall"}
    assert nat.parse_spec("", HOSTS) == dict.fromkeys(HOSTS, "public")
    assert nat.check({}, HOSTS) == dict.fromkeys(HOSTS, "public")


@pytest.mark.parametrize("spec, error", [
    ("h2=cone", "h2: unknown NAT class 'cone' (one of public, eim, eim-adf, eim-apdf, edm, firewall)"),
    ("h9=eim", "no host 'h9' in the lab (hosts: h1, h2, h3, h4)"),
    ("h2=eim,h2=edm", "h2 is given twice"),
    ("h2", "'h2' is not HOST=CLASS"),
    ("=eim", "'=eim' is not HOST=CLASS"),
    ("h1=eim,h2=eim,h3=edm,h4=firewall", "at least one host must stay public"),
])
def test_a_bad_spec_is_one_line_naming_what_is_wrong(spec, error):
    with pytest.raises(ValueError) as err:
        nat.parse_spec(spec, HOSTS)
    assert error in str(err.value) and "\n" not in str(err.value)


def test_naming_a_host_public_is_allowed_but_one_must_stay_public():
    assert nat.check({"h1": "public", "h2": "edm"}, ["h1", "h2"]) == {"h1": "public", "h2": "edm"}
    with pytest.raises(ValueError, match="stay public"):
        nat.check({"h1": "eim", "h2": "edm"}, ["h1", "h2"])


@pytest.mark.parametrize("udp, stream", [(0, 120), (30, 0), (30, 100_000)])
def test_timeouts_are_checked(udp, stream):
    with pytest.raises(ValueError, match="between 1 and 86400"):
        nat.Timeouts(udp=udp, udp_stream=stream)


def test_timeouts_are_the_routers_conntrack_sysctls():
    assert nat.Timeouts().sysctls() == {"net.netfilter.nf_conntrack_udp_timeout": "30",
                                        "net.netfilter.nf_conntrack_udp_timeout_stream": "120"}


def test_each_rebind_moves_to_a_port_block_disjoint_from_the_last_and_never_51820():
    assert nat.port_range(0) is None
    ranges = [nat.port_range(g) for g in range(1, 30)]
    assert ranges[0] == (2048, 7047)
    for (low, high), (nlow, nhigh) in zip(ranges, ranges[1:]):
        assert high < nlow or nhigh < low
    assert all(1024 <= low and high < 51820 for low, high in ranges)
    with pytest.raises(ValueError):
        nat.port_range(-1)


def rules(cls: str, **kw) -> list[str]:
    return [line.strip() for line in nat.ruleset(cls, external="10.200.0.2", **kw).splitlines()]


def test_every_ruleset_replaces_the_last_one_whole():
    for cls in ("eim", "eim-adf", "eim-apdf", "edm", "firewall"):
        assert nat.ruleset(cls, external="10.200.0.2").startswith("flush ruleset\n")
    with pytest.raises(ValueError, match="no router"):
        nat.ruleset("public", external="10.200.0.2")


def test_full_cone_maps_inner_ports_itself_and_admits_anyone_to_a_mapping():
    r = rules("eim")
    assert "map fullcone {" in r and "map eim {" in r
    assert ('iifname != "lan0" ip daddr 10.200.0.2 meta l4proto { tcp, udp } '
            "dnat ip to meta l4proto . th dport map @fullcone") in r
    post = r.index("chain postrouting {")
    # the remembered mapping first, then a new one: the inner port kept before any rebind
    assert r[post + 2].endswith("snat ip to meta l4proto . ip saddr . th sport map @eim")
    assert r[post + 3].endswith("meta l4proto { tcp, udp } snat ip to 10.200.0.2")
    assert "type filter hook postrouting priority srcnat + 1; policy accept;" in r  # after the translation
    assert not any("table ip filter" in line for line in r)  # nothing filtered


def test_a_rebound_router_draws_from_the_generations_block():
    r = rules("eim-apdf", generation=2)
    assert any(line.endswith("meta l4proto { tcp, udp } snat ip to 10.200.0.2:7048-12047") for line in r)
    assert any(line.endswith("snat ip to meta l4proto . ip saddr . th sport map @eim") for line in r)


def test_mappings_age_like_conntracks_udp_entries():
    r = rules("eim", timeouts=nat.Timeouts(udp=4, udp_stream=60))
    updates = [line for line in r if "update @eim" in line]
    assert len(updates) == 2
    assert "ct status assured" not in updates[0] and "timeout 4s" in updates[0]
    assert "ct status assured" in updates[1] and "timeout 60s" in updates[1]


@pytest.mark.parametrize("cls", ["eim-apdf", "edm", "firewall"])
def test_port_restricted_filtering_admits_only_what_conntrack_holds(cls):
    r = rules(cls)
    forward = r[r.index("chain forward {"):]
    assert forward[2:4] == ['oifname "lan0" ct state established,related accept', 'oifname "lan0" drop']


def test_address_restricted_filtering_admits_contacted_addresses():
    r = rules("eim-adf", timeouts=nat.Timeouts(udp=5, udp_stream=50))
    assert "set contacted {" in r
    assert 'oifname "lan0" ip saddr @contacted accept' in r
    assert r.index('oifname "lan0" ip saddr @contacted accept') < r.index('oifname "lan0" drop')
    assert 'oifname != "lan0" update @contacted { ip daddr timeout 5s }' in r
    assert 'oifname != "lan0" ct status assured update @contacted { ip daddr timeout 50s }' in r


def test_symmetric_nat_draws_a_random_port_per_flow_and_keeps_an_empty_prerouting():
    r = rules("edm")
    assert 'oifname != "lan0" ip saddr 192.168.1.0/24 meta l4proto { tcp, udp } snat ip to 10.200.0.2 random' in r
    pre = r.index("chain prerouting {")
    assert r[pre + 1].startswith("type nat hook prerouting") and r[pre + 2] == "}"  # there, and empty
    assert not any("@fullcone" in line or "@eim" in line for line in r)


def test_a_firewall_translates_nothing():
    r = rules("firewall")
    assert not any("table ip nat" in line or "snat" in line or "dnat" in line for line in r)


def test_status_describes_the_external_ports():
    assert nat.describe_ports("public", 0) is None and nat.describe_ports("firewall", 3) is None
    assert nat.describe_ports("eim", 0) == "the inner port"
    assert nat.describe_ports("eim-apdf", 1) == "2048-7047"
    assert nat.describe_ports("edm", 0) == "random"
    assert nat.describe_ports("edm", 1) == "random in 2048-7047"
