"""The job protocol's requests as types (host/service.py has the protocol and who may ask what):
each a frozen dataclass whose `to_wire` is the map the coordinator sends and whose
`from_wire` reads a peer's map, checking every field's type and range and naming the
field it refuses (ValueError; the handler counts it `malformed` and answers the reason).
The first frame of every op is ``{op, job, cert}`` and the op's fields (host/service.py checks
the first three); `Start` is the second frame of a start."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from .checkpoints.rules import check_listed, check_name, is_sha256
from .ids import check_job_id
from .spec import ENV_NAME, MAX_CMD, MAX_CPUS, MAX_ENV, MAX_MEM_MB, MAX_TEXT, Serve, SpecError, serve_from_wire
from .torchenv import NodeRole
from .workdir import is_digest

MAX_LEASE = 300.0
# a Ray job's auth token: minted by its coordinator (64 hex digits), written for its ranks by
# host/rayhost.py; here, not there, so the host's side is not below this module
TOKEN = re.compile(r"[0-9a-f]{64}")
MAX_NODES = 1024  # as a job spec allows
MAX_PROCS_PER_NODE = 256


@dataclass(frozen=True)
class Reserve:
    """Hold `gpus` GPUs and room for `ranks` ranks for `lease` seconds."""

    OP: ClassVar[str] = "reserve"
    gpus: int
    ranks: int
    lease: float

    def to_wire(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "ranks": self.ranks, "lease": self.lease}

    @classmethod
    def from_wire(cls, req: dict[str, Any]) -> Reserve:
        ranks = _uint(req, "ranks")
        if not 1 <= ranks <= MAX_PROCS_PER_NODE:
            raise ValueError(f"'ranks' must be 1-{MAX_PROCS_PER_NODE}")
        return cls(gpus=_uint(req, "gpus"), ranks=ranks, lease=_lease(req.get("lease")))


@dataclass(frozen=True)
class Commit:
    """Turn the lease into a hold; `port`: also name a free TCP port of the host (rank 0's)."""

    OP: ClassVar[str] = "commit"
    port: bool

    def to_wire(self) -> dict[str, Any]:
        return {"port": self.port}

    @classmethod
    def from_wire(cls, req: dict[str, Any]) -> Commit:
        return cls(port=bool(req.get("port")))


@dataclass(frozen=True)
class Workdir:
    """The job's workdir, the tree of sha256 `digest`, packed in `size` bytes."""

    OP: ClassVar[str] = "workdir"
    digest: str
    size: int

    def to_wire(self) -> dict[str, Any]:
        return {"digest": self.digest, "size": self.size}

    @classmethod
    def from_wire(cls, req: dict[str, Any]) -> Workdir:
        digest, size = req.get("digest"), _uint(req, "size")
        if not is_digest(digest):
            raise ValueError("'digest' must be a sha256 hex digest")
        return cls(digest=digest, size=size)


@dataclass(frozen=True)
class Forward:
    """A byte pipe to the job's listener on TCP `port` of the host."""

    OP: ClassVar[str] = "forward"
    port: int

    def to_wire(self) -> dict[str, Any]:
        return {"port": self.port}

    @classmethod
    def from_wire(cls, req: dict[str, Any]) -> Forward:
        return cls(port=_port(req.get("port")))


@dataclass(frozen=True)
class CkptPut:
    """The checkpoint `name` of the job (its sha256 and size) into the host's cache."""

    OP: ClassVar[str] = "ckpt_put"
    name: str
    sha256: str
    size: int

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256, "size": self.size}

    @classmethod
    def from_wire(cls, req: dict[str, Any]) -> CkptPut:
        name = check_name(req.get("name"))
        sha, size = req.get("sha256"), _uint(req, "size")
        if not is_sha256(sha):
            raise ValueError("'sha256' must be 64 lowercase hex digits")
        return cls(name=name, sha256=sha, size=size)


@dataclass(frozen=True)
class CkptGet:
    """The checkpoint of sha256 `sha256` out of the requester's cache of the job."""

    OP: ClassVar[str] = "ckpt_get"
    sha256: str

    def to_wire(self) -> dict[str, Any]:
        return {"sha256": self.sha256}

    @classmethod
    def from_wire(cls, req: dict[str, Any]) -> CkptGet:
        sha = req.get("sha256")
        if not is_sha256(sha):
            raise ValueError("'sha256' must be 64 lowercase hex digits")
        return cls(sha256=sha)


@dataclass(frozen=True)
class Start:
    """What a host's ranks of the job run (the start's second frame): the node's `role`, the
    command and its environment, the interpreter, the workdir's digest (None: an empty
    directory), the checkpoints it finds in its cache, its CPU and memory limits (0: the
    host's share per slot) and, for a Ray job, the cluster's token."""

    role: NodeRole
    cmd: tuple[str, ...]
    env: dict[str, str]
    python: str | None = None
    workdir: str | None = None
    checkpoints: tuple[tuple[str, str, int], ...] = ()
    cpus: float = 0.0
    mem_mb: int = 0
    ray: str | None = None
    serve: Serve | None = None  # a service's replica: the host gives it $PORT and announces it

    def to_wire(self) -> dict[str, Any]:
        return {"role": role_to_wire(self.role), "cmd": list(self.cmd), "env": self.env, "python": self.python,
                "workdir": self.workdir, "checkpoints": [list(c) for c in self.checkpoints],
                "limits": {"cpus": self.cpus, "mem_mb": self.mem_mb}, "ray": self.ray,
                **({"serve": self.serve.to_wire()} if self.serve is not None else {})}

    @classmethod
    def from_wire(cls, body: Any, checkpoint_max: int) -> Start:
        """`checkpoint_max`: the largest checkpoint this host takes (a listed one over it is refused)."""
        if not isinstance(body, dict):
            raise ValueError("the start request must be a map")
        python, workdir = body.get("python"), body.get("workdir")
        if workdir is not None and not is_digest(workdir):
            raise ValueError("'workdir' must be a sha256 hex digest (the tree shipped for the job) or absent")
        return cls(role=role_from_wire(body.get("role")), cmd=tuple(_strings(body.get("cmd"), "cmd")),
                   env=_env(body.get("env")), python=_text(python, "python") if python is not None else None,
                   workdir=workdir,
                   checkpoints=check_listed(body.get("checkpoints"), checkpoint_max),
                   ray=_ray_token(body.get("ray")), serve=_serve(body.get("serve")),
                   **limits_from_wire(body.get("limits")))


def _port(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 65535:
        raise ValueError("'port' must be an integer from 1 to 65535")
    return v


def _lease(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 1 <= v <= MAX_LEASE:
        raise ValueError(f"'lease' must be 1-{MAX_LEASE:g} seconds")
    return float(v)


def _uint(req: dict[str, Any], name: str) -> int:
    v = req.get(name, 0)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**40:
        raise ValueError(f"'{name}' must be a non-negative integer")
    return v


def _text(v: Any, name: str) -> str:
    if not isinstance(v, str) or len(v) > MAX_TEXT or "\0" in v:
        raise ValueError(f"'{name}' must be a string of at most {MAX_TEXT} characters")
    return v


def _strings(v: Any, name: str) -> list[str]:
    if not isinstance(v, list) or not 1 <= len(v) <= MAX_CMD:
        raise ValueError(f"'{name}' must be a list of 1-{MAX_CMD} strings")
    return [_text(x, name) for x in v]


def _env(v: Any) -> dict[str, str]:
    if not isinstance(v, dict) or len(v) > MAX_ENV:
        raise ValueError(f"'env' must map at most {MAX_ENV} names to strings")
    for k, x in v.items():
        if not isinstance(k, str) or not ENV_NAME.fullmatch(k):
            raise ValueError("'env' names must be letters, digits and _, not starting with a digit")
        _text(x, f"env.{k}")
    return v


def role_from_wire(v: Any) -> NodeRole:
    """A node's part in a job, from a peer: every number in range (a member's request must
    not make this host start a thousand ranks), every address an IP."""
    if not isinstance(v, dict):
        raise ValueError("'role' must be a map")

    def integer(name: str, low: int, high: int) -> int:
        x = v.get(name)
        if isinstance(x, bool) or not isinstance(x, int) or not low <= x <= high:
            raise ValueError(f"'role.{name}' must be an integer from {low} to {high}")
        return x

    def ip(x: Any, name: str) -> str:
        try:
            if not isinstance(x, str) or "%" in x:  # a scoped address names an interface of this host
                raise ValueError
            return str(ipaddress.ip_address(x))
        except ValueError:
            raise ValueError(f"'role.{name}' must be an IP address (no zone)") from None

    nnodes = integer("nnodes", 1, MAX_NODES)
    ips = v.get("node_ips")
    if not isinstance(ips, list) or len(ips) != nnodes:
        raise ValueError("'role.node_ips' must list one address per node")
    job = check_job_id(v.get("job_id"), "role.job_id")
    return NodeRole(job_id=job, node_rank=integer("node_rank", 0, nnodes - 1), nnodes=nnodes,
                    procs_per_node=integer("procs_per_node", 1, MAX_PROCS_PER_NODE),
                    master_addr=ip(v.get("master_addr"), "master_addr"),
                    master_port=integer("master_port", 1, 65535), ifname=None, gpus=(),
                    node_ips=tuple(ip(x, "node_ips") for x in ips), checkpoint_dir="",
                    restart_count=integer("restart_count", 0, 1_000_000),
                    max_restarts=integer("max_restarts", 0, 1_000_000) if "max_restarts" in v else 0,
                    groups=_groups(v.get("groups", []), nnodes))


def _groups(value: Any, nnodes: int) -> tuple[tuple[int, ...], ...]:
    """A role's latency groups: lists of node ranks naming each of 0..nnodes-1 exactly once, or
    none (a coordinator is a member like any other: a malformed list must not reach the ranks)."""
    if value == []:
        return ()
    if not isinstance(value, list) or not 0 < len(value) <= nnodes or not all(
            isinstance(g, list) and g and all(isinstance(n, int) and not isinstance(n, bool) for n in g)
            for g in value) or sorted(n for g in value for n in g) != list(range(nnodes)):
        raise ValueError(f"'role.groups' must list groups of node ranks naming each of 0..{nnodes - 1} once")
    return tuple(tuple(g) for g in value)


def _ray_token(v: Any) -> str | None:
    """A Ray job's auth token (rayhost.py), or None for a torch job."""
    if v is None:
        return None
    if not isinstance(v, str) or not TOKEN.fullmatch(v):
        raise ValueError("'ray' must be the job's Ray token: 64 lowercase hex characters")
    return v


def _serve(v: Any) -> Serve | None:
    if v is None:
        return None
    try:
        return serve_from_wire(v)
    except SpecError as exc:
        raise ValueError(str(exc).removeprefix("spec: ")) from None


def limits_from_wire(v: Any) -> dict[str, Any]:
    """The job's --cpus and --mem for this host, from a peer: its sandbox's CPU quota and
    memory limit (absent: this host's share per slot)."""
    if v is None:
        return {}
    if not isinstance(v, dict) or set(v) - {"cpus", "mem_mb"}:
        raise ValueError("'limits' must be a map of cpus and mem_mb")
    cpus, mem = v.get("cpus", 0.0), v.get("mem_mb", 0)
    if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not 0 <= cpus <= MAX_CPUS:
        raise ValueError(f"'limits.cpus' must be a number from 0 to {MAX_CPUS}")
    if isinstance(mem, bool) or not isinstance(mem, int) or not 0 <= mem <= MAX_MEM_MB:
        raise ValueError(f"'limits.mem_mb' must be an integer from 0 to {MAX_MEM_MB}")
    return {"cpus": float(cpus), "mem_mb": mem}


def role_to_wire(role: NodeRole) -> dict[str, Any]:
    out = {k: (list(x) if isinstance(x, tuple) else x) for k, x in dataclasses.asdict(role).items()}
    out["groups"] = [list(g) for g in role.groups]  # (asdict leaves the inner ones tuples)
    return out
