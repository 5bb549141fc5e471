"""compute/messages.py: each job-protocol request as the coordinator sends it is read back
by the host as the same value, through the real framing; what a peer may change in it is
refused naming the field (test_job_protocol.py drives the same through the handler)."""

from __future__ import annotations

import dataclasses

import pytest

from swarmd.compute.messages import CkptGet, CkptPut, Commit, Forward, Reserve, Start, Workdir
from swarmd.compute.spec import Serve
from swarmd.compute.torchenv import NodeRole
from swarmd.rpc.framing import HEADER, decode, encode_frame

ROLE = NodeRole(job_id="j0b1d2e3f4g5", node_rank=1, nnodes=2, procs_per_node=2, master_addr="10.211.0.1",
                master_port=29500, ifname=None, gpus=(), node_ips=("10.211.0.1", "fd00::2"), checkpoint_dir="",
                restart_count=3, max_restarts=5)
SHA = "ab" * 32


def wire(message: dict) -> dict:
    """As the host reads it: msgpack through the control framing (tuples arrive as lists)."""
    return decode(encode_frame(message)[HEADER.size:])


@pytest.mark.parametrize("message", [
    Reserve(gpus=2, ranks=4, lease=30.0), Commit(port=True), Commit(port=False), Workdir(digest=SHA, size=4096),
    Forward(port=8000), CkptPut(name="step-00010.pt", sha256=SHA, size=1 << 30), CkptGet(sha256=SHA)])
def test_a_request_reads_back_as_it_was_sent(message):
    assert type(message).from_wire(wire({"op": message.OP, **message.to_wire()})) == message


def test_a_start_reads_back_as_it_was_sent():
    start = Start(role=ROLE, cmd=("python", "train.py", "--epochs", "3"), env={"SEED": "1"}, python="/usr/bin/python3",
                  workdir=SHA, checkpoints=(("step-00010.pt", SHA, 1234),), cpus=1.5, mem_mb=2048, ray="0f" * 32)
    assert Start.from_wire(wire(start.to_wire()), checkpoint_max=1 << 30) == start
    plain = Start(role=ROLE, cmd=("true",), env={})
    assert Start.from_wire(wire(plain.to_wire()), checkpoint_max=0) == plain
    replica = Start(role=ROLE, cmd=("python", "app.py"), env={}, serve=Serve(service="embed", replica=2, health="/h"))
    assert Start.from_wire(wire(replica.to_wire()), checkpoint_max=0) == replica


@pytest.mark.parametrize("kind, change, field", [
    (Reserve, {"ranks": 257}, "'ranks'"), (Reserve, {"gpus": -1}, "'gpus'"), (Reserve, {"lease": 301}, "'lease'"),
    (Reserve, {"lease": True}, "'lease'"), (Workdir, {"digest": "AB" * 32}, "'digest'"),
    (Workdir, {"size": 2**40}, "'size'"), (Forward, {"port": 0}, "'port'"), (Forward, {"port": "80"}, "'port'"),
    (CkptPut, {"name": "../x"}, "name"), (CkptPut, {"sha256": SHA.upper()}, "'sha256'"),
    (CkptGet, {"sha256": None}, "'sha256'")])
def test_a_member_changing_a_field_is_refused_naming_it(kind, change, field):
    good = {Reserve: Reserve(1, 1, 10.0), Workdir: Workdir(SHA, 10), Forward: Forward(80),
            CkptPut: CkptPut("a.pt", SHA, 10), CkptGet: CkptGet(SHA)}[kind].to_wire()
    with pytest.raises(ValueError, match=field):
        kind.from_wire(wire(good | change))


@pytest.mark.parametrize("change, field", [
    ({"workdir": "../../etc"}, "'workdir'"), ({"workdir": 7}, "'workdir'"), ({"cmd": []}, "'cmd'"), ({"cmd": ["a\0b"]}, "'cmd'"), ({"env": {"1X": "y"}}, "'env'"),
    ({"python": 3}, "'python'"), ({"ray": "nope"}, "'ray'"), ({"limits": {"cpus": 1e9}}, "'limits.cpus'"),
    ({"serve": {"service": "../x", "replica": 0}}, "serve.service"), ({"serve": {"service": "a", "replica": -1}},
                                                                        "serve.replica"),
    ({"serve": {"service": "a", "replica": 0, "health": "x"}}, "serve.health"), ({"serve": ["a"]}, "'serve'"),
    ({"limits": {"gpus": 1}}, "'limits'"), ({"role": {**Start(role=ROLE, cmd=("x",), env={}).to_wire()["role"],
                                                       "nnodes": 5000}}, "'role.nnodes'")])
def test_a_start_a_member_changed_is_refused_naming_the_field(change, field):
    good = Start(role=ROLE, cmd=("python", "x.py"), env={}).to_wire()
    with pytest.raises(ValueError, match=field):
        Start.from_wire(wire(good | change), checkpoint_max=1 << 20)
    with pytest.raises(ValueError, match="must be a map"):
        Start.from_wire(wire(["not", "a", "map"]), checkpoint_max=1 << 20)


def test_a_roles_latency_groups_read_back_and_a_member_cannot_bend_them():
    """The coordinator names each node's latency group (compute/groups.py); the host checks the
    list names each node rank once before a rank's environment carries it (SWARM_GROUPS)."""
    grouped = Start(role=dataclasses.replace(ROLE, groups=((1,), (0,))), cmd=("x",), env={})
    assert Start.from_wire(wire(grouped.to_wire()), checkpoint_max=0) == grouped
    plain = Start(role=ROLE, cmd=("x",), env={})
    assert Start.from_wire(wire(plain.to_wire()), checkpoint_max=0).role.groups == ()
    for bad in ([[0]], [[0, 1, 1]], [[0], [2]], [[0], []], [[0, True]], [["0", "1"]], [[0, 1], [1]], "0,1", [0, 1],
                [[0]] * 3):
        role = {**plain.to_wire()["role"], "groups": bad}
        with pytest.raises(ValueError, match="role.groups"):
            Start.from_wire(wire(plain.to_wire() | {"role": role}), checkpoint_max=0)

