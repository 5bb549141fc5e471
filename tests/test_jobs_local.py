"""Jobs on one daemon on loopback (no root needed): the whole path from swarmctl to ranks and
back, for machines where the netlab tests skip."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import wait_until
from sim.netlab.lab import job_user

ALLREDUCE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)]); dist.all_reduce(t)
print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "sum", int(t.item()))
dist.destroy_process_group()  # without it, gloo may abort the process at exit (SIGABRT, 134)
"""


@pytest.fixture
def node(make_daemon):
    jobs_dir = Path(tempfile.mkdtemp(prefix="swarmd-test-jobs-"))
    jobs_dir.chmod(0o711)  # ranks of another user reach their own directory inside
    args = ["--jobs-dir", str(jobs_dir)] + (["--job-user", job_user()] if os.geteuid() == 0 else [])
    d = make_daemon(args=args)
    d.call("swarm.init")
    wait_until(lambda: d.call("status").get("record"), 10, "the node's own record")
    yield d
    subprocess.run(["rm", "-rf", str(jobs_dir)], check=False)


def swarmctl(d, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarmctl.main", "--socket", str(d.socket), *args],
                          capture_output=True, text=True, timeout=timeout)


def test_a_two_rank_job_runs_and_its_failures_come_back(node, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.py").write_text(ALLREDUCE)
    r = swarmctl(node, "jobs", "run", "--procs-per-node", "2", "--workdir", str(work), "--", "python", "job.py")
    assert r.returncode == 0, r.stderr
    assert sorted(line for line in r.stdout.splitlines()) == ["[rank 0] rank 0 of 2 sum 3", "[rank 1] rank 1 of 2 sum 3"]

    r = swarmctl(node, "jobs", "run", "--name", "fails", "--", "python", "-c", "import sys; print('bye'); sys.exit(7)")
    assert r.returncode == 7 and r.stdout == "[rank 0] bye\n" and "rank 0" in r.stderr and "exited with 7" in r.stderr

    listed = node.call("jobs.ls")["jobs"]
    assert [(j["name"], j["state"], j["exit_code"]) for j in listed] == [("fails", "failed", 7), (None, "succeeded", 0)]
    r = swarmctl(node, "jobs", "logs", "--rank", "0", listed[0]["id"])
    assert r.returncode == 0 and r.stdout == "bye\n"


def test_waiting_for_capacity_gives_up_with_the_reason(node):
    r = swarmctl(node, "jobs", "run", "--nodes", "2", "--wait", "2s", "--", "python", "-c", "pass")
    assert r.returncode == 1 and "need 2 nodes; 1 alive member fits" in r.stderr, r.stderr


def test_unknown_jobs_and_bad_flags_are_clear(node):
    r = swarmctl(node, "jobs", "show", "nosuchjob")
    assert r.returncode == 1 and "no job 'nosuchjob'" in r.stderr
    r = swarmctl(node, "jobs", "run", "--env", "NOEQUALS", "--", "true")
    assert r.returncode == 2 and "--env: expected K=V" in r.stderr
    r = swarmctl(node, "jobs", "run", "--nodes", "2")
    assert r.returncode == 2 and "'cmd' is missing" in r.stderr
    with pytest.raises(Exception, match="set by a service's controller"):  # a job cannot pose as a replica
        list(node.client().stream("jobs.run", spec={"cmd": ["true"], "serve": {"service": "embed", "replica": 0}},
                                  detach=True))


def test_a_rank_that_cannot_start_fails_the_job_saying_why(node):
    r = swarmctl(node, "jobs", "run", "--python", "/nonexistent/python", "--", "python", "-c", "pass")
    assert r.returncode == 1 and "cannot start" in r.stderr and "/nonexistent/python" in r.stderr, r.stderr
    assert node.call("status")["jobs"]["slots_free"] == node.call("status")["jobs"]["slots"], "the slot came back"


def test_logs_follow_streams_until_the_job_ends(node):
    script = "import time\nfor i in range(4):\n    print('tick', i, flush=True)\n    time.sleep(0.5)\n"
    r = swarmctl(node, "jobs", "run", "--detach", "--procs-per-node", "2", "--", "python", "-c", script)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    r = swarmctl(node, "jobs", "logs", "-f", job)
    assert r.returncode == 0, r.stderr
    shown = node.call("jobs.show", id=job)  # once -f returned with nothing (-n 3): why the job ended, if it did
    for rank in (0, 1):
        assert [line for line in r.stdout.splitlines() if line.startswith(f"[rank {rank}]")] == \
            [f"[rank {rank}] tick {i}" for i in range(4)], (r.stdout, r.stderr, {k: shown[k] for k in (
                "state", "reason", "exit_code", "node_state", "attempts")})
    assert node.call("jobs.show", id=job)["state"] == "succeeded", "-f returned because the job ended"


class _Terminal:
    """`swarmctl ARGS` on a terminal of its own, as a user runs it: in that terminal's
    foreground, Ctrl-C typed there (the line discipline signals the foreground group).

    swarmctl starts with SIGINT's default disposition, whatever pytest's own is (a shell without
    job control starts background commands with SIGINT ignored, and exec keeps it), or `sigint`."""

    def __init__(self, d, *args: str, sigint=None) -> None:
        import pty
        import signal

        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            try:
                signal.signal(signal.SIGINT, signal.SIG_DFL if sigint is None else sigint)
                os.execv(sys.executable, [sys.executable, "-m", "swarmctl.main", "--socket", str(d.socket), *args])
            finally:
                os._exit(127)  # never back into pytest in the child
        self.seen = b""
        self.code: int | None = None

    def read_until(self, marker: bytes, timeout: float = 60) -> None:
        """Read until `marker`; fails at once, saying so, if swarmctl exits first."""
        import select
        import time

        deadline = time.monotonic() + timeout
        while marker not in self.seen:
            assert time.monotonic() < deadline, f"no {marker!r} in {self.seen[-2000:]!r}"
            if select.select([self.fd], [], [], 0.2)[0]:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # EIO: swarmctl is gone and its terminal with it
                    chunk = b""
                if not chunk:
                    self.seen += b"<eof>"
                    if marker != b"<eof>":
                        raise AssertionError(f"swarmctl exited ({self.wait()}) before {marker!r}: {self.seen[-2000:]!r}")
                self.seen += chunk

    def ctrl_c(self) -> None:
        os.write(self.fd, b"\x03")  # what the user types; the terminal sends SIGINT

    def wait(self) -> int:
        if self.code is None:
            _, status = os.waitpid(self.pid, 0)
            self.code = os.waitstatus_to_exitcode(status)
            os.close(self.fd)
        return self.code


def _run_on_a_tty(d, answer: bytes, sigint=None) -> tuple[int, bytes]:
    """`swarmctl jobs run` on a terminal, Ctrl-C once the job prints, then `answer` to its question."""
    tty = _Terminal(d, "jobs", "run", "--", "python", "-c", "import time; print('ready', flush=True); time.sleep(600)",
                    sigint=sigint)
    tty.read_until(b"[rank 0] ready")
    tty.ctrl_c()
    tty.read_until(b"[c]ancel it or [d]etach?")
    os.write(tty.fd, answer + b"\n")
    asked = len(tty.seen)
    tty.read_until(b"<eof>", timeout=30)  # everything the command says until it exits
    return tty.wait(), tty.seen[asked:]


def test_ctrl_c_asks_whether_to_cancel_or_detach(node):
    code, seen = _run_on_a_tty(node, b"c")
    assert code == 130 and b"cancelled" in seen
    wait_until(lambda: node.call("jobs.ls")["jobs"][0]["state"] == "cancelled", 20, "the job cancelled")

    code, seen = _run_on_a_tty(node, b"d")
    assert code == 130 and b"detached" in seen and b"swarmctl jobs logs -f" in seen
    job = node.call("jobs.ls")["jobs"][0]
    assert job["state"] == "running", "a detached job goes on"
    node.call("jobs.cancel", id=job["id"])
    wait_until(lambda: node.call("jobs.show", id=job["id"])["state"] == "cancelled", 20, "the job cancelled")


def test_ctrl_c_asks_even_when_swarmctl_inherited_sigint_ignored(node):
    """`make test &` from a script, or a CI runner's shell: SIGINT arrives ignored. Once lost a
    user's Ctrl-C (no question in 60 s); swarmctl now handles it in its terminal's foreground."""
    import signal

    code, seen = _run_on_a_tty(node, b"c", sigint=signal.SIG_IGN)
    assert code == 130 and b"cancelled" in seen
    wait_until(lambda: node.call("jobs.ls")["jobs"][0]["state"] == "cancelled", 20, "the job cancelled")


def test_ctrl_c_stops_logs_follow_even_when_swarmctl_inherited_sigint_ignored(node):
    """Every command hears a Ctrl-C typed at its terminal, not only `jobs run`: `jobs logs -f`
    started with SIGINT ignored followed the job until it ended, deaf to Ctrl-C."""
    import signal

    r = swarmctl(node, "jobs", "run", "--detach", "--", "python", "-c",
                 "import time; print('ready', flush=True); time.sleep(600)")
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    tty = _Terminal(node, "jobs", "logs", "-f", job, sigint=signal.SIG_IGN)
    tty.read_until(b"ready")
    tty.ctrl_c()
    tty.read_until(b"<eof>", timeout=30)
    assert tty.wait() == 130
    assert node.call("jobs.show", id=job)["state"] == "running", "following stopped, the job goes on"
    node.call("jobs.cancel", id=job)


def test_a_job_cancelled_as_soon_as_it_is_submitted_runs_nothing(node):
    """A cancel that came while the hosts were reserved, or crossed the start on the wire, was
    lost: the job's ranks started anyway (state 'running', or 'cancelled' with ranks running)."""
    for _ in range(4):  # it lands in placing, reserving or starting, depending on timing
        job = node.call("jobs.run", spec={"cmd": ["sleep", "600"]}, detach=True)["submitted"]
        node.call("jobs.cancel", id=job)
        wait_until(lambda: node.call("jobs.show", id=job)["state"] == "cancelled"
                   and node.call("status")["jobs"]["ranks_here"] == 0, 20, "the job cancelled, no rank left")
        wait_until(lambda: not node.call("status")["jobs"]["coordinating"], 20, "the coordinator done with it")


def test_status_says_which_jobs_hold_the_slots_here(node):
    job = node.call("jobs.run", spec={"cmd": ["sleep", "600"]}, detach=True)["submitted"]
    try:
        me = node.call("status")["peer_id"]
        wait_until(lambda: node.call("status")["jobs"]["holding"] == [
            {"job": job, "coordinator": me, "state": "running"}], 20, "the job holding a slot, running")
        shown = swarmctl(node, "status").stdout
        assert f"slots held by {job} (running, for …{me[-8:]})" in " ".join(shown.split()), shown
    finally:
        node.call("jobs.cancel", id=job)
    wait_until(lambda: node.call("status")["jobs"]["holding"] == [], 20, "the slot given back")


def test_a_hostile_workdir_upload_is_refused_and_the_daemon_keeps_serving(node):
    import hashlib
    import io
    import tarfile

    from swarmd.rpc.client import RemoteError

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    with pytest.raises(RemoteError, match="only plain files and directories"):
        node.call("jobs.upload", digest=digest, offset=0, size=len(data), data=data)
    with pytest.raises(RemoteError, match="does not match its digest"):
        node.call("jobs.upload", digest="0" * 64, offset=0, size=len(data), data=data)
    with pytest.raises(RemoteError, match="was not uploaded"):
        list(node.client().stream("jobs.run", spec={"cmd": ["true"]}, workdir=digest))
    assert node.call("status")["peer_id"]


def test_a_workdir_too_deep_to_walk_is_refused_and_a_restart_comes_up(node):
    """Issue 23, finding 1, through the control socket: jobs.upload of a workdir 1,200
    directories deep answered `internal error … RecursionError`, left the half-unpacked tree
    in STATE_DIR/workdirs, and every later start of the daemon died removing it. Now it is
    refused before anything is made, and a start with such a leftover (an older daemon's)
    removes it and serves."""
    import hashlib

    import deep_trees
    from swarmd.rpc.client import RemoteError

    data = deep_trees.deep_archive()
    digest = hashlib.sha256(data).hexdigest()
    workdirs = node.state_dir / "workdirs"
    try:
        with pytest.raises(RemoteError, match="names deep: at most 64 are accepted"):
            node.call("jobs.upload", digest=digest, offset=0, size=len(data), data=data)
        assert list(workdirs.iterdir()) == []
        deep_trees.make_deep(workdirs / ".unpack-old")
        node.stop()
        node.start()  # fails if the daemon exits
        assert node.call("status")["peer_id"] and list(workdirs.iterdir()) == []
    finally:
        deep_trees.remove(workdirs)
