"""sandbox.box: what this host can confine, and one job's box from start to end, with the
real parts where this machine has them (root, cgroups, bubblewrap, nftables), or without
some of them as a host lacking them runs (sandbox = auto)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
import trio

from swarmd.compute.host.sandbox import box as boxmod
from swarmd.compute.host.sandbox.box import PARTS, Sandbox, SandboxError, Settings
from swarmd.compute.host.sandbox.uids import SCRATCH, ipc_of, pids_of

pytestmark = pytest.mark.usefixtures("own_firewall_table")  # (conftest): no daemon sweeps it

UIDS = (64900, 64999)  # apart from the lab's slices and the default's low end


def settings(tmp_path: Path, mode: str = "auto") -> Settings:
    jobs = tmp_path / "jobs"
    jobs.mkdir(exist_ok=True)
    jobs.chmod(0o711)
    return Settings(mode=mode, uids=UIDS, egress="mesh", egress_allow=(), paths=(), pids=64,
                    state_dir=tmp_path / "state", jobs_dir=jobs, socket=tmp_path / "swarmd.sock",
                    name=f"swarmd-t{uuid.uuid4().hex[:8]}")


async def test_off_confines_nothing_and_says_so(tmp_path):
    sb = await Sandbox.start(settings(tmp_path, "off"))
    assert sb.status() == {"mode": "off", "active": False, "complete": False,
                           "parts": {p: "off: sandbox = off" for p in PARTS}}
    async with sb.open(job="j", top=tmp_path, cwd=tmp_path, memory=None, cpus=None, gpus=()) as box:
        assert box.uid is None and box.command(["true"], {"A": "1"}, 0) == (["true"], {"A": "1"})


async def test_required_refuses_a_job_when_a_part_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(boxmod.mounts, "detect_bwrap", lambda: "bwrap (bubblewrap) is not installed")
    sb = await Sandbox.start(settings(tmp_path, "required"))
    try:
        assert sb.parts["namespaces"] == "off: bwrap (bubblewrap) is not installed" and not sb.complete
        with pytest.raises(SandboxError, match="namespaces: bwrap .bubblewrap. is not installed"):
            async with sb.open(job="j", top=tmp_path, cwd=tmp_path, memory=None, cpus=None, gpus=()):
                pass
    finally:
        await sb.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's parts need root")
async def test_a_box_runs_its_command_as_its_uid_and_leaves_nothing(tmp_path):
    sb = await Sandbox.start(settings(tmp_path))
    try:
        assert sb.complete, sb.parts
        top = tmp_path / "jobs" / "d212xxxxxxxx-00000000"
        (top / "work").mkdir(parents=True)
        async with sb.open(job="j", top=top, cwd=top / "work", memory=64 << 20, cpus=1.0, gpus=()) as box:
            assert box.parts == PARTS and box.uid is not None and UIDS[0] <= box.uid <= UIDS[1]
            os.chown(top / "work", box.uid, box.uid)
            script = "id -u; touch mine; ls /proc | grep -c '^[0-9]'; setsid sleep 300 >/dev/null 2>&1 & echo started"
            out = tmp_path / "out"
            with open(out, "wb") as f:  # not a pipe: bubblewrap's pid 1 holds it while the sleep lives
                argv, env = box.command(["/bin/sh", "-c", script], {"PATH": "/usr/bin:/bin"}, 0)
                done = await trio.run_process(argv, env=env, stdout=f, stderr=f, check=False)
            assert done.returncode == 0, out.read_text()
            uid, procs, started = out.read_text().split()
            assert int(uid) == box.uid and int(procs) <= 4 and started == "started"
            assert box.cgroup is not None and box.cgroup.pids(), "the setsid'd sleep is still in the cgroup"
            chains = subprocess.run(["nft", "list", "chain", "inet", sb.policy.table, f"job_{box.uid}"],
                                    capture_output=True)
            assert chains.returncode == 0
        assert box.usage is not None and box.usage.peak_memory and box.usage.oom_kills == 0
        assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and _uid(p) == box.uid], \
            "no process of the job's uid survives its box"
        assert (top / "work" / "mine").stat().st_uid == os.geteuid(), "its files are handed back"
        assert subprocess.run(["nft", "list", "chain", "inet", sb.policy.table, f"job_{box.uid}"],
                              capture_output=True).returncode != 0, "its firewall chain is gone"
        assert sb.pool is not None and sb.pool.holder(box.uid) is None, "the uid is free again"
    finally:
        await sb.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's parts need root")
async def test_the_jobs_environment_never_reaches_the_stages_that_run_as_root(tmp_path):
    """A job's env with LD_PRELOAD (a library of its workdir) or BASH_ENV ran its code as
    root in sh and bwrap, before anything was confined."""
    sb = await Sandbox.start(settings(tmp_path))
    try:
        top = tmp_path / "jobs" / "d212yyyyyyyy-00000000"
        (top / "work").mkdir(parents=True)
        marker = tmp_path / "ran-as-root"
        hostile = {"LD_PRELOAD": "/nonexistent/evil.so", "BASH_ENV": str(tmp_path / "evil.sh"), "ENV": "x",
                   "SECRET": "it's \"quoted\" $(touch /tmp/never) `x`\nand two lines", "PATH": "/usr/bin:/bin"}
        (tmp_path / "evil.sh").write_text(f"touch {marker}\n")
        async with sb.open(job="j", top=top, cwd=top / "work", memory=None, cpus=None, gpus=()) as box:
            argv, env = box.command(["/usr/bin/env"], hostile, 0)
            assert env == boxmod.CHAIN_ENV and not any(v in " ".join(argv) for v in ("evil", "SECRET"))
            out = tmp_path / "out"
            with open(out, "wb") as f:
                done = await trio.run_process(argv, env=env, stdout=f, stderr=f, check=False)
            seen = out.read_text()
        assert done.returncode == 0, seen
        assert "SECRET=it's \"quoted\" $(touch /tmp/never) `x`\nand two lines\n" in seen, seen
        assert "LD_PRELOAD=/nonexistent/evil.so" in seen, "the rank itself gets what it asked for"
        assert not marker.exists() and not Path("/tmp/never").exists()
        assert (top / ".env-0").stat().st_mode & 0o777 == 0o400
    finally:
        await sb.close()


root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's parts need root")


@pytest.fixture
def without(monkeypatch):
    """Make this host lack sandbox parts, as `auto` finds a host without them."""
    def lack(*parts: str) -> None:
        if "namespaces" in parts:
            monkeypatch.setattr(boxmod.mounts, "detect_bwrap", lambda: "bwrap (bubblewrap) is not installed")
        if "cgroup" in parts:
            monkeypatch.setattr(boxmod.cgroups, "detect", lambda: "no cgroup file system here")
        if "firewall" in parts:
            monkeypatch.setattr(boxmod.firewall, "detect", lambda: "nft is not installed")
    return lack


@pytest.fixture
def reachable() -> Path:
    """A jobs directory a job's uid reaches without bubblewrap's view (tmp_path is 0700)."""
    jobs = Path(tempfile.mkdtemp(prefix="swarmd-test-box-"))
    jobs.chmod(0o711)
    yield jobs
    shutil.rmtree(jobs)


@root
async def test_without_a_cgroup_closing_the_box_kills_every_process_of_its_uid(tmp_path, without, reachable):
    """Issue 23, finding 2: a rank's setsid'd child left its group, and without a cgroup
    nothing found it: it lived on as the uid the next job would get."""
    without("cgroup", "namespaces", "firewall")
    sb = await Sandbox.start(dataclasses.replace(settings(tmp_path), jobs_dir=reachable))
    try:
        assert sb.parts["cgroup"].startswith("off") and sb.parts["namespaces"].startswith("off")
        top = reachable / "d212zzzzzzzz-00000000"
        (top / "work").mkdir(parents=True)
        async with sb.open(job="j", top=top, cwd=top / "work", memory=None, cpus=None, gpus=()) as box:
            assert box.parts == ("uid",) and box.cgroup is None
            script = "setsid sh -c 'sleep 300 & sleep 300' </dev/null >/dev/null 2>&1 & echo $!"
            argv, env = box.command(["/bin/sh", "-c", script], {"PATH": "/usr/bin:/bin"}, 0)
            done = await trio.run_process(argv, env=env, capture_stdout=True, check=True)
            stray = int(done.stdout)
            assert stray in pids_of(box.uid), "it outlived its rank"
        assert pids_of(box.uid) == [], "no process of the job's uid survives its box (zombies wait for init)"
        assert sb.pool is not None and sb.pool.holder(box.uid) is None
    finally:
        await sb.close()


@root
async def test_without_bubblewrap_what_the_job_left_in_tmp_dev_shm_and_sysv_ipc_goes_with_it(tmp_path, without,
                                                                                          reachable):
    """Its private /tmp would have: a job without bubblewrap leaves nothing at the top of
    the host's shared directories nor in its IPC for a later job, and its uid is free
    again; a file deeper, in someone else's world-writable directory, stays and holds it."""
    without("cgroup", "namespaces", "firewall")
    marker = f"swarmd-test-{uuid.uuid4().hex[:8]}"
    shared = Path("/tmp") / f"{marker}-shared"  # another user's world-writable directory
    shared.mkdir()
    shared.chmod(0o777)
    planted = [Path("/tmp") / marker, Path("/dev/shm") / marker, Path("/var/tmp") / marker]
    script = (f"mkdir {planted[0]} && echo x > {planted[0]}/kernel.py && chmod 0 {planted[0]} && "
              f"touch {planted[1]} {planted[2]} && ipcmk -M 4096 >/dev/null && ipcmk -Q >/dev/null")
    sb = await Sandbox.start(dataclasses.replace(settings(tmp_path), jobs_dir=reachable))
    try:
        top = reachable / "d212vvvvvvvv-00000000"
        (top / "work").mkdir(parents=True)
        for deeper in (False, True):
            async with sb.open(job="j", top=top, cwd=top / "work", memory=None, cpus=None, gpus=()) as box:
                argv, env = box.command(["/bin/sh", "-c", script + (f" && touch {shared}/left" if deeper else "")],
                                        {"PATH": "/usr/bin:/bin"}, 0)
                await trio.run_process(argv, env=env, check=True)
                assert len(ipc_of(box.uid)) == 2 and all(p.lstat().st_uid == box.uid for p in planted)
            assert not [p for p in planted if os.path.lexists(p)] and ipc_of(box.uid) == []
            assert sb.pool is not None
            assert sb.pool.holder(box.uid) == (f"files in {', '.join(map(str, SCRATCH))}" if deeper else None)
    finally:
        await sb.close()
        for p in [*planted, shared]:
            subprocess.run(["rm", "-rf", str(p)], check=False)


def test_only_a_job_uids_processes_and_files_are_ever_touched():
    with pytest.raises(ValueError, match="uid 0 is not a job's: its processes"):
        boxmod.kill_uid(0, "/usr/bin/setpriv")
    with pytest.raises(ValueError, match="uid 999 is not a job's: its files"):
        boxmod.clear_uid(999, "/usr/bin/setpriv")


ATTACKER = 2_000_000_100  # a local user, apart from the job uids


@pytest.fixture
def shm(tmp_path, monkeypatch) -> Path:
    """A stand-in for the host's /dev/shm (world-writable, sticky): other daemons on this
    machine keep theirs in the real one."""
    d = tmp_path / "shm"
    d.mkdir()
    d.chmod(0o1777)
    monkeypatch.setattr(boxmod, "SHM", d)
    return d


@root
def test_a_previous_lifes_shared_memory_goes_and_a_lookalike_stays(shm):
    name = "swarmd-t0000"
    left = shm / f"{name}.abc12345"  # a killed life's, with a job's directory in it
    (left / "d212-0").mkdir(parents=True)
    lookalike = shm / f"{name}.evil0000"
    lookalike.mkdir()
    os.chown(lookalike, ATTACKER, ATTACKER)
    other = shm / "swarmd-t1111.abc12345"  # another daemon's on this machine
    other.mkdir()
    boxmod.remove_left_shm(name)
    assert not left.exists() and lookalike.exists() and other.exists()
    made = boxmod._shm_parent(name)
    assert made is not None and made.parent == shm and made.name.startswith(f"{name}.")
    st = made.lstat()
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o711


@root
async def test_a_local_user_racing_for_dev_shm_swarmd_cannot_fail_a_job_start(tmp_path, monkeypatch, shm):
    """Issue 23, finding 16: the jobs' shared /dev/shm lay under /dev/shm/swarmd; a local user
    who made that name again whenever the daemon removed it failed every job start (mkdir:
    File exists), and had their own directory removed by root."""
    theirs = shm / "swarmd"
    real_remove = boxmod.trees.remove

    def race(path: Path) -> None:
        real_remove(path)
        if path == theirs:  # the local user wins the race for the name
            os.mkdir(theirs, 0o777)
            os.chown(theirs, ATTACKER, ATTACKER)

    os.mkdir(theirs, 0o777)
    os.chown(theirs, ATTACKER, ATTACKER)
    monkeypatch.setattr(boxmod.trees, "remove", race)
    sb = await Sandbox.start(settings(tmp_path))
    try:
        assert sb.bwrap is not None, sb.parts
        top = tmp_path / "jobs" / "d212wwwwwwww-00000000"
        (top / "work").mkdir(parents=True)
        async with sb.open(job="j", top=top, cwd=top / "work", memory=None, cpus=None, gpus=()) as box:
            shared = sb.shm / top.name
            assert shared.stat().st_uid == box.uid and stat.S_IMODE(shared.stat().st_mode) == 0o700
            assert shared.parent.parent == shm and shared.parent.stat().st_uid == 0
        assert not shared.exists()
        assert theirs.stat().st_uid == ATTACKER, "a local user's directory is neither used nor removed"
    finally:
        await sb.close()
        real_remove(theirs)
    assert sb.shm is not None and not sb.shm.exists(), "the daemon's own goes when it stops"


def _uid(proc: Path) -> int | None:
    try:
        for line in (proc / "status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


@root
async def test_a_failing_step_of_the_boxs_close_skips_none_of_the_others(tmp_path, without, reachable, monkeypatch):
    """Handing the job's files back failing (a tree the job shaped, a full disk) left the
    uid handed out for good and the firewall chain in place: each step runs regardless."""
    import structlog

    without("cgroup", "namespaces", "firewall")

    def cannot(top, uid):
        raise boxmod.trees.TreeError("chown: cannot change ownership: Read-only file system")

    monkeypatch.setattr(boxmod, "_hand_back", cannot)
    sb = await Sandbox.start(dataclasses.replace(settings(tmp_path), jobs_dir=reachable))
    try:
        top = reachable / "d212zzzzzzzy-00000000"
        (top / "work").mkdir(parents=True)
        with structlog.testing.capture_logs() as logs:
            async with sb.open(job="j", top=top, cwd=top / "work", memory=None, cpus=None, gpus=()) as box:
                uid = box.uid
        assert [(e["step"], e["error"]) for e in logs if e.get("step")] == [
            ("hand its files back", "TreeError: chown: cannot change ownership: Read-only file system")]
        assert uid not in sb.pool._given, "the uid went back to the pool"
    finally:
        await sb.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's parts need root")
async def test_a_failing_sweep_of_dead_daemons_tables_still_puts_the_firewall_up(tmp_path, monkeypatch):
    async def refuse(family):
        raise boxmod.firewall.FirewallError("nft -j list tables: unreadable output")

    monkeypatch.setattr(boxmod.firewall, "tables", refuse)
    sb = await Sandbox.start(settings(tmp_path))
    try:
        assert sb.parts["firewall"].startswith("nftables"), sb.parts
    finally:
        await sb.close()
