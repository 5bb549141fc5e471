"""`swarm-sim run` end to end, as a person runs it: the small scenario, its summary, its files."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL = ROOT / "sim" / "scenarios" / "small.toml"


def swarm_sim(*words: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sim.cli", *words], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


@pytest.mark.slow
def test_run_small_prints_a_summary_and_writes_the_report_and_plots(tmp_path):
    out = tmp_path / "out"
    t0 = time.monotonic()
    r = swarm_sim("run", str(SMALL), "--seed", "2", "--out", str(out))
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert took < 30, f"the CI scenario took {took:.1f} s"
    for figure in ("detection p50 / p99 / max", "false dead", "change reached 100 %", "bytes sent /node/s",
                   "of which syncs", "of which duplicates", "core counters"):
        assert figure in r.stdout
    assert "60 simulated s in" in r.stdout and "wall" in r.stdout
    names = sorted(p.name for p in out.iterdir())
    assert names == ["bandwidth.png", "bandwidth_by_kind.png", "convergence.png", "detection_cdf.png",
                     "false_positives.png", "report.json"]
    data = json.loads((out / "report.json").read_text())
    assert data["scenario"]["name"] == "small" and data["scenario"]["seed"] == 2
    assert data["detection"]["crashes"] == 2
    assert "wall" not in json.dumps(data)  # the wall time is the summary's, never the report's


@pytest.mark.parametrize("text, field", [
    ("nodes = 10\nseconds = 60\n[network\n", "not TOML"),
    ("nodes = 10\nseconds = 60\nspeed = 3\n", "speed: unknown key"),
    ("nodes = 10\nseconds = 60\n[network]\ncountries = [\"ZZ\"]\n", "[network] countries: unknown country code 'ZZ'"),
    ("nodes = 10\nseconds = 60\n[network]\ncountries = [\"DE\", \"US\"]\n[[events]]\nat = 1\nuntil = 2\n"
     "partition = [[\"DE\"], [\"FR\"]]\n", "[[events]] #1 partition: no nodes in FR"),
])
def test_bad_input_is_one_line_on_stderr_exit_2_and_no_traceback(tmp_path, text, field):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    r = swarm_sim("run", str(path), "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.startswith(f"swarm-sim: {path}: ") and field in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()  # nothing left behind


def test_a_partition_of_a_country_the_weighted_draw_left_empty(tmp_path):
    path = tmp_path / "w.toml"
    path.write_text('seconds = 10\nnodes = 3\n[network]\ncountries = "weighted"\ntop = 3\n'
                    '[[events]]\nat = 1\nuntil = 2\npartition = [["US"], ["JP"]]\n')
    r = swarm_sim("run", str(path), "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    assert r.stderr.startswith(f"swarm-sim: {path}: [[events]] partition at 1 s: no nodes in JP")
    assert not (tmp_path / "o").exists()


def test_a_missing_scenario_file(tmp_path):
    r = swarm_sim("run", str(tmp_path / "nope.toml"))
    assert r.returncode == 2
    assert r.stderr.startswith(f"swarm-sim: {tmp_path / 'nope.toml'}: no such file (or name a shipped scenario: ")
    assert "lab-5-countries" in r.stderr and r.stderr.count("\n") == 1


def test_a_shipped_scenario_by_name(tmp_path):
    r = swarm_sim("run", "lab-soak-5pct", "--out", str(tmp_path / "o"), "--no-plots")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "o" / "report.json").read_text())["scenario"]["name"] == "lab-soak-5pct"


def test_an_out_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    r = swarm_sim("run", str(SMALL), "--out", str(tmp_path / "f"))
    assert r.returncode == 2 and r.stderr.startswith(f"swarm-sim: --out {tmp_path / 'f'}: cannot make the directory")


def test_disseminate_mode_follows_one_record_to_every_node(tmp_path):
    path = tmp_path / "d.toml"
    path.write_text('name = "d"\nmode = "disseminate"\nnodes = 500\n[network]\ncountries = ["DE", "US", "JP"]\n')
    r = swarm_sim("run", str(path), "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    assert "one record to 500 nodes" in r.stdout
    data = json.loads((tmp_path / "o" / "report.json").read_text())
    d = data["dissemination_s"]
    assert d["reached"] == 500
    # DE-US-JP: nobody is nearer than the same-country delay, nobody farther than a few mesh hops
    assert 0 < d["t50"] <= d["t99"] <= d["t100"] <= 6 * data["max_one_way_s"]
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["dissemination.png", "report.json"]


def test_a_swarm_too_big_for_this_machines_memory_is_refused_before_it_starts(tmp_path, monkeypatch, capsys):
    """Each of n cores holds n members: 25,000 nodes need about 26 GB. Refused at once with what it
    needs, not killed for memory (or swapping) an hour in."""
    from sim import cli, runner

    monkeypatch.setattr(runner, "memory_available_gb", lambda: 1.0)
    path = tmp_path / "big.toml"
    path.write_text("seconds = 10\nnodes = 7000\n")
    assert cli.main(["run", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err == "swarm-sim: big: 7,000 nodes, each holding every member, need about 2 GB of memory; 1 GB is available\n"
    assert not (tmp_path / "o").exists()
    assert runner.memory_needed_gb(10_000) < 12 and runner.memory_needed_gb(2_000) < 1  # issue 30's target
    # headroom: a run starts only within 80 % of the free memory (with rows of slots, 10,000 nodes'
    # estimate fit 90 % of a 24 GB machine's, and its warm start alone passed 19.4 GB there)
    monkeypatch.setattr(runner, "memory_available_gb", lambda: 22.8)
    assert runner.fits(20_000)[0] and not runner.fits(25_000)[0]  # issue 30: 20k fits a 24 GB machine
