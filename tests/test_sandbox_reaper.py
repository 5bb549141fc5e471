"""sandbox.reaper: a job's ranks never outlive their daemon. The reaper's protocol against
real process groups (a group under the fence is killed at end of file, never after `-` or
`done`; signals to it change nothing), then the real Executor in a stand-in daemon
(reaper_daemon.py) that is SIGKILLed mid-job, without a sandbox and in a real box: every
rank process is gone within seconds. A normal end leaves no reaper behind."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import trio

from conftest import wait_until
from swarmd.compute.host.executor import Executor, RankProc
from reaper_daemon import settings
from swarmd.compute.host.sandbox import box as boxmod, cgroups, reaper

pytestmark = pytest.mark.usefixtures("own_firewall_table")  # (conftest): no daemon sweeps it

ROOT = os.geteuid() == 0
DAEMON = Path(__file__).with_name("reaper_daemon.py")
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/"}
UIDS = [64800, 64899]  # apart from test_sandbox_box's, the lab's slices and the default's low end
GONE_WITHIN = 5.0  # seconds from the daemon's death to its last rank's


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie is dead, whoever reaps it


def marked(marker: str) -> list[int]:
    """Pids of the live `sleep` processes whose argument carries `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit():
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if argv[0] == b"sleep" and marker.encode() in argv[1] and alive(int(entry.name)):
                found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def reading(pid: int) -> bool:
    """The reaper has set itself up and waits on its pipe: in read(0, …)."""
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[:2] == ["0", "0x0"]
    except (OSError, IndexError):
        return False


def stranger() -> subprocess.Popen:
    """A process group of its own with a child in it: what a rank's group looks like."""
    p = subprocess.Popen(["/bin/sh", "-c", "sleep 1000 & echo $!; wait"], stdout=subprocess.PIPE,
                         start_new_session=True)
    p.child = int(p.stdout.readline())  # type: ignore[attr-defined]
    return p


def start_reaper(*args: str) -> subprocess.Popen:
    argv = reaper.command("j1", None)[:-1] + list(args or ["j1"])
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=reaper.environment(),
                            start_new_session=True)


def finish(p: subprocess.Popen, *lines: bytes) -> tuple[int, str]:
    assert p.stdin is not None and p.stderr is not None
    for line in lines:
        p.stdin.write(line)
    p.stdin.close()
    err = p.stderr.read().decode()
    return p.wait(timeout=30), err


def end(p: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


# --- the reaper's protocol -------------------------------------------------------------------

def test_end_of_file_kills_every_group_under_the_fence():
    a, b = stranger(), stranger()
    try:
        code, err = finish(start_reaper(), reaper.watch(a.pid), reaper.watch(b.pid))
        assert code == 0 and "the daemon is gone; killed 2 rank group(s)" in err, err
        wait_until(lambda: not any(alive(p) for p in (a.pid, a.child, b.pid, b.child)), GONE_WITHIN,
                   "both groups to die")
    finally:
        end(a), end(b)


def test_a_forgotten_group_or_a_done_job_is_never_killed():
    """After `-PGID` the number may be a stranger's (its leader reaped); after `done` the job
    ended normally: the reaper kills nothing."""
    a, b = stranger(), stranger()
    try:
        assert finish(start_reaper(), reaper.watch(a.pid), reaper.watch(b.pid), reaper.forget(a.pid),
                      b"nonsense\n", reaper.forget(b.pid))[0] == 0
        assert finish(start_reaper(), reaper.watch(a.pid), reaper.watch(b.pid), reaper.DONE)[0] == 0
        assert all(alive(p) for p in (a.pid, a.child, b.pid, b.child))
    finally:
        end(a), end(b)


def test_signals_do_not_take_the_fence_down():
    """Its life is the pipe's: SIGINT (a terminal's Ctrl-C), SIGTERM and SIGHUP change nothing."""
    a = stranger()
    r = start_reaper()
    try:
        assert r.stdin is not None
        r.stdin.write(reaper.watch(a.pid))
        r.stdin.flush()
        wait_until(lambda: reading(r.pid), 10, "the reaper to wait on its pipe")
        assert int(_status(r.pid)["SigIgn"], 16) & 0x4003 == 0x4003, "SIGHUP, SIGINT and SIGTERM ignored"
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            r.send_signal(sig)
        assert finish(r)[0] == 0
        wait_until(lambda: not alive(a.child), GONE_WITHIN, "the group to die")
    finally:
        end(a), end(r)


def test_bad_arguments_are_refused_and_a_cgroup_round_trips():
    code, err = finish(start_reaper("j1", "v3", "memory=/x"))
    assert code == 2 and "expected v1 or v2" in err
    code, err = finish(start_reaper("j1", "v1", "memory=relative"))
    assert code == 2 and "CONTROLLER=/absolute/dir" in err
    cg = cgroups.JobCgroup(1, [Path("/cg/memory/a/j"), Path("/cg/cpu,cpuacct/a/j")],
                           {"memory": Path("/cg/memory/a/j"), "cpu": Path("/cg/cpu,cpuacct/a/j"),
                            "cpuacct": Path("/cg/cpu,cpuacct/a/j")})
    job, back = reaper.parse(reaper.command("j1", cg)[5:])
    assert job == "j1" and back is not None and (back.version, back.dirs, back.by) == (cg.version, cg.dirs, cg.by)


@pytest.fixture
def hierarchy():
    found = cgroups.detect()
    if isinstance(found, str):
        pytest.skip(f"needs cgroups as root: {found}")
    name = f"swarmd-test-{os.getpid()}-{secrets.token_hex(4)}"
    found.parent(name)
    try:
        yield found, name
    finally:
        found.discard(name)


def test_a_cgroup_is_emptied_unless_it_was_made_afresh_since(hierarchy):
    h, name = hierarchy
    limits = cgroups.Limits(memory=None, cpus=None, pids=None, devices=None)
    for fresh in (False, True):
        cg = h.create(name, "job", limits)
        r = start_reaper(*reaper.command("j1", cg)[5:])
        wait_until(lambda: reading(r.pid), 10, "the reaper to wait on its pipe")  # it has seen the cgroup
        if fresh:  # a later start of the same job, under the same name
            cg.remove()
            cg = h.create(name, "job", limits)
        p = subprocess.Popen(["/bin/sh", "-c", boxmod.JOIN_CGROUP, "sh", *map(str, cg.procs_files), "--",
                              "sleep", "1000"], start_new_session=True)
        try:
            wait_until(lambda: cg.pids() and _comm(p.pid) == "sleep", 10, "the sleep to join the cgroup")
            assert finish(r)[0] == 0
            if fresh:
                assert alive(p.pid), "a cgroup made afresh is another start's"
            else:
                wait_until(lambda: not cg.pids(), GONE_WITHIN, "the cgroup to empty")
        finally:
            p.kill()
            p.wait()
            cg.kill()
            cg.remove()


# --- the executor's fence --------------------------------------------------------------------

@pytest.fixture
def workdir():
    path = Path(tempfile.mkdtemp(prefix="swarmd-reaper-"))
    path.chmod(0o755)  # the job user enters it
    yield path
    shutil.rmtree(path)


def daemon(cfg: dict) -> tuple[subprocess.Popen, int, list[str]]:
    """The stand-in daemon, once every rank said `ready`: it, its reaper's pid, what else it said."""
    p = subprocess.Popen([sys.executable, str(DAEMON), json.dumps(cfg)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    said, ready, pid = [], 0, None
    while ready < len(cfg["scripts"]) or pid is None:
        line = p.stdout.readline()
        assert line, f"the daemon ended early: {said}"
        said.append(line.strip())
        ready += line.split()[1:] == ["ready"]
        if line.startswith("reaper "):
            pid = int(line.split()[1])
    return p, pid, said


def kill_daemon(p: subprocess.Popen, reaper_pid: int) -> None:
    assert alive(reaper_pid) and os.getsid(reaper_pid) == reaper_pid, "the reaper is a session of its own"
    p.kill()
    p.wait()


def test_ranks_die_with_their_daemon_without_a_sandbox(workdir):
    m = f"1000.{os.getpid()}{secrets.randbelow(10**6)}"
    scripts = [f"sleep {m}1 & sleep {m}2 & echo ready; wait", f"echo ready; exec sleep {m}3"]
    p, pid, _ = daemon({"cwd": str(workdir), "scripts": scripts, "user": "nobody" if ROOT else None,
                        "sandbox": None})
    try:
        # `ready` follows the forks, not the children's exec of sleep: until then they are `sh`
        wait_until(lambda: len(marked(m)) == 3, 10, "the three sleeps")
        kill_daemon(p, pid)
        wait_until(lambda: not marked(m), GONE_WITHIN, "every rank process to die with the daemon")
        wait_until(lambda: not alive(pid), GONE_WITHIN, "the reaper to exit")
    finally:
        p.kill()
        for leftover in marked(m):
            os.kill(leftover, signal.SIGKILL)


@pytest.mark.skipif(not ROOT, reason="the sandbox's parts need root")
def test_ranks_in_a_box_die_with_their_daemon_setsid_included(tmp_path):
    m = f"1000.{os.getpid()}{secrets.randbelow(10**6)}"
    scripts = [f"setsid sleep {m}1 >/dev/null 2>&1 & sleep {m}2 & echo ready; wait", f"echo ready; exec sleep {m}3"]
    sandbox = {"dir": str(tmp_path), "name": f"swarmd-t{secrets.token_hex(4)}", "uids": UIDS}
    (tmp_path / "jobs").mkdir(mode=0o711)
    p, pid, said = daemon({"cwd": None, "scripts": scripts, "user": None, "sandbox": sandbox})
    try:
        dirs = next(line.split()[1:] for line in said if line.startswith("cgroup "))
        cg = cgroups.JobCgroup(1, [Path(d) for d in dirs], {})
        wait_until(lambda: len(marked(m)) == 3, 10, "the three sleeps")
        assert cg.pids()
        kill_daemon(p, pid)
        wait_until(lambda: not marked(m) and not cg.pids(), GONE_WITHIN,
                   "every process of the job (the setsid'd sleep too) to die with the daemon")
        wait_until(lambda: not alive(pid), GONE_WITHIN, "the reaper to exit")
    finally:
        p.kill()
        p.wait()
        trio.run(_restart_and_stop, tmp_path, sandbox)


async def _restart_and_stop(tmp_path: Path, sandbox: dict) -> None:
    """What the daemon's next start and stop do: its cgroups and firewall table taken down."""
    sb = await boxmod.Sandbox.start(settings(tmp_path, sandbox["name"], sandbox["uids"]))
    await sb.close()


async def test_a_normal_end_leaves_no_reaper_and_kills_nothing_after(workdir):
    ranks = [RankProc(rank=0, local_rank=0, argv=["/bin/sh", "-c", "echo $$"], env=ENV, cwd=workdir)]
    lines: list[bytes] = []
    executor = Executor("j1", ranks, user="nobody" if ROOT else None, on_output=lambda r, line: lines.append(line))
    with trio.fail_after(30):
        assert await executor.run() == {0: 0}
    assert executor.fence is not None and executor.fence.proc.returncode == 0, "told done, it exited by itself"
    assert not alive(executor.fence.proc.pid)


def _status(pid: int) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
