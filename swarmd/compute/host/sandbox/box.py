"""The sandbox as the worker uses it: what this host can confine, and one box per job.

`Sandbox.start` finds out, once, which parts this host can do and says why a part is
missing; `Sandbox.open` gives a job its box for as long as its ranks run. Rules:
- Parts: `uid` (a uid and gid of the job's own from `job_uids`: needs root), `cgroup`
  (v1 or v2: memory, CPU quota, pids, v1 device whitelist; cgroups.py), `namespaces`
  (bubblewrap: a read-only view of the host without the daemon's directories, a private
  /tmp, its own /proc and pid namespace, a /dev with only what a job needs and its GPUs;
  mounts.py), `firewall` (nftables rules keyed on the job's uid; firewall.py). `auto`
  uses every part this host has and runs without the others; `required` refuses jobs
  unless all four are there; `off` runs ranks as `job_user`, as before the sandbox.
- A rank starts as a chain, spawned by the daemon (root): `sh` writes its own pid into
  the job's cgroup before anything can fork, execs bwrap, which builds the view and execs
  setpriv, which drops to the job's uid with no capabilities and no way to regain any
  (no_new_privs, empty bounding set) and execs the rank's command. Without bwrap, setpriv
  follows sh directly.
- The box's uid is the job's alone while it has a process or a file on this host: when
  the box closes, its processes are gone and its files in the job's directory are handed
  to the daemon (links never followed); only then does the uid go back to the pool, which
  hands it out again only once nothing of it remains anywhere a job could write, and
  least recently used first (uids.py).
- Without a cgroup, closing the box kills every process of the job's uid (what a rank
  left with setsid included): a process dropped to that uid sends SIGKILL to -1, which
  reaches every process whose real or saved uid is the job's (kill(2)), in one pass the
  kernel makes under its task list lock, so none forks past it; repeated until /proc
  shows none, `KILL_WAIT` at most. The uid is the job's alone, so nothing else is hit.
- Without bubblewrap the job wrote in the host's /tmp, /var/tmp, /dev/shm and SysV IPC:
  once none of its processes is left, what its uid owns at their top level and its IPC
  objects are removed (`clear_uid`), as a private /tmp would have gone; what remains
  deeper keeps the uid from the next job (uids.py).
- /dev/shm shared by a job's ranks (with bubblewrap) lies in a directory of this daemon's
  life in the host's /dev/shm, made by mkdtemp at its first job (a name nobody can take
  first: a fixed name there, world-writable and sticky, could be made by any local user
  to fail every job start), root's, 0711; one 0700 directory of the job's uid in it per
  job. It goes when the daemon stops; a killed daemon's goes at its next start.
- Closing the box kills everything left in its cgroup (a `setsid` + `sleep` included),
  reads peak memory, CPU time and OOM kills, removes the cgroup and the firewall chain.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import trio

from ... import trees
from ...spec import ENV_NAME
from . import cgroups, firewall, mounts
from .cgroups import Limits, Usage
from .uids import LOWEST, SCRATCH, SYSVIPC, UidPool, ipc_of, pids_of

log = structlog.get_logger("swarmd.sandbox")

PARTS = ("uid", "cgroup", "namespaces", "firewall")
CHAIN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}  # the root stages' only environment
LOAD_ENV = 'set -a && . "$0" && set +a && exec "$@"'  # as the job: its variables, then its command
JOIN_CGROUP = 'for f; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; shift; done; shift; exec "$@"'
# never visible to a job: where other users keep secrets, and the host's services' state
HIDDEN = ("/root", "/home", "/run", "/var/lib", "/var/log", "/var/cache", "/var/spool", "/var/mail", "/srv",
          "/mnt", "/media", "/boot", "/lost+found", "/etc/swarmd", "/etc/wireguard", "/etc/ssh")
SHM = Path("/dev/shm")
GPU_SIDE_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
KILL_ALL = "kill -s KILL -- -1"  # as the job's uid: every process of that uid but the shell itself
KILL_WAIT = 5.0  # seconds for the uid's processes to go: SIGKILL is not ignored, but a D-state task is slow


class SandboxError(Exception):
    """A job cannot be confined as this host is configured to require."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    mode: str  # auto | required | off
    uids: tuple[int, int]
    egress: str  # mesh | internet
    egress_allow: tuple[str, ...]
    paths: tuple[Path, ...]
    pids: int
    state_dir: Path
    jobs_dir: Path
    socket: Path
    name: str  # this daemon's cgroup under its own: unique per daemon (several share a lab machine)
    mesh_ifname: str | None = None
    daemon_port: int | None = None  # the daemon's libp2p TCP port, answered over the mesh
    serve_ports: tuple[int, int] | None = None  # service replicas' ports (firewall.Policy)


@dataclass(slots=True)
class Box:
    """One job's confinement on this host while its ranks run."""

    uid: int | None
    parts: tuple[str, ...]
    prefix: list[str] = field(default_factory=list)  # argv before the rank's command
    top: Path | None = None  # the job's directory: root's, where each rank's environment file is written
    cgroup: cgroups.JobCgroup | None = None
    usage: Usage | None = None
    memory_limit: int | None = None

    def command(self, argv: Sequence[str], env: Mapping[str, str], rank: int) -> tuple[list[str], dict[str, str]]:
        """The chain that runs `argv` as the job with `env`, and the chain's own environment.

        Nothing of the job's environment reaches the stages that run as root (sh, bwrap,
        setpriv): LD_PRELOAD, BASH_ENV and their kind would run the job's code there. The
        rank's variables are written to a file in the job's directory (root's: the job can
        neither plant nor swap it), which a last shell, already the job's uid, exports
        before it execs the command."""
        if not self.prefix:
            return list(argv), dict(env)
        assert self.top is not None
        path = self.top / f".env-{rank}"
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
        with os.fdopen(fd, "w") as f:
            for name, value in env.items():
                if not ENV_NAME.fullmatch(name):
                    raise ValueError(f"environment variable name {name[:40]!r} is not a shell name")
                f.write(f"{name}={shlex.quote(value)}\n")
        if self.uid is not None:
            os.chown(path, self.uid, self.uid)
        return [*self.prefix, "/bin/sh", "-c", LOAD_ENV, str(path), *argv], dict(CHAIN_ENV)

    def describe(self) -> str:
        return ", ".join(self.parts) if self.parts else "none"

    def signal(self, sig: signal.Signals) -> bool:
        """Send `sig` to the job's own processes (not bubblewrap's, which end with them);
        False when there is no cgroup to find them by."""
        if self.cgroup is None:
            return False
        for pid in self.cgroup.pids():
            try:
                if os.readlink(f"/proc/{pid}/exe").endswith("/bwrap"):
                    continue
                os.kill(pid, sig)
            except OSError:
                continue  # gone already
        return True


class Sandbox:
    def __init__(self, settings: Settings, parts: dict[str, str], *, hierarchy: cgroups.Hierarchy | None,
                 bwrap: str | None, policy: firewall.Policy | None, pool: UidPool | None,
                 setpriv: str | None) -> None:
        self.settings = settings
        self.parts = parts  # part -> what it is here, or "off: why"
        self.hierarchy = hierarchy
        self.bwrap = bwrap
        self.policy = policy
        self.pool = pool
        self.setpriv = setpriv
        self.shm: Path | None = None  # the jobs' shared /dev/shm directories' parent, made at the first job
        self._shm_made = trio.Lock()

    # --- what this host can do ---------------------------------------------------------

    @classmethod
    async def start(cls, settings: Settings) -> Sandbox:
        if settings.mode == "off":
            return cls(settings, {p: "off: sandbox = off" for p in PARTS}, hierarchy=None, bwrap=None, policy=None,
                       pool=None, setpriv=None)
        parts: dict[str, str] = {}
        root = os.geteuid() == 0
        setpriv = shutil.which("setpriv")
        pool = None
        if not root:
            parts["uid"] = "off: swarmd is not root"
        elif setpriv is None:
            parts["uid"] = "off: setpriv (util-linux) is not installed"
        else:
            pool = UidPool(*settings.uids, settings.jobs_dir, history=settings.state_dir / "job-uids")
            parts["uid"] = f"a uid per job from {settings.uids[0]}-{settings.uids[1]}"
        hierarchy = None
        found = await trio.to_thread.run_sync(cgroups.detect)
        if isinstance(found, str):
            parts["cgroup"] = f"off: {found}"
        else:
            try:  # what a previous life left (ranks outlive a killed daemon) is killed first
                await trio.to_thread.run_sync(found.discard, settings.name)
                await trio.to_thread.run_sync(found.parent, settings.name)
                hierarchy = found
                parts["cgroup"] = found.describe()
            except cgroups.CgroupError as exc:
                parts["cgroup"] = f"off: {exc}"
        await trio.to_thread.run_sync(remove_left_shm, settings.name)
        bwrap = None
        if pool is None:
            parts["namespaces"] = "off: needs the per-job uid"
        else:
            found_bwrap = await trio.to_thread.run_sync(mounts.detect_bwrap)
            if found_bwrap.startswith("/"):
                bwrap = found_bwrap
                parts["namespaces"] = "mount, pid, ipc, uts (bubblewrap): host read-only, private /tmp"
            else:
                parts["namespaces"] = f"off: {found_bwrap}"
        policy = None
        if pool is None:
            parts["firewall"] = "off: needs the per-job uid"
        elif (why := await trio.to_thread.run_sync(firewall.detect)) is not None:
            parts["firewall"] = f"off: {why}"
        else:
            policy = firewall.Policy(uids=settings.uids, egress=settings.egress,
                                     allow=tuple(ipaddress.ip_network(n) for n in settings.egress_allow),
                                     resolvers=_resolvers(), mesh_ifname=settings.mesh_ifname,
                                     daemon=None if settings.daemon_port is None else (os.geteuid(),
                                                                                         settings.daemon_port),
                                     serve_ports=settings.serve_ports if settings.mesh_ifname else None,
                                     table=firewall.table_for(os.getpid()))
            try:  # a killed daemon's chains would judge the next job handed their uids; failing, ours still go up
                left = firewall.stale(await firewall.tables("inet"), firewall.is_swarmd)
                if left:
                    await firewall.apply(firewall.sweep(left))
                    log.info("job firewall tables of daemons gone removed", tables=left)
            except firewall.FirewallError as exc:
                log.warning("job firewall tables of daemons gone not removed", error=str(exc))
            try:
                await firewall.apply(firewall.base(policy))
                parts["firewall"] = f"nftables: egress {settings.egress}" + (
                    f" + {', '.join(settings.egress_allow)}" if settings.egress_allow else "")
            except firewall.FirewallError as exc:
                policy = None
                parts["firewall"] = f"off: {exc}"
        box = cls(settings, parts, hierarchy=hierarchy, bwrap=bwrap, policy=policy, pool=pool, setpriv=setpriv)
        missing = [f"{p} ({parts[p][5:]})" for p in PARTS if parts[p].startswith("off")]
        if missing:
            log.warning("job sandbox incomplete", mode=settings.mode, missing=missing,
                        consequence="jobs are refused" if settings.mode == "required" else "jobs run without them")
        else:
            log.info("job sandbox ready", **parts)
        return box

    async def close(self) -> None:
        """The daemon stops: take down its firewall table and its (empty) cgroups."""
        with trio.CancelScope(shield=True):
            if self.policy is not None:
                try:
                    await firewall.apply(f"delete table inet {self.policy.table}\n")
                except firewall.FirewallError as exc:
                    log.warning("job firewall not removed", error=str(exc))
            if self.hierarchy is not None:
                try:
                    await trio.to_thread.run_sync(self.hierarchy.discard, self.settings.name)
                except cgroups.CgroupError as exc:
                    log.warning("job cgroups not removed", error=str(exc))
            if self.shm is not None:
                await trio.to_thread.run_sync(trees.remove, self.shm)

    @property
    def complete(self) -> bool:
        return not any(v.startswith("off") for v in self.parts.values())

    def status(self) -> dict[str, object]:
        return {"mode": self.settings.mode, "active": any(not v.startswith("off") for v in self.parts.values()),
                "complete": self.complete, "parts": dict(self.parts)}

    # --- one job's box -----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def open(self, *, job: str, top: Path, cwd: Path, memory: int | None, cpus: float | None,
                   gpus: Sequence[int], nodes: Iterable[str] = (),
                   blocked: Iterable[tuple[str, int]] = (), serves: int | None = None) -> AsyncIterator[Box]:
        """The box for one job's ranks on this host (`top` its directory, `cwd` where ranks
        start); on exit everything in it is killed and the box taken down."""
        if self.settings.mode == "required" and not self.complete:
            missing = "; ".join(f"{p}: {v[5:]}" for p, v in self.parts.items() if v.startswith("off"))
            raise SandboxError(f"this host requires the sandbox and cannot provide it ({missing})")
        if self.pool is None:
            yield Box(uid=None, parts=tuple(p for p in PARTS if not self.parts[p].startswith("off")))
            return
        uid = await trio.to_thread.run_sync(self.pool.allocate)
        box = Box(uid=uid, parts=("uid",), memory_limit=memory, top=top)
        devices = _gpu_devices(gpus)
        chain = False
        try:
            if self.hierarchy is not None:
                limits = Limits(memory=memory, cpus=cpus, pids=self.settings.pids,
                                devices=tuple(_device_numbers(devices)))
                box.cgroup = await trio.to_thread.run_sync(self.hierarchy.create, self.settings.name, top.name, limits)
                box.parts += ("cgroup",)
                box.prefix += ["/bin/sh", "-c", JOIN_CGROUP, "sh", *map(str, box.cgroup.procs_files), "--"]
            if self.bwrap is not None:
                hide = [self.settings.state_dir, self.settings.jobs_dir, self.settings.socket, *map(Path, HIDDEN)]
                expose = [*self.settings.paths, *mounts.interpreter_paths()]
                async with self._shm_made:
                    if self.shm is None:  # at the first job: a daemon that runs none leaves none behind
                        self.shm = await trio.to_thread.run_sync(_shm_parent, self.settings.name)
                shm = None if self.shm is None else await trio.to_thread.run_sync(_shared_memory, self.shm / top.name,
                                                                                 uid)
                box.prefix += mounts.bwrap_argv(bwrap=self.bwrap, top=top, cwd=cwd, hide=hide, expose=expose,
                                                devices=devices, uid=uid, gid=uid, setpriv=self.setpriv, shm=shm)
                box.parts += ("namespaces",)
            else:
                box.prefix += mounts.setpriv_argv(self.setpriv, uid, uid)
            if self.policy is not None:
                await firewall.apply(firewall.add_job(self.policy, uid, _addresses(nodes), _pairs(blocked),
                                                      serves=serves))
                chain = True
                box.parts += ("firewall",)
            if self.settings.mode == "required" and len(box.parts) < len(PARTS):
                raise SandboxError(f"only {box.describe()} could be set up for this job")
            yield box
        finally:
            with trio.CancelScope(shield=True):
                if box.cgroup is not None:
                    cg = box.cgroup
                    try:
                        await trio.to_thread.run_sync(cg.kill)
                        box.usage = await trio.to_thread.run_sync(cg.usage)
                        await trio.to_thread.run_sync(cg.remove)
                    except cgroups.CgroupError as exc:
                        log.warning("job cgroup not taken down", job=job, error=str(exc))
                else:  # nothing holds its processes together: the uid does
                    assert self.setpriv is not None  # the pool is there only with it
                    try:
                        left = await trio.to_thread.run_sync(kill_uid, uid, self.setpriv)
                    except OSError as exc:
                        left = [-1]
                        log.warning("a job's processes not killed", job=job, uid=uid, error=str(exc))
                    if left:
                        log.warning("processes of a job survive its end", job=job, uid=uid, pids=left[:10])
                if "namespaces" not in box.parts:  # it wrote in the host's /tmp, /dev/shm, SysV IPC
                    assert self.setpriv is not None
                    try:
                        await trio.to_thread.run_sync(clear_uid, uid, self.setpriv)
                    except OSError as exc:  # what remains keeps the uid from the next job (uids.py)
                        log.warning("a job's files in the host's temp directories not removed", job=job, uid=uid,
                                    error=str(exc))
                # each step whatever the others did: a failed one is logged, and what it left keeps
                # the uid from the next job (uids.py), never the chain or the uid held for good
                if self.shm is not None:
                    await _step(job, "remove its /dev/shm", trio.to_thread.run_sync, trees.remove, self.shm / top.name)
                await _step(job, "hand its files back", trio.to_thread.run_sync, _hand_back, top, uid)
                if chain and self.policy is not None:
                    await _step(job, "remove its firewall chain", firewall.apply, firewall.remove_job(self.policy, uid))
                # it scans /proc and the jobs dir
                await _step(job, "give its uid back", trio.to_thread.run_sync, self.pool.release, uid)


async def _step(job: str, what: str, run: Callable[..., Awaitable[object]], *args: object) -> None:
    """One clean-up step of a box's close: a failure is logged, and the next step runs."""
    try:
        await run(*args)
    except Exception as exc:  # noqa: BLE001 - any error of one step must not skip the others
        log.warning("a step of a job's sandbox clean-up failed", job=job, step=what,
                    error=f"{type(exc).__name__}: {exc}")


def name_for(peer: str) -> str:
    """The sandbox's name on the host of daemon ``peer``: its cgroups' and /dev/shm directories'."""
    return f"swarmd-{peer[-8:]}"


def _shm_parent(name: str) -> Path | None:
    """This daemon life's directory in the host's /dev/shm (None without one): a fresh name
    from mkdtemp (O_EXCL, random: no local user can take it first or guess it), root's,
    0711 (a job's uid passes through to its own directory only), named `NAME.XXXXXXXX`
    so that the next start finds it (`remove_left_shm`)."""
    if not SHM.is_dir():
        return None
    path = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=SHM))
    os.chmod(path, 0o711)
    return path


def remove_left_shm(name: str) -> None:
    """What a killed life of this daemon left in /dev/shm (at its next start, or a lab's
    `down` once its daemons are gone): its `_shm_parent` directories
    (only root's: a local user's lookalike is neither used nor removed), and the jobs'
    directories of the layout before (/dev/shm/swarmd/NAME-*, where that parent is root's)."""
    for entry in _entries(SHM):
        if entry.name.startswith(f"{name}.") and _roots_dir(Path(entry.path)):
            trees.remove(Path(entry.path))
    if _roots_dir(SHM / "swarmd"):
        for entry in _entries(SHM / "swarmd"):
            if entry.name.startswith(f"{name}-"):
                trees.remove(Path(entry.path))


def _entries(d: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(d) as it:
            return list(it)
    except OSError:
        return []


def _roots_dir(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == 0


def _shared_memory(path: Path, uid: int) -> Path:
    """/dev/shm for a job's ranks on this host to share (each rank has its own namespaces):
    `path` in this daemon's `_shm_parent` (only root writes there), made for the job's uid
    alone."""
    trees.remove(path)  # a leftover of a start of the same job directory
    os.mkdir(path, 0o700)
    os.chown(path, uid, uid)
    return path


def clear_uid(uid: int, setpriv: str, scratch: Sequence[Path] = SCRATCH, sysvipc: Path = SYSVIPC,
              proc: Path = Path("/proc")) -> None:
    """What a job without bubblewrap left where every local user writes, as systemd's
    RemoveIPC= does for a user's last process, and its private /tmp would have: the entries
    of the world-writable directories (`scratch`) that `uid` owns, and its SysV IPC
    objects. Only once no process of the uid is left (else nothing is touched): then nobody
    can replace such an entry (the directories are sticky: only its owner or root may
    rename or remove it), and the IPC objects are removed by a process of the uid itself,
    which the kernel lets remove only what it owns or created. What is deeper (its files in
    another user's world-writable directory) stays and keeps the uid from the next job."""
    if uid < LOWEST:
        raise ValueError(f"uid {uid} is not a job's: its files are not ours to remove")
    if pids_of(uid, proc):
        return
    for d in scratch:
        for entry in _entries(d):  # a directory this host lacks has none
            with contextlib.suppress(FileNotFoundError):  # another user's, removed while we looked
                if entry.stat(follow_symlinks=False).st_uid == uid:
                    trees.remove(Path(entry.path))
    flags = {"shm": "-m", "sem": "-s", "msg": "-q"}
    objects = [arg for kind, ident in ipc_of(uid, sysvipc) for arg in (flags[kind], str(ident))]
    ipcrm = shutil.which("ipcrm", path=CHAIN_ENV["PATH"])
    if objects and ipcrm is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):  # what remains keeps the uid held
            subprocess.run([*mounts.setpriv_argv(setpriv, uid, uid), ipcrm, *objects], env=CHAIN_ENV,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           check=False, timeout=KILL_WAIT)


def kill_uid(uid: int, setpriv: str, proc: Path = Path("/proc")) -> list[int]:
    """Kill every process of `uid` (a job's alone: never a system user's); returns the pids
    still there after `KILL_WAIT` seconds of trying (empty: all gone)."""
    if uid < LOWEST:
        raise ValueError(f"uid {uid} is not a job's: its processes are not ours to kill")
    deadline = time.monotonic() + KILL_WAIT
    delay = 0.001
    while left := pids_of(uid, proc):
        if time.monotonic() > deadline:
            return left
        # setpriv fails rather than run the shell as anyone else: the kill is never root's
        with contextlib.suppress(subprocess.TimeoutExpired):  # the deadline decides
            subprocess.run([*mounts.setpriv_argv(setpriv, uid, uid), "/bin/sh", "-c", KILL_ALL], env=CHAIN_ENV,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           check=False, timeout=KILL_WAIT)
        time.sleep(delay)  # the kernel's to reap: no event to wait on
        delay = min(delay * 2, 0.05)
    return []


def _hand_back(top: Path, uid: int) -> None:
    """Give what `uid` owns under `top` to the daemon, so that no file keeps the uid taken."""
    try:
        trees.hand_back(top, uid, os.geteuid())
    except trees.TreeError as exc:
        log.warning("a job's files not handed back", path=str(top), error=str(exc))


def _gpu_devices(gpus: Sequence[int]) -> list[Path]:
    """The device nodes a job holding `gpus` (NVML indices) opens: its GPUs and the driver's
    control nodes, those this host has."""
    if not gpus:
        return []
    paths = [Path(f"/dev/nvidia{i}") for i in gpus] + [Path(p) for p in GPU_SIDE_DEVICES]
    return [p for p in paths if p.exists()]


def _device_numbers(devices: Iterable[Path]) -> Iterable[tuple[str, int, int]]:
    for d in devices:
        rdev = d.stat().st_rdev
        yield "c", os.major(rdev), os.minor(rdev)


def _addresses(nodes: Iterable[str]) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    return [ipaddress.ip_address(n) for n in nodes]


def _pairs(blocked: Iterable[tuple[str, int]]) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    return [(ipaddress.ip_address(a), p) for a, p in blocked]


def _resolvers(path: Path = Path("/etc/resolv.conf")) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...]:
    """The DNS servers this host uses: jobs may ask them (port 53) whatever the egress policy."""
    found = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return ()
    for line in lines:
        words = line.split()
        if len(words) >= 2 and words[0] == "nameserver":
            with contextlib.suppress(ValueError):
                found.append(ipaddress.ip_address(words[1].split("%")[0]))
    return tuple(found)
