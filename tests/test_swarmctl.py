"""swarmctl as a user runs it: exit codes, JSON, hints, speed."""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import wait_until
from swarmd.rpc.client import RemoteError
from swarmd.rpc.protocol import ErrorCode

SWARMCTL = [sys.executable, "-m", "swarmctl.main"]


def run(*args, env=None, timeout=30):
    return subprocess.run([*SWARMCTL, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})


def test_status_json_and_table(daemon):
    proc = run("--socket", str(daemon.socket), "status", "--json")
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert status["peer_id"].startswith("12D3KooW")
    table = run("status", env={"SWARMD_SOCKET": str(daemon.socket)})
    assert table.returncode == 0
    assert status["peer_id"] in table.stdout and "connected peers" in table.stdout


def test_version_shows_client_and_daemon(daemon):
    proc = run("--json", "--socket", str(daemon.socket), "version")
    info = json.loads(proc.stdout)
    assert info["client"] == info["daemon"]["version"] == "0.1.0"
    assert info["daemon"]["libp2p"] == "0.8.1"


def test_log_level_round_trip(daemon):
    proc = run("--socket", str(daemon.socket), "log-level", "debug")
    assert proc.returncode == 0 and "info -> debug" in proc.stdout
    assert daemon.call("status")["log_level"] == "debug"


def test_watch_streams_snapshots(daemon):
    proc = subprocess.Popen([*SWARMCTL, "--socket", str(daemon.socket), "status", "--json", "--watch", "0.2"],
                            stdout=subprocess.PIPE, text=True)
    try:
        decoder, buf, docs = json.JSONDecoder(), "", []
        while len(docs) < 3:
            buf += proc.stdout.readline()
            try:
                doc, end = decoder.raw_decode(buf.strip())
            except json.JSONDecodeError:
                continue
            docs.append(doc)
            buf = ""
        assert docs[0]["uptime_s"] < docs[2]["uptime_s"]
    finally:
        proc.terminate()
        proc.wait(10)


def test_unreachable_daemon_exits_3_with_a_hint(tmp_path):
    missing = tmp_path / "nope.sock"
    proc = run("--socket", str(missing), "status")
    assert proc.returncode == 3
    assert f"cannot reach swarmd at {missing}: no such socket" in proc.stderr
    assert "is swarmd running?" in proc.stderr


def test_stale_socket_is_reported_as_refused(tmp_path):
    import socket
    path = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    proc = run("--socket", str(path), "status")
    assert proc.returncode == 3 and "connection refused" in proc.stderr


@pytest.mark.parametrize("args", [["frobnicate"], ["log-level", "loud"], ["status", "--watch", "0"], []])
def test_usage_errors_exit_2(args):
    proc = run(*args)
    assert proc.returncode == 2
    assert "usage: swarmctl" in proc.stderr


def test_help_is_fast():
    """DESIGN: `swarmctl --help` < 300 ms. Best of five, so one slow start on a busy CI box
    does not decide it; measured here at about 60 ms."""
    times = []
    for _ in range(5):
        started = time.monotonic()
        proc = run("--help")
        times.append(time.monotonic() - started)
        assert proc.returncode == 0 and "status" in proc.stdout
    assert min(times) < 0.3, times


def test_help_imports_nothing_heavy():
    code = "import sys, swarmctl.main; print(sorted(m for m in ('trio', 'libp2p', 'rich', 'structlog') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.stdout.strip() == "[]"


def test_swarm_commands_from_init_to_peers(make_daemon):
    owner = make_daemon("owner")
    sock = ["--socket", str(owner.socket)]
    assert "not in a swarm" in run(*sock, "peers").stdout
    refused = run(*sock, "swarm", "invite")
    assert refused.returncode == 1 and "swarm init" in refused.stderr
    init = run(*sock, "swarm", "init")
    assert init.returncode == 0 and "created" in init.stdout
    again = run(*sock, "swarm", "init")
    assert again.returncode == 1 and "already in a swarm" in again.stderr
    invite = run(*sock, "swarm", "invite", "--expires", "1h")
    assert invite.returncode == 0, invite.stderr
    token = invite.stdout.strip()
    assert token.startswith("swarmd1.") and "valid for 1h" in invite.stderr

    member = make_daemon("member")
    joined = run("--socket", str(member.socket), "swarm", "join", token)
    assert joined.returncode == 0, joined.stderr
    member_id = member.call("status")["peer_id"]
    assert run("--socket", str(member.socket), "labels", "set", "region=eu", "tier=a").returncode == 0
    assert run("--socket", str(member.socket), "labels", "rm", "tier").returncode == 0

    def row():
        peers = json.loads(run(*sock, "--json", "peers").stdout)["peers"]
        return peers[0] if peers and peers[0]["labels"] == {"region": "eu"} else None
    got = wait_until(row, 10, "the member's labels at the owner")
    assert got["peer"] == member_id and got["state"] == "alive"
    # until a probe lands, the RTT shown is the coordinates' estimate (rtt_source says which)
    measured = wait_until(lambda: (r := row()) and r["rtt_source"] == "measured" and r, 10, "the owner's probe RTT")
    assert 0 < measured["rtt_ms"] < 1000
    table = run(*sock, "peers").stdout
    assert member_id[-8:] in table and "alive" in table and "region=eu" in table


@pytest.mark.parametrize("args, message", [
    (["labels", "set", "region"], "expected K=V"),
    (["labels", "set", "Bad Key=x"], "key"),
    (["swarm", "join", "swarmd1.garbage"], "token"),
    (["swarm", "invite", "--expires", "soon"], "expires"),
    (["swarm", "invite", "--uses", "0"], "must be 1 to 10000"),
    (["swarm", "invite", "--uses", "two"], "expected a whole number"),
    (["swarm", "revoke", "12D3KooWxyz"], "only the node that ran `swarm init`"),
])
def test_bad_swarm_arguments_are_named(daemon, args, message):
    proc = run("--socket", str(daemon.socket), *args)
    assert proc.returncode in (1, 2) and message in proc.stderr, proc.stderr


def test_ctrl_c_before_the_daemon_names_the_job_is_held_until_it_does():
    """Between sending `jobs.run` and reading the job's id a Ctrl-C would quit and leave the
    job running unseen: it is held, and acted on (asking) once the id is known."""
    from swarmctl.jobs import CtrlC

    ctrl_c = CtrlC()
    with pytest.raises(KeyboardInterrupt):
        ctrl_c._handle(2, None)  # before the request: quits as usual
    ctrl_c.hold()
    ctrl_c._handle(2, None)  # held
    with pytest.raises(KeyboardInterrupt):
        ctrl_c.named()
    ctrl_c.named()  # nothing held: nothing raised
    with pytest.raises(KeyboardInterrupt):
        ctrl_c._handle(2, None)  # after: as usual
    ctrl_c.hold()
    ctrl_c._handle(2, None)
    with pytest.raises(KeyboardInterrupt):
        ctrl_c._handle(2, None)  # a second press while one is held quits at once


# --- paths and RTTs (routing), drawn from canned daemon answers -----------------------------------

H2 = "12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq"
H3 = "12D3KooWRndVhVZPCiQwHBBBdg769GyrPUW13zxwqQyf9r3ANaba"
H4 = "12D3KooWPT98FXMfDQYavZm66EeVjTqP9Nnehn1gyaydqV8L8BQw"


class CannedClient:
    """Stands in for swarmd.rpc.client.Client: each method answers what the table says (an
    exception is raised), and every call is kept."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def __call__(self, path, *, timeout=None):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def call(self, method, **params):
        self.calls.append((method, params))
        answer = self.answers[method]
        if isinstance(answer, Exception):
            raise answer
        return answer


def swarmctl_in_process(monkeypatch, capsys, answers, *args):
    from swarmctl import main as swarmctl_main

    client = CannedClient(answers)
    monkeypatch.setattr(swarmctl_main, "Client", client)
    monkeypatch.setenv("COLUMNS", "200")
    code = swarmctl_main.main(["--socket", "/nonexistent", *args])
    out, err = capsys.readouterr()
    return code, out, err, client.calls


def peer_row(peer, rtt_ms, source):
    return {"peer": peer, "state": "alive", "stale": False, "rtt_ms": rtt_ms, "rtt_source": source, "labels": {},
            "resources": {"gpus": [], "cpu_free": 2, "cpu_count": 2, "memory_free_mb": 1024,
                          "memory_total_mb": 2048}, "record_age_s": 3}


def test_peers_show_a_measured_rtt_as_measured_and_an_estimate_marked_with_a_legend(monkeypatch, capsys):
    answer = {"swarm": "s1", "peers": [peer_row(H2, 42.13, "measured"), peer_row(H3, 118.4, "estimated"),
                                       peer_row(H4, None, None)]}
    code, out, _, _ = swarmctl_in_process(monkeypatch, capsys, {"peers": answer}, "peers")
    lines = {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│")}
    assert code == 0
    assert "42.1 ms" in lines[H2[-8:]] and "~118 ms" in lines[H3[-8:]] and " - " in lines[H4[-8:]]
    assert "~ RTT estimated from network coordinates" in out
    measured_only = {"swarm": "s1", "peers": [peer_row(H2, 42.13, "measured")]}
    assert "estimated" not in swarmctl_in_process(monkeypatch, capsys, {"peers": measured_only}, "peers")[1]


def test_peers_draw_a_members_words_as_text_never_markup_or_control_sequences(monkeypatch, capsys):
    """Finding 9: a member's label value `[/x]` crashed `swarmctl peers` for every operator
    (Rich read it as a closing tag); a GPU name or label with an escape reached the terminal."""
    row = peer_row(H2, 42.0, "measured")
    row["labels"] = {"zone": "[/x]", "tier": "[bold red]gold"}
    row["resources"]["gpus"] = [{"name": "H100 \x1b]52;c;aGk=\x07", "memory_free_mb": 81920}]
    code, out, _, _ = swarmctl_in_process(monkeypatch, capsys, {"peers": {"swarm": "s1", "peers": [row]}}, "peers")
    assert code == 0
    assert "zone=[/x]" in out and "tier=[bold red]gold" in out
    assert "\x1b" not in out and "\x07" not in out
    assert "H100 \\x1b]52;c;aGk=\\x07" in out  # shown, as an escape


def test_a_hosts_error_reaches_the_terminal_as_text(monkeypatch, capsys):
    """Finding 10: an error quoting a host prints its controls as escapes."""
    error = RemoteError(ErrorCode.OPERATION_FAILED, "host said: \x1b[2J\x1b[1;1Hjob succeeded\r")
    code, _, err, _ = swarmctl_in_process(monkeypatch, capsys, {"route": error}, "route", H2)
    assert code != 0
    assert "\x1b" not in err and "\r" not in err
    assert "\\x1b[2J\\x1b[1;1Hjob succeeded\\x0d" in err


def test_rank_output_is_neutralised_on_a_terminal_and_passed_unchanged_to_a_pipe(monkeypatch, capsys):
    """Finding 10: a rank's OSC 52 (clipboard), title change or carriage return never acts on
    the user's terminal; piped into a file the output stays byte for byte what the rank wrote."""
    from swarmctl import jobs

    line = "loss 0.1\x1b]52;c;ZXZpbA==\x07\rjob succeeded\u202e\tend"
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    jobs._write_output([[0, line]], None)
    shown = capsys.readouterr().out
    assert shown == "[rank 0] loss 0.1\\x1b]52;c;ZXZpbA==\\x07\\x0djob succeeded\\u202e\tend\n"
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    jobs._write_output([[0, line]], 0)
    assert capsys.readouterr().out == line + "\n"


def mesh_row(peer, **path):
    return {"peer": peer, "public_key": "k", "overlay": "10.211.0.2", "overlay6": None,
            "endpoint": "192.0.2.3:51821", "direct": False, "handshake_age_s": 4.0, "rx_bytes": 10, "tx_bytes": 20,
            "path": "direct", "relay": None, "relay_state": None, "path_rtt_ms": None, "direct_rtt_ms": None,
            "estimate_ms": None, **path}


def test_mesh_shows_each_peers_path_its_rtt_the_direct_rtt_and_the_estimate(monkeypatch, capsys):
    answer = {"interface": "wrd0", "backend": "kernel", "address": "10.211.0.1", "public_key": "key", "peers": [
        mesh_row(H2, path=f"via {H3[-8:]}", relay=H3, relay_state="active", path_rtt_ms=50.4, direct_rtt_ms=120.2,
                 estimate_ms=117.6),
        mesh_row(H4, path="direct", relay=H3, relay_state="requesting", path_rtt_ms=80.0, direct_rtt_ms=80.0),
        mesh_row(H3, path_rtt_ms=20.0, direct_rtt_ms=20.0, estimate_ms=22.0)]}
    code, out, _, _ = swarmctl_in_process(monkeypatch, capsys, {"mesh": answer}, "mesh")
    header = next(line for line in out.splitlines() if "peer" in line)
    assert [c.strip() for c in header.split("┃")[1:-1]] == \
        ["peer", "overlay", "endpoint", "path", "rtt", "direct", "estimate", "handshake", "rx", "tx"]
    rows = table_rows(out)
    assert code == 0
    assert rows[H2[-8:]][3:7] == [f"via {H3[-8:]}", "50.4 ms", "120.2 ms", "~118 ms"]
    assert rows[H4[-8:]][3] == f"direct (via {H3[-8:]} requesting)", "a relay chosen, its session not active yet"
    assert rows[H3[-8:]][3:7] == ["direct", "20.0 ms", "20.0 ms", "~22 ms"]


def route_answer(view, rounds: int) -> dict:
    """What the daemon answers for `route` about B, the middle of the three sorted peer ids (the
    lowest is ``view.me``): routing/paths.py's own explain after ``rounds`` evaluations one second
    apart, with the relay session through C (the highest) the driver adds once the switch is made."""
    from swarmd.routing.paths import Paths

    me, b, c = sorted([H2, H3, H4])
    paths = Paths(me)
    for t in range(rounds):
        paths.evaluate(float(t), view)
    out = {"peer": b, **paths.explain(b, view, now=float(rounds))}
    relayed = paths.path(b) is not None
    out["session"] = {"relay": c, "state": "active", "port": 51821, "via_ip": "10.0.0.3", "misses": 0,
                      "error": None, "for_s": 4.0} if relayed else None
    out["in_use"] = f"via {c}" if relayed else "direct"
    return json.loads(json.dumps(out))  # as it comes over the socket


def explained(rounds: int) -> dict:
    """`route`'s answer where the direct path to B (120 ms) loses to one through C (20 + 30 ms)."""
    from swarmd.routing.paths import PathView

    me, b, c = sorted([H2, H3, H4])
    reports = {b: {c: 30.0, me: 120.0}, c: {b: 30.0, me: 20.0}}
    view = PathView(me=me, peers=frozenset({b, c}), relays=frozenset({c}), own={b: 120.0, c: 20.0},
                    reports=lambda p: reports.get(p, {}), estimate=lambda x, y: 52.0 if c in (x, y) else 110.0,
                    announced=lambda p: None)
    return route_answer(view, rounds)


def table_rows(out: str) -> dict[str, list[str]]:
    return {cells[0]: cells for cells in ([c.strip() for c in line.split("│")[1:-1]]
                                          for line in out.splitlines() if line.startswith("│"))}


def test_route_explains_a_relayed_path(monkeypatch, capsys):
    answer = explained(rounds=3)
    me, b, c = sorted([H2, H3, H4])
    code, out, _, calls = swarmctl_in_process(monkeypatch, capsys, {"route": answer}, "route", b[-8:])
    assert code == 0 and calls == [("route", {"peer": b[-8:]})]
    assert f"via {c[-8:]} (relay session active, port 51821)" in out
    assert "path RTT    50.0 ms" in out and "direct RTT  120.0 ms" in out
    assert "lower peer id of a pair chooses" in out and "settled: no move wanted" in out
    assert "to a relay at ≤ 90 % of the path and ≥ 2 ms faster, back to direct above 95 %" in out
    assert table_rows(out)[f"{c[-8:]} (in use)"][1:] == ["20.0 ms", "30.0 ms", "50.0 ms", "~82 ms", "-58 %"]


def test_route_marks_an_asked_leg_and_a_busy_pair(monkeypatch, capsys):
    """A relay leg from outside the peer's record (paths.py AskLegs) is marked as asked."""
    answer = explained(rounds=3)
    me, b, c = sorted([H2, H3, H4])
    answer["candidates"][0]["leg2_source"] = "asked"
    answer["busy"] = True
    code, out, _, _ = swarmctl_in_process(monkeypatch, capsys, {"route": answer}, "route", b)
    assert code == 0 and "heavy now: not moved for latency" in out
    assert table_rows(out)[f"{c[-8:]} (in use)"][2] == "30.0 ms (asked)"


def test_route_shows_a_switch_under_way(monkeypatch, capsys):
    me, b, c = sorted([H2, H3, H4])
    code, out, _, _ = swarmctl_in_process(monkeypatch, capsys, {"route": explained(rounds=2)}, "route", b)
    assert code == 0
    assert "path        direct" in out and f"wants via {c[-8:]}: 2 of 3 rounds in a row" in out
    assert table_rows(out)[c[-8:]][1:4] == ["20.0 ms", "30.0 ms", "50.0 ms"]


def test_route_as_a_follower_and_with_no_relay_to_consider(monkeypatch, capsys):
    answer = {"peer": H2, "role": "follower", "path": "direct", "current": None, "direct_ms": 80.0,
              "direct_source": "reported by the peer", "path_ms": 80.0, "estimate_ms": None, "candidates": [],
              "held_down": {H4: 41.2}, "announced": H3, "refused": "the relay is held down after a failure",
              "session": None, "in_use": "direct"}
    code, out, _, _ = swarmctl_in_process(monkeypatch, capsys, {"route": answer}, "route", H2)
    assert code == 0
    assert "80.0 ms (reported by the peer)" in out and "follows what its record announces" in out
    assert f"announced     via {H3[-8:]}" in out and "not followed  the relay is held down" in out
    assert f"{H4[-8:]} for 41 s more (it failed)" in out and "no relay considered" in out


def test_route_json_is_the_daemons_answer(monkeypatch, capsys):
    answer = explained(rounds=3)
    code, out, _, _ = swarmctl_in_process(monkeypatch, capsys, {"route": answer}, "route", H2, "--json")
    assert code == 0 and json.loads(out) == answer


@pytest.mark.parametrize("code, status", [(ErrorCode.INVALID_PARAMS, 2), (ErrorCode.OPERATION_FAILED, 1)])
def test_route_errors_are_printed_with_their_exit_status(monkeypatch, capsys, code, status):
    error = RemoteError(code, "route: 'ASuq' is too short to name a peer")
    got, out, err, _ = swarmctl_in_process(monkeypatch, capsys, {"route": error}, "route", "ASuq")
    assert got == status and out == "" and "swarmctl: route: 'ASuq' is too short" in err


def test_route_needs_a_peer():
    proc = run("route")
    assert proc.returncode == 2 and "PEER" in proc.stderr


def test_route_on_a_daemon_without_the_mesh_says_so(daemon):
    proc = run("--socket", str(daemon.socket), "route", H2)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("swarmctl: route: the WireGuard mesh is off on this node"), proc.stderr


def test_status_shows_the_coordinate_the_relayed_paths_and_relaying_for_others():
    from swarmctl import render

    relaying = {"coordinate": {"vec_ms": [1.0] * 8, "height_ms": 0.5, "error": 0.123},
                "vivaldi": {"updates": 120, "rejected": 2, "rejections": {"rtt": 1, "implausible": 1}, "resets": 0},
                "relayed_paths": {H2: H3},
                "legs": {"asked": 4, "taken": 3, "dropped": 1, "failed": 0, "served": 7, "refused": 2},
                "relay": {"mode": "auto", "offered": True, "off": None, "ports": "51821-52820", "cap_mbit": 100,
                          "pairs": 3, "error": None}}
    assert dict(render.routing_rows(relaying)) == {
        "coordinate": "error 0.12 after 120 RTTs (2 rejected: implausible 1, rtt 1)",
        "relayed paths": [f"{H2[-8:]} via {H3[-8:]}"],
        "relay legs": "asked 4, taken 3, dropped 1, unanswered 0; answered 7 for others, refused 2",
        "relaying for others": "on: 3 pairs, up to 100 Mbit/s, ports 51821-52820"}
    off = relaying | {"relayed_paths": {}, "relay": {"mode": "auto", "offered": False, "off": "not root"}}
    rows = dict(render.routing_rows(off))
    assert rows["relayed paths"] == "none: all direct" and rows["relaying for others"] == "off (auto): not root"
    assert render.routing_rows(None) == []


def test_jobs_run_host_flags_make_the_specs_allow_list():
    """`--host PEER` (repeatable, or A,B) keeps a job on the members its user trusts (finding 6)."""
    from swarmctl import jobs
    from swarmctl.main import parser

    a, b = H2, H3
    args = parser().parse_args(["jobs", "run", "--host", a, "--host", f"{b},{a}", "--", "python", "x.py"])
    assert jobs._spec(args)["hosts"] == [a, b]
    with pytest.raises(jobs.UsageError, match=r"'hosts\[0\]' must be a full peer id"):
        jobs._spec(parser().parse_args(["jobs", "run", "--host", "XaN6WKvN", "--", "python"]))


def test_jobs_run_no_grow_turns_growth_off_and_without_it_the_spec_grows():
    from swarmctl import jobs
    from swarmctl.main import parser

    grows = jobs._spec(parser().parse_args(["jobs", "run", "--nodes", "2:4", "--", "python", "t.py"]))
    still = jobs._spec(parser().parse_args(["jobs", "run", "--nodes", "2:4", "--no-grow", "--", "python", "t.py"]))
    assert grows["grow"] is True and still["grow"] is False


def test_jobs_run_groups_auto_a_cap_or_a_bad_value_named():
    from swarmctl import jobs
    from swarmctl.main import parser

    def spec(*flags):
        return jobs._spec(parser().parse_args(["jobs", "run", "--nodes", "6", *flags, "--", "python", "t.py"]))

    assert spec("--groups", "auto")["groups"] == 30.0 and spec("--groups", "50ms")["groups"] == 50.0
    assert "groups" not in spec() and "groups" not in spec("--groups", "off")
    with pytest.raises(jobs.UsageError, match="'groups' must be auto, off"):
        spec("--groups", "near")
