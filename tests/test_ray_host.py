"""A host's part in a Ray job (rayhost.py, raynode.py) and what a peer may send for one."""

from __future__ import annotations

import os
import socket
import stat

import pytest

from swarmd.compute.host import raynode
from swarmd.compute.events import checked_event
from swarmd.compute.host.rayhost import (BLOCK, MIN_OBJECT_STORE, NoPorts, PortBlocks, RayNode, describe, install_launcher,
                                    port_free, rank_argv, ray_cpus, split_memory, write_token)

from test_job_protocol import HOST_RANKS, JOB, Host, req, start_body

TOKEN = "ab" * 32


def free_span(ports: int) -> int:
    """The first port of ``ports`` consecutive ports nothing here listens on, below the kernel's
    ephemeral range (a port bound at random, as these tests once did, has neighbours that the
    host's own connections hold: a make test run found a whole block busy)."""
    for low in range(21000, 32000, ports):
        if all(port_free(p) for p in range(low, low + ports)):
            return low
    pytest.skip(f"no {ports} free consecutive ports below 32000")


def test_port_blocks_are_disjoint_per_job_skip_ports_in_use_and_come_back():
    low = free_span(4 * BLOCK)
    blocks = PortBlocks((low, low + 4 * BLOCK - 1))
    a, b = blocks.take(("c", "j1")), blocks.take(("c", "j2"))
    assert (a, b) == (low, low + BLOCK) and blocks.take(("c", "j1")) == a, "a job keeps its block"
    blocks.give_back(("c", "j1"))
    assert blocks.take(("c", "j3")) == low


def test_a_block_with_a_port_already_bound_is_skipped_and_a_full_range_says_so():
    with socket.socket() as busy:
        port = free_span(2 * BLOCK)
        busy.bind(("0.0.0.0", port))
        blocks = PortBlocks((port, port + 2 * BLOCK - 1))
        assert blocks.take(("c", "j")) == port + BLOCK, "the block holding a bound port is passed over"
        with pytest.raises(NoPorts, match="no free block of 100 Ray ports"):
            blocks.take(("c", "k"))


def test_a_squatter_on_the_last_port_of_each_block_leaves_no_block_that_looks_free():
    # a co-located job holding one worker port of each block (issue 23 finding 17): a block
    # handed out then has Ray's workers fail on that port; each is refused, not given
    low = free_span(2 * BLOCK)
    squatters = []
    try:
        for base in (low, low + BLOCK):
            s = socket.socket()
            squatters.append(s)
            s.bind(("0.0.0.0", base + BLOCK - 1))
        blocks = PortBlocks((low, low + 2 * BLOCK - 1))
        with pytest.raises(NoPorts):
            blocks.take(("c", "j"))
    finally:
        for s in squatters:
            s.close()
    assert PortBlocks((low, low + 2 * BLOCK - 1)).take(("c", "j")) == low, "free again once the squatter left"


def test_the_layout_pins_every_port_inside_the_block():
    ports = raynode.layout(25000, BLOCK)
    assert len(set(ports.values())) == len(ports)
    assert all(25000 <= p < 25000 + BLOCK for p in ports.values())
    assert ports["min_worker"] == 25000 + raynode.FIXED and ports["max_worker"] == 25099
    with pytest.raises(ValueError):
        raynode.layout(25000, 5)


def node(head: bool, memory: int = 8 << 30) -> RayNode:
    return RayNode(head=head, ip="10.211.0.1", gcs="41000" if head else "10.211.0.1:41000", base=25000, nodes=3,
                   cpus=2, gpus=0, memory=memory, temp="/tmp/ray")


def test_the_head_runs_ray_start_then_the_driver_and_a_worker_only_ray_start(tmp_path):
    launcher = install_launcher(tmp_path)
    assert stat.S_IMODE(launcher.stat().st_mode) == 0o444
    head = rank_argv("/venv/bin/python", launcher, node(True), ["/venv/bin/python", "tune.py", "--", "x"])
    worker = rank_argv("/venv/bin/python", launcher, node(False), ["/venv/bin/python", "tune.py"])
    assert head[-4:] == ["--", "/venv/bin/python", "tune.py", "--", "x"][-4:] and "tune.py" not in worker
    args = raynode.parse(head[2:])
    assert args.head and args.cmd == ["/venv/bin/python", "tune.py", "--", "x"] and args.nodes == 3
    argv = raynode.start_argv(args, tmp_path)
    assert "--head" in argv and "--port=41000" in argv and "--include-dashboard=false" in argv
    assert "--node-ip-address=10.211.0.1" in argv and "--disable-usage-stats" in argv and "--block" in argv
    wargs = raynode.parse(worker[2:])
    wargv = raynode.start_argv(wargs, tmp_path)
    assert "--address=10.211.0.1:41000" in wargv and "--head" not in wargv
    # every port Ray takes is named, and from the block
    named = [a for a in argv if a.split("=")[0].endswith("-port") and a != "--port=41000"]
    assert len(named) == 9 and all(25000 <= int(a.split("=")[1]) < 25100 for a in named)
    env = raynode.node_env(args)
    assert env["AUTOSCALER_METRIC_PORT"] == "25007" and env["DASHBOARD_METRIC_PORT"] == "25008"


def test_ray_gets_the_jobs_share_of_the_host():
    tasks, store = split_memory(10 << 30)
    assert store == 3 << 30 and tasks == 5 << 30, "the rest after 20 % for Ray's own processes"
    assert split_memory(100 << 20)[1] == MIN_OBJECT_STORE and split_memory(0) == (0, 0)
    assert describe(node(True, 10 << 30)) == {"cpus": 2, "gpus": 0, "memory": tasks, "object_store": store}
    assert [ray_cpus(c) for c in (0.25, 1.0, 1.5, 2)] == [1, 1, 2, 2]


def test_the_token_file_is_the_jobs_alone_and_never_follows_a_link(tmp_path):
    write_token(tmp_path / "t", TOKEN, None, None)
    assert (tmp_path / "t").read_text() == TOKEN and stat.S_IMODE((tmp_path / "t").stat().st_mode) == 0o400
    os.symlink("/etc/passwd", tmp_path / "link")
    with pytest.raises(OSError):
        write_token(tmp_path / "link", TOKEN, None, None)
    with pytest.raises(ValueError, match="64 lowercase hex"):
        write_token(tmp_path / "u", "AB" * 32, None, None)


@pytest.mark.parametrize("token", ["", "ab" * 31, "AB" * 32, "ab" * 33, "zz" * 32, 12, ["ab" * 32], True])
async def test_a_malformed_ray_token_from_a_member_is_refused_and_counted(tmp_path, token):
    host = Host(tmp_path)
    assert await host.ask("coord", req("reserve", gpus=0, ranks=1, lease=30.0)) == [{"gpus": []}]
    assert await host.ask("coord", req("commit")) == [{"gpus": []}]
    replies = await host.ask("coord", req("start"), {**start_body(), "ray": token})
    assert len(replies) == 1 and "'ray' must be the job's Ray token" in replies[0]["error"]
    assert host.rejected == {"malformed": 1} and list(host.jobs_dir.iterdir()) == []
    assert host.worker.ledger.state_of(JOB, "coord") == "committed", "the hold is untouched"


@pytest.mark.parametrize("event, why", [
    ({"ray": {"cpus": 1, "gpus": 0, "memory": 1}}, "'ray' must be a map"),
    ({"ray": {"cpus": -1, "gpus": 0, "memory": 1, "object_store": 1}}, "'ray.cpus'"),
    ({"ray": {"cpus": 1, "gpus": True, "memory": 1, "object_store": 1}}, "'ray.gpus'"),
    ({"ray": {"cpus": 1, "gpus": 0, "memory": 2**51, "object_store": 1}}, "'ray.memory'"),
    ({"ray": "4 CPUs"}, "'ray' must be a map"),
])
def test_a_hosts_account_of_its_ray_node_is_checked(event, why):
    with pytest.raises(ValueError, match=why):
        checked_event({"started": [2, 3], **event}, HOST_RANKS, started=False)
    ok = {"cpus": 2, "gpus": 1, "memory": 7 << 30, "object_store": 3 << 30}
    assert checked_event({"started": [2, 3], "ray": ok}, HOST_RANKS, started=False)["ray"] == ok


def test_a_jobs_ray_temp_dir_cannot_be_made_first_by_a_local_user(tmp_path, monkeypatch):
    """The Ray temp dir of a job without bwrap lives in the world-writable /tmp. Its name was
    fixed (a hash of the job's directory): a local user who made it first (or again, between
    the daemon's removal and its mkdir) failed every start of the job. Now its end is random
    and made exclusively; leftovers of the job's prefix go, links not followed."""
    from swarmd.compute.host import rayhost

    monkeypatch.setattr(rayhost, "TEMP_ROOT", str(tmp_path))
    top = tmp_path / "jobs" / "job1"
    prefix = rayhost.ray_temp_prefix(top)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    (tmp_path / (prefix + "squat")).mkdir()  # a squatter's guess, and a leftover's shape
    (tmp_path / (prefix + "link")).symlink_to(victim)
    first = rayhost.make_temp_dir(top, None)
    assert first.name.startswith(prefix) and stat.S_IMODE(first.stat().st_mode) == 0o700
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["victim", first.name])
    assert (victim / "keep").exists(), "a link is removed, never followed"
    second = rayhost.make_temp_dir(top, None)
    assert second != first and not first.exists()
    other = rayhost.make_temp_dir(tmp_path / "jobs" / "job2", None)
    rayhost.remove_temp_dirs(top)
    assert not second.exists() and other.exists(), "another job's temp dir is not this job's to remove"
    assert len(f"/tmp/{prefix}12345678") <= 33, "Ray's socket paths (about 64 bytes below it) fit in 107"
