"""Scenario files: what a correct one becomes, and the one-line error each mistake gets."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sim import cli
from sim import scenario as sc

SCENARIOS = Path(__file__).resolve().parent.parent / "sim" / "scenarios"

BASE = """
name = "t"
seconds = 60
nodes = 10
[network]
countries = ["DE", "US"]
"""


def write(tmp_path: Path, text: str, name: str = "s.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_full_scenario_becomes_its_dataclasses(tmp_path):
    path = write(tmp_path, BASE + """loss = 0.01
jitter_ms = 2
[[events]]
at = 10
crash = 1
revive_after = 20
every = 5
times = 3
[[events]]
at = 5
until = 30
partition = [["de"], ["US"]]
[[events]]
at = 0
until = 60
churn_per_min = 6
[[events]]
at = 40
until = 50
congest = 2
delay_ms = 800
[[events]]
at = 12
change = 3
""")
    s = sc.load(path)
    assert (s.name, s.nodes, s.seconds, s.timing, s.mode, s.seed) == ("t", 10, 60.0, "wan", "membership", 1)
    assert s.network == sc.Network(countries=("DE", "US"), loss=0.01, jitter_ms=2.0)
    assert s.events == (
        sc.Churn(at=0.0, until=60.0, per_min=6.0),
        sc.Partition(at=5.0, until=30.0, a=("DE",), b=("US",)),
        sc.Crash(at=10.0, count=1, revive_after=20.0),
        sc.Change(at=12.0, count=3),
        sc.Crash(at=15.0, count=1, revive_after=20.0),
        sc.Crash(at=20.0, count=1, revive_after=20.0),
        sc.Congest(at=40.0, until=50.0, count=2, delay_ms=800.0),
    )


def test_a_kill_is_a_crash_with_the_host_up():
    s = sc.parse({"seconds": 60, "nodes": 5, "events": [{"at": 1, "kill": 2, "revive_after": 5}]})
    assert s.events == (sc.Crash(at=1.0, count=2, revive_after=5.0, kill=True),)


def test_defaults_a_uniform_rtt_and_the_file_name(tmp_path):
    s = sc.load(write(tmp_path, "seconds = 10\nnodes = 3\n", "plain.toml"))
    assert (s.name, s.network.rtt_ms, s.network.loss, s.events) == ("plain", 20.0, 0.0, ())


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_scenario_loads_and_places(path):
    s = sc.load(path)
    placed = sc.place(s, random.Random(1))
    assert placed is None or len(placed) == s.nodes


def test_a_file_name_that_cannot_name_a_directory_is_made_one(tmp_path):
    assert sc.load(write(tmp_path, "seconds = 10\nnodes = 3\n", "my run (2).toml")).name == "my-run--2-"


def test_a_latency_csv_is_read_relative_to_the_scenario(tmp_path):
    write(tmp_path, "0,30,80\n30,0,60\n80,60,0\n", "m.csv")
    s = sc.load(write(tmp_path, 'seconds = 10\nnodes = 6\n[network]\nlatency_csv = "m.csv"\n'))
    assert s.network.latency == ((0.0, 30.0, 80.0), (30.0, 0.0, 60.0), (80.0, 60.0, 0.0))
    assert s.network.latency_csv == "m.csv"


def test_weighted_placement_is_seeded_and_follows_the_data():
    s = sc.parse({"seconds": 10, "nodes": 2000, "network": {"countries": "weighted", "top": 20}})
    a, b = sc.place(s, random.Random(7)), sc.place(s, random.Random(7))
    assert a == b
    weights = sc.country_weights()
    top = sorted(weights, key=lambda c: -weights[c])[:20]
    assert set(a) <= set(top)
    assert a.count("US") > a.count(top[-1])  # the data's heaviest country gets the most nodes
    assert "None" not in weights  # the data's unknown-country rows place nobody


def test_listed_countries_take_turns():
    s = sc.parse({"seconds": 10, "nodes": 5, "network": {"countries": ["DE", "US"]}})
    assert sc.place(s, random.Random(1), total=7) == ["DE", "US", "DE", "US", "DE", "US", "DE"]


# Each mistake: the TOML after BASE's top-level keys (or a whole file), and what the one line says.
ERRORS = [
    ("nodes = 10\nseconds = 60\nlossy = 1\n", "lossy: unknown key (allowed: name, mode, seconds"),
    (BASE + "los = 0.1\n", "[network] los: unknown key (allowed: countries, top, latency_csv, rtt_ms, loss"),
    (BASE + "loss = 2\n", "[network] loss: must be 0..0.5, got 2"),
    (BASE + "loss = -0.1\n", "[network] loss: must be 0..0.5, got -0.1"),
    (BASE + "loss = true\n", "[network] loss: must be a number, got true"),
    (BASE + "loss = \"1%\"\n", "[network] loss: must be a number, got '1%'"),
    (BASE + "jitter_ms = 5000\n", "[network] jitter_ms: must be 0..1000, got 5000"),
    ("seconds = 60\nnodes = 1\n", "nodes: must be 2..100000, got 1"),
    ("seconds = 60\nnodes = 10.5\n", "nodes: must be a whole number, got 10.5"),
    ("seconds = 60\n", "nodes: missing (a whole number, 2..100000)"),
    ("nodes = 10\n", "seconds: missing (a number, more than 0 and at most 86400)"),
    ("nodes = 10\nseconds = 0\n", "seconds: must be more than 0 and at most 86400, got 0"),
    ("nodes = 10\nseconds = 60\ntiming = \"fast\"\n", "timing: must be one of wan, lan, got 'fast'"),
    ("nodes = 10\nseconds = 60\nmode = \"x\"\n", "mode: must be one of membership, disseminate, got 'x'"),
    ("nodes = 10\nseconds = 60\nname = \"\"\n", "name: must be 1..100 letters, digits, '.', '_' or '-'"),
    ("nodes = 10\nseconds = 60\nname = \"../x\"\n", "name: must be 1..100 letters, digits, '.', '_' or '-' "
                                                    "(not starting with '.'), got '../x'"),
    ("nodes = 10\nseconds = 60\n[network]\ncountries = [\"DE\", \"XX\"]\n",
     "[network] countries: unknown country code 'XX' (ISO 3166 alpha-2"),
    ("nodes = 10\nseconds = 60\n[network]\ncountries = \"everywhere\"\n",
     "[network] countries: must be a list of country codes (e.g. [\"DE\", \"US\"]) or \"weighted\", got 'everywhere'"),
    ("nodes = 10\nseconds = 60\n[network]\ncountries = [\"DE\"]\nrtt_ms = 30\n",
     "[network] rtt_ms: give one of countries, latency_csv, rtt_ms (got countries and rtt_ms)"),
    ("nodes = 10\nseconds = 60\n[network]\ncountries = [\"DE\"]\ntop = 5\n",
     "[network] top: only with countries = \"weighted\""),
    ("nodes = 10\nseconds = 60\n[network]\ncountries = \"weighted\"\ntop = 500\n",
     "[network] top: must be 1..91, got 500"),
    ("nodes = 10\nseconds = 60\n[network]\nlatency_csv = \"nope.csv\"\n", "[network] latency_csv: no such file:"),
    ("nodes = 10\nseconds = 60\n[network]\ncountries = [\"US\", \"ZM\"]\n",
     "[network] countries: the RTT data has no measurement between US and ZM"),
    ("nodes = 10\nseconds = 60\nnetwork = 3\n", "[network]: must be a table, got 3"),
    (BASE + "[[events]]\nat = 10\n", "[[events]] #1: needs exactly one of crash, kill, leave, partition"),
    (BASE + "[[events]]\nat = 10\ncrash = 1\nchange = 1\n", "[[events]] #1: needs exactly one of crash, kill, "),
    (BASE + "[[events]]\nat = 10\ncrash = 1\nuntil = 20\n",
     "[[events]] #1 until: unknown key (allowed: at, crash, revive_after, every, times)"),
    (BASE + "[[events]]\nat = 10\ncrsh = 1\n", "[[events]] #1 crsh: unknown key (allowed: at, crash, kill,"),
    (BASE + "[[events]]\nat = 10\ncrash = 10\n", "[[events]] #1 crash: must be 1..9, got 10"),
    (BASE + "[[events]]\nat = 70\nchange = 1\n", "[[events]] #1 at: must be 0..60, got 70"),
    (BASE + "[[events]]\ncrash = 1\n", "[[events]] #1 at: missing (a number, 0..60)"),
    (BASE + "[[events]]\nat = 10\nchange = 1\n[[events]]\nat = 20\nuntil = 20\ncongest = 1\ndelay_ms = 100\n",
     "[[events]] #2 until: must be more than 20 and at most 60, got 20"),
    (BASE + "[[events]]\nat = 10\nuntil = 20\ncongest = 1\n", "[[events]] #1 delay_ms: missing"),
    (BASE + "[[events]]\nat = 10\nchange = 1\ntimes = 3\n", "[[events]] #1 times: needs every = S"),
    (BASE + "[[events]]\nat = 10\nchange = 1\nevery = 30\ntimes = 3\n",
     "[[events]] #1 times: the last repeat would start at 70 s, after the scenario's end (60 s)"),
    ("seconds = 600\nnodes = 10\n[[events]]\nat = 0\nuntil = 600\nchurn_per_min = 20000\n",
     "[[events]] churn_per_min: would start 100,001 more nodes; a scenario runs at most 100,000 in all"),
    (BASE + "[[events]]\nat = 10\nuntil = 30\npartition = [[\"DE\"], [\"JP\"]]\n",
     "[[events]] #1 partition: no nodes in JP ([network] countries: DE, US)"),
    (BASE + "[[events]]\nat = 10\nuntil = 30\npartition = [[\"DE\"], [\"DE\", \"US\"]]\n",
     "[[events]] #1 partition: DE is on both sides"),
    (BASE + "[[events]]\nat = 10\nuntil = 30\npartition = [\"DE\", \"US\"]\n",
     "[[events]] #1 partition: must be two lists of country codes"),
    (BASE + "[[events]]\nat = 10\nuntil = 30\npartition = [[\"DE\"], [\"QQ\"]]\n",
     "[[events]] #1 partition: unknown country code 'QQ'"),
    ("nodes = 10\nseconds = 60\n[[events]]\nat = 10\nuntil = 30\npartition = [[\"DE\"], [\"US\"]]\n",
     "[[events]] #1 partition: cuts countries: needs [network] countries"),
    ("nodes = 10\nseconds = 60\nevents = 3\n", "events: must be an array of tables"),
    ("mode = \"disseminate\"\nnodes = 10\n", "[network] countries: missing (mode = \"disseminate\" needs countries"),
    ("mode = \"disseminate\"\nnodes = 10\n[network]\ncountries = [\"DE\"]\n[[events]]\nat = 1\ncrash = 1\n",
     "[[events]]: mode = \"disseminate\" takes no events"),
    ("mode = \"disseminate\"\nnodes = 10\nseconds = 5\n[network]\ncountries = [\"DE\"]\n",
     "seconds: mode = \"disseminate\" follows one record until it is everywhere: no seconds"),
    ("nodes = 10\nseconds = 60\n[network\n", "not TOML: "),
]


@pytest.mark.parametrize("text, message", ERRORS, ids=[m[:40] for _, m in ERRORS])
def test_each_mistake_gets_one_line_naming_the_file_and_the_field(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(sc.ScenarioError) as caught:
        sc.load(path)
    line = str(caught.value)
    assert line.startswith(f"{path}: ")
    assert message in line, line
    assert "\n" not in line


def test_a_matrix_that_is_not_square_is_named_with_its_row(tmp_path):
    write(tmp_path, "0,30\n30,0,5\n", "m.csv")
    with pytest.raises(sc.ScenarioError, match=r"latency_csv: .*must be square: row 2 has 3 values, there are 2"):
        sc.load(write(tmp_path, 'seconds = 10\nnodes = 6\n[network]\nlatency_csv = "m.csv"\n'))


def test_a_partition_of_a_country_the_weighted_draw_left_empty_is_refused_at_placement():
    s = sc.parse({"seconds": 60, "nodes": 3, "network": {"countries": "weighted", "top": 3},
                  "events": [{"at": 1, "until": 2, "partition": [["US"], ["JP"]]}]}, file="w.toml")
    with pytest.raises(sc.ScenarioError, match=r"^w.toml: \[\[events\]\] partition at 1 s: no nodes in JP"):
        sc.place(s, random.Random(1))


def test_missing_file_is_one_line():
    with pytest.raises(sc.ScenarioError, match=r"^/no/such.toml: no such file \(or name a shipped scenario: "
                                                r"congested, disseminate-100k, lab-5-countries, "):
        sc.load("/no/such.toml")
    assert {"small", "lab-5-countries", "swarm-2k"} <= set(sc.shipped())


@pytest.mark.parametrize("words, message", [
    (["/no/such.toml"], "swarm-sim: /no/such.toml: no such file (or name a shipped scenario: "
                        + ", ".join(sc.shipped()) + ")"),
    (["BAD", "--seed", "-1"], "swarm-sim: --seed must be 0..2^63-1, got -1"),
])
def test_the_cli_says_it_in_one_line_and_exits_2(tmp_path, capsys, words, message):
    words = [str(write(tmp_path, BASE + "loss = 2\n")) if w == "BAD" else w for w in words]
    assert cli.main(["run", *words]) == 2
    err = capsys.readouterr().err
    assert err == message + "\n"


def test_the_cli_names_the_field_of_a_bad_scenario(tmp_path, capsys):
    path = write(tmp_path, BASE + "loss = 2\n")
    assert cli.main(["run", str(path), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == f"swarm-sim: {path}: [network] loss: must be 0..0.5, got 2\n"
    assert not (tmp_path / "o").exists()  # nothing written for a scenario that cannot run


def test_timing_overrides_set_membership_timing_fields_on_top_of_the_preset(tmp_path):
    from sim.runner import timing

    path = tmp_path / "w.toml"
    path.write_text('seconds = 10\nnodes = 3\ntiming = "lan"\n[timing_overrides]\nsuspicion_mult = 2\n'
                    'indirect_probes = 2\n')
    s = sc.load(path)
    assert s.overrides == (("indirect_probes", 2), ("suspicion_mult", 2.0))
    t = timing(s.timing, s.overrides)
    assert (t.suspicion_mult, t.indirect_probes, t.probe_interval) == (2.0, 2, 0.3)  # the rest: lan's


@pytest.mark.parametrize("body, message", [
    ("probe_intervall = 1", "[timing_overrides] probe_intervall: unknown key (allowed: accusation_burst"),
    ("indirect_probes = 1.5", "[timing_overrides] indirect_probes: must be a whole number, got 1.5"),
    ("probe_interval = 0", "[timing_overrides] probe_interval: must be more than 0 and at most 1e+06, got 0"),
    ('suspicion_mult = "2"', "[timing_overrides] suspicion_mult: must be a number"),
])
def test_a_bad_timing_override_is_named(tmp_path, body, message):
    path = tmp_path / "w.toml"
    path.write_text(f"seconds = 10\nnodes = 3\n[timing_overrides]\n{body}\n")
    with pytest.raises(sc.ScenarioError) as exc:
        sc.load(path)
    assert message in str(exc.value)
