"""What a job's rank sees of the host: the bubblewrap command that builds its mount and
pid namespaces, and the setpriv command that drops it to the job's uid.

Rules:
- The host is read-only ("/" bound read-only, every mount under it too); the rank writes
  only its job directory (`top`), a private /tmp, /var/tmp and /dev/shm (fresh tmpfs,
  sticky and world-writable like the host's; gone with the rank; /dev/shm can be a
  directory the job's ranks on this host share instead) and an empty /run.
- `hide` paths get an empty tmpfs over them: the daemon's state, jobs and socket
  directories, other users' homes, the host services' state. `expose` paths are bound
  read-only again; only those under a hidden path need it (the rest of the host is
  already visible), so an exposed path that merely contains a hidden one never uncovers
  it. A path both hidden and exposed stays hidden: a configuration mistake never shows
  the daemon's own directories.
- Mounts are applied parents first (bubblewrap creates each mount point in the tmpfs
  above it): a hidden directory under an exposed one is hidden again after the bind, an
  exposed one under a hidden one appears after the tmpfs; the job's `top` comes last
  among equals, so it is writable even though the jobs directory is hidden.
- /dev is a fresh one (null, zero, full, random, urandom, tty, pts) plus each device
  listed (the GPUs the job holds and the driver's control nodes): nothing else of the
  host's /dev (disks, kmsg, kvm, other GPUs) exists there. The cgroup device whitelist
  (cgroups.py) is the second fence.
- The rank has its own pid, IPC and UTS namespaces (it sees and signals only its own
  processes; no SysV IPC with other jobs); everything in them dies with bubblewrap's pid 1,
  which stays in the rank's process group.
- setpriv then drops to the job's uid and gid with no supplementary groups, an empty
  bounding set, no inheritable or ambient capabilities and no_new_privs: nothing it
  executes can gain a privilege back (setuid binaries included).
- /etc/resolv.conf keeps resolving: where it links under a hidden path (systemd-resolved
  keeps it in /run) its target is exposed. The interpreter the daemon runs jobs with
  stays reachable: `interpreter_paths()` names its prefixes and the swarmd package (ranks
  import its jobs' library, swarmd.train), for the caller's `expose`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

# private, writable by everyone with the sticky bit (as on the host): the job's scratch space
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")
EMPTY = ("/run",)  # sockets and pid files of the host's services (dbus, systemd, docker)
RESOLV_CONF = Path("/etc/resolv.conf")
PROBE_TIMEOUT = 10.0  # seconds; bubblewrap starts in a few ms, a hung probe means a broken host


def bwrap_argv(*, bwrap: str, top: Path, cwd: Path, hide: Sequence[Path], expose: Sequence[Path],
               devices: Sequence[Path], uid: int, gid: int, setpriv: str, shm: Path | None = None,
               resolv_conf: Path = RESOLV_CONF) -> list[str]:
    """The command prefix that runs a rank confined, up to the final "--" before its argv.

    `shm`: a directory of the host bound at /dev/shm instead of a private tmpfs, for the
    job's ranks on this host to share (NCCL's shared-memory transport, a DataLoader's
    workers across ranks); the caller makes it on a tmpfs (the host's /dev/shm), owned by
    the job's uid, mode 0700, and removes it when the job ends."""
    top, cwd = _real(top), _real(cwd)
    hidden = {p for p in map(_real, [*hide, *map(Path, EMPTY)]) if p.exists()}
    if Path("/") in hidden:
        raise ValueError("cannot hide / (a socket directly in / is hidden by its own path)")
    scratch = {Path(p) for p in SCRATCH if p == "/dev/shm" or Path(p).is_dir()}  # /dev/shm: in bwrap's /dev
    if shm is not None:
        scratch.discard(Path("/dev/shm"))
    fresh = {_real(p) for p in scratch}
    hidden = {p for p in hidden if not any(_under(p, f) for f in fresh)}  # already absent from a fresh tmpfs
    covered = hidden | fresh
    shown = {p for p in map(_real, [*expose, resolv_conf]) if p.exists() and p not in covered
             and any(_under(p, c) for c in covered)}
    # (path, rank among equals, args): parents first; at one path, the tmpfs before a bind onto it
    mounts: list[tuple[Path, int, list[str]]] = []
    for p in hidden - scratch:
        # a file (a key, a config) is hidden behind an empty one
        mounts.append((p, 0, ["--tmpfs", str(p)] if p.is_dir() else ["--ro-bind", "/dev/null", str(p)]))
    for p in scratch:
        mounts.append((p, 0, ["--perms", "1777", "--tmpfs", str(p)]))
    binds = [(p, ["--ro-bind", str(p), str(p)]) for p in shown]
    binds += [(d, ["--dev-bind", str(d), str(d)]) for d in map(_real, devices)]
    binds.append((top, ["--bind", str(top), str(top)]))
    if shm is not None:
        binds.append((Path("/dev/shm"), ["--bind", str(_real(shm)), "/dev/shm"]))
    made: set[Path] = set()
    for p, args in binds:
        mounts.append((p, 2 if p == top else 1, args))
        # bubblewrap makes a file's missing parents 0700 (root's): make them traversable
        below = max((c for c in covered | {Path("/dev")} if _under(p, c)), key=lambda c: len(c.parts), default=None)
        for d in p.parents:
            if below is None or d == below or d in made:
                break
            made.add(d)
            mounts.append((d, 0, ["--perms", "0755", "--dir", str(d)]))
    mounts.sort(key=lambda m: (len(m[0].parts), m[1], str(m[0])))
    argv = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    for _, _, args in mounts:
        argv += args
    # no --die-with-parent: it follows the thread that spawned bwrap, and trio spawns from a
    # worker thread that exits after 10 s idle (every rank was SIGKILLed 10 s in); a rank
    # outliving the daemon is the job cgroup's to end
    # no --new-session: a rank has no controlling terminal to push input into (the daemon
    # starts it in a session of its own, stdin /dev/null), and bubblewrap's pid 1 must stay in
    # the rank's process group, so that the group's SIGKILL when the rank exits takes the
    # namespace down with what the rank left in it (a setsid'd child holding its stdout)
    argv += ["--chdir", str(cwd), "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--"]
    return argv + setpriv_argv(setpriv, uid, gid)


def setpriv_argv(setpriv: str, uid: int, gid: int) -> list[str]:
    """The drop to the job's identity alone, up to the "--" before the rank's argv."""
    return [setpriv, "--reuid", str(uid), "--regid", str(gid), "--clear-groups", "--bounding-set", "-all",
            "--inh-caps", "-all", "--no-new-privs", "--"]


def interpreter_paths() -> list[Path]:
    """The directories the daemon's Python lives in (its venv and the installation the venv
    was made from, as named and with links resolved) and the swarmd package's: what a job
    needs exposed to run `sys.executable` and import swarmd.train when one of them lies
    under a hidden path."""
    found: list[Path] = []
    names = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]
    for name in names:
        for p in (Path(name), _real(Path(name))):
            if p not in found and p.exists():
                found.append(p)
    exe = _real(Path(sys.executable)).parent
    if exe.exists() and not any(_under(exe, p) for p in found):
        found.append(exe)
    # the swarmd package, for its jobs' library (swarmd.train): in the venv when installed, beside
    # it in a checkout's editable install (only the package: the rest of the checkout stays hidden)
    package = _real(Path(__file__)).parents[3]
    if package.is_dir() and not any(_under(package, p) for p in found):
        found.append(package)
    return found


def detect_bwrap(name: str = "bwrap") -> str:
    """The path of a bubblewrap that works here, or why there is none (the message starts
    with no "/")."""
    path = shutil.which(name)
    if path is None:
        return f"{name} (bubblewrap) is not installed"
    if os.geteuid() != 0:
        return "swarmd is not root: bubblewrap cannot build a job's view without it"
    probe = [path, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--tmpfs", "/tmp",
             "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--",
             "/bin/sh", "-c", "exit 0"]
    try:
        done = subprocess.run(probe, stdin=subprocess.DEVNULL, capture_output=True, timeout=PROBE_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{path} cannot be run: {exc}"
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        return f"{path} cannot create namespaces here (exit {done.returncode}): {why[-1] if why else 'no message'}"
    return path


def _real(p: Path) -> Path:
    """The path with links resolved: bubblewrap mounts onto what a link points at, and
    parents-first ordering compares real paths."""
    return Path(os.path.realpath(p))


def _under(p: Path, parent: Path) -> bool:
    return p != parent and p.is_relative_to(parent)

