"""cgroups.py: real v1 cgroups where this host has them (root), v2 logic against a fake
cgroupfs tree. Each test nests its own uniquely named parent under our cgroup and removes
it at the end, pass or fail, so parallel runs and lab daemons never meet."""

from __future__ import annotations

import errno
import os
import secrets
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import wait_until
from swarmd.compute.host.sandbox import cgroups
from swarmd.compute.host.sandbox.cgroups import CgroupError, Limits, Usage

# the join line the worker puts before a rank's command (box.JOIN_CGROUP): sh writes its own
# pid into each file, then execs the command, so nothing it starts is ever outside
JOIN = 'for f; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; shift; done; shift; exec "$@"'
NO_LIMITS = Limits(memory=None, cpus=None, pids=None, devices=None)
MiB = 1 << 20


def start(cg: cgroups.JobCgroup, *argv: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(["/bin/sh", "-c", JOIN, "sh", *map(str, cg.procs_files), "--", *argv], **kw)


def run(cg: cgroups.JobCgroup, script: str, timeout: float = 60) -> tuple[int, str]:
    p = start(cg, sys.executable, "-c", script, stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


def execed(p: subprocess.Popen, command: str) -> bool:
    """The join line has run to its end: it has joined every hierarchy and exec'd `command`."""
    try:
        return Path(f"/proc/{p.pid}/comm").read_text().strip() == command
    except FileNotFoundError:
        return False


def gone_or_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture
def v1():
    found = cgroups.detect()
    if isinstance(found, str) or found.version != 1:
        pytest.skip(f"needs cgroup v1 as root: {found if isinstance(found, str) else found.describe()}")
    name = f"swarmd-test-{os.getpid()}-{secrets.token_hex(4)}"
    found.parent(name)
    try:
        yield found, name
    finally:
        found.discard(name)
        assert not any((d / name).exists() for d in found.own.values())


# --- real v1 ---------------------------------------------------------------------------------

def test_memory_limit_kills_an_allocation_past_it_and_counts_the_oom_kill(v1):
    h, name = v1
    cg = h.create(name, "mem", Limits(memory=64 * MiB, cpus=None, pids=None, devices=None))
    code, out = run(cg, "b = b'x' * (200 << 20); print('survived')")
    assert code == -9 and "survived" not in out
    assert cg.usage().oom_kills == 1


def test_pids_limit_stops_a_fork_bomb(v1):
    h, name = v1
    cg = h.create(name, "bomb", Limits(memory=None, cpus=None, pids=20, devices=None))
    code, out = run(cg, """
import os, time
made = 0
for _ in range(200):
    try:
        pid = os.fork()
    except BlockingIOError:
        break
    if pid == 0:
        os.close(1)  # the test reads stdout to its end
        time.sleep(60)
        os._exit(0)
    made += 1
print(made, flush=True)
""")
    assert code == 0 and int(out) < 20
    assert 0 < len(cg.pids()) <= 20  # the children outlived their parent, inside the cgroup
    cg.kill()
    assert cg.pids() == set()


def test_kill_ends_a_setsid_double_forked_process(v1):
    h, name = v1
    cg = h.create(name, "escape", NO_LIMITS)
    p = start(cg, "/bin/sh", "-c", "setsid /bin/sh -c 'sleep 1000 </dev/null >/dev/null 2>&1 & echo $!' & wait",
              stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=10)
    sleeper = int(out)
    assert p.returncode == 0 and sleeper in cg.pids()  # its job's process is gone; it is not
    assert os.getsid(sleeper) != os.getsid(0)  # a session of its own, its parent gone: double forked
    cg.kill()
    assert cg.pids() == set()
    wait_until(lambda: gone_or_zombie(sleeper), 5, "the setsid'd sleep to die")


def test_kill_ends_a_fork_bomb_that_is_still_forking(v1):
    h, name = v1
    cg = h.create(name, "storm", Limits(memory=None, cpus=None, pids=30, devices=None))
    p = start(cg, sys.executable, "-c", """
import os
while True:
    try:
        if os.fork() == 0:
            continue  # every child forks too
    except BlockingIOError:
        pass
""", stdout=subprocess.DEVNULL)
    wait_until(lambda: len(cg.pids()) >= 20, 10, "the bomb to fill its pids limit")
    cg.kill()
    assert cg.pids() == set()
    assert p.wait(timeout=10) == -9


def test_kill_on_an_empty_or_removed_cgroup_is_a_no_op(v1):
    h, name = v1
    cg = h.create(name, "empty", NO_LIMITS)
    cg.kill()
    cg.remove()
    cg.kill()
    cg.remove()
    assert not any(d.exists() for d in cg.dirs)


def test_usage_reports_peak_memory_and_cpu_time(v1):
    h, name = v1
    cg = h.create(name, "use", Limits(memory=256 * MiB, cpus=None, pids=None, devices=None))
    code, _ = run(cg, """
import time
b = b'x' * (50 << 20)
while time.process_time() < 0.3:
    pass
""")
    assert code == 0
    use = cg.usage()
    assert 50 * MiB <= use.peak_memory < 256 * MiB
    assert 0.3 <= use.cpu_seconds < 10
    assert use.oom_kills == 0


def test_cpu_quota_caps_cpu_time(v1):
    h, name = v1
    cg = h.create(name, "cpu", Limits(memory=None, cpus=0.2, pids=None, devices=None))
    assert (cg.by["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "20000"
    code, _ = run(cg, """
import time
t = time.monotonic()
while time.monotonic() - t < 1.0:
    pass
""")
    assert code == 0
    assert cg.usage().cpu_seconds < 0.5  # 0.2 s per wall second, plus a period's burst


@pytest.fixture
def fake_gpu(tmp_path):
    node = tmp_path / "nvidia0"
    try:
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(195, 0))  # nvidia's major
    except PermissionError:
        pytest.skip("cannot mknod here")
    return node


OPEN = """
import sys
for path in sys.argv[1:]:
    try:
        open(path, 'rb').close()
        print('ok')
    except OSError as e:
        print(e.errno)
"""


def test_devices_a_job_opens_only_the_devices_it_holds(v1, fake_gpu):
    h, name = v1
    held = h.create(name, "held", Limits(memory=None, cpus=None, pids=None, devices=(("c", 195, 0),)))
    other = h.create(name, "other", Limits(memory=None, cpus=None, pids=None, devices=()))
    for cg, gpu_denied in ((held, False), (other, True)):
        p = start(cg, sys.executable, "-c", OPEN, str(fake_gpu), "/dev/null", "/dev/urandom",
                  stdout=subprocess.PIPE, text=True)
        out, _ = p.communicate(timeout=30)
        gpu, null, urandom = out.split()
        assert (gpu == str(errno.EPERM)) == gpu_denied  # allowed: no driver behind it (ENXIO), never EPERM
        assert null == urandom == "ok"


def test_create_replaces_a_leftover_job_cgroup_of_the_same_name(v1):
    h, name = v1
    old = h.create(name, "again", NO_LIMITS)
    p = start(old, "sleep", "1000")
    wait_until(lambda: execed(p, "sleep"), 5, "the sleep to join")
    new = h.create(name, "again", NO_LIMITS)
    assert p.wait(timeout=10) == -9
    assert new.pids() == set()


def test_parent_is_idempotent_and_removes_empty_leftovers(v1):
    h, name = v1
    empty = h.create(name, "empty", NO_LIMITS)
    busy = h.create(name, "busy", NO_LIMITS)
    p = start(busy, "sleep", "1000")
    wait_until(lambda: execed(p, "sleep"), 5, "the sleep to join")
    h.parent(name)
    assert not any(d.exists() for d in empty.dirs)
    assert all(d.exists() for d in busy.dirs) and p.pid in busy.pids()
    busy.kill()
    p.wait(timeout=10)


def test_a_refused_write_names_the_file_and_the_value_and_leaves_no_cgroup(v1):
    h, name = v1
    (h.own["devices"] / name / "devices.deny").write_text("c 195:1 rwm")  # a child cannot get more
    with pytest.raises(CgroupError, match=r"'c 195:1 rwm'.*devices\.allow"):
        h.create(name, "refused", Limits(memory=MiB * 64, cpus=None, pids=None, devices=(("c", 195, 1),)))
    assert not any((d / name / "refused").exists() for d in h.own.values())


def test_names_must_be_plain(v1):
    h, name = v1
    for bad in ("../escape", "a/b", "", ".hidden", "cgroup.procs", "x" * 200):
        with pytest.raises(CgroupError):
            h.create(name, bad, NO_LIMITS)


def test_limits_are_checked():
    for bad in (dict(memory=0), dict(memory=-1), dict(cpus=0), dict(cpus=float("nan")), dict(pids=0),
                dict(devices=(("b", 8, 0),)), dict(devices=(("c", -1, 0),))):
        with pytest.raises(CgroupError):
            Limits(**{"memory": None, "cpus": None, "pids": None, "devices": None, **bad})


# --- detect and v2 against a fake tree ------------------------------------------------------------

@pytest.fixture
def root(monkeypatch):
    monkeypatch.setattr(cgroups.os, "geteuid", lambda: 0)


def fake(tmp_path: Path, mountinfo: str, self_cgroup: str) -> tuple[Path, Path]:
    (tmp_path / "mountinfo").write_text(mountinfo)
    (tmp_path / "self_cgroup").write_text(self_cgroup)
    return tmp_path / "self_cgroup", tmp_path / "mountinfo"


@pytest.fixture
def v2_tree(tmp_path, root):
    top = tmp_path / "cg"
    own = top / "system.slice" / "swarmd.service"
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (own / "cgroup.type").write_text("domain\n")
    (own / "cgroup.procs").write_text("123\n456\n")
    (own / "cgroup.subtree_control").write_text("")
    paths = fake(tmp_path, f"30 25 0:26 / {top} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
                 "0::/system.slice/swarmd.service\n")
    return own, paths


def test_detect_v2_and_parent_moves_the_daemon_into_a_leaf(v2_tree):
    own, paths = v2_tree
    h = cgroups.detect(*paths)
    assert not isinstance(h, str) and h.version == 2
    assert h.describe().startswith("cgroup v2: memory, cpu, pids") and "devices" in h.describe()
    h.parent("swarmd-a")
    assert (own / cgroups.LEAF / "cgroup.procs").exists()  # the no-internal-process rule
    assert (own / "cgroup.subtree_control").read_text() == "+memory +cpu +pids"
    assert (own / "swarmd-a" / "cgroup.subtree_control").read_text() == "+memory +cpu +pids"


def test_v2_at_the_real_root_moves_nothing(v2_tree):
    own, paths = v2_tree
    (own / "cgroup.type").unlink()
    h = cgroups.detect(*paths)
    h.parent("swarmd-a")
    assert not (own / cgroups.LEAF).exists()


def test_v2_a_daemon_started_from_the_leaf_nests_beside_it_not_below(v2_tree, tmp_path):
    own, (self_cgroup, mountinfo) = v2_tree
    cgroups.detect(self_cgroup, mountinfo).parent("swarmd-a")
    self_cgroup.write_text(f"0::/system.slice/swarmd.service/{cgroups.LEAF}\n")  # a restart from inside
    h = cgroups.detect(self_cgroup, mountinfo)
    assert h.own["memory"] == own
    h.parent("swarmd-b")
    assert (own / "swarmd-b").is_dir() and not (own / cgroups.LEAF / cgroups.LEAF).exists()


def test_v2_create_writes_limits_and_one_join_file(v2_tree):
    own, paths = v2_tree
    h = cgroups.detect(*paths)
    h.parent("swarmd-a")
    cg = h.create("swarmd-a", "job1", Limits(memory=1 << 30, cpus=1.5, pids=100, devices=(("c", 195, 0),)))
    d = own / "swarmd-a" / "job1"
    assert cg.procs_files == [d / "cgroup.procs"]
    assert (d / "memory.max").read_text() == str(1 << 30)
    assert (d / "cpu.max").read_text() == "150000 100000"
    assert (d / "pids.max").read_text() == "100"
    assert not (d / "memory.swap.max").exists()  # only written where the kernel offers it


def test_v2_usage_and_kill(v2_tree):
    own, paths = v2_tree
    h = cgroups.detect(*paths)
    h.parent("swarmd-a")
    cg = h.create("swarmd-a", "job1", NO_LIMITS)
    d = own / "swarmd-a" / "job1"
    (d / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert cg.usage() == Usage(None, 2.5, 1)  # no memory.peak before kernel 5.19
    (d / "memory.peak").write_text("12345\n")
    assert cg.usage().peak_memory == 12345
    (d / "cgroup.kill").write_text("")
    cg.kill()
    assert (d / "cgroup.kill").read_text() == "1"


def test_detect_v1_co_mounted_cpu_cpuacct_nested_mount_root_no_swap_accounting(tmp_path, root):
    top = tmp_path / "cg"
    for d in ("memory/b", "cpu,cpuacct", "pids", "devices", "freezer"):
        (top / d).mkdir(parents=True)
    paths = fake(tmp_path, "".join(
        f"{i} 31 0:{i} {r} {top / d} rw - cgroup cgroup rw,{opts}\n"
        for i, r, d, opts in ((1, "/a", "memory", "memory"), (2, "/", "cpu,cpuacct", "cpu,cpuacct"),
                              (3, "/", "pids", "pids"), (4, "/", "devices", "devices"),
                              (5, "/", "freezer", "freezer"))),
        "5:freezer:/\n4:devices:/\n3:pids:/\n2:cpu,cpuacct:/\n1:memory:/a/b\n0::/\n")
    h = cgroups.detect(*paths)
    assert not isinstance(h, str) and h.version == 1
    assert h.own["memory"] == top / "memory" / "b"  # the container's view: mount root /a
    assert h.own["cpu"] == h.own["cpuacct"]
    assert "no swap accounting" in h.describe()
    h.parent("n")
    cg = h.create("n", "j", Limits(memory=64 * MiB, cpus=2, pids=50, devices=None))
    assert len(cg.procs_files) == 5  # memory, cpu+cpuacct, pids, devices, freezer: one file per hierarchy
    assert (top / "memory/b/n/j/memory.limit_in_bytes").read_text() == str(64 * MiB)
    assert not (top / "memory/b/n/j/memory.memsw.limit_in_bytes").exists()
    assert (top / "cpu,cpuacct/n/j/cpu.cfs_quota_us").read_text() == "200000"


def test_detect_says_why_not(tmp_path, root, monkeypatch):
    assert cgroups.detect(*fake(tmp_path, "22 1 0:5 / /proc rw - proc proc rw\n", "0::/\n")) == \
        "no cgroup filesystem mounted"
    top = tmp_path / "cpu"
    top.mkdir()
    why = cgroups.detect(*fake(tmp_path, f"1 31 0:1 / {top} rw - cgroup cgroup rw,cpu\n", "1:cpu:/\n"))
    assert isinstance(why, str) and "no memory or pids controller" in why
    monkeypatch.setattr(cgroups.os, "geteuid", lambda: 1000)
    assert cgroups.detect() == "not root"
