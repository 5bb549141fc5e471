"""How jobs look to a person: progress lines, the end-of-job summary, `jobs ls` and `jobs show`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from typing import Any

from .render import cell, duration, key_values, plain, size


def _peer(p: str) -> str:
    return p[-8:]


def state_text(job: Mapping[str, Any]) -> str:
    """The state as a person reads it: "restarting (1/3): host XaN6WKvN lost (…)" during a restart."""
    state = job["state"]
    if state == "restarting":
        done, most = job.get("restarts") or (0, 0)
        return f"restarting ({done}/{most})" + (f": {job['reason']}" if job.get("reason") else "")
    return state


def job_progress(job: Mapping[str, Any]) -> str:
    state = job["state"]
    if state == "restarting":
        phase = job.get("phase")
        return f"job {job['id']}: {state_text(job)}" + (f" [{phase}]" if phase else "")
    if state == "shipping" and job.get("shipped"):
        done, total = job["shipped"]
        return f"job {job['id']}: shipping workdir {size(done)} / {size(total)}"
    nodes = job.get("node_state") or {}
    if state in ("starting", "running") and nodes:
        per = ", ".join(f"{_peer(p)} {s}" for p, s in nodes.items())
        return f"job {job['id']}: {state} on {len(nodes)} node(s): {per}"
    if state == "reserving":
        return f"job {job['id']}: reserving {', '.join(map(_peer, job['nodes']))}"
    return f"job {job['id']}: {state}…"


def job_summary(job: Mapping[str, Any], waited: float) -> str:
    wall = job.get("wall_s")
    head = f"job {job['id']} {job['state']}"
    if job.get("exit_code") is not None:
        head += f" (exit {job['exit_code']})"
    parts = [head, f"{len(job['nodes'])} node(s): {', '.join(map(_peer, job['nodes'])) or '-'}",
             f"wall {wall:.1f} s" if wall is not None else f"after {waited:.1f} s"]
    if job.get("reason"):
        parts.append(f"why: {job['reason']}")
    return "; ".join(parts)


def jobs(rows: list[Mapping[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    if not rows:
        console.print("no jobs yet: swarmctl jobs run -- python train.py")
        return
    table = Table(title_justify="left")
    for column in ("id", "name", "state", "nodes", "exit", "wall", "command"):
        table.add_column(column, no_wrap=column != "command")
    for j in rows:
        style = {"succeeded": "green", "failed": "red", "cancelled": "yellow"}.get(j["state"], "")
        state = Text(plain(state_text(j)), style=style)  # a restart's reason quotes a host: never markup
        table.add_row(cell(j["id"]), cell(j["name"] or "-"), state,
                      str(len(j["nodes"])), "-" if j["exit_code"] is None else str(j["exit_code"]),
                      "-" if j["wall_s"] is None else duration(j["wall_s"]) if j["wall_s"] >= 60
                      else f"{j['wall_s']:.1f} s", cell(" ".join(j["cmd"] or [])))
    console.print(table)


def job(j: Mapping[str, Any]) -> None:
    ranks = [f"rank {r['rank']} on {_peer(r['node'])}: {r['state']}"
             + ("" if r["exit_code"] is None else f" (exit {r['exit_code']})") for r in j["ranks"]]
    key_values(f"job {j['id']}", [
        ("name", j["name"]), ("state", j["state"]), ("command", " ".join(j["cmd"] or [])),
        ("nodes", [_peer(p) for p in j["nodes"]]), ("exit code", j["exit_code"]), ("why", j["reason"]),
        ("wall", None if j["wall_s"] is None else f"{j['wall_s']:.1f} s"),
        ("restarts", None if not j.get("restarts") or not j["restarts"][1] else f"{j['restarts'][0]} of at most "
                                                                                 f"{j['restarts'][1]}"),
        ("growth", _growth_lines(j, j.get("started") or j.get("created"))),
        ("groups", _groups_lines(j.get("groups"))),
        ("attempts", [_attempt_line(a, j.get("started") or j.get("created")) for a in j.get("attempts") or []]),
        ("checkpoints", [f"{c['name']} ({size(c['size'])}) on {', '.join(map(_peer, c['holders']))}"
                         for c in j.get("checkpoints") or []]),
        ("coordinator", _coordinator_line(j)),
        ("record", _replicas_line(j.get("replicas"))),
        ("ranks", ranks), ("hosts", [_host_line(p, h) for p, h in (j.get("hosts") or {}).items()]),
        ("Ray nodes", [_ray_line(p, h["ray"], p == (j["nodes"] or [None])[0])
                       for p, h in (j.get("hosts") or {}).items() if h.get("ray")]),
    ])


def _coordinator_line(j: Mapping[str, Any]) -> str | None:
    """Who coordinates the job: its origin, or the replica that took it over, at which epoch
    and since when (issue 26)."""
    h = j.get("handover")
    if not h:
        return _peer(j["coordinator"]) if j.get("coordinator") else None
    since = h.get("since")
    when = f", since {time.strftime('%H:%M:%S', time.localtime(since))}" if isinstance(since, (int, float)) else ""
    who = "this node" if h.get("coordinator") == j.get("coordinator") else "took over from this node"
    return f"{_peer(h['coordinator'])} (epoch {h.get('epoch')}{when}; {who})"


def _replicas_line(r: Mapping[str, Any] | None) -> str | None:
    """Where the job's record is kept: on how many of its replicas, at which epoch and write."""
    if not r:
        return None
    missing = "; ".join(f"{_peer(p)}: {why}" for p, why in (r.get("missing") or {}).items())
    return (f"on {len(r.get('holding') or [])} of {len(r.get('replicas') or [])} replicas "
            f"(epoch {r.get('epoch')}, write {r.get('seq')})" + (f"; not on {missing}" if missing else ""))


def _ray_line(peer: str, node: Mapping[str, Any], head: bool) -> str:
    """A Ray job's node: its host, overlay address and what Ray was given there."""
    gpus = f", {node['gpus']} GPU{'s' if node['gpus'] != 1 else ''}" if node.get("gpus") else ""
    return (f"{_peer(peer)} {node.get('address')}{' (head)' if head else ''}: {node['cpus']} CPU{gpus}, "
            f"memory {size(node['memory'])}, object store {size(node['object_store'])}")


def _groups_lines(g: Any) -> list[str] | None:
    """A grouped job's latency groups: the cap, each group's nodes and its slowest link, and the
    fastest link between groups (what keeps them apart). What a coordinator sent: anything
    malformed is shown as such, never trusted to index with."""
    if not isinstance(g, Mapping):
        return None
    groups, nodes, rtt = g.get("groups"), g.get("nodes"), g.get("rtt_ms")
    n = len(nodes) if isinstance(nodes, list) else 0
    if not (isinstance(groups, list) and all(isinstance(x, list) and all(isinstance(i, int) and 0 <= i < n for i in x)
                                             for x in groups) and isinstance(rtt, list) and len(rtt) == n
            and all(isinstance(row, list) and len(row) == n for row in rtt)):
        return ["(malformed)"]

    def link(a: int, b: int) -> float | None:
        ms = rtt[a][b]
        return float(ms) if isinstance(ms, (int, float)) and not isinstance(ms, bool) else None

    def ms_text(values: list[float | None], pick) -> str:
        known = [v for v in values if v is not None]
        if not known:
            return "unknown"
        return f"{pick(known):.1f} ms" + (" (some unknown)" if len(known) < len(values) else "")

    cap = g.get("max_rtt_ms")
    lines = [f"{len(groups)} group{'s' if len(groups) != 1 else ''}, none spanning a link over "
             f"{cap:g} ms" if isinstance(cap, (int, float)) else f"{len(groups)} groups"]
    for k, members in enumerate(groups, 1):
        inside = [link(a, b) for a in members for b in members if a < b]
        lines.append(f"group {k}: node{'s' if len(members) != 1 else ''} {', '.join(map(str, members))} "
                     f"({', '.join(_peer(str(nodes[i])) for i in members)})"
                     + (f", slowest link {ms_text(inside, max)}" if inside else ""))
    across = [link(a, b) for x, y in itertools.combinations(groups, 2) for a in x for b in y]
    if across:
        lines.append(f"between groups: fastest link {ms_text(across, min)}")
    return lines


def _growth_lines(j: Mapping[str, Any], origin: float | None) -> list[str] | str | None:
    """An elastic job's growth: off, or when it may grow and each time it did (attempt, when, why)."""
    g = j.get("growth")
    if not g:
        return None
    if not g.get("on"):
        return "off (--no-grow)"
    events = [f"after attempt #{e['attempt']}"
              + (f" at {e['at'] - origin:+.1f} s" if isinstance(e.get("at"), (int, float)) and origin else "")
              + f": {e['why']}" for e in g.get("events") or []]
    every = g.get("every_s")
    rule = "on: toward its maximum at a checkpoint when hosts are free" + \
        (f", at most once per {duration(every)}" if isinstance(every, (int, float)) else "")
    return [rule, *events]


def _attempt_line(a: Mapping[str, Any], origin: float | None) -> str:
    """One attempt: its number, hosts, when it ran (seconds from the job's start), how it ended,
    and the checkpoint it resumed from."""
    def at(t: float | None) -> str:
        return "-" if t is None or origin is None else f"{t - origin:+.1f} s"

    line = f"#{a['n']} on {', '.join(map(_peer, a['nodes'])) or '-'}: ran {at(a.get('started'))} to {at(a.get('ended'))}"
    line += f"; ended: {a['why']}" if a.get("why") else ("" if a.get("ended") is None else "; ended: ok")
    return line + (f"; resumed from {a['resumed_from']}" if a.get("resumed_from") else "")


def _host_line(peer: str, h: Mapping[str, Any]) -> str:
    """A host's account of the job: peak memory, CPU time, the sandbox the ranks had."""
    peak, cpu = h.get("peak_memory"), h.get("cpu_seconds")
    use = [f"peak memory {size(peak)}" if peak is not None else None,
           f"CPU {cpu:.1f} s" if cpu is not None else None]
    line = f"{_peer(peer)}: " + (", ".join(u for u in use if u) or "no usage reported")
    return line + f"; sandbox: {h.get('sandbox') or 'unknown'}"
