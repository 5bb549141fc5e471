"""What a user asks for: a job spec, from flags, a YAML file, or the wire (sans-IO).

Every value is checked where it enters and a bad one raises `SpecError` naming the field
(`spec: 'nodes' must be …, got 'three'`); unknown fields are errors with a suggestion.
The same checks guard specs arriving over the control socket, which are untrusted.
"""

from __future__ import annotations

import difflib
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..gossip.signed import Invalid
from ..gossip.wire import check_labels

NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_ENV = 128
MAX_CMD = 256
_SIZES = {"": 1, "m": 1, "mb": 1, "mi": 1, "mib": 1, "g": 1024, "gb": 1024, "gi": 1024, "gib": 1024,
          "t": 1024 ** 2, "tb": 1024 ** 2, "ti": 1024 ** 2, "tib": 1024 ** 2}
_DURATIONS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
FIELDS = ("name", "nodes", "gpus_per_node", "procs_per_node", "cpus", "mem", "labels", "env", "workdir",
          "wait", "python", "cmd")


class SpecError(ValueError):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    cmd: tuple[str, ...]
    name: str | None = None
    nodes: int = 1
    gpus_per_node: int = 0
    procs_per_node: int = 1
    cpus: float = 0.0
    mem_mb: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    wait_s: float = 0.0
    python: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"cmd": list(self.cmd), "name": self.name, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
                "procs_per_node": self.procs_per_node, "cpus": self.cpus, "mem": self.mem_mb,
                "labels": dict(self.labels), "env": dict(self.env), "workdir": self.workdir, "wait": self.wait_s,
                "python": self.python}

    @classmethod
    def from_wire(cls, data: Any) -> JobSpec:
        if not isinstance(data, Mapping):
            raise SpecError(f"spec: expected a map of fields, got {type(data).__name__}")
        return build(data, {})


def _fail(name: str, expected: str, value: Any) -> SpecError:
    return SpecError(f"spec: '{name}' must be {expected}, got {value!r}")


def _int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _fail(name, f"an integer from {low} to {high}", value)
    return value


def _number(name: str, value: Any, high: float) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        raise _fail(name, f"a number from 0 to {high:g}", value) from None
    if not 0 <= number <= high:
        raise _fail(name, f"a number from 0 to {high:g}", value)
    return number


def _text(name: str, value: Any, limit: int = 4096) -> str:
    if not isinstance(value, str) or not value or len(value) > limit or "\0" in value:
        raise _fail(name, f"a non-empty string of at most {limit} characters", value)
    return value


def parse_size_mb(value: Any, name: str = "mem") -> int:
    """8G, 512M, 1.5GiB, or a plain number of megabytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return _int(name, value, 0, 2**40)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value) if isinstance(value, str) else None
    if m is None or m.group(2).lower() not in _SIZES:
        raise _fail(name, "a size such as 8G, 512M or a number of MB", value)
    return int(float(m.group(1)) * _SIZES[m.group(2).lower()])


def parse_duration_s(value: Any, name: str = "wait") -> float:
    """10m, 30s, 2h, 1d, or a number of seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _number(name, value, 30 * 86400)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]?)\s*", value) if isinstance(value, str) else None
    if m is None or m.group(2) not in _DURATIONS:
        raise _fail(name, "a duration such as 30s, 10m or 2h", value)
    return _number(name, float(m.group(1)) * _DURATIONS[m.group(2)], 30 * 86400)


def _map(name: str, value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise _fail(name, "a map of strings", value)
    return {str(k): v if isinstance(v, str) else str(v) for k, v in value.items()}


def _cmd(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            value = shlex.split(value)
        except ValueError as exc:
            raise SpecError(f"spec: 'cmd' does not parse as a shell command: {exc}") from None
    if not isinstance(value, (list, tuple)) or not value or len(value) > MAX_CMD:
        raise _fail("cmd", f"a command: a non-empty list of at most {MAX_CMD} strings", value)
    return tuple(_text(f"cmd[{i}]", v) for i, v in enumerate(value))


def build(file_fields: Mapping[str, Any], flags: Mapping[str, Any]) -> JobSpec:
    """A spec from a file's fields with the flags on top (a flag of None is not given)."""
    for source in (file_fields, flags):
        for key in source:
            if key not in FIELDS:
                near = difflib.get_close_matches(str(key), FIELDS, n=1)
                raise SpecError(f"spec: unknown field {key!r}" + (f"; did you mean {near[0]!r}?" if near else ""))
    given = {k: v for k, v in file_fields.items() if v is not None} | {k: v for k, v in flags.items() if v is not None}
    if "cmd" not in given:
        raise SpecError("spec: 'cmd' is missing: the command every rank runs (swarmctl jobs run … -- CMD ARGS)")
    gpus = _int("gpus_per_node", given.get("gpus_per_node", 0), 0, 64)
    env = _map("env", given.get("env", {}))
    if len(env) > MAX_ENV:
        raise _fail("env", f"at most {MAX_ENV} variables", f"{len(env)} variables")
    for key, value in env.items():
        if not ENV_NAME.match(key):
            raise _fail(f"env.{key}", "a variable name of letters, digits and _", key)
        if len(value) > 4096 or "\0" in value:
            raise _fail(f"env.{key}", "a string of at most 4096 characters", value)
    try:
        labels = check_labels(_map("labels", given.get("labels", {})), "labels")
    except Invalid as exc:
        raise SpecError(f"spec: {exc.detail}") from None
    name = given.get("name")
    if name is not None and (not isinstance(name, str) or not NAME.match(name)):
        raise _fail("name", "1-64 characters of letters, digits, . _ -", name)
    return JobSpec(
        cmd=_cmd(given["cmd"]), name=name, nodes=_int("nodes", given.get("nodes", 1), 1, 1024),
        gpus_per_node=gpus, procs_per_node=_int("procs_per_node", given.get("procs_per_node", gpus or 1), 1, 256),
        cpus=_number("cpus", given.get("cpus", 0), 4096), mem_mb=parse_size_mb(given.get("mem", 0)),
        labels=labels, env=env,
        workdir=None if given.get("workdir") is None else _text("workdir", given["workdir"]),
        wait_s=parse_duration_s(given.get("wait", 0)),
        python=None if given.get("python") is None else _text("python", given["python"]))


def load_yaml(text: str, source: str = "spec") -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise SpecError(f"{source}:{where} not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a map of fields (nodes: 3, cmd: [...]), got {type(data).__name__}")
    return data


def describe(spec: JobSpec) -> str:
    """The request in words, for errors: "3 nodes with ≥1 GPU, region=eu"."""
    parts = [f"{spec.nodes} node{'s' if spec.nodes != 1 else ''}"]
    needs = []
    if spec.gpus_per_node:
        needs.append(f"≥{spec.gpus_per_node} free GPU{'s' if spec.gpus_per_node != 1 else ''}")
    if spec.cpus:
        needs.append(f"≥{spec.cpus:g} free cores")
    if spec.mem_mb:
        needs.append(f"≥{spec.mem_mb} MB free")
    needs += [f"{k}={v}" for k, v in sorted(spec.labels.items())]
    return parts[0] + (" with " + ", ".join(needs) if needs else "")
