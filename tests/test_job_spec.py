"""Job specs: what a user may ask for, and the errors that name what is wrong."""

from __future__ import annotations

import re

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.compute.spec import (FIELDS, JobSpec, SpecError, build, describe, load_yaml, parse_duration_s,
                                 parse_size_mb)
from swarmd.p2p.signed import peer_from_key, peer_str

TRUSTED = peer_str(peer_from_key(bytes(32)))

FILE = """\
name: resnet-eu
nodes: 2
gpus_per_node: 4
mem: 8G
labels: {region: eu, tier: gold}
env: {NCCL_DEBUG: INFO, SEED: "1"}
wait: 10m
cmd: python train.py --lr 0.1
"""


def test_a_file_gives_every_field_and_defaults_fill_the_rest():
    spec = build(load_yaml(FILE, "job.yaml"), {})
    assert spec == JobSpec(cmd=("python", "train.py", "--lr", "0.1"), name="resnet-eu", nodes=2, gpus_per_node=4,
                           procs_per_node=4, mem_mb=8192, labels={"region": "eu", "tier": "gold"},
                           env={"NCCL_DEBUG": "INFO", "SEED": "1"}, wait_s=600.0)
    assert describe(spec) == "2 nodes with ≥4 free GPUs, ≥8192 MB free, region=eu, tier=gold"


def test_flags_override_the_file_and_add_to_its_maps():
    flags = {"nodes": 3, "cmd": ["python3", "eval.py"], "procs_per_node": 1, "cpus": 2, "name": None, "wait": None,
             "labels": {"region": "us"}, "env": {"SEED": "2", "EXTRA": "x"}}
    spec = build(load_yaml(FILE), flags)
    assert (spec.nodes, spec.cmd, spec.procs_per_node, spec.cpus) == (3, ("python3", "eval.py"), 1, 2.0)
    assert spec.name == "resnet-eu" and spec.wait_s == 600, "a flag of None is not given"
    assert spec.labels == {"region": "us", "tier": "gold"}
    assert spec.env == {"NCCL_DEBUG": "INFO", "SEED": "2", "EXTRA": "x"}
    assert describe(spec) == "3 nodes with ≥4 free GPUs, ≥2 free cores, ≥8192 MB free, region=us, tier=gold"


def test_a_spec_from_flags_alone_needs_only_a_command():
    spec = build({}, {"cmd": ["python", "-c", "", "--flag="]})
    assert spec == JobSpec(cmd=("python", "-c", "", "--flag="))
    assert spec.procs_per_node == 1 and describe(spec) == "1 node"


@pytest.mark.parametrize("fields, message", [
    ({"nodes": "three"}, "spec: 'nodes' must be an integer from 1 to 1024, or MIN:MAX (e.g. 2:4), got 'three'"),
    ({"nodes": "4:2"}, "spec: 'nodes' must be N or MIN:MAX with 1 ≤ MIN ≤ MAX ≤ 1024, got '4:2'"),
    ({"nodes": "0:3"}, "spec: 'nodes' must be N or MIN:MAX with 1 ≤ MIN ≤ MAX ≤ 1024, got '0:3'"),
    ({"nodes": "2:2000"}, "spec: 'nodes' must be N or MIN:MAX with 1 ≤ MIN ≤ MAX ≤ 1024, got '2:2000'"),
    ({"nodes": "2:"}, "spec: 'nodes' must be an integer from 1 to 1024, or MIN:MAX (e.g. 2:4), got '2:'"),
    ({"nodes": "-1:3"}, "spec: 'nodes' must be an integer from 1 to 1024, or MIN:MAX (e.g. 2:4), got '-1:3'"),
    ({"max_restarts": -1}, "spec: 'max_restarts' must be an integer from 0 to 1000, got -1"),
    ({"max_restarts": "many"}, "spec: 'max_restarts' must be an integer from 0 to 1000, got 'many'"),
    ({"max_restarts": 1001}, "spec: 'max_restarts' must be an integer from 0 to 1000, got 1001"),
    ({"nodes": 0}, "spec: 'nodes' must be an integer from 1 to 1024, got 0"),
    ({"nodes": 2.0}, "spec: 'nodes' must be an integer from 1 to 1024, got 2.0"),
    ({"nodes": True}, "spec: 'nodes' must be an integer from 1 to 1024, got True"),
    ({"nodes": "9" * 5000}, "spec: 'nodes' must be an integer from 1 to 1024, or MIN:MAX (e.g. 2:4), got "
                            "'999999999999...9999999999999'"),
    ({"gpus_per_node": 65}, "spec: 'gpus_per_node' must be an integer from 0 to 64, got 65"),
    ({"procs_per_node": -1}, "spec: 'procs_per_node' must be an integer from 1 to 256, got -1"),
    ({"procs_per_node": 257}, "spec: 'procs_per_node' must be an integer from 1 to 256, got 257"),
    ({"cpus": "lots"}, "spec: 'cpus' must be a number from 0 to 4096, got 'lots'"),
    ({"cpus": -1}, "spec: 'cpus' must be a number from 0 to 4096, got -1"),
    ({"cpus": "nan"}, "spec: 'cpus' must be a number from 0 to 4096, got 'nan'"),
    ({"cpus": 10 ** 400}, "spec: 'cpus' must be a number from 0 to 4096"),
    ({"mem": "8 parsecs"}, "spec: 'mem' must be a size such as 8G, 512M or a number of MB, got '8 parsecs'"),
    ({"mem": 1.5}, "spec: 'mem' must be a size such as 8G, 512M or a number of MB, got 1.5"),
    ({"mem": -1}, "spec: 'mem' must be an integer from 0 to 1073741824, got -1"),
    ({"mem": "2000000T"}, "spec: 'mem' must be at most 1073741824 MB, got '2000000T'"),
    ({"wait": "soon"}, "spec: 'wait' must be a duration such as 30s, 10m or 2h, got 'soon'"),
    ({"wait": "31d"}, "spec: 'wait' must be a number from 0 to 2.592e+06, got 2678400.0"),
    ({"wait": -5}, "spec: 'wait' must be a number from 0 to 2.592e+06, got -5"),
    ({"env": ["A=1"]}, "spec: 'env' must be a map of at most 128 variables, got ['A=1']"),
    ({"env": {f"V{i}": "" for i in range(129)}}, "spec: 'env' must be a map of at most 128 variables"),
    ({"env": {"1BAD": "x"}}, "spec: 'env' must be a map from variable names (letters, digits and _, not "
                             "starting with a digit), got '1BAD'"),
    ({"env": {"OMP_NUM_THREADS": 4}}, "spec: 'env.OMP_NUM_THREADS' must be a string of at most 4096 characters "
                                      "(quote it in YAML), got 4"),
    ({"env": {"A": "x\0y"}}, "spec: 'env.A' must be a string of at most 4096 characters, got 'x\\x00y'"),
    ({"labels": {"Region!": "eu"}}, "spec: labels: key 'Region!' must be 1-63 of a-z 0-9"),
    ({"labels": {"tier": 1}}, "spec: labels.tier: value must be printable text"),
    ({"hosts": ["QmNotAnEd25519Id"]}, "spec: 'hosts[0]' must be a full peer id such as 12D3KooW… (swarmctl peers "
                                      "--json), got 'QmNotAnEd25519Id'"),
    ({"hosts": [TRUSTED, 5]}, "spec: 'hosts[1]' must be a full peer id"),
    ({"hosts": {"a": 1}}, "spec: 'hosts' must be a list of at most 4096 peer ids"),
    ({"hosts": [TRUSTED] * 4097}, "spec: 'hosts' must be a list of at most 4096 peer ids"),
    ({"labels": "region=eu"}, "spec: labels: expected a map of at most 32 labels"),
    ({"name": "has space"}, "spec: 'name' must be 1-64 characters of letters, digits, . _ -, got 'has space'"),
    ({"name": "job\n"}, "spec: 'name' must be 1-64 characters"),
    ({"name": "x" * 65}, "spec: 'name' must be 1-64 characters"),
    ({"workdir": ""}, "spec: 'workdir' must be a non-empty string of at most 4096 characters, got ''"),
    ({"python": 3}, "spec: 'python' must be a non-empty string of at most 4096 characters, got 3"),
    ({"cmd": []}, "spec: 'cmd' must be a command: a non-empty list of at most 256 strings, got []"),
    ({"cmd": {"run": "x"}}, "spec: 'cmd' must be a command"),
    ({"cmd": ["x"] * 257}, "spec: 'cmd' must be a command"),
    ({"cmd": ["", "train.py"]}, "spec: 'cmd[0]' must be a non-empty string"),
    ({"cmd": ["python", "train.py", "--epochs", 3]}, "spec: 'cmd[3]' must be a string of at most 4096 characters "
                                                     "(quote it in YAML), got 3"),
    ({"cmd": "python 'unclosed"}, "spec: 'cmd' does not parse as a shell command: No closing quotation"),
    ({"node": 3}, "spec: unknown field 'node'; did you mean 'nodes'?"),
    ({"colour": "blue"}, "spec: unknown field 'colour'"),
])
def test_every_bad_field_is_named(fields, message):
    with pytest.raises(SpecError, match="^" + re.escape(message)):
        build({"cmd": ["python"], **fields}, {})


def test_a_bad_flag_is_named_like_a_bad_file_field():
    with pytest.raises(SpecError, match=r"^spec: 'nodes' must be an integer from 1 to 1024, or MIN:MAX \(e.g. 2:4\), got 'x'$"):
        build(load_yaml(FILE), {"nodes": "x"})


def test_a_command_is_required():
    with pytest.raises(SpecError, match=r"'cmd' is missing: the command every rank runs"):
        build({"nodes": 2}, {"cmd": None})


@pytest.mark.parametrize("text, message", [
    ("nodes: 2\nname: a: b\n", "line 2: not valid YAML: mapping values are not allowed here"),
    ("nodes: 2\ncmd: [python,\n  'unclosed\n",
     "line 4: not valid YAML: found unexpected end of stream (while scanning a quoted scalar from line 3)"),
    ("nodes: 2\nname: \x07\n", "line 2: not valid YAML: special characters are not allowed (#x0007)"),
    ("cmd: *train\n", "line 1: not valid YAML: found undefined alias 'train'"),
    ("cmd: " + "[" * 5000, "not valid YAML: nested too deeply"),
    ("- just\n- a list\n", "expected a map of fields (nodes: 3, cmd: [...]), got list"),
])
def test_yaml_errors_say_where(text, message):
    with pytest.raises(SpecError, match="^" + re.escape(f"job.yaml: {message}") + "$"):
        load_yaml(text, "job.yaml")


def test_an_empty_file_is_no_fields():
    assert load_yaml("", "empty.yaml") == {} and load_yaml("# nothing yet\n") == {}


def test_yaml_that_loads_but_is_wrong_is_named_by_field():
    with pytest.raises(SpecError, match=r"'env.DEBUG' must be a string .*\(quote it in YAML\), got True"):
        build(load_yaml("cmd: [python]\nenv: {DEBUG: yes}\n"), {})
    with pytest.raises(SpecError, match=r"unknown field 'gpus'; did you mean 'cpus'\?"):
        build(load_yaml("cmd: [python]\ngpus: 8\n"), {})


@pytest.mark.parametrize("text, mb", [
    ("512M", 512), ("512", 512), (" 8G ", 8192), ("8g", 8192), ("1.5G", 1536), ("2GiB", 2048), ("1gb", 1024),
    ("1T", 1024 ** 2), ("0.5M", 0), (300, 300), (0, 0),
])
def test_sizes_are_binary_megabytes(text, mb):
    assert parse_size_mb(text, "mem") == mb


@pytest.mark.parametrize("text, seconds", [
    ("30s", 30), ("10m", 600), ("2h", 7200), ("1d", 86400), ("1.5h", 5400), ("90", 90), (45, 45), (2.5, 2.5), (0, 0),
])
def test_durations_are_seconds(text, seconds):
    assert parse_duration_s(text, "wait") == seconds


def test_parsers_name_the_field_they_were_given():
    with pytest.raises(SpecError, match=r"^spec: '--mem' must be a size such as 8G"):
        parse_size_mb("8X", "--mem")
    with pytest.raises(SpecError, match=r"^spec: '--wait' must be a duration such as 30s"):
        parse_duration_s("10 minutes", "--wait")
    with pytest.raises(SpecError, match=r"^spec: '--wait' must be a duration"):
        parse_duration_s(None, "--wait")


@pytest.mark.parametrize("fields", [
    {"cmd": "python -c 'print(1)'"},
    {"cmd": ["torchrun", "x.py", ""], "nodes": 4, "gpus_per_node": 8, "procs_per_node": 2, "cpus": 1.5,
     "mem": "1.5G", "labels": {"region": "eu"}, "env": {"A": "", "B": "ü"}, "workdir": "/home/u/proj",
     "wait": "1m", "python": "/opt/venv/bin/python", "name": "run.1"},
    {"cmd": ["python", "train.py"], "nodes": "2:4", "max_restarts": 3},
    {"cmd": ["python", "train.py"], "hosts": [TRUSTED]},
])
def test_wire_round_trip_through_msgpack(fields):
    spec = build(fields, {})
    wire = msgpack.unpackb(msgpack.packb(spec.to_wire(), use_bin_type=True), raw=False)
    assert JobSpec.from_wire(wire) == spec


@pytest.mark.parametrize("nodes, least, most, words", [
    (3, 3, 3, "3 nodes"), ("3", 3, 3, "3 nodes"), ("2:4", 2, 4, "2 to 4 nodes"), (" 1 : 3 ", 1, 3, "1 to 3 nodes"),
    ("3:3", 3, 3, "3 nodes"), ("1:1", 1, 1, "1 node"),
])
def test_nodes_take_torchruns_min_max(nodes, least, most, words):
    spec = build({"cmd": ["x"], "nodes": nodes, "max_restarts": 2}, {})
    assert (spec.least_nodes, spec.nodes, spec.elastic, spec.max_restarts) == (least, most, least < most, 2)
    assert describe(spec) == words


def test_a_flag_min_max_overrides_the_files_nodes():
    spec = build({"cmd": ["x"], "nodes": 3, "max_restarts": 1}, {"nodes": "2:3", "max_restarts": "4"})
    assert (spec.least_nodes, spec.nodes, spec.max_restarts) == (2, 3, 4)


@pytest.mark.parametrize("data, message", [
    (None, "spec: expected a map of fields, got NoneType"),
    ([["cmd", "x"]], "spec: expected a map of fields, got list"),
    (b"\x81", "spec: expected a map of fields, got bytes"),
    ({"cmd": [b"python"]}, "spec: 'cmd[0]' must be a non-empty string"),
    ({"cmd": ["x"], "mem": "8G", "v": 2}, "spec: unknown field 'v'"),
    ({"cmd": ["x"], "labels": {"a": "b" * 300}}, "spec: labels.a: value must be printable text of at most 255 characters"),
])
def test_from_wire_refuses_junk(data, message):
    with pytest.raises(SpecError, match="^" + re.escape(message)):
        JobSpec.from_wire(data)


JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=12)
PLAUSIBLE = st.sampled_from(["1", "8G", "10m", "eu", "python", "", "0", "-1", "1e999", "²", "a\n", "\0"])


@settings(max_examples=300, deadline=None)
@given(JUNK)
def test_any_junk_is_a_spec_error_or_a_valid_spec(data):
    _valid_or_spec_error(data)


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), JUNK | PLAUSIBLE | st.lists(PLAUSIBLE, max_size=3)
                       | st.dictionaries(PLAUSIBLE, PLAUSIBLE, max_size=3), max_size=8))
def test_junk_in_known_fields_is_a_spec_error_or_a_valid_spec(data):
    _valid_or_spec_error({"cmd": ["python"], **data} if "cmd" not in data else data)


def _valid_or_spec_error(data):
    try:
        spec = JobSpec.from_wire(data)
    except SpecError:
        return
    assert spec.cmd and spec.cmd[0] and 1 <= spec.nodes <= 1024 and 1 <= spec.procs_per_node <= 256
    assert JobSpec.from_wire(spec.to_wire()) == spec


def test_an_unquoted_min_max_in_yaml_is_not_read_as_a_base_60_number():
    spec = build(load_yaml("nodes: 2:4\nmax_restarts: 3\ncmd: [python, x.py]\n", "job.yaml"), {})
    assert (spec.least_nodes, spec.nodes, spec.max_restarts) == (2, 4, 3)  # YAML 1.1 alone: 124 nodes
    assert load_yaml("a: 0x10\nb: 12\nc: '1:2'\n") == {"a": 16, "b": 12, "c": "1:2"}


# --- Ray jobs (issue 14) ---------------------------------------------------------------------

def test_a_ray_job_is_one_ray_node_per_host_even_with_gpus():
    spec = build({}, {"cmd": ["python", "tune.py"], "ray": True, "gpus_per_node": 2, "nodes": 3})
    assert spec.ray and spec.procs_per_node == 1 and spec.gpus_per_node == 2
    assert JobSpec.from_wire(spec.to_wire()) == spec


@pytest.mark.parametrize("fields, says", [
    ({"ray": True, "procs_per_node": 2}, "one Ray node per host"),
    ({"ray": True, "max_restarts": 1}, "'max_restarts' must be 0"),
    ({"ray": "yes"}, "'ray' must be true or false"),
    ({"ray": 1}, "'ray' must be true or false"),
])
def test_a_ray_job_refuses_what_it_cannot_be(fields, says):
    with pytest.raises(SpecError, match=says):
        build({"cmd": ["python", "x.py"], **fields}, {})


def test_ray_in_a_yaml_spec():
    spec = build(load_yaml("cmd: [python, serve.py]\nray: true\nnodes: 2\n"), {})
    assert spec.ray and spec.nodes == 2 and not build({"cmd": ["x"]}, {}).ray


def test_a_users_host_list_from_flags_and_its_words_in_errors():
    spec = build({"cmd": ["python"], "hosts": f"{TRUSTED}, {TRUSTED}"}, {})
    assert spec.hosts == (TRUSTED,)
    assert describe(spec).endswith("among the 1 host of its allow list")
    assert build({"cmd": ["python"]}, {}).hosts == ()


def test_a_replica_spec_reads_back_and_only_as_one_node_without_ray():
    spec = build({"cmd": ["python", "app.py"], "serve": {"service": "embed", "replica": 3, "health": "/healthz"}}, {})
    assert spec.serve is not None and (spec.serve.service, spec.serve.replica, spec.serve.health) == ("embed", 3,
                                                                                                      "/healthz")
    assert JobSpec.from_wire(spec.to_wire()) == spec
    assert "serve" not in build({"cmd": ["x"]}, {}).to_wire(), "a job's spec (and its charter's digest) is as before"
    for bad, words in (({"service": "Embed", "replica": 0}, "serve.service"), ({"service": "e", "replica": 1000},
                       "serve.replica"), ({"service": "e", "replica": 0, "extra": 1}, "'serve'"),
                       ({"service": "e", "replica": 0, "health": "/a b"}, "serve.health")):
        with pytest.raises(SpecError, match=re.escape(words)):
            build({"cmd": ["x"], "serve": bad}, {})
    with pytest.raises(SpecError, match="one node"):
        build({"cmd": ["x"], "nodes": 2, "serve": {"service": "e", "replica": 0}}, {})


def test_a_replicas_demand_points_read_back_and_a_bad_one_is_refused_naming_it():
    near = [[TRUSTED, 90]]
    spec = build({"cmd": ["x"], "serve": {"service": "e", "replica": 0, "near": near}}, {})
    assert spec.serve is not None and spec.serve.near == ((TRUSTED, 90),)
    assert JobSpec.from_wire(spec.to_wire()) == spec
    for bad, words in (([[TRUSTED, 0]], "serve.near[0].weight"), ([[TRUSTED, 1001]], "serve.near[0].weight"),
                       ([[TRUSTED, True]], "serve.near[0].weight"), ([["QmNope", 5]], "serve.near[0]' must be [full peer id, weight]"),
                       ([[TRUSTED]], "serve.near[0]"), ([[TRUSTED, 1]] * 9, "at most 8"), ("x", "serve.near")):
        with pytest.raises(SpecError, match=re.escape(words)):
            build({"cmd": ["x"], "serve": {"service": "e", "replica": 0, "near": bad}}, {})


def test_grow_is_on_by_default_off_with_false_and_read_back_from_the_wire():
    spec = build({}, {"cmd": ["python", "train.py"], "nodes": "2:4"})
    assert spec.grow and spec.to_wire()["grow"] is True
    off = build(load_yaml("cmd: [python, train.py]\nnodes: '2:4'\ngrow: false\n"), {})
    assert not off.grow and JobSpec.from_wire(off.to_wire()) == off
    assert build({"cmd": ["x"], "grow": True}, {"grow": False}).grow is False, "the flag wins over the file"


@pytest.mark.parametrize("value", ["false", "true", "no", 0, 1, [], {}])
def test_grow_must_be_exactly_true_or_false(value):
    with pytest.raises(SpecError, match="'grow' must be true or false"):
        JobSpec.from_wire({"cmd": ["x"], "nodes": "2:4", "grow": value})


@pytest.mark.parametrize("given, cap", [(None, None), ("off", None), (False, None), ("auto", 30.0), (True, 30.0),
                                        ("50ms", 50.0), (" 7.5 ms ", 7.5), (120, 120.0)])
def test_groups_are_off_by_default_auto_at_30_ms_or_a_cap_and_read_back_from_the_wire(given, cap):
    spec = build({"cmd": ["python", "train.py"], "nodes": 6, **({"groups": given} if given is not None else {})}, {})
    assert spec.groups == cap and JobSpec.from_wire(spec.to_wire()) == spec
    assert ("groups" in spec.to_wire()) == (cap is not None), "a spec without groups sends none (older peers)"


@pytest.mark.parametrize("value", ["0", 0, -5, "fast", "30s", "1e3", 10_001, float("nan"), [30], {"ms": 30}])
def test_a_bad_groups_cap_is_refused_naming_what_it_must_be(value):
    with pytest.raises(SpecError, match="'groups' must be auto, off, or the slowest RTT"):
        JobSpec.from_wire({"cmd": ["x"], "groups": value})


def test_a_ray_job_takes_no_groups():
    with pytest.raises(SpecError, match="leave groups off with ray"):
        JobSpec.from_wire({"cmd": ["x"], "ray": True, "groups": "auto"})


def test_groups_are_refused_for_more_nodes_than_grouping_takes():
    from swarmd.compute.groups import MAX_NODES

    assert JobSpec.from_wire({"cmd": ["x"], "nodes": MAX_NODES, "groups": "auto"}).groups == 30.0
    with pytest.raises(SpecError, match=f"at most {MAX_NODES} nodes"):
        JobSpec.from_wire({"cmd": ["x"], "nodes": f"2:{MAX_NODES + 1}", "groups": "auto"})
