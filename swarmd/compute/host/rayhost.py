"""A host's part in a Ray job (issue 14): its port block, its token file, its Ray node's command.

A Ray job's rank on each host is `raynode.py` (the Ray node; on the first host also the
driver), run like any rank: in the job's sandbox, as the job's uid. This module is what
the worker needs to start it:
- `PortBlocks` hands each running Ray job on this host a block of `BLOCK` consecutive ports
  from the `ray_ports` range, free now (every port of it checked by binding) and not another
  job's, and takes it back when the job's ranks end. raynode.layout says what each port of a
  block is for. Limits: the check is of the moment (Ray binds the ports itself, later: a
  socket bound in between, by a co-located job too, still takes a port of the block), and a
  job that binds one port of every block leaves none free (NoPorts: refused, not misplaced).
- `write_token` puts the job's auth token (from its coordinator: 64 hex characters) in a
  file of the job's directory readable only by the job's uid.
- `rank_argv` is the command of the rank; `ray_env` what Ray reads from the environment
  (token auth on, usage stats off).
Sizes given to Ray are the job's own on this host: `--num-cpus` its CPUs (at least 1),
`--num-gpus` its GPUs, the object store `OBJECT_STORE_SHARE` of its memory limit, and what
is left after Ray's own processes (`SYSTEM_SHARE`, at least `SYSTEM_MIN`) `--memory` for tasks
and actors.
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import trees
from ..messages import TOKEN
from . import raynode

BLOCK = 100  # ports of one job on one host: raynode.FIXED of its node's, the rest for its workers
DEFAULT_RANGE = (20000, 29999)  # below Linux's ephemeral ports (32768-60999)
OBJECT_STORE_SHARE = 0.3  # Ray's own default share of a node's memory
# left out of what Ray may schedule: its own processes (GCS, raylet, agents: ~850 MiB on a head,
# ~510 MiB on a worker, measured) and the driver, so tasks at Ray's limit do not meet the cgroup's
SYSTEM_SHARE, SYSTEM_MIN = 0.2, 1 << 30
MIN_OBJECT_STORE = 80 * 2**20  # Ray refuses less than 75 MiB
TEMP_ROOT = "/tmp"  # where a job without the sandbox's private /tmp gets its Ray temp dir
TEMP_IN_BOX = "/tmp/ray"  # inside the sandbox /tmp is the job's own tmpfs: short socket paths, gone with it
WAIT_FOR_CLUSTER = 120.0
RAY_STOP_GRACE = 10.0  # a stopped Ray job's rank (raynode: driver, then node) gets this long before SIGKILL


class NoPorts(Exception):
    """Every block of this host's Ray port range is taken or in use."""


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


class PortBlocks:
    """Blocks of ports for the Ray jobs running on this host, keyed by (coordinator, job)."""

    def __init__(self, ports: tuple[int, int] = DEFAULT_RANGE, *, free: Callable[[int], bool] = port_free) -> None:
        low, high = ports
        self.bases = list(range(low, high + 1 - BLOCK + 1, BLOCK))
        self.held: dict[tuple[str, str], int] = {}
        self.free = free

    def take(self, key: tuple[str, str]) -> int:
        if key in self.held:
            return self.held[key]
        taken = set(self.held.values())
        for base in self.bases:
            # every port of the block, not only its node's (raynode.FIXED): a co-located job holding
            # a worker port of each block would otherwise have every Ray job here fail its workers
            if base not in taken and all(self.free(p) for p in range(base, base + BLOCK)):
                self.held[key] = base
                return base
        raise NoPorts(f"no free block of {BLOCK} Ray ports on this host ({len(self.held)} Ray jobs hold one)")

    def give_back(self, key: tuple[str, str]) -> None:
        self.held.pop(key, None)


@dataclass(frozen=True, slots=True, kw_only=True)
class RayNode:
    """What one host's Ray node of a job is."""
    head: bool
    ip: str  # this host's address in the job (its overlay address)
    gcs: str  # head: its GCS port; worker: the head's ip:port
    base: int  # this job's port block here
    nodes: int  # Ray nodes in the job
    cpus: int
    gpus: int
    memory: int  # bytes of the job's memory limit here (0: not limited)
    temp: str  # Ray's temp dir ("" : a fresh one in /tmp, removed at the end)


def ray_temp_prefix(top: Path) -> str:
    """The name Ray's temp dirs of the job at `top` start with in /tmp (a job without the
    sandbox's private /tmp): short, since Unix socket paths take 107 bytes and the job's own
    directory is too deep; with mkdtemp's 8 random characters about 33 bytes, leaving Ray's
    session and socket names (about 64) room."""
    return f"swarmd-ray-{hashlib.sha256(str(top).encode()).hexdigest()[:8]}-"


def make_temp_dir(top: Path, uid: int | None) -> Path:
    """A fresh temp dir for the job's Ray node, the job uid's. Its name ends in random
    characters and is made exclusively (mkdtemp): a local user who could predict a fixed name
    in the world-writable /tmp could make it first and fail every start of the job."""
    remove_temp_dirs(top)  # a leftover of a daemon killed with the job
    path = Path(tempfile.mkdtemp(prefix=ray_temp_prefix(top), dir=TEMP_ROOT))
    if uid is not None and os.geteuid() == 0:
        os.chown(path, uid, uid)
    return path


def remove_temp_dirs(top: Path) -> None:
    """Remove every Ray temp dir of the job at `top`, at any depth (the job shaped them),
    links never followed: when its ranks end, whatever killed them, and before a start. A
    local user's entry of the same prefix is theirs to lose: nothing is followed or read."""
    prefix = ray_temp_prefix(top)
    with os.scandir(TEMP_ROOT) as entries:
        found = [Path(e.path) for e in entries if e.name.startswith(prefix)]
    for path in found:
        trees.remove(path)


def install_launcher(top: Path) -> Path:
    """raynode.py copied into the job's directory (the daemon's, world-readable): the job's
    uid reads it there wherever swarmd itself is installed."""
    dest = top / "raynode.py"
    dest.write_bytes(Path(raynode.__file__).read_bytes())
    dest.chmod(0o444)
    return dest


def split_memory(memory: int) -> tuple[int, int]:
    """(bytes for tasks and actors, bytes of object store) of a node with `memory` (0: Ray's defaults)."""
    if not memory:
        return 0, 0
    store = max(MIN_OBJECT_STORE, int(memory * OBJECT_STORE_SHARE))
    system = max(SYSTEM_MIN, int(memory * SYSTEM_SHARE))
    return max(memory - store - system, 2**20), store


def describe(node: RayNode) -> dict[str, int]:
    """What Ray is given on this host, for the coordinator's `jobs show`."""
    tasks, store = split_memory(node.memory)
    return {"cpus": node.cpus, "gpus": node.gpus, "memory": tasks, "object_store": store}


def rank_argv(python: str, launcher: Path, node: RayNode, driver: list[str]) -> list[str]:
    tasks, store = split_memory(node.memory)
    argv = [python, str(launcher), "--head" if node.head else "--worker", f"--ip={node.ip}", f"--gcs={node.gcs}",
            f"--ports={node.base}:{BLOCK}", f"--nodes={node.nodes}", f"--cpus={node.cpus}", f"--gpus={node.gpus}",
            f"--wait={WAIT_FOR_CLUSTER:g}", f"--temp={node.temp}"]
    if node.memory:
        argv += [f"--memory={tasks}", f"--object-store={store}"]
    return argv + (["--", *driver] if node.head else [])


def ray_cpus(cpus: float) -> int:
    """Ray counts whole CPUs: the job's share, rounded up, at least one."""
    return max(1, math.ceil(cpus - 1e-9))


def ray_env(token_path: Path) -> dict[str, str]:
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path), "RAY_USAGE_STATS_ENABLED": "0"}


def write_token(path: Path, token: str, uid: int | None, gid: int | None) -> None:
    """The token, readable by the job's uid alone (the daemon's, mode 0400, when it has none)."""
    if not TOKEN.fullmatch(token):
        raise ValueError("a Ray token is 64 lowercase hex characters")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
    try:
        os.write(fd, token.encode())
        if uid is not None and os.geteuid() == 0:
            os.fchown(fd, uid, gid if gid is not None else uid)
    finally:
        os.close(fd)
