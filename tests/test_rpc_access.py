"""Who may do what through the control socket, against a real daemon and real callers of
other uids (forked children that drop to them; root only): a job belongs to the uid that
submitted it, members of the daemon's group run and manage their own jobs, swarm
administration needs root or the daemon's user, anyone else who reaches the socket reads."""

from __future__ import annotations

import grp
import os
import pickle
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import root_only, wait_until
from swarmd.rpc.client import Client, DaemonUnreachable, RemoteError
from swarmd.rpc.protocol import ErrorCode

pytestmark = root_only()

MEMBER, OTHER_MEMBER, OUTSIDER = 61000, 61001, 65534  # two members of the group; nobody
SLEEP = {"cmd": ["sleep", "600"]}


def _group() -> grp.struct_group:
    """An existing group to serve as the daemon's (the test adds no group to the host)."""
    by_name = {g.gr_name: g for g in grp.getgrall()}
    return by_name.get("users") or next(g for g in grp.getgrall() if g.gr_gid != 0)


def as_user(d, uid: int, groups: list[int], method: str, stream: bool = False, **params) -> tuple:
    """Call `method` as `uid` with supplementary `groups`, from a forked child:
    ("ok", result), ("refused", code, message) or ("unreachable", message)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.setgroups(groups)
            os.setgid(uid)
            os.setuid(uid)
            with Client(str(d.socket), timeout=10) as c:
                out: tuple = ("ok", list(c.stream(method, **params)) if stream else c.call(method, **params))
        except RemoteError as exc:
            out = ("refused", exc.code, exc.message)
        except DaemonUnreachable as exc:
            out = ("unreachable", str(exc))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = ("error", f"{type(exc).__name__}: {exc}")
        os.write(write, pickle.dumps(out))
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return pickle.loads(data)


def let_others_reach(path: Path) -> None:
    """Other uids may pass through pytest's 0700 directories to ``path`` (searched, not listed),
    every one of them up to the system's temporary directory (xdist's workers nest one more)."""
    top = Path(tempfile.gettempdir()).resolve()
    for parent in path.resolve().parents:
        if parent == top or top not in parent.parents:
            break
        parent.chmod(parent.stat().st_mode | 0o001)


def group_daemon(make_daemon) -> tuple:
    """A daemon in a swarm of its own whose socket group is an existing group (`d.gid`), running
    jobs as a job user in a fresh jobs directory (returned too: the caller removes it)."""
    from sim.netlab.lab import job_user

    group = _group()
    jobs_dir = Path(tempfile.mkdtemp(prefix="swarmd-test-jobs-"))
    jobs_dir.chmod(0o711)
    d = make_daemon(args=["--jobs-dir", str(jobs_dir), "--job-user", job_user(), "--socket-group", group.gr_name])
    let_others_reach(d.socket)
    d.call("swarm.init")
    wait_until(lambda: d.call("status").get("record"), 10, "the node's own record")
    d.gid = group.gr_gid
    return d, jobs_dir


@pytest.fixture
def node(make_daemon):
    d, jobs_dir = group_daemon(make_daemon)
    yield d
    for job in d.call("jobs.ls")["jobs"]:
        d.call("jobs.cancel", id=job["id"])
    subprocess.run(["rm", "-rf", str(jobs_dir)], check=False)


def submit(d, uid: int | None = None) -> str:
    if uid is None:
        return d.call("jobs.run", spec=SLEEP, detach=True)["submitted"]
    outcome = as_user(d, uid, [d.gid], "jobs.run", spec=SLEEP, detach=True)
    assert outcome[0] == "ok", outcome
    return outcome[1]["submitted"]


def listed(d, uid: int) -> list[str]:
    outcome = as_user(d, uid, [d.gid], "jobs.ls")
    assert outcome[0] == "ok", outcome
    return [j["id"] for j in outcome[1]["jobs"]]


def test_members_see_and_manage_only_their_own_jobs(node):
    mine, roots = submit(node, MEMBER), submit(node)
    wait_until(lambda: node.call("jobs.show", id=mine)["state"] == "running", 60, "the member's job running")

    assert listed(node, MEMBER) == [mine]
    assert listed(node, OTHER_MEMBER) == []
    assert [j["id"] for j in node.call("jobs.ls")["jobs"]] == [roots, mine], "root sees every job"

    for method, stream in (("jobs.show", False), ("jobs.logs", True), ("jobs.cancel", False)):
        outcome = as_user(node, OTHER_MEMBER, [node.gid], method, stream=stream, id=mine)
        assert outcome[:2] == ("refused", ErrorCode.PERMISSION_DENIED), outcome
        assert outcome[2].startswith(f"{method}: job {mine} belongs to uid {MEMBER}; uid {OTHER_MEMBER} may act "
                                     "only on its own jobs"), outcome
        outcome = as_user(node, MEMBER, [node.gid], method, stream=stream, id=roots)
        assert outcome[:2] == ("refused", ErrorCode.PERMISSION_DENIED), outcome
        assert f"job {roots} belongs to uid 0" in outcome[2]
        outcome = as_user(node, OTHER_MEMBER, [node.gid], method, stream=stream, id=mine[:8])
        assert outcome == ("refused", ErrorCode.OPERATION_FAILED, f"{method}: no job {mine[:8]!r}"), \
            "a prefix looks among the caller's own jobs only"
    assert as_user(node, MEMBER, [node.gid], "jobs.show", id=mine[:8])[1]["id"] == mine, \
        "another user's job with the same prefix does not make it ambiguous"
    assert node.call("jobs.show", id=mine)["state"] == "running", "the refused cancel changed nothing"

    assert as_user(node, MEMBER, [node.gid], "jobs.show", id=mine)[1]["state"] == "running"
    assert as_user(node, MEMBER, [node.gid], "jobs.logs", stream=True, id=mine)[0] == "ok"
    assert as_user(node, MEMBER, [node.gid], "jobs.cancel", id=mine)[1]["id"] == mine
    wait_until(lambda: node.call("jobs.show", id=mine)["state"] == "cancelled", 20, "the member's job cancelled")

    wait_until(lambda: node.call("status")["jobs"]["slots_free"], 20, "the cancelled job's slot back")
    # placement reads this node's record, which follows the ledger within publish_interval: wait for it
    outcome = as_user(node, OTHER_MEMBER, [node.gid], "jobs.run", spec=SLEEP | {"wait": "30s"}, detach=True)
    assert outcome[0] == "ok", outcome
    other = outcome[1]["submitted"]
    wait_until(lambda: node.call("jobs.show", id=other)["state"] == "running", 60, "the other member's job running")
    assert node.call("jobs.cancel", id=other)["id"] == other, "root may cancel anyone's job"
    wait_until(lambda: node.call("jobs.show", id=other)["state"] == "cancelled", 20, "the other member's job cancelled")


@pytest.mark.parametrize("method, params", [
    ("log.level", {"level": "debug"}),
    ("swarm.invite", {}),
    ("swarm.init", {}),
    ("swarm.join", {"token": "x"}),
    ("labels.set", {"labels": {"a": "b"}}),
    ("labels.rm", {"keys": ["a"]}),
    ("mesh.rotate-key", {}),
])
def test_swarm_administration_needs_root_or_the_daemons_user(node, method, params):
    outcome = as_user(node, MEMBER, [node.gid], method, **params)
    assert outcome == ("refused", ErrorCode.PERMISSION_DENIED,
                       f"{method}: refused: it needs root or the daemon's user; uid {MEMBER} may run jobs and "
                       "manage only its own"), outcome
    status = node.call("status")
    assert status["log_level"] == "info" and status["record"]["labels"] == {}


def test_members_read_status_and_peers_and_root_administers(node):
    for method in ("status", "peers", "version", "jobs.ls"):
        assert as_user(node, MEMBER, [node.gid], method)[0] == "ok", method
    assert node.call("swarm.invite")["token"]
    assert node.call("log.level", level="debug")["previous"] == "info"


def test_a_user_outside_the_group_cannot_connect_and_only_reads_when_let_in(node):
    outcome = as_user(node, OUTSIDER, [], "status")
    assert outcome[0] == "unreachable" and "permission denied" in outcome[1], outcome

    os.chmod(node.socket, 0o666)  # an admin loosened the socket: reading is all it gives
    assert as_user(node, OUTSIDER, [], "status")[1]["peer_id"] == node.call("status")["peer_id"]
    for method, params in (("jobs.run", {"spec": SLEEP}), ("jobs.ls", {}), ("log.level", {"level": "debug"})):
        outcome = as_user(node, OUTSIDER, [], method, **params)
        assert outcome[:2] == ("refused", ErrorCode.PERMISSION_DENIED), outcome
        assert f"uid {OUTSIDER} may only read this node's status" in outcome[2]
    assert "a member of the daemon's group" in as_user(node, OUTSIDER, [], "jobs.run", spec=SLEEP)[2]
    assert node.call("jobs.ls")["jobs"] == []


def test_a_member_cannot_spoil_anothers_upload(node):
    import hashlib
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("job.py")
        payload = b"print('hello')\n" * 2000
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    data = buf.getvalue()
    digest, half = hashlib.sha256(data).hexdigest(), len(data) // 2
    upload = dict(digest=digest, size=len(data))
    assert as_user(node, MEMBER, [node.gid], "jobs.upload", offset=0, data=data[:half], **upload)[1]["have"] is False
    outcome = as_user(node, OTHER_MEMBER, [node.gid], "jobs.upload", offset=half, data=b"x" * (len(data) - half), **upload)
    assert outcome[:2] == ("refused", ErrorCode.INVALID_PARAMS) and "does not follow the 0 bytes" in outcome[2], \
        "each user uploads into its own part"
    assert as_user(node, MEMBER, [node.gid], "jobs.upload", offset=half, data=data[half:], **upload)[1] == {"have": True}


def test_a_member_starting_many_uploads_keeps_at_most_a_few_parts(node):
    """Finding 14: a group user starts uploads of 64 MiB under many digests and never ends
    them: only its newest MAX_PARTS_PER_UID parts stay on disk, another user's part is not
    touched, and a whole upload still lands."""
    import hashlib
    import io
    import tarfile

    from swarmd.compute.api import MAX_PARTS_PER_UID

    other = dict(digest="f" * 64, size=64 * 1024 * 1024)
    assert as_user(node, OTHER_MEMBER, [node.gid], "jobs.upload", offset=0, data=b"x" * 1024, **other)[1]["have"] is False
    for i in range(MAX_PARTS_PER_UID + 3):
        upload = dict(digest=f"{i:x}" * 64, size=64 * 1024 * 1024)
        outcome = as_user(node, MEMBER, [node.gid], "jobs.upload", offset=0, data=b"x" * 1024, **upload)
        assert outcome[1]["have"] is False, outcome
    parts = sorted(p.name for p in (node.state_dir / "archives").glob("*.part"))
    assert len([p for p in parts if p.endswith(f".{MEMBER}.part")]) == MAX_PARTS_PER_UID
    assert f"{'f' * 64}.{OTHER_MEMBER}.part" in parts, "another user's upload is untouched"
    assert f"{'6' * 64}.{MEMBER}.part" in parts and f"{'0' * 64}.{MEMBER}.part" not in parts, "the oldest went"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("job.py")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"1+1"))
    data = buf.getvalue()
    upload = dict(digest=hashlib.sha256(data).hexdigest(), size=len(data))
    assert as_user(node, MEMBER, [node.gid], "jobs.upload", offset=0, data=data, **upload)[1] == {"have": True}
