"""A host's job directories: only job ids name them, they stay under jobs_dir, they are made
afresh, and only what the daemon just created is handed to the job user."""

from __future__ import annotations

import os
import pwd
import stat

import pytest

import deep_trees
from swarmd.compute.ids import host_dir, is_host_dir
from swarmd.compute.ledger import Ledger
from swarmd.compute.host.worker import Worker, WorkerError
from swarmd.compute.workdir import Cache

JOB = "0123456789ab"


@pytest.fixture
def worker(tmp_path):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    return Worker(ledger=Ledger(1), cache=Cache(tmp_path / "cache"), jobs_dir=jobs,
                  user="nobody" if os.geteuid() == 0 else None)


@pytest.mark.parametrize("job", ["/var/lib/swarmd", "../x", ".", "", "0123456789ab/..", "0123456789AB"])
def test_only_a_job_id_names_a_directory(worker, job):
    with pytest.raises(ValueError, match="must be a job id"):
        worker.job_dir(job, "coord")


def test_a_jobs_dir_that_is_a_link_elsewhere_is_refused(worker, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, worker.jobs_dir / host_dir(JOB, "coord"))
    with pytest.raises(WorkerError, match="outside"):
        worker.job_dir(JOB, "coord")


def test_two_coordinators_same_id_never_share_a_directory(worker):
    mine, theirs = worker.job_dir(JOB, "coord"), worker.job_dir(JOB, "mallory")
    assert mine != theirs and mine.parent == theirs.parent == worker.jobs_dir.resolve()
    assert mine.name.startswith(JOB + "-") and len(mine.name) == len(JOB) + 33, \
        "128 bits of the coordinator's hash: no member makes a peer id that lands in another's directory"
    assert is_host_dir(mine.name) and worker.busy_dirs() == []
    worker.ledger.reserve(0.0, JOB, "coord", 0, 1, 60.0)
    assert worker.busy_dirs() == [mine.name], "gc keeps the directory of a hold by its new name"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_leftover_tree_is_removed_unfollowed_and_only_fresh_dirs_are_chowned(worker, tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "key").write_text("secret")
    top = worker.jobs_dir / host_dir(JOB, "coord")
    top.mkdir()
    os.symlink(precious, top / "work")  # a leftover a job user could have planted
    os.symlink(precious / "key", top / "home")
    work = worker._prepare(worker.job_dir(JOB, "coord"), None)
    nobody = pwd.getpwnam("nobody").pw_uid
    assert os.stat(precious).st_uid == 0 and os.stat(precious / "key").st_uid == 0, "never chowned through a link"
    assert (precious / "key").read_text() == "secret"
    assert work == top / "work" and not work.is_symlink()
    assert {p.name: p.lstat().st_uid for p in top.iterdir()} == {"work": nobody, "checkpoints": nobody,
                                                                  "home": nobody, "tmp": nobody}
    assert top.stat().st_uid == 0 and stat.S_IMODE(top.stat().st_mode) == 0o711, "the job's top stays the daemon's"


async def test_ranks_stop_when_membership_declares_their_coordinator_dead(tmp_path):
    """A coordinator that crashed or was cut off by a partition: its ranks here do not run on
    unsupervised (the job has been placed elsewhere)."""
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    import trio

    from swarmd.compute.torchenv import NodeRole
    from swarmd.compute.host.worker import CoordinatorGone, StartRequest

    jobs = Path(tempfile.mkdtemp(prefix="swarmd-test-gone-"))  # reachable by the job user (tmp_path is 0700)
    jobs.chmod(0o711)
    verdict: dict[str, str | None] = {"coord": None}
    w = Worker(ledger=Ledger(1), cache=Cache(tmp_path / "cache"), jobs_dir=jobs,
               user="nobody" if os.geteuid() == 0 else None, coordinator_gone=lambda peer: verdict.get(peer))
    w.reserve(JOB, "coord", 0, 1, 60.0)
    w.commit(JOB, "coord")
    role = NodeRole(job_id=JOB, node_rank=0, nnodes=1, procs_per_node=1, master_addr="127.0.0.1",
                    master_port=29500, ifname=None, gpus=(), node_ips=("127.0.0.1",), checkpoint_dir="")
    req = StartRequest(job=JOB, coordinator="coord", role=role, env={}, python=None, workdir=None,
                       cmd=(sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(600)"))
    pids: list[int] = []

    async def emit(event) -> None:
        if "out" in event:
            pids.extend(int(line) for _, line in event["out"])
            verdict["coord"] = "dead"

    started = time.monotonic()
    try:
        with trio.fail_after(30), pytest.raises(CoordinatorGone, match="declared the coordinator dead"):
            await w.start(req, emit)
    finally:
        subprocess.run(["rm", "-rf", str(jobs)], check=False)
    assert time.monotonic() - started < 15 and pids
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)
    assert w.ledger.state_of(JOB, "coord") is None and not w.running, "the slot is free again"


async def test_a_checkpoint_scan_that_never_returns_does_not_hold_the_exit_or_the_slot(tmp_path, monkeypatch):
    """Reviewer's #9: a scan stuck in the job's file system (a FUSE mount that blocks every
    lstat) is given up LAST_CHECKPOINT_WAIT after the ranks exit: the exit is told, the slot
    freed; until then the coordinator hears heartbeats."""
    import subprocess
    import tempfile
    import threading
    from pathlib import Path

    import trio

    from swarmd.compute.host import worker as worker_module
    from swarmd.compute.checkpoints.cache import Watcher
    from swarmd.compute.torchenv import NodeRole
    from swarmd.compute.host.worker import StartRequest

    stuck = threading.Event()
    monkeypatch.setattr(Watcher, "_poll", lambda self: stuck.wait() and [])
    monkeypatch.setattr(worker_module, "LAST_CHECKPOINT_WAIT", 1.0)
    jobs = Path(tempfile.mkdtemp(prefix="swarmd-test-stuck-"))
    jobs.chmod(0o711)
    w = Worker(ledger=Ledger(1), cache=Cache(tmp_path / "cache"), jobs_dir=jobs,
               user="nobody" if os.geteuid() == 0 else None)
    w.reserve(JOB, "coord", 0, 1, 60.0)
    w.commit(JOB, "coord")
    role = NodeRole(job_id=JOB, node_rank=0, nnodes=1, procs_per_node=1, master_addr="127.0.0.1",
                    master_port=29500, ifname=None, gpus=(), node_ips=("127.0.0.1",), checkpoint_dir="")
    req = StartRequest(job=JOB, coordinator="coord", role=role, env={}, python=None, workdir=None, cmd=("true",))
    events: list = []

    async def emit(event) -> None:
        events.append(event)

    try:
        with trio.fail_after(20):
            assert await w.start(req, emit) == {0: 0}
    finally:
        stuck.set()  # the abandoned thread ends
        subprocess.run(["rm", "-rf", str(jobs)], check=False)
    assert "exit" in events[-1] and any("hb" in e for e in events)
    assert w.ledger.state_of(JOB, "coord") is None and not w.running, "the slot is free again"


async def test_refused_starts_never_evict_another_coordinators_kept_checkpoints(worker):
    """Issue 23 #13: a start the ledger refuses records nothing, so a member sending 4,097
    refused starts does not push out what another coordinator's job keeps here; and what
    one coordinator's jobs keep is bounded per coordinator, its own oldest going first."""
    import dataclasses
    import sys

    from swarmd.compute.ids import encode
    from swarmd.compute.torchenv import NodeRole
    from swarmd.compute.host.worker import MAX_KEPT_PER_COORDINATOR, Refused, StartRequest

    kept = frozenset({"a" * 64})
    worker.keep_checkpoints(JOB, "coord", kept)  # the hub's list, or the latest start's
    role = NodeRole(job_id=JOB, node_rank=0, nnodes=1, procs_per_node=1, master_addr="127.0.0.1",
                    master_port=29500, ifname=None, gpus=(), node_ips=("127.0.0.1",), checkpoint_dir="")

    async def emit(event) -> None:
        raise AssertionError("a refused start tells nothing")

    for i in range(4097):
        job = encode(i + 1)
        req = StartRequest(job=job, coordinator="mallory", role=dataclasses.replace(role, job_id=job), env={},
                           python=None, workdir=None, cmd=(sys.executable, "-c", "pass"))
        with pytest.raises(Refused, match="no reservation|not committed|holds no"):
            await worker.start(req, emit)
    assert worker.kept_checkpoints(JOB, "coord") == kept
    assert list(worker.checkpoints_kept) == [host_dir(JOB, "coord")], "a refused start records nothing"

    for i in range(MAX_KEPT_PER_COORDINATOR + 10):  # starts the ledger took, or a hub's lists
        worker.keep_checkpoints(encode(i + 1), "mallory", {"b" * 64})
    assert worker.kept_checkpoints(JOB, "coord") == kept
    assert len(worker.checkpoints_kept) == MAX_KEPT_PER_COORDINATOR + 1
    assert worker.kept_checkpoints(encode(1), "mallory") == frozenset(), "its own oldest went"
    assert worker.kept_checkpoints(encode(MAX_KEPT_PER_COORDINATOR + 10), "mallory") == {"b" * 64}


@pytest.mark.skipif(os.geteuid() != 0, reason="job uids need root")
async def test_without_bubblewrap_the_next_job_gets_another_uid_and_its_own_temp(tmp_path, monkeypatch):
    """Issue 23, finding 2: on a host without bubblewrap (sandbox = auto) job B got job A's
    uid, the lowest free one, and with it A's /tmp/torchinductor_$USER/kernel.py, which
    TorchInductor would run. Now B gets another uid, its temp and caches are in its own
    job directory, and A's stray process (no cgroup to find it by) and what A planted are
    gone when A ends."""
    import subprocess
    import sys
    import tempfile
    import uuid
    from pathlib import Path

    import trio

    from swarmd.compute.host.sandbox import box as boxmod
    from swarmd.compute.host.sandbox.box import Sandbox, Settings
    from swarmd.compute.host.sandbox.uids import pids_of
    from swarmd.compute.torchenv import NodeRole
    from swarmd.compute.host.worker import StartRequest

    monkeypatch.setattr(boxmod.mounts, "detect_bwrap", lambda: "bwrap (bubblewrap) is not installed")
    monkeypatch.setattr(boxmod.cgroups, "detect", lambda: "no cgroup file system here")
    monkeypatch.setattr(boxmod.firewall, "detect", lambda: "nft is not installed")
    jobs = Path(tempfile.mkdtemp(prefix="swarmd-test-tmp-"))  # reachable by the job's uid (tmp_path is 0700)
    jobs.chmod(0o711)
    sb = await Sandbox.start(Settings(mode="auto", uids=(64800, 64899), egress="mesh", egress_allow=(), paths=(),
                                      pids=64, state_dir=tmp_path, jobs_dir=jobs, socket=tmp_path / "s.sock",
                                      name=f"swarmd-t{uuid.uuid4().hex[:8]}"))
    assert sb.parts["namespaces"].startswith("off") and sb.parts["cgroup"].startswith("off")
    w = Worker(ledger=Ledger(1), cache=Cache(tmp_path / "cache"), jobs_dir=jobs, user=None, sandbox=sb)
    tag = uuid.uuid4().hex[:8]
    planted = [Path(f"/tmp/torchinductor_{tag}"), Path(f"/dev/shm/{tag}")]
    show = ('echo uid=$(id -u); for v in TMPDIR TORCHINDUCTOR_CACHE_DIR XDG_CACHE_HOME TRITON_CACHE_DIR; '
            'do eval echo $v=\\$$v; done; touch "$TMPDIR/mine" && echo tmp=writable')
    plant = (f'mkdir /tmp/torchinductor_{tag}; echo "import os" > /tmp/torchinductor_{tag}/kernel.py; '
             f'touch /dev/shm/{tag}; setsid sleep 300 </dev/null >/dev/null 2>&1 & echo stray=$!; ')

    async def run(job: str, script: str) -> dict[str, str]:
        w.reserve(job, "coord", 0, 1, 60.0)
        w.commit(job, "coord")
        role = NodeRole(job_id=job, node_rank=0, nnodes=1, procs_per_node=1, master_addr="127.0.0.1",
                        master_port=29500, ifname=None, gpus=(), node_ips=("127.0.0.1",), checkpoint_dir="")
        seen: dict[str, str] = {}

        async def emit(event) -> None:
            for _, line in event.get("out", ()):
                name, _, value = line.partition("=")
                seen[name] = value

        with trio.fail_after(30):
            assert await w.start(StartRequest(job=job, coordinator="coord", role=role, env={}, python=None,
                                              workdir=None, cmd=("/bin/sh", "-c", script)), emit) == {0: 0}
        return seen

    try:
        a = await run("0123456789aa", plant + show + f"; stat -c planted=%u {' '.join(map(str, planted))}")
        assert a["planted"] == a["uid"], "job A planted them as its uid"
        assert a["stray"] and pids_of(int(a["uid"])) == [], "job A's stray (setsid, no cgroup) was killed at its end"
        assert not [p for p in planted if os.path.lexists(p)], "and what it planted went with it"
        b = await run("0123456789bb", show)
        top = w.job_dir("0123456789bb", "coord")
        assert b["uid"] != a["uid"], "job B never gets the uid that owns what A left in /tmp and /dev/shm"
        assert b == {"uid": b["uid"], "TMPDIR": str(top / "tmp"),
                     "TORCHINDUCTOR_CACHE_DIR": str(top / "tmp" / "torchinductor"),
                     "XDG_CACHE_HOME": str(top / "home" / ".cache"),
                     "TRITON_CACHE_DIR": str(top / "home" / ".triton" / "cache"), "tmp": "writable"}
    finally:
        await sb.close()
        for p in planted:
            subprocess.run(["rm", "-rf", str(p)], check=False)
        subprocess.run(["rm", "-rf", str(jobs)], check=False)


DEEP_TEMP = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
for _ in range(int(sys.argv[2])):  # each level made relative to the last: no path past PATH_MAX
    os.mkdir("d", dir_fd=fd)
    inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    os.close(fd)
    fd = inner
"""


async def _run_ray_rank(tmp_path, monkeypatch, *, depth: int):
    """A Ray job's rank on a host without bwrap (its Ray temp dir in the host's /tmp), which
    fills that dir with a tree `depth` directories deep: (worker, the job's Ray temp dirs left
    in /tmp, what start returned or raised)."""
    import sys
    import tempfile
    from pathlib import Path

    import trio

    from swarmd.compute.host import worker as worker_module
    from swarmd.compute.host.rayhost import TEMP_ROOT, ray_temp_prefix
    from swarmd.compute.torchenv import NodeRole
    from swarmd.compute.host.worker import StartRequest

    jobs = Path(tempfile.mkdtemp(prefix="swarmd-test-raytemp-"))  # reachable by the job user (tmp_path is 0700)
    jobs.chmod(0o711)
    w = Worker(ledger=Ledger(1), cache=Cache(tmp_path / "cache"), jobs_dir=jobs,
               user="nobody" if os.geteuid() == 0 else None)
    prefix = ray_temp_prefix(w.job_dir(JOB, "coord"))
    monkeypatch.setattr(worker_module, "rank_argv", lambda python, launcher, node, driver:
                        [sys.executable, "-c", DEEP_TEMP, node.temp, str(depth)])  # Ray itself is not needed
    w.reserve(JOB, "coord", 0, 1, 60.0)
    w.commit(JOB, "coord")
    role = NodeRole(job_id=JOB, node_rank=0, nnodes=1, procs_per_node=1, master_addr="127.0.0.1",
                    master_port=29500, ifname=None, gpus=(), node_ips=("127.0.0.1",), checkpoint_dir="")
    req = StartRequest(job=JOB, coordinator="coord", role=role, env={}, python=None, workdir=None,
                       cmd=("python", "-c", "pass"), ray="0" * 64)

    async def emit(event) -> None:
        pass

    try:
        with trio.fail_after(60):
            outcome = await w.start(req, emit)
    except Exception as exc:  # noqa: BLE001 - the caller looks at it
        outcome = exc
    finally:
        deep_trees.remove(jobs)
    return w, sorted(Path(TEMP_ROOT).glob(prefix + "*")), outcome


async def test_a_ray_jobs_deep_temp_tree_is_removed_and_its_slot_freed(tmp_path, monkeypatch):
    """Issue 23, finding 5: shutil.rmtree of the job's Ray temp dir raised RecursionError
    in the `finally` of start, before the ledger's finish: the slot and GPUs stayed held."""
    w, temp, outcome = await _run_ray_rank(tmp_path, monkeypatch, depth=deep_trees.DEEP)
    try:
        assert outcome == {0: 0}
        assert temp == [], "removed at any depth"
        assert w.ledger.state_of(JOB, "coord") is None and w.ledger.slots_free == 1, "the slot is free again"
        assert not w.running and not w.ray_ports.held
    finally:
        for left in temp:
            deep_trees.remove(left)


async def test_a_clean_up_step_that_fails_skips_none_of_the_others(tmp_path, monkeypatch):
    import structlog

    from swarmd.compute import trees
    from swarmd.compute.forward import Forwards

    remove = trees.remove

    def cannot(path):
        if path.name.startswith("swarmd-ray-") and path.exists():  # made, and used: the end's removal
            raise trees.TreeError("rm: cannot remove: Operation not permitted")
        remove(path)

    monkeypatch.setattr(trees, "remove", cannot)
    monkeypatch.setattr(Forwards, "ended", lambda self, key: 1 / 0)
    with structlog.testing.capture_logs() as logs:
        w, temp, outcome = await _run_ray_rank(tmp_path, monkeypatch, depth=3)
    try:
        assert outcome == {0: 0}
        assert [(e["step"], e["error"]) for e in logs if e.get("step")] == [
            ("end the forwards", "ZeroDivisionError: division by zero"),
            ("remove the Ray temp dir", "TreeError: rm: cannot remove: Operation not permitted")]
        assert w.ledger.state_of(JOB, "coord") is None and not w.running and not w.ray_ports.held
        assert ("coord", JOB) in w.lingering, "the steps after each failure ran"
    finally:
        for left in temp:
            deep_trees.remove(left)


async def test_replicas_started_at_once_get_ports_of_their_own(tmp_path):
    """Two replicas set up at the same moment on one host (an autoscaler adding two at once)
    never get one port: a port is the replica's from the moment it is chosen."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import trio

    from swarmd.compute.host.worker import StartRequest
    from swarmd.compute.spec import Serve
    from swarmd.compute.torchenv import NodeRole

    jobs = Path(tempfile.mkdtemp(prefix="swarmd-test-ports-"))
    jobs.chmod(0o711)
    w = Worker(ledger=Ledger(2), cache=Cache(tmp_path / "cache"), jobs_dir=jobs,
               user="nobody" if os.geteuid() == 0 else None, serve_ports=(30200, 30209))
    ports: dict[str, str] = {}

    async def one(job: str, index: int) -> None:
        w.reserve(job, "coord", 0, 1, 60.0)
        w.commit(job, "coord")
        role = NodeRole(job_id=job, node_rank=0, nnodes=1, procs_per_node=1, master_addr="127.0.0.1",
                        master_port=29500, ifname=None, gpus=(), node_ips=("127.0.0.1",), checkpoint_dir="")

        async def emit(event) -> None:
            for _, line in event.get("out", ()):
                ports[job] = line

        await w.start(StartRequest(job=job, coordinator="coord", role=role, env={}, python=None, workdir=None,
                                   cmd=(sys.executable, "-c", "import os; print(os.environ['PORT'])"),
                                   serve=Serve(service="embed", replica=index)), emit)

    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, "0123456789aa", 0)
                nursery.start_soon(one, "0123456789bb", 1)
    finally:
        subprocess.run(["rm", "-rf", str(jobs)], check=False)
    assert len(ports) == 2 and len(set(ports.values())) == 2, ports
    assert not w.serving and not w.serve_held, "both ports given back once the replicas ended"
