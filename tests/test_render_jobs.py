"""How jobs look: a peer's words (a host's error in a restart's reason) are shown as text, never as markup."""

from __future__ import annotations

from swarmctl import render_jobs

HOSTILE = "host X lost ([/] [red]boom)"


def job(**changes):
    j = {"id": "abcd", "name": None, "state": "restarting", "reason": HOSTILE, "restarts": [1, 3], "phase": "placing",
         "nodes": ["peer1"], "exit_code": None, "wall_s": None, "cmd": ["python", "[bold]x"], "ranks": [], "hosts": {},
         "attempts": [{"n": 1, "nodes": ["peer1"], "started": 11.0, "ended": 12.5, "why": "[/]", "resumed_from": None},
                      {"n": 2, "nodes": ["peer2"], "started": 20.0, "ended": None, "why": None,
                       "resumed_from": "epoch-0004.pt"}],
         "checkpoints": [{"name": "epoch-0004.pt", "size": 80687, "holders": ["peerA", "peerB"]}],
         "created": 10.0, "started": 10.0}
    return j | changes


def test_a_restart_reads_restarting_k_of_max_with_its_reason():
    assert render_jobs.state_text(job()) == f"restarting (1/3): {HOSTILE}"
    assert render_jobs.job_progress(job()) == f"job abcd: restarting (1/3): {HOSTILE} [placing]"
    assert render_jobs.state_text(job(state="running")) == "running"


def test_ls_and_show_print_a_hosts_words_as_they_are(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    render_jobs.jobs([job()])
    render_jobs.job(job())
    out = capsys.readouterr().out
    assert HOSTILE in out and "python [bold]x" in out
    assert "#1 on peer1: ran +1.0 s to +2.5 s; ended: [/]" in out
    assert "#2 on peer2: ran +10.0 s to -; resumed from epoch-0004.pt" in out
    assert "epoch-0004.pt (78.8 KiB) on peerA, peerB" in out


def test_show_says_who_coordinates_and_where_the_record_is_kept(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    replicas = {"epoch": 0, "seq": 7, "replicas": ["12D3KooWorigin01", "12D3KooWhost0002", "12D3KooWhost0003"],
                "holding": ["12D3KooWorigin01", "12D3KooWhost0002"], "missing": {"12D3KooWhost0003": "[red]timeout"}}
    render_jobs.job(job(coordinator="12D3KooWorigin01", replicas=replicas))
    out = capsys.readouterr().out
    assert "coordinator  origin01" in out
    assert "on 2 of 3 replicas (epoch 0, write 7); not on host0003: [red]timeout" in out
    render_jobs.job(job())  # a job whose record is not replicated (an older daemon): no such lines
    assert "replicas" not in capsys.readouterr().out


def test_show_lists_a_grouped_jobs_groups_with_the_links_that_made_them(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    nodes = ["12D3KooWaaaaaaa1", "12D3KooWbbbbbbb2", "12D3KooWccccccc3", "12D3KooW[red]ddd"]
    rtt = [[None, 150.0, 4.0, 151.0], [150.0, None, 149.0, 5.5], [4.0, 149.0, None, None], [151.0, 5.5, None, None]]
    render_jobs.job(job(groups={"groups": [[0, 2], [1, 3]], "max_rtt_ms": 30.0, "nodes": nodes, "rtt_ms": rtt}))
    out = capsys.readouterr().out
    assert "2 groups, none spanning a link over 30 ms" in out
    assert "group 1: nodes 0, 2 (aaaaaaa1, ccccccc3), slowest link 4.0 ms" in out
    assert "group 2: nodes 1, 3 (bbbbbbb2, [red]ddd), slowest link 5.5 ms" in out
    assert "between groups: fastest link 149.0 ms (some unknown)" in out
    for bad in ({"groups": [[0, 9]], "nodes": nodes, "rtt_ms": rtt}, {"groups": "0,1", "nodes": nodes, "rtt_ms": rtt},
                {"groups": [[0]], "nodes": nodes, "rtt_ms": [[1.0]]}):
        render_jobs.job(job(groups=bad))
        assert "(malformed)" in capsys.readouterr().out
    render_jobs.job(job())
    assert "group 1" not in capsys.readouterr().out
