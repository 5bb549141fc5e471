"""The fence: a job's ranks on this host never outlive the daemon that started them (issue 13).

A daemon that dies without a word (SIGKILL, the OOM killer, a crash) leaves its ranks
running unsupervised: they are its children, each in a session of its own, and would hold
the job's GPUs and keep writing checkpoints while the coordinator restarts the job
elsewhere. PR_SET_PDEATHSIG cannot help: trio spawns from a worker thread (the signal fires
when that thread exits, not the daemon) and the ranks' credential changes clear it. So each
job gets a reaper on each host: this module, run as a small process of its own
(`python -m swarmd.compute.host.sandbox.reaper`, importing nothing but the stdlib and cgroups.py).

Rules:
- The executor starts one reaper per job, before the job's first rank: as the daemon's user
  (root with the sandbox), outside the job's cgroup, in a session of its own, with the read
  end of a pipe as its stdin, cwd /, an environment of its own and no other descriptor. The
  write end is the daemon's alone: close-on-exec, never passed to a rank or to another
  job's reaper, so end of file on it means exactly that the daemon is gone.
- The daemon writes one ASCII line per fact (each write is one line, well under PIPE_BUF,
  so atomic): `+PGID` a rank's process group, right after the rank is spawned; `-PGID` just
  before the daemon reaps that rank's leader (from then on the number may be reused by a
  stranger's group); `done` once every rank is reaped and the job's cgroup emptied.
- End of file without `done`: the daemon is gone. The reaper SIGKILLs every group it still
  knows, then everything in the job's cgroup (cgroups.JobCgroup.kill: v2's cgroup.kill, or
  v1 freeze, SIGKILL each pid, thaw, until empty; bounded, tried `ATTEMPTS` times), then
  exits. The groups first: a rank's first `sh` that has not yet joined the cgroup is in its
  group, and once killed it never joins. After `done` it exits and kills nothing, so a
  normal end can never reach a stranger. A cgroup directory that is not the one it was
  given (a later start of the same job, made afresh under the same name) is left alone.
- Its life is the pipe's: SIGINT, SIGTERM and SIGHUP are ignored, and being a session of
  its own, a terminal's Ctrl-C or a signal to the daemon's process group never reaches it.
  Under systemd (KillMode=mixed) a stop sends SIGTERM to the daemon alone, which stops the
  ranks and ends the reaper with `done`; whatever is left after TimeoutStopSec gets SIGKILL
  from systemd, reaper included. A job cannot signal it: another uid, no capabilities.
- What it reports goes to stderr, the daemon's (the journal under systemd). Exit status:
  0 (done, or everything killed), 1 (something survived), 2 (bad arguments).
- Not covered: a rank spawned in the instant the daemon dies, before its `+PGID` is
  written and before it joined the cgroup; without a cgroup, a process that left its rank's
  group (setsid), as it escapes the executor. The daemon's next start kills what is left in
  its cgroups (Sandbox.start) or under its jobs directory (worker.stop_orphans).
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from .cgroups import CgroupError, JobCgroup

DONE = b"done\n"
ATTEMPTS = 3  # JobCgroup.kill waits cgroups.WAIT (5 s) each: a D-state task may hold it that long
_LINE = re.compile(rb"([+-])([1-9][0-9]{0,9})")
_CONTROLLER = re.compile(r"[a-z_]{1,32}")


def watch(pgid: int) -> bytes:
    """The line that puts a rank's group under the fence."""
    return b"+%d\n" % pgid


def forget(pgid: int) -> bytes:
    """The line that takes it out, before its leader is reaped."""
    return b"-%d\n" % pgid


def command(job: str, cgroup: JobCgroup | None) -> list[str]:
    """The reaper's argv: `JOB [vVERSION CONTROLLER=DIR…]` after the interpreter's flags
    (-s: no user site; -P: no cwd on sys.path)."""
    argv = [sys.executable, "-s", "-P", "-m", __name__, job]
    if cgroup is not None:
        argv += [f"v{cgroup.version}", *(f"{c}={d}" for c, d in cgroup.by.items())]
    return argv


def environment() -> dict[str, str]:
    """The reaper's whole environment: where this package is, and nothing of the daemon's."""
    return {"PYTHONPATH": str(Path(__file__).resolve().parents[4]), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8"}


def parse(args: Sequence[str]) -> tuple[str, JobCgroup | None]:
    """The job and its cgroup from `command`'s arguments; ValueError when they are not that."""
    if not args or not args[0] or len(args[0]) > 200:
        raise ValueError("usage: reaper JOB [v1|v2 CONTROLLER=DIR...]")
    job, rest = args[0], list(args[1:])
    if not rest:
        return job, None
    version = {"v1": 1, "v2": 2}.get(rest[0])
    if version is None or len(rest) < 2:
        raise ValueError(f"expected v1 or v2 and at least one CONTROLLER=DIR, not {rest[:2]!r}")
    by: dict[str, Path] = {}
    for item in rest[1:]:
        name, sep, path = item.partition("=")
        if not sep or not _CONTROLLER.fullmatch(name) or not path.startswith("/"):
            raise ValueError(f"expected CONTROLLER=/absolute/dir, not {item[:100]!r}")
        by[name] = Path(path)
    dirs = list(dict.fromkeys(by.values()))  # one per hierarchy, as Hierarchy._dirs makes them
    return job, JobCgroup(version, dirs, by)


def _identity(dirs: Sequence[Path]) -> list[tuple[int, int] | None]:
    found: list[tuple[int, int] | None] = []
    for d in dirs:
        try:
            st = os.stat(d)
            found.append((st.st_dev, st.st_ino))
        except OSError:
            found.append(None)
    return found


def _read_until_end(fd: int) -> tuple[set[int], bool]:
    """The groups the daemon left under the fence, and whether it said `done`; returns at
    `done` or at end of file. A line that is neither is ignored (the daemon wrote it)."""
    groups: set[int] = set()
    pending = b""
    while chunk := os.read(fd, 4096):
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if line + b"\n" == DONE:
                return groups, True
            if (m := _LINE.fullmatch(line)) is None:
                print(f"swarmd-reaper: ignored a line {line[:40]!r}", file=sys.stderr)
            elif m[1] == b"+":
                groups.add(int(m[2]))
            else:
                groups.discard(int(m[2]))
    return groups, False  # a partial last line cannot happen (atomic writes): it is ignored


def reap(groups: set[int], cgroup: JobCgroup | None, identity: Sequence[tuple[int, int] | None]) -> list[str]:
    """Kill what the daemon left; returns what survived, in words (empty: nothing)."""
    problems = []
    for pgid in sorted(groups):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the whole group is gone already
        except OSError as exc:
            problems.append(f"group {pgid}: {exc.strerror}")
    if cgroup is None:
        return problems
    if _identity(cgroup.dirs) != list(identity):
        return problems  # removed, or made afresh for a later start: not the cgroup we were given
    for attempt in range(ATTEMPTS):
        try:
            cgroup.kill()
            return problems
        except CgroupError as exc:
            if attempt == ATTEMPTS - 1:
                problems.append(str(exc))
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    try:
        job, cgroup = parse(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(f"swarmd-reaper: {exc}", file=sys.stderr)
        return 2
    identity = _identity(cgroup.dirs) if cgroup is not None else []
    groups, done = _read_until_end(0)
    if done:
        return 0
    problems = reap(groups, cgroup, identity)
    what = f"{len(groups)} rank group(s)" + (f" and cgroup {cgroup.dirs[0]}" if cgroup is not None else "")
    if problems:
        print(f"swarmd-reaper: job {job}: the daemon is gone; killed {what}, but: {'; '.join(problems)}",
              file=sys.stderr)
        return 1
    print(f"swarmd-reaper: job {job}: the daemon is gone; killed {what}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
