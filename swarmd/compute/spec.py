"""What a user asks for: a job spec, from flags, a YAML file, or the wire (sans-IO).

Rules:
- A spec has the fields of `FIELDS`; an unknown one is an error with the nearest known
  name ("unknown field 'node'; did you mean 'nodes'?").
- Flags win over the file; a flag of None is not given. For the maps (labels, env) a flag
  wins per key, so `--env SEED=1` adds to the file's env instead of replacing it.
- Every value is checked where it enters, and a bad one raises `SpecError` naming the
  field, what it must be and what it was (`spec: 'nodes' must be an integer from 1 to
  1024, got 'three'`). Strings stay strings: a YAML number or boolean where a string is
  expected (an env value, a cmd argument) is refused with a hint to quote it, because YAML
  reads `1.10` as 1.1 and `yes` as True.
- `nodes` is N or torchrun's MIN:MAX: the job starts on as many hosts as fit up to MAX, at
  least MIN, and after a lost host goes on with the survivors while they are at least MIN
  (coordinator/run.py). `max_restarts` (default 0) is how many times it is started again.
- `grow` (default true; `--no-grow`): a MIN:MAX job on fewer than MAX hosts grows back
  toward MAX when hosts are free again, at its next checkpoint, at most once per the
  coordinator's `job_grow_every` (coordinator/growth.py). A growth costs one restart from
  that checkpoint but none of `max_restarts`. Exactly true or false: "no" or 0 is refused.
- `groups` (`--groups auto` or a cap such as `50ms`; default off): the coordinator puts the
  placed hosts in groups by their measured RTTs, no group spanning a link slower than the cap
  (30 ms for auto; compute/groups.py), and tells the ranks (SWARM_GROUPS): a script using
  swarmd.train then syncs every step inside a group and every H steps across groups.
- `ray: true` runs a Ray cluster for the job alone (one Ray node per host, the command as its
  driver on the first host; host/raynode.py): one process per node, and no restarts (Ray handles
  failures inside its cluster, e.g. Train's FailureConfig), so `procs_per_node` above 1 and
  `max_restarts` are refused with it.
- Sizes are binary megabytes (8G = 8192); waits are at most 30 days; procs_per_node
  defaults to gpus_per_node when GPUs are asked for, else 1.
- `hosts` is the user's allow list of peer ids (full ids, as `swarmctl peers --json` prints
  them): when given, the job is placed, and placed again after a loss, only there. A job
  trusts the hosts it runs on (rank 0 and a Ray head most: what every host resumes from,
  the Ray token); labels are each host's own claim, a peer id is proven by its key, so
  this, not a label, is how a user keeps a job on providers they trust.
- Specs from the control socket or a peer take the same path (`from_wire`): they are
  untrusted, and anything wrong in them is a `SpecError`, never another exception.
"""

from __future__ import annotations

import difflib
import re
import reprlib
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..p2p.signed import Invalid, peer_bytes
from ..gossip.registry import MAX_INDEX, check_health, check_name
from ..gossip.wire import check_labels
from .groups import MAX_NODES as GROUP_MAX_NODES
from .groups import MAX_RTT_MS as GROUP_RTT_MS

FIELDS = ("name", "nodes", "max_restarts", "gpus_per_node", "procs_per_node", "cpus", "mem", "labels", "hosts",
          "env", "workdir", "wait", "python", "ray", "serve", "grow", "groups", "cmd")
NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")
MAX_ENV = 128
MAX_CMD = 256  # arguments
MAX_TEXT = 4096  # characters in one argument, env value or path
MAX_CPUS = 4096
MAX_MEM_MB = 1 << 30  # 1 PiB
MAX_WAIT_S = 30 * 86400
MAX_NODES = 1024
MAX_RESTARTS = 1000
MAX_HOSTS = 4096  # peer ids in a job's allow list
MAX_PEER_ID = 64  # characters: an Ed25519 peer id is 52
MAX_GROUP_RTT_MS = 10_000.0  # a latency group's cap: above any RTT on Earth
MAX_NEAR, MAX_NEAR_WEIGHT = 8, 1000  # a service replica's demand points (serve/demand.py)
_INT = re.compile(r"\s*[0-9]{1,9}\s*")  # Python refuses int() on more than 4300 digits
_RANGE = re.compile(r"\s*([0-9]{1,9})\s*:\s*([0-9]{1,9})\s*")  # torchrun's --nnodes MIN:MAX
_SIZE = re.compile(r"\s*([0-9]{1,15}(?:\.[0-9]{1,9})?)\s*([A-Za-z]{0,3})\s*")
_MS = re.compile(r"\s*([0-9]{1,6}(?:\.[0-9]{1,6})?)\s*(ms)?\s*")
_DURATION = re.compile(r"\s*([0-9]{1,15}(?:\.[0-9]{1,9})?)\s*([smhd]?)\s*")
_MB_PER = {"": 1, "m": 1, "mb": 1, "mi": 1, "mib": 1, "g": 1024, "gb": 1024, "gi": 1024, "gib": 1024,
           "t": 1024 ** 2, "tb": 1024 ** 2, "ti": 1024 ** 2, "tib": 1024 ** 2}
_S_PER = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_MAPS = ("labels", "env")


@dataclass(frozen=True, slots=True, kw_only=True)
class Serve:
    """A job that is one replica of a service (serve/): set by the service's controller, never by
    a user's `jobs run`. Its host gives it a port ($PORT), checks `health` there and announces
    it; placement keeps replicas of one service on different hosts and, with ``near``, puts it
    where the service's requests enter: the host with the least RTT to those members, weighed
    by their requests (serve/demand.py)."""
    service: str
    replica: int
    health: str = "/"
    near: tuple[tuple[str, int], ...] = ()  # (member, weight 1-MAX_NEAR_WEIGHT), at most MAX_NEAR

    def to_wire(self) -> dict[str, Any]:
        return {"service": self.service, "replica": self.replica, "health": self.health,
                **({"near": [[p, w] for p, w in self.near]} if self.near else {})}


class SpecError(ValueError):
    """A spec that cannot be run; the message names the field and what was wrong."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    cmd: tuple[str, ...]
    name: str | None = None
    nodes: int = 1  # the most hosts the job runs on (MAX of MIN:MAX)
    min_nodes: int = 0  # the fewest it may run on; 0: `nodes` (a fixed size)
    max_restarts: int = 0  # restarts after a lost host or a failed rank before the job fails
    gpus_per_node: int = 0
    procs_per_node: int = 1
    cpus: float = 0.0  # free cores each host must have
    mem_mb: int = 0  # free memory each host must have
    labels: dict[str, str] = field(default_factory=dict)
    hosts: tuple[str, ...] = ()  # the only peers it may run on; (): any member
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None  # a path on the client
    wait_s: float = 0.0  # how long to wait for capacity; 0: fail at once
    python: str | None = None  # interpreter replacing a leading python/python3 in cmd
    ray: bool = False  # a Ray cluster for this job, cmd its driver on the first host
    serve: Serve | None = None  # a service's replica (serve/)
    grow: bool = True  # below `nodes`, grow back toward it at a checkpoint when hosts are free again
    groups: float | None = None  # latency groups: the slowest RTT (ms) a group may span; None: off

    @property
    def least_nodes(self) -> int:
        return self.min_nodes or self.nodes

    @property
    def elastic(self) -> bool:
        return self.least_nodes < self.nodes

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-able map in the file's terms (mem, wait, nodes as "MIN:MAX"), so
        `from_wire` is `build`."""
        nodes: int | str = f"{self.least_nodes}:{self.nodes}" if self.elastic else self.nodes
        return {"cmd": list(self.cmd), "name": self.name, "nodes": nodes, "max_restarts": self.max_restarts,
                "gpus_per_node": self.gpus_per_node,
                "procs_per_node": self.procs_per_node, "cpus": self.cpus, "mem": self.mem_mb,
                "labels": dict(self.labels), "hosts": list(self.hosts), "env": dict(self.env), "workdir": self.workdir, "wait": self.wait_s,
                "python": self.python, "ray": self.ray, "grow": self.grow,
                **({"groups": self.groups} if self.groups is not None else {}),
                **({"serve": self.serve.to_wire()} if self.serve else {})}

    @classmethod
    def from_wire(cls, data: Any) -> JobSpec:
        if not isinstance(data, Mapping):
            raise SpecError(f"spec: expected a map of fields, got {type(data).__name__}")
        return build(data, {})


def _fail(name: str, expected: str, value: Any) -> SpecError:
    return SpecError(f"spec: '{name}' must be {expected}, got {reprlib.repr(value)}")


def _int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, str) and _INT.fullmatch(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _fail(name, f"an integer from {low} to {high}", value)
    return value


def _number(name: str, value: Any, high: float) -> float:
    number = float("nan")
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            number = float(value)
        except (ValueError, OverflowError):
            pass
    if not 0 <= number <= high:
        raise _fail(name, f"a number from 0 to {high:g}", value)
    return number


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_TEXT or "\0" in value:
        raise _fail(name, f"a non-empty string of at most {MAX_TEXT} characters", value)
    return value


def _string(name: str, value: Any) -> str:
    """A string that may be empty: an argument or an env value."""
    if isinstance(value, str) and len(value) <= MAX_TEXT and "\0" not in value:
        return value
    hint = " (quote it in YAML)" if isinstance(value, (bool, int, float)) else ""
    raise _fail(name, f"a string of at most {MAX_TEXT} characters{hint}", value)


def parse_nodes(value: Any) -> tuple[int, int]:
    """(MIN, MAX) from `N` or torchrun's `MIN:MAX`; MIN ≤ MAX, both 1-1024."""
    if isinstance(value, str) and (m := _RANGE.fullmatch(value)):
        low, high = int(m.group(1)), int(m.group(2))
        if not 1 <= low <= high <= MAX_NODES:
            raise _fail("nodes", f"N or MIN:MAX with 1 ≤ MIN ≤ MAX ≤ {MAX_NODES}", value)
        return low, high
    if isinstance(value, str) and not _INT.fullmatch(value):
        raise _fail("nodes", f"an integer from 1 to {MAX_NODES}, or MIN:MAX (e.g. 2:4)", value)
    n = _int("nodes", value, 1, MAX_NODES)
    return n, n


def parse_size_mb(text: str | int, field: str) -> int:
    """Megabytes (binary units) from 8G, 512M, 1.5GiB, 1T, or a plain number of megabytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return _int(field, text, 0, MAX_MEM_MB)
    m = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if m is None or m.group(2).lower() not in _MB_PER:
        raise _fail(field, "a size such as 8G, 512M or a number of MB", text)
    mb = float(m.group(1)) * _MB_PER[m.group(2).lower()]
    if mb > MAX_MEM_MB:
        raise _fail(field, f"at most {MAX_MEM_MB} MB", text)
    return int(mb)


def parse_duration_s(text: str | int | float, field: str) -> float:
    """Seconds from 30s, 10m, 2h, 1d, or a plain number of seconds; at most 30 days."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return _number(field, text, MAX_WAIT_S)
    m = _DURATION.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise _fail(field, "a duration such as 30s, 10m or 2h", text)
    return _number(field, float(m.group(1)) * _S_PER[m.group(2)], MAX_WAIT_S)


def parse_groups(value: Any) -> float | None:
    """The cap of ``groups``: "auto" (compute/groups.py's default), "off", or milliseconds
    ("50ms", 50); None when off."""
    if value is None or value is False or value == "off":
        return None
    if value is True or value == "auto":
        return GROUP_RTT_MS
    number = float("nan")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str) and (m := _MS.fullmatch(value)):
        number = float(m.group(1))
    if not 0 < number <= MAX_GROUP_RTT_MS:
        raise _fail("groups", f"auto, off, or the slowest RTT a group may span, above 0 and at most "
                              f"{MAX_GROUP_RTT_MS:g} ms (such as 50ms)", value)
    return number


def _env(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping) or len(value) > MAX_ENV:
        raise _fail("env", f"a map of at most {MAX_ENV} variables", value)
    for key, text in value.items():
        if not isinstance(key, str) or not ENV_NAME.fullmatch(key):
            raise _fail("env", "a map from variable names (letters, digits and _, not starting with a digit)", key)
        _string(f"env.{key}", text)
    return dict(value)


def _labels(value: Any) -> dict[str, str]:
    try:
        return check_labels(value, "labels")
    except Invalid as exc:
        raise SpecError(f"spec: {exc.detail}") from None


def _hosts(value: Any) -> tuple[str, ...]:
    """Peer ids, as a list or "A,B"; each a member's Ed25519 libp2p id, duplicates dropped."""
    if isinstance(value, str):
        value = [x for x in (p.strip() for p in value.split(",")) if x]
    if not isinstance(value, (list, tuple)) or len(value) > MAX_HOSTS:
        raise _fail("hosts", f"a list of at most {MAX_HOSTS} peer ids", value)
    for i, peer in enumerate(value):
        try:
            if not isinstance(peer, str) or len(peer) > MAX_PEER_ID:
                raise Invalid("malformed", "not a string")
            peer_bytes(peer)
        except Invalid:
            raise _fail(f"hosts[{i}]", "a full peer id such as 12D3KooW… (swarmctl peers --json)", peer) from None
    return tuple(dict.fromkeys(value))


def _cmd(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            value = shlex.split(value)
        except ValueError as exc:
            raise SpecError(f"spec: 'cmd' does not parse as a shell command: {exc}") from None
    if not isinstance(value, (list, tuple)) or not value or len(value) > MAX_CMD:
        raise _fail("cmd", f"a command: a non-empty list of at most {MAX_CMD} strings", value)
    return (_text("cmd[0]", value[0]), *(_string(f"cmd[{i}]", v) for i, v in enumerate(value) if i))


def _merge(file_fields: Mapping[str, Any], flags: Mapping[str, Any]) -> dict[str, Any]:
    for source in (file_fields, flags):
        for key in source:
            if key not in FIELDS:
                near = difflib.get_close_matches(str(key), FIELDS, n=1)
                raise SpecError(f"spec: unknown field {reprlib.repr(key)}"
                                + (f"; did you mean {near[0]!r}?" if near else ""))
    given = {k: v for k, v in file_fields.items() if v is not None}
    for key, value in flags.items():
        if value is None:
            continue
        below = given.get(key)
        both_maps = key in _MAPS and isinstance(below, Mapping) and isinstance(value, Mapping)
        given[key] = {**below, **value} if both_maps else value
    return given


def build(file_fields: Mapping[str, Any], flags: Mapping[str, Any]) -> JobSpec:
    """A spec from a file's fields with the flags on top (a flag of None is not given)."""
    given = _merge(file_fields, flags)
    if "cmd" not in given:
        raise SpecError("spec: 'cmd' is missing: the command every rank runs (swarmctl jobs run … -- CMD ARGS)")
    name = given.get("name")
    if name is not None and (not isinstance(name, str) or not NAME.fullmatch(name)):
        raise _fail("name", "1-64 characters of letters, digits, . _ -", name)
    gpus = _int("gpus_per_node", given.get("gpus_per_node", 0), 0, 64)
    least, most = parse_nodes(given.get("nodes", 1))
    ray = given.get("ray", False)
    if not isinstance(ray, bool):
        raise _fail("ray", "true or false", ray)
    grow = given.get("grow", True)
    if not isinstance(grow, bool):
        raise _fail("grow", "true or false", grow)
    spec = JobSpec(
        cmd=_cmd(given["cmd"]), name=name, nodes=most, min_nodes=least if least < most else 0,
        max_restarts=_int("max_restarts", given.get("max_restarts", 0), 0, MAX_RESTARTS),
        gpus_per_node=gpus, procs_per_node=_int("procs_per_node", given.get("procs_per_node", 1 if ray else gpus or 1), 1, 256),
        cpus=_number("cpus", given.get("cpus", 0), MAX_CPUS), mem_mb=parse_size_mb(given.get("mem", 0), "mem"),
        labels=_labels(given.get("labels", {})), hosts=_hosts(given.get("hosts", [])), env=_env(given.get("env", {})),
        workdir=None if given.get("workdir") is None else _text("workdir", given["workdir"]),
        wait_s=parse_duration_s(given.get("wait", 0), "wait"),
        python=None if given.get("python") is None else _text("python", given["python"]), ray=ray, grow=grow,
        groups=parse_groups(given.get("groups")),
        serve=None if given.get("serve") is None else serve_from_wire(given["serve"]))
    if ray and spec.procs_per_node != 1:
        raise SpecError(f"spec: a Ray job runs one Ray node per host, so 'procs_per_node' must be 1, got "
                        f"{spec.procs_per_node}: give the node its GPUs with gpus_per_node and Ray places the work")
    if spec.groups is not None and spec.nodes > GROUP_MAX_NODES:
        raise SpecError(f"spec: 'groups' are formed for at most {GROUP_MAX_NODES} nodes; this job asks for "
                        f"{spec.nodes}")
    if ray and spec.groups is not None:
        raise SpecError("spec: 'groups' tells a torch job's ranks which hosts are near each other; a Ray job "
                        "places its own work (leave groups off with ray)")
    if ray and spec.max_restarts:
        raise SpecError("spec: a Ray job is not restarted by swarmd ('max_restarts' must be 0): Ray handles failures "
                        "inside its cluster (Tune's and Train's FailureConfig)")
    if spec.serve is not None and (ray or spec.nodes != 1):
        raise SpecError("spec: a service's replica is one node and no Ray cluster")
    return spec


def serve_from_wire(value: Any) -> Serve:
    if not isinstance(value, Mapping) or set(value) - {"service", "replica", "health", "near"}:
        raise _fail("serve", "a map of service, replica, health and near", value)
    try:
        name = check_name(value.get("service"), "serve.service")
        health = check_health(value.get("health", "/"), "serve.health")
    except Invalid as exc:
        raise SpecError(f"spec: {exc.detail}") from None
    near = value.get("near", [])
    if not isinstance(near, (list, tuple)) or len(near) > MAX_NEAR:
        raise _fail("serve.near", f"a list of at most {MAX_NEAR} [peer id, weight] pairs", near)
    points = []
    for i, pair in enumerate(near):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise _fail(f"serve.near[{i}]", "a [peer id, weight] pair", pair)
        try:
            peer = _hosts([pair[0]])[0]
        except SpecError:
            raise _fail(f"serve.near[{i}]", "[full peer id, weight]", pair) from None
        points.append((peer, _int(f"serve.near[{i}].weight", pair[1], 1, MAX_NEAR_WEIGHT)))
    return Serve(service=name, replica=_int("serve.replica", value.get("replica"), 0, MAX_INDEX), health=health,
                 near=tuple(points))


def load_yaml(text: str, source: str = "spec") -> dict[str, Any]:
    """A spec file's fields (yaml.safe_load); `source` names the file in errors."""
    import yaml  # only swarmctl reads spec files: the daemon never pays for the import

    try:
        data = yaml.load(text, Loader=_loader())  # noqa: S506 (a SafeLoader, below)
    except yaml.YAMLError as exc:
        raise SpecError(f"{source}: {_yaml_problem(exc, text)}") from None
    except RecursionError:
        raise SpecError(f"{source}: not valid YAML: nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a map of fields (nodes: 3, cmd: [...]), got {type(data).__name__}")
    return data


def _loader() -> Any:
    """PyYAML's SafeLoader, except that `2:4` stays the text it is: YAML 1.1 reads an unquoted
    `nodes: 2:4` as the base-60 integer 124, which would silently ask for 124 nodes."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def integer(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
        if ":" in node.value:
            return loader.construct_scalar(node)
        return yaml.SafeLoader.construct_yaml_int(loader, node)

    Loader.add_constructor("tag:yaml.org,2002:int", integer)
    return Loader


def _yaml_problem(exc: Exception, text: str) -> str:
    """PyYAML's error in one line: where it was found, and where the construct began."""
    import yaml

    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow; no mark, a position
        return f"line {text.count(chr(10), 0, exc.position) + 1}: not valid YAML: {exc.reason} (#x{exc.character:04x})"
    mark, context = getattr(exc, "problem_mark", None), getattr(exc, "context", None)
    problem = (f"line {mark.line + 1}: " if mark is not None else "") + "not valid YAML: "
    problem += getattr(exc, "problem", None) or str(exc)
    start = getattr(exc, "context_mark", None)
    if context and start is not None and (mark is None or start.line != mark.line):
        problem += f" ({context} from line {start.line + 1})"
    return problem


def describe(spec: JobSpec) -> str:
    """The request in words, for errors: "3 nodes with ≥1 free GPU, ≥2 free cores, region=eu"."""
    needs = []
    if spec.gpus_per_node:
        needs.append(f"≥{spec.gpus_per_node} free GPU{'s' if spec.gpus_per_node != 1 else ''}")
    if spec.cpus:
        needs.append(f"≥{spec.cpus:g} free cores")
    if spec.mem_mb:
        needs.append(f"≥{spec.mem_mb} MB free")
    needs += [f"{k}={v}" for k, v in sorted(spec.labels.items())]
    if spec.hosts:
        needs.append(f"among the {len(spec.hosts)} host{'s' if len(spec.hosts) != 1 else ''} of its allow list")
    count = f"{spec.least_nodes} to {spec.nodes}" if spec.elastic else str(spec.nodes)
    nodes = f"{count} node{'s' if spec.nodes != 1 else ''}"
    return nodes + (" with " + ", ".join(needs) if needs else "")
