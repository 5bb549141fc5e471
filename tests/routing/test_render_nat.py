"""`swarmctl mesh` and `swarmctl route` for members behind NATs (swarmctl/render.py): direct,
direct (punched), via X (reason); the route's why and direct-path rows; a peer's text stays text."""

from swarmd.routing import direct as dp
from swarmd.routing.paths import PathView
from test_swarmctl import H2, H3, H4, mesh_row, route_answer, swarmctl_in_process, table_rows


def test_mesh_says_direct_punched_or_via_a_relay_with_its_reason(monkeypatch, capsys):
    answer = {"interface": "wrd0", "backend": "kernel", "address": "10.211.0.1", "public_key": "key", "peers": [
        mesh_row(H2, path=f"via {H3[-8:]} (symmetric NAT)", relay=H3, relay_state="active", reason=dp.SYMMETRIC),
        mesh_row(H4, path="direct", reflexive=True, endpoint="203.0.113.7:40001"),
        mesh_row(H3)]}
    code, out, _, _ = swarmctl_in_process(monkeypatch, capsys, {"mesh": answer}, "mesh")
    rows = table_rows(out)
    assert code == 0
    assert rows[H2[-8:]][3] == f"via {H3[-8:]} (symmetric NAT)"
    assert rows[H4[-8:]][3] == "direct (punched)"
    assert rows[H3[-8:]][3] == "direct"


def test_a_peers_words_in_a_path_reach_the_terminal_as_text(monkeypatch, capsys):
    hostile = "via [bold red]x[/] (\x1b]52;c;aGk=\x07)"
    answer = {"interface": "wrd0", "backend": "kernel", "address": "10.211.0.1", "public_key": "key",
              "peers": [mesh_row(H2, path=hostile, relay=H3, relay_state="active")]}
    code, out, _, _ = swarmctl_in_process(monkeypatch, capsys, {"mesh": answer}, "mesh")
    assert code == 0 and "\x1b]52" not in out and "\\x1b]52" in out and "[bold red]x[/]" in out


def explained_nat(me_nat: str, peer_nat: str, rounds: int) -> dict:
    me, b, c = sorted([H2, H3, H4])
    reach = {me: (me_nat, "198.51.100.1:51820"), b: (peer_nat, "203.0.113.2:40000"), c: ("public", None)}
    reports = {b: {c: 30.0, me: 20.0}, c: {b: 30.0, me: 20.0}}
    view = PathView(me=me, peers=frozenset({b, c}), relays=frozenset({c}), own={b: 20.0, c: 20.0},
                    reports=lambda p: reports.get(p, {}), estimate=lambda x, y: None, announced=lambda p: None,
                    reach=lambda p: reach.get(p, (None, None)), public=frozenset({c}), unshaken=frozenset({b}))
    return route_answer(view, rounds)


def test_route_explains_a_pair_relayed_for_a_symmetric_nat(monkeypatch, capsys):
    me, b, c = sorted([H2, H3, H4])
    answer = explained_nat("edm", "edm", rounds=1)
    code, out, _, _ = swarmctl_in_process(monkeypatch, capsys, {"route": answer}, "route", b[-8:])
    assert code == 0 and f"via {c[-8:]} (relay session active" in out
    assert "symmetric NAT: an end's NAT maps each destination to a new port" in " ".join(out.split())
    assert "the two NATs rule it out" in out
    assert "here behind NAT (symmetric), peer behind NAT (symmetric)" in out


def test_route_explains_no_direct_path_and_an_unproven_one(monkeypatch, capsys):
    me, b, c = sorted([H2, H3, H4])
    code, out, _, _ = swarmctl_in_process(monkeypatch, capsys, {"route": explained_nat("eim", "firewall", 11)},
                                          "route", b[-8:])
    flat = " ".join(out.split())
    assert code == 0 and "no direct path: WireGuard completed no handshake on it" in flat
    assert "none (0 tries failed; next in 29.0 s)" in flat
    code, out, _, _ = swarmctl_in_process(monkeypatch, capsys, {"route": explained_nat("eim", "firewall", 5)},
                                          "route", b[-8:])
    flat = " ".join(out.split())
    assert "no handshake yet, for 5.0 s (relayed after 10.0 s)" in flat and " why " not in flat
