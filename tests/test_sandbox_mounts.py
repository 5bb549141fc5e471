"""mounts.py: a process started through the argv it builds sees and does only what a job
may. Real bubblewrap and setpriv (root): each test runs a small Python program inside and
asserts what it found."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import swarmd
import swarmd.train
from swarmd.compute.host.sandbox import mounts

UID = GID = 64999  # a job uid for these tests (nothing here depends on who else has it)
REPO = Path(__file__).resolve().parents[1]
BWRAP = shutil.which("bwrap")
SETPRIV = shutil.which("setpriv")

real = pytest.mark.skipif(os.geteuid() != 0 or BWRAP is None or SETPRIV is None,
                          reason="needs root, bubblewrap and setpriv")


@dataclass
class Layout:
    """A daemon's directories outside /tmp (the box's /tmp is private, so a directory under
    the host's /tmp would be invisible whether hidden or not)."""

    root: Path
    state: Path  # hidden: the daemon's state
    jobs: Path  # hidden: every job's directory
    top: Path  # this job's directory, under jobs
    other: Path  # another job's directory
    lib: Path  # hidden, like /var/lib
    dataset: Path  # exposed, under lib

    def argv(self, *, hide=None, expose=(), devices=(), uid=UID, gid=GID, interpreter=True, **kw) -> list[str]:
        # the interpreter stays reachable, as the daemon's box keeps it (a checkout under /tmp)
        return mounts.bwrap_argv(bwrap=BWRAP, top=self.top, cwd=self.top,
                                 hide=[self.state, self.jobs, self.lib] if hide is None else hide,
                                 expose=[*expose, *(mounts.interpreter_paths() if interpreter else ())],
                                 devices=devices, uid=uid, gid=gid, setpriv=SETPRIV, **kw)


@pytest.fixture
def layout() -> Iterator[Layout]:
    # beside the checkout, unless that is under /tmp, which the box replaces with its own
    base = REPO if not REPO.resolve().is_relative_to("/tmp") else Path("/var/local")
    root = Path(tempfile.mkdtemp(prefix=".sandbox-test-", dir=base))
    root.chmod(0o755)  # as a daemon's state and jobs directories' parents are
    try:
        lay = Layout(root=root, state=root / "state", jobs=root / "jobs", top=root / "jobs" / "a",
                     other=root / "jobs" / "b", lib=root / "lib", dataset=root / "lib" / "dataset")
        for d in (lay.state, lay.top, lay.other, lay.dataset):
            d.mkdir(parents=True)
        (lay.state / "identity.key").write_text("secret key")
        (lay.other / "checkpoint").write_text("another job's checkpoint")
        (lay.lib / "private").write_text("host service state")
        (lay.dataset / "train.txt").write_text("data")
        os.chown(lay.top, UID, GID)
        lay.top.chmod(0o700)
        os.chown(lay.dataset, UID, GID)  # writable by the job but for the read-only bind
        yield lay
    finally:
        shutil.rmtree(root)


ATTEMPT = """
import errno
def attempt(f, *a):
    try:
        f(*a)
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]
"""


def inside(argv: list[str], code: str) -> dict:
    """Run `code` with the daemon's interpreter through `argv`; it sets `out` (a dict)."""
    program = "\n".join(["import json, os, sys", "out = {}", ATTEMPT, textwrap.dedent(code), "print(json.dumps(out))"])
    done = subprocess.run([*argv, sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@real
def test_hidden_directories_are_empty_and_other_jobs_invisible(layout):
    out = inside(layout.argv(), f"""
        out["state"] = os.listdir({str(layout.state)!r})
        out["jobs"] = os.listdir({str(layout.jobs)!r})
        out["lib"] = os.listdir({str(layout.lib)!r})
        out["other"] = os.path.exists({str(layout.other / "checkpoint")!r})
    """)
    assert out == {"state": [], "jobs": ["a"], "lib": [], "other": False}


@real
def test_the_job_writes_its_own_directory_and_nothing_of_the_host(layout):
    out = inside(layout.argv(), f"""
        out["cwd"] = os.getcwd()
        out["top"] = attempt(lambda: open("result.txt", "w").write("done"))
        out["usr"] = attempt(lambda: open("/usr/swarmd-probe", "w"))
        out["etc"] = attempt(lambda: open("/etc/swarmd-probe", "w"))
        out["repo"] = attempt(lambda: open({str(REPO / "swarmd-probe")!r}, "w"))
    """)
    assert out["cwd"] == str(layout.top)
    assert out["top"] == "ok"
    assert (layout.top / "result.txt").read_text() == "done"
    assert (layout.top / "result.txt").stat().st_uid == UID
    assert out["usr"] == out["etc"] == "EROFS"
    assert out["repo"] in ("EROFS", "EACCES")  # EACCES: a checkout under /tmp, only its venv bound in


@real
def test_read_only_even_for_a_uid_0_without_capabilities(layout):
    """The host is read-only by the mount, not only by permissions: root's own files
    cannot be written by a process that still has uid 0."""
    out = inside(layout.argv(uid=0, gid=0), """
        out["usr"] = attempt(lambda: open("/usr/swarmd-probe", "w"))
    """)
    assert out["usr"] == "EROFS"
    assert not Path("/usr/swarmd-probe").exists()


@real
def test_a_daemon_whose_directories_are_under_tmp(tmp_path):
    """The lab's daemons keep state and jobs under /tmp, which the box replaces: the job's
    directory is still there and writable, its parents traversable, the rest absent."""
    top = tmp_path / "jobs" / "a"
    top.mkdir(parents=True)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "identity.key").write_text("secret")
    os.chown(top, UID, GID)
    argv = mounts.bwrap_argv(bwrap=BWRAP, top=top, cwd=top, hide=[tmp_path / "state", tmp_path / "jobs"],
                             expose=mounts.interpreter_paths(), devices=[], uid=UID, gid=GID, setpriv=SETPRIV)
    out = inside(argv, f"""
        out["write"] = attempt(lambda: open("out", "w").write("x"))
        out["state"] = os.path.exists({str(tmp_path / "state")!r})
        out["jobs"] = os.listdir({str(tmp_path / "jobs")!r})
    """)
    assert out == {"write": "ok", "state": False, "jobs": ["a"]}
    assert (top / "out").read_text() == "x"


def test_hiding_the_root_is_refused():
    with pytest.raises(ValueError, match="cannot hide /"):
        mounts.bwrap_argv(bwrap="bwrap", top=Path("/nonexistent/a"), cwd=Path("/nonexistent/a"), hide=[Path("/")],
                          expose=[], devices=[], uid=61184, gid=61184, setpriv="setpriv")


@real
def test_tmp_is_private_and_writable(layout, tmp_path):
    marker = tmp_path / "host-marker"
    marker.write_text("host")
    name = f"/tmp/swarmd-box-{os.getpid()}"
    out = inside(layout.argv(), f"""
        out["tmp"] = attempt(lambda: open({name!r}, "w").write("job"))
        out["var_tmp"] = attempt(lambda: open("/var/tmp/x", "w").write("job"))
        out["shm"] = attempt(lambda: open("/dev/shm/x", "w").write("job"))
        out["host_marker"] = os.path.exists({str(marker)!r})
        out["tmp_list"] = os.listdir("/tmp")
    """)
    venv_in_tmp = [Path(sys.prefix).relative_to("/tmp").parts[0]] if Path(sys.prefix).is_relative_to("/tmp") else []
    assert {**out, "tmp_list": sorted(out["tmp_list"])} == {
        "tmp": "ok", "var_tmp": "ok", "shm": "ok", "host_marker": False,
        "tmp_list": sorted([name.removeprefix("/tmp/"), *venv_in_tmp])}  # and the way to the interpreter
    assert not Path(name).exists()


@real
def test_ranks_given_one_shm_directory_share_it(layout, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    os.chown(shm, UID, GID)
    first = inside(layout.argv(shm=shm), """
        open("/dev/shm/nccl-seg", "w").write("from rank 0")
        out["mode"] = oct(os.stat("/dev/shm").st_mode & 0o7777)
    """)
    second = inside(layout.argv(shm=shm), """
        out["seen"] = open("/dev/shm/nccl-seg").read()
    """)
    alone = inside(layout.argv(), """
        out["seen"] = os.listdir("/dev/shm")
    """)
    assert first == {"mode": "0o700"}
    assert second == {"seen": "from rank 0"}
    assert alone == {"seen": []}
    assert (shm / "nccl-seg").stat().st_uid == UID


@real
def test_only_its_own_processes_in_proc(layout):
    out = inside(layout.argv(), """
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
        out["commands"] = sorted(open(f"/proc/{p}/cmdline", "rb").read().split(b"\\0")[0].decode() for p in pids)
        out["pid"] = os.getpid()
    """)
    assert out["pid"] < 10  # pid 1 is bubblewrap's init in the new namespace
    assert {Path(c).name for c in out["commands"]} <= {Path(BWRAP).name, Path(sys.executable).name}
    assert len(out["commands"]) <= 3  # bwrap, its init, this python


@real
def test_runs_as_the_job_uid_with_no_capabilities_and_no_new_privileges(layout):
    out = inside(layout.argv(), """
        out["ids"] = [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), os.getgroups()]
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
        out["status"] = {k: status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs")}
    """)
    assert out["ids"] == [UID, UID, GID, GID, []]
    assert out["status"] == {"CapInh": "0" * 16, "CapPrm": "0" * 16, "CapEff": "0" * 16, "CapBnd": "0" * 16,
                             "CapAmb": "0" * 16, "NoNewPrivs": "1"}


@real
def test_an_exposed_path_under_a_hidden_one_is_visible_read_only(layout):
    out = inside(layout.argv(expose=[layout.dataset]), f"""
        out["lib"] = sorted(os.listdir({str(layout.lib)!r}))
        out["data"] = open({str(layout.dataset / "train.txt")!r}).read()
        out["write"] = attempt(lambda: open({str(layout.dataset / "new")!r}, "w"))
    """)
    assert out == {"lib": ["dataset"], "data": "data", "write": "EROFS"}


@real
def test_exposing_a_parent_of_a_hidden_path_does_not_uncover_it(layout):
    out = inside(layout.argv(expose=[layout.root, layout.state]), f"""
        out["state"] = os.listdir({str(layout.state)!r})
        out["other"] = os.path.exists({str(layout.other)!r})
    """)
    assert out == {"state": [], "other": False}


@real
def test_a_hidden_path_inside_an_exposed_one_stays_hidden(layout):
    secret = layout.dataset / "secret"
    secret.mkdir()
    (secret / "key").write_text("k")
    out = inside(layout.argv(hide=[layout.jobs, layout.lib, secret], expose=[layout.dataset]), f"""
        out["dataset"] = sorted(os.listdir({str(layout.dataset)!r}))
        out["secret"] = os.listdir({str(secret)!r})
    """)
    assert out == {"dataset": ["secret", "train.txt"], "secret": []}


@real
def test_only_the_listed_devices_exist(layout, tmp_path):
    given, withheld = tmp_path / "nvidia0", tmp_path / "nvidia1"
    os.mknod(given, 0o666 | stat.S_IFCHR, os.makedev(195, 0))
    os.mknod(withheld, 0o666 | stat.S_IFCHR, os.makedev(195, 1))
    out = inside(layout.argv(devices=[given]), f"""
        import stat
        st = os.stat({str(given)!r})
        out["given"] = [stat.S_ISCHR(st.st_mode), os.major(st.st_rdev), os.minor(st.st_rdev)]
        out["withheld"] = os.path.exists({str(withheld)!r})
        out["dev"] = sorted(os.listdir("/dev"))
    """)
    assert out["given"] == [True, 195, 0]
    assert out["withheld"] is False
    basics = {"core", "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty",
              "urandom", "zero"}
    assert set(out["dev"]) <= basics, set(out["dev"]) - basics  # no disk, kmsg, kvm, other GPU


@real
def test_resolv_conf_stays_readable(layout):
    out = inside(layout.argv(), """
        out["resolv"] = open("/etc/resolv.conf").read()
    """)
    assert out["resolv"] == Path("/etc/resolv.conf").read_text()


@real
def test_a_resolv_conf_linked_into_a_hidden_directory_is_exposed(layout):
    """systemd-resolved: /etc/resolv.conf -> /run/systemd/resolve/stub-resolv.conf, and
    /run is hidden."""
    run = layout.root / "run"
    (run / "resolve").mkdir(parents=True)
    (run / "resolve" / "stub-resolv.conf").write_text("nameserver 127.0.0.53\n")
    (run / "resolve" / "io.systemd.Resolve").write_text("a socket")
    link = layout.root / "resolv.conf"
    link.symlink_to(run / "resolve" / "stub-resolv.conf")
    out = inside(layout.argv(hide=[layout.jobs, run], resolv_conf=link), f"""
        out["resolv"] = open({str(link)!r}).read()
        out["run"] = os.listdir({str(run / "resolve")!r})
    """)
    assert out == {"resolv": "nameserver 127.0.0.53\n", "run": ["stub-resolv.conf"]}


@real
def test_the_interpreter_stays_reachable_when_its_directory_is_hidden(layout):
    venv = Path(sys.prefix)
    if sys.prefix == sys.base_prefix or venv.parent == Path("/"):
        pytest.skip("needs the tests to run in a venv below /")
    hide = [layout.jobs, venv.parent]
    done = subprocess.run([*layout.argv(hide=hide, interpreter=False), sys.executable, "-c", "pass"],
                          capture_output=True, timeout=60)
    assert done.returncode != 0  # hidden: there is no python to run
    out = inside(layout.argv(hide=hide, expose=mounts.interpreter_paths()), """
        out["prefix"] = sys.prefix
        out["siblings"] = os.listdir(os.path.dirname(sys.prefix))
    """)
    assert out["prefix"] == sys.prefix
    beside = {layout.root.name} if layout.root.parent == venv.parent else set()
    package = Path(swarmd.__file__).resolve().parent  # the jobs' library, in a checkout's editable install
    beside |= {package.name} if package.parent == venv.parent else set()
    assert set(out["siblings"]) == {venv.name, *beside}  # the rest of its directory stays hidden


@real
def test_exit_status_reaches_the_caller(layout):
    done = subprocess.run([*layout.argv(), sys.executable, "-c", "import sys; sys.exit(3)"], timeout=60)
    assert done.returncode == 3


@real
def test_the_rank_outlives_the_thread_that_started_it(layout):
    """trio starts processes from a worker thread that exits after 10 s idle; a rank must not
    die with it (bubblewrap's --die-with-parent is tied to that thread: every rank was
    SIGKILLed ten seconds in)."""
    started = {}

    def spawn():
        started["tid"] = threading.get_native_id()
        started["proc"] = subprocess.Popen(
            [*layout.argv(), sys.executable, "-c", "print('ready', flush=True); input(); print('alive')"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert started["proc"].stdout.readline() == "ready\n"  # running: bubblewrap set itself up long ago

    thread = threading.Thread(target=spawn)
    thread.start()
    thread.join()
    task = Path(f"/proc/self/task/{started['tid']}")
    deadline = time.monotonic() + 30
    while task.exists():  # the kernel's end of the thread, after join() returns
        assert time.monotonic() < deadline, "the spawning thread never ended"
        time.sleep(0.01)
    out, _ = started["proc"].communicate("go\n", timeout=60)
    assert (started["proc"].returncode, out) == (0, "alive\n")


@real
def test_setpriv_alone_drops_to_the_uid_with_no_capabilities():
    program = ("import os; s = dict(l.split(':', 1) for l in open('/proc/self/status'));"
               "print(os.getuid(), os.getgid(), os.getgroups(), s['CapEff'].strip(), s['NoNewPrivs'].strip())")
    done = subprocess.run([*mounts.setpriv_argv(SETPRIV, UID, GID), sys.executable, "-c", program],
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == [str(UID), str(GID), "[]", "0" * 16, "1"]


def test_mounts_are_ordered_parents_first_and_the_job_directory_last():
    jobs = Path("/nonexistent-swarmd/jobs")
    argv = mounts.bwrap_argv(bwrap="bwrap", top=jobs / "a", cwd=jobs / "a" / "work", hide=[jobs],
                             expose=[], devices=[], uid=61184, gid=61184, setpriv="setpriv")
    assert argv[:8] == ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    tmp = argv.index("/tmp")
    assert argv[tmp - 3:tmp + 1] == ["--perms", "1777", "--tmpfs", "/tmp"]
    assert argv.index("--bind") > tmp
    assert argv[argv.index("--bind"):argv.index("--bind") + 3] == ["--bind", str(jobs / "a"), str(jobs / "a")]
    assert argv[argv.index("--chdir") + 1] == str(jobs / "a" / "work")
    assert "--tmpfs" not in argv[argv.index("--chdir"):]
    assert argv[-12:] == ["setpriv", "--reuid", "61184", "--regid", "61184", "--clear-groups", "--bounding-set",
                          "-all", "--inh-caps", "-all", "--no-new-privs", "--"]


def test_interpreter_paths_name_the_venv_and_its_base_and_the_swarmd_package():
    paths = mounts.interpreter_paths()
    assert Path(sys.prefix) in paths
    assert any(Path(os.path.realpath(sys.executable)).is_relative_to(p) for p in paths)
    assert any(Path(swarmd.train.__file__).resolve().is_relative_to(p) for p in paths), "ranks import swarmd.train"
    assert Path(swarmd.__file__).resolve().parent.parent not in paths, "not the whole checkout"


@real
def test_detect_bwrap_finds_a_working_one():
    assert mounts.detect_bwrap() == BWRAP


def test_detect_bwrap_says_why_not(tmp_path):
    assert mounts.detect_bwrap("swarmd-no-such-bwrap") == "swarmd-no-such-bwrap (bubblewrap) is not installed"
    broken = tmp_path / "bwrap"
    broken.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    broken.chmod(0o755)
    why = mounts.detect_bwrap(str(broken))
    if os.geteuid() == 0:
        assert why == f"{broken} cannot create namespaces here (exit 1): bwrap: No permissions to creating new namespace"
    else:
        assert "not root" in why

