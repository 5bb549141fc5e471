"""One job's ranks on this host, as real processes: torch.distributed across them, output
lines, a failing rank stopping the others, cancel and its grace, whole trees killed, and
who the ranks run as."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import trio

from swarmd.compute.host.executor import MAX_LINE, Executor, ExecutorError, RankProc, free_port
from swarmd.compute.torchenv import NodeRole, rank_env

ROOT = os.geteuid() == 0
USER = "nobody" if ROOT else None  # root must name a job user; anyone else runs ranks as itself
# The job user may not reach the venv's interpreter (here it lives under /root, 0700), so
# the torch test runs as root when root; who ranks run as has tests of its own.
TORCH_USER = "root" if ROOT else None
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/"}


@pytest.fixture
def workdir():
    """A directory the job user can enter (pytest's own tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="swarmd-executor-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


class Job:
    """An executor over `argvs` (one a rank) that records every line it gets."""

    def __init__(self, argvs: list[list[str]], cwd: Path, *, user: str | None = USER, grace: float = 5.0,
                 envs: list[dict[str, str]] | None = None) -> None:
        self.lines: list[tuple[int, bytes]] = []
        self.line_seen = trio.Event()
        self.codes: dict[int, int] | None = None
        self.ended = trio.Event()
        ranks = [RankProc(rank=i, local_rank=i, argv=argv, env=envs[i] if envs else ENV, cwd=cwd)
                 for i, argv in enumerate(argvs)]
        self.executor = Executor("j1", ranks, user=user, on_output=self._out, grace=grace)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.codes = await self.executor.run(task_status=task_status)
        self.ended.set()

    def _out(self, rank: int, line: bytes) -> None:
        self.lines.append((rank, line))
        self.line_seen.set()

    async def first_line(self) -> bytes:
        await self.line_seen.wait()
        return self.lines[0][1]

    def of(self, rank: int) -> list[bytes]:
        return [line for r, line in self.lines if r == rank]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie nobody reaps here is dead all the same


async def dies(pid: int) -> None:
    """A killed process that closed its files may still be on its way out for a moment."""
    with trio.fail_after(5):
        while alive(pid):
            await trio.sleep(0.01)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


async def test_two_ranks_all_reduce_over_gloo_and_their_lines_come_back_by_rank(tmp_path):
    (tmp_path / "allreduce.py").write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        print(f"rank {os.environ['RANK']} of {dist.get_world_size()}: sum {t.item():g}")
        dist.destroy_process_group()
    """))
    role = NodeRole(job_id="j1", node_rank=0, nnodes=1, procs_per_node=2, master_addr="127.0.0.1",
                    master_port=free_port("127.0.0.1"), ifname="lo", gpus=(), node_ips=("127.0.0.1",),
                    checkpoint_dir=str(tmp_path))
    job = Job([[sys.executable, "allreduce.py"]] * 2, tmp_path, user=TORCH_USER,
              envs=[rank_env(role, i, {}, ENV) for i in (0, 1)])
    with trio.fail_after(120):
        codes = await job.executor.run()
    assert codes == {0: 0, 1: 0}, job.lines
    assert job.of(0) == [b"rank 0 of 2: sum 3"] and job.of(1) == [b"rank 1 of 2: sum 3"]
    assert job.executor.first_failure is None


async def test_a_rank_exiting_3_stops_the_others_and_is_the_failure_reported(workdir):
    job = Job([sh("sleep 1000"), sh("echo bye; exit 3"), sh("sleep 1000")], workdir, grace=30)
    with trio.fail_after(10):
        codes = await job.executor.run()
    assert codes == {0: 128 + signal.SIGTERM, 1: 3, 2: 128 + signal.SIGTERM}
    assert job.executor.first_failure == (1, 3)
    assert job.of(1) == [b"bye"]


async def test_a_rank_killed_by_a_signal_exits_128_plus_its_number(workdir):
    job = Job([sh("kill -KILL $$")], workdir)
    with trio.fail_after(10):
        assert await job.executor.run() == {0: 128 + signal.SIGKILL}
    assert job.executor.first_failure == (0, 137)


async def test_cancel_kills_a_rank_that_ignores_sigterm_once_grace_is_over(workdir):
    job = Job([sh("trap '' TERM; echo ignoring SIGTERM; sleep 1000"), sh("sleep 1000")], workdir, grace=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(job.run)
        with trio.fail_after(10):
            await job.first_line()
            start = trio.current_time()
            job.executor.cancel()
            await job.ended.wait()
    assert trio.current_time() - start >= 1.0, "SIGKILL came before the grace was over"
    assert job.codes == {0: 128 + signal.SIGKILL, 1: 128 + signal.SIGTERM}
    assert job.executor.first_failure is None, "a cancelled job has no failing rank"


async def test_cancel_reaches_the_whole_tree_of_a_rank(workdir):
    job = Job([sh("sleep 1000 & echo $!; wait")], workdir)
    async with trio.open_nursery() as nursery:
        await nursery.start(job.run)
        with trio.fail_after(10):
            grandchild = int(await job.first_line())
            assert alive(grandchild)
            job.executor.cancel()
            await job.ended.wait()
    await dies(grandchild)


async def test_what_a_finished_rank_left_behind_is_killed_and_does_not_hold_the_job(workdir):
    job = Job([sh("sleep 1000 & echo $!")], workdir, grace=60)  # the orphan holds the output pipe open
    with trio.fail_after(10):
        assert await job.executor.run() == {0: 0}
    await dies(int(job.of(0)[0]))


async def test_cancelling_run_itself_stops_and_reaps_the_ranks(workdir):
    job = Job([sh("echo $$; sleep 1000")], workdir)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(job.run)
            pid = int(await job.first_line())
            nursery.cancel_scope.cancel()
    assert job.codes is None
    await dies(pid)


async def test_stdout_and_stderr_come_back_as_lines_and_a_last_partial_one_is_kept(workdir):
    job = Job([sh(r"echo out; echo err >&2; printf '\n\r\nno newline'")], workdir)
    with trio.fail_after(10):
        assert await job.executor.run() == {0: 0}
    assert job.of(0) == [b"out", b"err", b"", b"", b"no newline"]


async def test_a_very_long_line_is_cut_at_64_kib(workdir):
    x, y = 2 * MAX_LINE + 10, MAX_LINE + 1
    job = Job([sh(f"head -c {x} /dev/zero | tr '\\0' x; echo; head -c {y} /dev/zero | tr '\\0' y; echo")], workdir)
    with trio.fail_after(10):
        assert await job.executor.run() == {0: 0}
    assert [len(line) for line in job.of(0)] == [MAX_LINE, MAX_LINE, 10, MAX_LINE, 1]
    assert b"".join(job.of(0)) == b"x" * x + b"y" * y


async def test_a_rank_gets_its_own_env_and_none_of_the_daemons_descriptors(workdir, monkeypatch):
    monkeypatch.setenv("SWARMD_DAEMON_ONLY", "secret")
    read, write = os.pipe()
    os.set_inheritable(write, True)
    ours = os.readlink(f"/proc/self/fd/{write}").encode()
    try:
        job = Job([["env"], ["ls", "-l", "/proc/self/fd"]], workdir)
        with trio.fail_after(10):
            assert await job.executor.run() == {0: 0, 1: 0}
    finally:
        os.close(read)
        os.close(write)
    assert sorted(job.of(0)) == sorted(f"{k}={v}".encode() for k, v in ENV.items())
    fds = job.of(1)
    assert any(b"/dev/null" in line for line in fds), fds
    assert not any(ours in line for line in fds), fds


@pytest.mark.skipif(not ROOT, reason="only root can run ranks as another user")
async def test_as_root_ranks_run_as_nobody_without_supplementary_groups(workdir):
    job = Job([sh("id -u; id -g; id -G")], workdir, user="nobody")
    with trio.fail_after(10):
        assert await job.executor.run() == {0: 0}
    assert job.of(0) == [b"65534", b"65534", b"65534"]


async def test_a_root_daemon_refuses_to_run_ranks_as_root_unless_told(workdir, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(ExecutorError, match="swarmd is root and no job user is set"):
        await Job([sh("true")], workdir, user=None).executor.run()


async def test_an_unprivileged_daemon_runs_ranks_only_as_itself(workdir, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 65534)
    with pytest.raises(ExecutorError, match="as job user 'root' only when swarmd is root"):
        await Job([sh("true")], workdir, user="root").executor.run()


async def test_a_missing_user_is_named(workdir):
    with pytest.raises(ExecutorError, match="job user 'no-such-swarm-user' does not exist"):
        await Job([sh("true")], workdir, user="no-such-swarm-user").executor.run()


async def test_a_rank_that_cannot_start_is_named_and_the_started_ones_are_stopped(workdir):
    marker = f"{os.getpid()}.5"  # a sleep no one else runs
    job = Job([["sleep", marker], ["/nonexistent/trainer"]], workdir)
    with trio.fail_after(10), pytest.raises(ExecutorError, match="rank 1 cannot start: .*'/nonexistent/trainer'"):
        await job.executor.run()
    assert not [p for p in Path("/proc").glob("[0-9]*/cmdline") if _read(p) == f"sleep\0{marker}\0".encode()]
    with pytest.raises(ExecutorError, match="rank 0 cannot start: .*gone"):
        await Job([sh("true")], workdir / "gone").executor.run()


async def test_without_pidfd_a_thread_waits_for_the_ranks(workdir, monkeypatch):
    def no_pidfd(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "pidfd_open")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    job = Job([sh("sleep 1000"), sh("echo x; exit 2")], workdir)
    with trio.fail_after(10):
        assert await job.executor.run() == {0: 128 + signal.SIGTERM, 1: 2}
    assert job.executor.first_failure == (1, 2)
