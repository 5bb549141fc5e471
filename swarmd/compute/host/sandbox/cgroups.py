"""A job's cgroup: limits it, holds every process it starts, and ends them all (issue 12).

The worker calls this from a thread: plain functions, blocking file I/O on cgroupfs.

Rules:
- `detect` finds a usable hierarchy or says why there is none. v2 (one unified tree, as on
  Debian 12 and Ubuntu 22.04+) is used when our own cgroup offers `memory` and `pids`;
  otherwise the v1 controllers (a directory per controller, as on this development
  machine). `memory` and `pids` are required: without them a job can take the host's
  memory or fork-bomb it, and half a sandbox reported as whole is worse than none.
- Everything nests under OUR OWN cgroup (from /proc/self/cgroup), never at the root:
  several lab daemons share one cgroupfs, and under systemd only the unit's subtree is
  delegated. Layout: `<own>/<name>/<job>`; `name` is the daemon's and must be unique per
  daemon (the lab runs several on one kernel), `job` the job's directory name.
- v2's no-internal-process rule: a cgroup with processes cannot hand controllers to its
  children. When ours has processes (and is not the real root, which has no
  `cgroup.type`), `parent` moves them all into the leaf `<own>/swarmd-leaf` first, then
  enables `+memory +pids` (and `+cpu` where offered) in `<own>` and `<own>/<name>`.
- v1 limits: `memory.limit_in_bytes`, then `memory.memsw.limit_in_bytes` to the same value
  (no swap on top) when the kernel accounts swap (the memsw files exist only with
  swapaccount); `cpu.cfs_quota_us` = cpus x `cpu.cfs_period_us`; `pids.max`; devices:
  `devices.deny a`, then `devices.allow` for what any process needs (`BASIC_DEVICES`) and
  each device the job holds. v2: `memory.max`, `memory.swap.max` 0, `cpu.max`, `pids.max`;
  v2 devices need an eBPF program and are not done (`describe` says so: the job's mount
  namespace's /dev is the limit there).
- A process joins by writing its pid into every file of `procs_files` (one per v1
  hierarchy, deduplicated when controllers share one, e.g. `cpu,cpuacct`; one in v2)
  before it execs the job's command, so nothing it forks is ever outside. The join fails
  closed: a cgroup removed before the write makes the write, and so the rank, fail. A
  process joins the hierarchies one after another, so "empty" means empty in all of them.
- `kill` leaves nothing: freeze (so nothing forks between reading the pids and killing
  them), SIGKILL every pid, thaw (a frozen task handles SIGKILL only once thawed), until
  the cgroup is empty. v2's `cgroup.kill` does all of it in the kernel where present. Each
  wait is bounded (`WAIT`): a task in uninterruptible sleep (D state) can delay FROZEN
  indefinitely, so kill goes on without it and retries; past `WAIT` it raises
  CgroupError listing the survivors. Zombies are not listed (their parent reaps them).
- `usage` stays readable after `kill` until `remove`. v1's peak memory counts page cache
  too (`memory.max_usage_in_bytes`), as the limit does.
- Every failed write raises `CgroupError` naming the file and the value.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

V1_CONTROLLERS = ("memory", "cpu", "cpuacct", "pids", "devices", "freezer")  # cpuset left alone: it needs cpus/mems set
V2_CONTROLLERS = ("memory", "cpu", "pids")
REQUIRED = ("memory", "pids")
LEAF = "swarmd-leaf"  # v2: where the daemon's own processes go so its cgroup may have children
CFS_PERIOD = 100_000  # µs: the kernel's default period; quota = cpus x period
CFS_MIN_QUOTA = 1_000  # µs: the kernel refuses less (EINVAL)
# (major, minor or None for all): null, zero, full, random, urandom, tty, ptmx, the pts
# terminals; what bubblewrap's --dev /dev creates and any program may open
BASIC_DEVICES: tuple[tuple[int, int | None], ...] = (
    (1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0), (5, 2), (136, None))
WAIT = 5.0  # seconds for a freeze, an empty cgroup, an rmdir: generous, and still bounded
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", re.ASCII)


class CgroupError(Exception):
    """A cgroup could not be created, limited, emptied or removed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    memory: int | None  # bytes; swap is limited to nothing on top where the kernel lets us
    cpus: float | None  # CPU quota in CPUs (1.5 = one and a half CPUs' time per period)
    pids: int | None  # processes and threads together
    devices: tuple[tuple[str, int, int], ...] | None  # ("c", major, minor) allowed; None: no device rule

    def __post_init__(self) -> None:
        if self.memory is not None and not (isinstance(self.memory, int) and self.memory > 0):
            raise CgroupError(f"memory limit must be a positive number of bytes, not {self.memory!r}")
        if self.cpus is not None and not (isinstance(self.cpus, (int, float)) and 0 < self.cpus < 1e6):
            raise CgroupError(f"cpu limit must be a positive number of CPUs, not {self.cpus!r}")
        if self.pids is not None and not (isinstance(self.pids, int) and self.pids > 0):
            raise CgroupError(f"pids limit must be a positive number, not {self.pids!r}")
        for dev in self.devices or ():
            if (len(dev) != 3 or dev[0] != "c" or not all(isinstance(n, int) and 0 <= n < 2**20 for n in dev[1:])):
                raise CgroupError(f"device must be ('c', major, minor), not {dev!r}")


@dataclass(frozen=True, slots=True)
class Usage:
    peak_memory: int | None  # bytes
    cpu_seconds: float | None
    oom_kills: int


def _write(path: Path, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as exc:
        raise CgroupError(f"cannot write {value!r} to {path}: {exc.strerror or exc}") from exc


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _keyed(path: Path, key: str) -> int | None:
    """The value of `key` in a flat keyed file (`oom_kill 3`, `usage_usec 1234`)."""
    for line in (_read(path) or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key and parts[1].isdigit():
            return int(parts[1])
    return None


def _procs(directory: Path) -> set[int]:
    return {int(p) for p in (_read(directory / "cgroup.procs") or "").split() if p.isdigit()}


def _check_name(value: str, what: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value) or value.startswith("cgroup."):
        raise CgroupError(f"{what} {value!r} is not a plain name (letters, digits, _ . -)")
    return value


def _wait(done, timeout: float = WAIT) -> bool:
    """Poll `done()` until it holds or `timeout` passes (kernel state has no event to wait on here)."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    return True


def _rmdir(path: Path) -> None:
    """Remove a cgroup directory; a task killed a moment ago can hold it briefly (EBUSY)."""

    def gone() -> bool:
        try:
            path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.EBUSY:  # nothing else passes by waiting
                raise CgroupError(f"cannot remove {path}: {exc.strerror}") from exc
            return False
        return True

    if not _wait(gone):
        raise CgroupError(f"cannot remove {path}: still busy after {WAIT:g} s")


def _mounts(mountinfo: str) -> tuple[dict[str, tuple[str, Path]], tuple[str, Path] | None]:
    """v1 mounts by controller and the v2 mount, each as (root within the hierarchy, mount point)."""
    v1: dict[str, tuple[str, Path]] = {}
    v2 = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else ""
        root, point = _unescape(fields[3]), Path(_unescape(fields[4]))
        if fstype == "cgroup2" and v2 is None:
            v2 = (root, point)
        elif fstype == "cgroup":
            for opt in options.split(","):
                if opt in V1_CONTROLLERS and opt not in v1:
                    v1[opt] = (root, point)
    return v1, v2


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _under(point: Path, root: str, own: str) -> Path | None:
    """Where cgroup `own` of a hierarchy mounted at `point` (showing `root`) lives, if visible."""
    rel = os.path.relpath(own, root) if own.startswith(root) else None
    if rel is None or rel.startswith(".."):
        return None
    return point if rel == "." else point / rel


def detect(proc_self_cgroup: Path = Path("/proc/self/cgroup"),
           mounts: Path = Path("/proc/self/mountinfo")) -> Hierarchy | str:
    """A usable hierarchy, or the reason there is none."""
    if os.geteuid() != 0:
        return "not root"
    try:
        own_lines = proc_self_cgroup.read_text().splitlines()
        v1_mounts, v2_mount = _mounts(mounts.read_text())
    except OSError as exc:
        return f"cannot read {exc.filename}: {exc.strerror}"
    own_v1: dict[str, str] = {}
    own_v2 = None
    for line in own_lines:
        hid, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if hid == "0" and ctrls == "":
            own_v2 = path
        for c in ctrls.split(","):
            own_v1[c] = path
    v2_offered = "not mounted"
    if v2_mount is not None and own_v2 is not None:
        where = _under(v2_mount[1], v2_mount[0], own_v2)
        if where is not None and where.name == LEAF:
            where = where.parent  # a daemon started from a process `parent` had moved: the cgroup is the one above
        offered = (_read(where / "cgroup.controllers") or "").split() if where else []
        v2_offered = ", ".join(offered) or "none"
        if where is not None and all(c in offered for c in REQUIRED):
            if not os.access(where, os.W_OK):
                return f"cgroup v2: our cgroup {where} is not writable (under systemd: Delegate=yes)"
            return Hierarchy(2, {c: where for c in V2_CONTROLLERS if c in offered})
    dirs: dict[str, Path] = {}
    for c, (root, point) in v1_mounts.items():
        if c in own_v1 and (where := _under(point, root, own_v1[c])) is not None:
            dirs[c] = where
    missing = [c for c in REQUIRED if c not in dirs]
    if missing:
        if not dirs and v2_mount is None:
            return "no cgroup filesystem mounted"
        return (f"no {' or '.join(missing)} controller in our cgroup (v1: {', '.join(sorted(dirs)) or 'none'}; "
                f"v2: {v2_offered})")
    for c, d in dirs.items():
        if not os.access(d, os.W_OK):
            return f"cgroup v1: our {c} cgroup {d} is not writable"
    return Hierarchy(1, dirs)


class Hierarchy:
    """The cgroup tree(s) of this host as seen from our own cgroup."""

    def __init__(self, version: int, own: dict[str, Path]):
        self.version = version
        self.own = own  # controller -> our own cgroup's directory (one directory for all in v2)
        self.controllers = tuple(c for c in (*V1_CONTROLLERS,) if c in own)

    def describe(self) -> str:
        text = f"cgroup v{self.version}: {', '.join(self.controllers)}"
        if self.version == 2:
            text += " (devices: no eBPF filter, the job's /dev is the limit)"
        elif "memory" in self.own and not (self.own["memory"] / "memory.memsw.limit_in_bytes").exists():
            text += " (no swap accounting: memory limit is RAM only)"
        return text

    def _dirs(self, *parts: str) -> list[Path]:
        """One directory per hierarchy (co-mounted controllers share one)."""
        seen: list[Path] = []
        for d in self.own.values():
            if d.joinpath(*parts) not in seen:
                seen.append(d.joinpath(*parts))
        return seen

    def parent(self, name: str) -> None:
        """Make `<own>/<name>` in every hierarchy, ready to hold job cgroups. Idempotent;
        removes leftover empty job cgroups (a previous run of this daemon)."""
        _check_name(name, "cgroup name")
        if self.version == 2:
            self._v2_delegate()
        for d in self._dirs(name):
            try:
                d.mkdir(exist_ok=True)
            except OSError as exc:
                raise CgroupError(f"cannot create {d}: {exc.strerror}") from exc
            if self.version == 2:
                _write(d / "cgroup.subtree_control", self._v2_enable())
        for job in self._jobs(name):
            cg = self._job(name, job)
            if not cg.pids():  # in no hierarchy: a process joins them one after another
                for d in cg.dirs:
                    try:
                        d.rmdir()
                    except OSError:
                        pass  # busy after all, or gone; create() replaces it by name

    def _jobs(self, name: str) -> set[str]:
        return {c.name for d in self._dirs(name) if d.is_dir() for c in d.iterdir() if c.is_dir()}

    def _job(self, name: str, job: str) -> JobCgroup:
        return JobCgroup(self.version, self._dirs(name, job), {c: d / name / job for c, d in self.own.items()})

    def discard(self, name: str) -> None:
        """Kill and remove every job cgroup under `<own>/<name>`, then `<own>/<name>` itself
        (a daemon stopping for good; tests)."""
        _check_name(name, "cgroup name")
        for job in sorted(self._jobs(name)):
            cg = self._job(name, job)
            cg.kill()
            cg.remove()
        for d in self._dirs(name):
            _rmdir(d)

    def _v2_enable(self) -> str:
        return " ".join(f"+{c}" for c in V2_CONTROLLERS if c in self.own)

    def _v2_delegate(self) -> None:
        own = self.own["memory"]
        enabled = (_read(own / "cgroup.subtree_control") or "").split()
        if all(c in enabled for c in self.own):
            return
        if (own / "cgroup.type").exists() and _procs(own):
            leaf = own / LEAF
            try:
                leaf.mkdir(exist_ok=True)
            except OSError as exc:
                raise CgroupError(f"cannot create {leaf}: {exc.strerror}") from exc
            for pid in _procs(own):
                try:
                    with open(leaf / "cgroup.procs", "w") as f:
                        f.write(str(pid))
                except ProcessLookupError:
                    pass  # exited meanwhile
                except OSError as exc:
                    raise CgroupError(f"cannot write {pid!r} to {leaf / 'cgroup.procs'}: {exc.strerror}") from exc
        _write(own / "cgroup.subtree_control", self._v2_enable())

    def create(self, name: str, job: str, limits: Limits) -> JobCgroup:
        """`<own>/<name>/<job>` with `limits`; a leftover of that name is emptied and removed first."""
        _check_name(name, "cgroup name")
        _check_name(job, "job cgroup name")
        cg = self._job(name, job)
        if any(d.exists() for d in cg.dirs):
            cg.kill()
            cg.remove()
        try:
            for d in cg.dirs:
                try:
                    d.mkdir()
                except OSError as exc:
                    raise CgroupError(f"cannot create {d}: {exc.strerror}") from exc
            (self._limit_v2 if self.version == 2 else self._limit_v1)(cg.by, limits)
        except CgroupError:
            try:
                cg.remove()  # nothing can have joined yet: the caller has not seen procs_files
            except CgroupError:
                pass  # the first error is the one worth reporting
            raise
        return cg

    @staticmethod
    def _limit_v1(by: dict[str, Path], limits: Limits) -> None:
        if limits.memory is not None:
            mem = by["memory"]
            _write(mem / "memory.limit_in_bytes", str(limits.memory))
            if (mem / "memory.memsw.limit_in_bytes").exists():
                # memsw >= limit always; a fresh cgroup has both unlimited, so limit first, then memsw
                _write(mem / "memory.memsw.limit_in_bytes", str(limits.memory))
        if limits.cpus is not None and "cpu" in by:
            period = int((_read(by["cpu"] / "cpu.cfs_period_us") or str(CFS_PERIOD)).strip() or CFS_PERIOD)
            _write(by["cpu"] / "cpu.cfs_quota_us", str(max(CFS_MIN_QUOTA, round(limits.cpus * period))))
        if limits.pids is not None:
            _write(by["pids"] / "pids.max", str(limits.pids))
        if limits.devices is not None and "devices" in by:
            dev = by["devices"]
            _write(dev / "devices.deny", "a")
            for major, minor in BASIC_DEVICES:
                _write(dev / "devices.allow", f"c {major}:{'*' if minor is None else minor} rwm")
            for kind, major, minor in limits.devices:
                _write(dev / "devices.allow", f"{kind} {major}:{minor} rwm")

    @staticmethod
    def _limit_v2(by: dict[str, Path], limits: Limits) -> None:
        d = by["memory"]
        if limits.memory is not None:
            _write(d / "memory.max", str(limits.memory))
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", "0")
        if limits.cpus is not None and "cpu" in by:
            _write(d / "cpu.max", f"{max(CFS_MIN_QUOTA, round(limits.cpus * CFS_PERIOD))} {CFS_PERIOD}")
        if limits.pids is not None:
            _write(d / "pids.max", str(limits.pids))


class JobCgroup:
    """One job's cgroup on this host: one directory per hierarchy (v1) or one (v2)."""

    def __init__(self, version: int, dirs: list[Path], by: dict[str, Path]):
        self.version = version
        self.dirs = dirs
        self.by = by  # controller -> directory
        self.procs_files = [d / "cgroup.procs" for d in dirs]

    def __repr__(self) -> str:
        return f"JobCgroup(v{self.version}, {self.by.get('memory')})"

    def pids(self) -> set[int]:
        """Every process in the job's cgroup (in any hierarchy: a join may have stopped half way)."""
        found: set[int] = set()
        for d in self.dirs:
            found |= _procs(d)
        return found

    def kill(self) -> None:
        """End every process in the cgroup; CgroupError if some survive `WAIT` seconds of trying."""
        if not any(d.exists() for d in self.dirs):
            return
        if self.version == 2 and (self.dirs[0] / "cgroup.kill").exists():
            _write(self.dirs[0] / "cgroup.kill", "1")
            if _wait(lambda: not self.pids()):
                return
        deadline = time.monotonic() + WAIT
        while pids := self.pids():
            if time.monotonic() > deadline:
                raise CgroupError(f"{len(pids)} processes survive in {self.dirs[0]}: {sorted(pids)[:10]}")
            self._freeze(True)
            try:
                for pid in self.pids():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            finally:
                self._freeze(False)
            _wait(lambda: not self.pids(), timeout=0.5)

    def _freeze(self, frozen: bool) -> None:
        if self.version == 2:
            d = self.dirs[0]
            if (d / "cgroup.freeze").exists():
                _write(d / "cgroup.freeze", "1" if frozen else "0")
                if frozen:
                    _wait(lambda: _keyed(d / "cgroup.events", "frozen") == 1, timeout=1.0)
        elif "freezer" in self.by:
            state = self.by["freezer"] / "freezer.state"
            _write(state, "FROZEN" if frozen else "THAWED")
            if frozen:  # FREEZING until every task stopped; a D-state task may hold it there
                _wait(lambda: (_read(state) or "").strip() == "FROZEN", timeout=1.0)

    def usage(self) -> Usage:
        """Peak memory, CPU time and OOM kills so far (readable after kill, before remove)."""
        if self.version == 2:
            d = self.dirs[0]
            peak = _read(d / "memory.peak")
            usec = _keyed(d / "cpu.stat", "usage_usec")
            return Usage(int(peak) if peak and peak.strip().isdigit() else None,
                         usec / 1e6 if usec is not None else None,
                         _keyed(d / "memory.events", "oom_kill") or 0)
        mem = self.by["memory"]
        peak = _read(mem / "memory.max_usage_in_bytes")
        ns = _read(self.by["cpuacct"] / "cpuacct.usage") if "cpuacct" in self.by else None
        return Usage(int(peak) if peak and peak.strip().isdigit() else None,
                     int(ns) / 1e9 if ns and ns.strip().isdigit() else None,
                     _keyed(mem / "memory.oom_control", "oom_kill") or 0)

    def remove(self) -> None:
        """Remove the job's cgroup (kill first: a cgroup with processes cannot be removed)."""
        for d in self.dirs:
            _rmdir(d)
