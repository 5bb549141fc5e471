"""Several daemons on one host (one network namespace): each confines its jobs with a job
firewall table of its own, so one stopping or dying leaves the others' jobs confined and
startable; a dead daemon's table goes when a daemon next starts (sandbox/firewall.py)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest
import trio

from conftest import root_only, wait_until
from sim.netlab.lab import job_user
from swarmd import nft
from swarmd.compute.host.sandbox import firewall
from test_jobs_local import swarmctl

# a job's connection to an address its egress does not allow: refused by its chain at once
# (ECONNREFUSED); with no chain for its uid it would go out (unreachable, or a timeout)
PROBE = """
import socket
try:
    socket.create_connection(("192.0.2.1", 80), timeout=5)
    print("connected")
except OSError as exc:
    print(type(exc).__name__)
"""


@pytest.fixture
def boxed(make_daemon):
    """make(name): a daemon whose sandbox has its job firewall up (as test_jobs_local's node)."""
    made: list[Path] = []

    def make(name: str):
        jobs_dir = Path(tempfile.mkdtemp(prefix="swarmd-test-jobs-"))  # not under pytest's 0700 tmp
        jobs_dir.chmod(0o711)  # ranks of another user reach their own directory inside
        made.append(jobs_dir)
        d = make_daemon(name, args=["--jobs-dir", str(jobs_dir), "--job-user", job_user()])
        wait_until(lambda: d.call("status")["sandbox"]["parts"].get("firewall", "").startswith("nftables"), 30,
                   f"{name}'s job firewall", detail=lambda: d.call("status")["sandbox"])
        return d

    yield make
    for jobs_dir in made:
        subprocess.run(["rm", "-rf", str(jobs_dir)], check=False)


def inet_tables() -> list[str]:
    return trio.run(nft.tables, "inet")


@root_only()
def test_a_daemon_stopping_or_killed_leaves_anothers_jobs_confined_and_its_table_is_swept(boxed, tmp_path):
    one, other = boxed("one"), boxed("other")
    mine, theirs = firewall.table_for(one.proc.pid), firewall.table_for(other.proc.pid)
    assert firewall.is_swarmd(one.proc.pid)
    assert {mine, theirs} <= set(inet_tables())

    assert other.stop() == 0  # SIGTERM: it deletes its own table, and only its own
    tables = inet_tables()
    assert theirs not in tables and mine in tables, tables

    one.call("swarm.init")
    wait_until(lambda: one.call("status").get("record"), 10, "the node's own record")
    work = tmp_path / "work"
    work.mkdir()
    (work / "probe.py").write_text(PROBE)
    r = swarmctl(one, "jobs", "run", "--workdir", str(work), "--", "python", "probe.py")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[rank 0] ConnectionRefusedError", r.stdout  # its chain judged it

    killed = boxed("killed")
    left = firewall.table_for(killed.proc.pid)
    killed.kill()  # SIGKILL: its table stays behind, chains and all, until a daemon starts
    boxed("next")  # (another worker's daemon starting meanwhile may be the one that sweeps it)
    tables = inet_tables()
    assert left not in tables and mine in tables, tables


def test_only_tables_of_daemons_gone_are_stale():
    alive = {os.getpid()}
    tables = ["swarmd_jobs", f"swarmd_jobs_{os.getpid()}", "swarmd_jobs_4000000", "swarmd_jobs_x", "swarmd_jobs_012",
              "filter", "swarmd_probe"]
    assert firewall.stale(tables, alive.__contains__) == ["swarmd_jobs", "swarmd_jobs_4000000"]
    assert firewall.sweep(["swarmd_jobs_4000000"]) == \
        "add table inet swarmd_jobs_4000000\ndelete table inet swarmd_jobs_4000000\n"
    assert firewall.sweep([]) == ""
    with pytest.raises(ValueError, match="bad nftables table name"):
        firewall.sweep(["x; flush ruleset"])


def test_a_pid_is_a_swarmds_only_while_swarmd_runs_there():
    assert not firewall.is_swarmd(os.getpid())  # pytest
    assert not firewall.is_swarmd(2**22 + 1)  # above pid_max: no such process
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        assert not firewall.is_swarmd(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()


@root_only()
def test_a_local_user_naming_a_process_swarmd_does_not_keep_a_dead_daemons_table():
    """exec -a swarmd: argv[0] is the name a user chose, the process is still the user's."""
    impostor = subprocess.Popen(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "bash", "-c",
                                 "exec -a swarmd sleep 60"])
    try:
        wait_until(lambda: Path(f"/proc/{impostor.pid}/cmdline").read_bytes().startswith(b"swarmd\0"), 10,
                   "the impostor's command line")
        assert not firewall.is_swarmd(impostor.pid)
        assert firewall.stale([firewall.table_for(impostor.pid)], firewall.is_swarmd) == \
            [firewall.table_for(impostor.pid)]
    finally:
        impostor.kill()
        impostor.wait()
