"""Job specs: what a user may ask for, and the errors that name what is wrong."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.compute.spec import JobSpec, SpecError, build, describe, load_yaml, parse_duration_s, parse_size_mb


def test_flags_override_the_file_and_defaults_fill_the_rest():
    spec = build(load_yaml("nodes: 2\ngpus_per_node: 4\nlabels: {region: eu}\ncmd: python train.py --lr 0.1\n"),
                 {"nodes": 3, "cmd": None, "mem": "8G"})
    assert spec.nodes == 3 and spec.gpus_per_node == 4 and spec.procs_per_node == 4, "procs follow GPUs"
    assert spec.cmd == ("python", "train.py", "--lr", "0.1") and spec.mem_mb == 8192
    assert spec.labels == {"region": "eu"} and spec.wait_s == 0
    assert describe(spec) == "3 nodes with ≥4 free GPUs, ≥8192 MB free, region=eu"


@pytest.mark.parametrize("fields, message", [
    ({"nodes": "three"}, "'nodes' must be an integer from 1 to 1024, got 'three'"),
    ({"nodes": 0}, "'nodes' must be an integer from 1 to 1024, got 0"),
    ({"nodes": True}, "'nodes' must be an integer"),
    ({"gpus_per_node": 65}, "'gpus_per_node' must be an integer from 0 to 64"),
    ({"procs_per_node": -1}, "'procs_per_node' must be an integer from 1 to 256"),
    ({"cpus": "lots"}, "'cpus' must be a number"),
    ({"mem": "8 parsecs"}, "'mem' must be a size such as 8G"),
    ({"wait": "soon"}, "'wait' must be a duration such as 30s"),
    ({"env": {"1BAD": "x"}}, "'env.1BAD' must be a variable name"),
    ({"env": ["A=1"]}, "'env' must be a map of strings"),
    ({"labels": {"Region!": "eu"}}, "key 'Region!' must be"),
    ({"name": "has space"}, "'name' must be 1-64 characters"),
    ({"cmd": []}, "'cmd' must be a command"),
    ({"cmd": "python 'unclosed"}, "'cmd' does not parse"),
    ({"node": 3}, "unknown field 'node'; did you mean 'nodes'?"),
])
def test_every_bad_field_is_named(fields, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace("?", r"\?")):
        build({"cmd": ["python"], **fields}, {})


def test_a_command_is_required():
    with pytest.raises(SpecError, match="'cmd' is missing"):
        build({"nodes": 2}, {})


def test_yaml_errors_say_where():
    with pytest.raises(SpecError, match="job.yaml: line 2"):
        load_yaml("nodes: 2\nname: a: b\n", "job.yaml")
    with pytest.raises(SpecError, match="expected a map of fields"):
        load_yaml("- just\n- a list\n", "job.yaml")
    assert load_yaml("", "empty.yaml") == {}


def test_sizes_and_durations():
    assert [parse_size_mb(v) for v in ("512M", "1.5G", "2GiB", "1T", 300)] == [512, 1536, 2048, 1024 ** 2, 300]
    assert [parse_duration_s(v) for v in ("30s", "10m", "2h", "1d", 45)] == [30, 600, 7200, 86400, 45]


def test_wire_round_trip():
    spec = build({"cmd": "python -c 'print(1)'", "nodes": 2, "env": {"A": ""}, "wait": "1m", "cpus": 1.5}, {})
    assert JobSpec.from_wire(spec.to_wire()) == spec


@settings(max_examples=300)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
                    max_leaves=12))
def test_junk_from_the_wire_is_a_spec_error_or_a_valid_spec(data):
    try:
        spec = JobSpec.from_wire(data)
    except SpecError:
        return
    assert spec.cmd and 1 <= spec.nodes <= 1024
