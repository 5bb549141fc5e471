"""A host's events as the job's coordinator takes them (sans-IO): a peer's input, checked.

A host speaks only for its own ranks (node_rank × procs_per_node + i), starts once, sends
lines as strings in batches of at most MAX_BATCH_LINES, integers in range, a
checkpoint as [name, sha256, size] with a checkpoint's name (checkpoints/rules.py); anything else
is a ValueError saying what, which the coordinator counts as `job_event` and takes as the
host lost to the job.
"""

from __future__ import annotations

from typing import Any

from .checkpoints.rules import check_name, is_sha256

MAX_BATCH_LINES = 4096  # lines per output event (output.py's take()): one event's work at the coordinator stays small
MAX_SANDBOX_TEXT = 200  # characters of a host's account of a job's confinement
MAX_CHECKPOINT_BYTES = 2**50  # what a host may announce; each host bounds its own by checkpoint_max


def checked_event(event: Any, ranks: range, *, started: bool) -> dict[str, Any]:
    """A host's event as the coordinator acts on it, or ValueError saying what is wrong: only
    the host's own `ranks`, `started` once (`started`: it already was), out lines as strings,
    at most `MAX_BATCH_LINES` of them, integers in range."""
    if not isinstance(event, dict):
        raise ValueError("an event must be a map")

    def rank(x: Any, field: str) -> int:
        if isinstance(x, bool) or not isinstance(x, int) or x not in ranks:
            raise ValueError(f"'{field}' names rank {str(x)[:20]}, not one of this host's "
                             f"{ranks.start}-{ranks.stop - 1}")
        return x

    def number(x: Any, field: str, low: int, high: int) -> int:
        if isinstance(x, bool) or not isinstance(x, int) or not low <= x <= high:
            raise ValueError(f"'{field}' must be an integer from {low} to {high}")
        return x

    def pairs(x: Any, field: str, most: int) -> list[Any]:
        if not isinstance(x, list) or len(x) > most:
            raise ValueError(f"'{field}' must be a list of at most {most} pairs")
        if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in x):
            raise ValueError(f"'{field}' must hold [rank, value] pairs")
        return x

    out: dict[str, Any] = {}
    if "started" in event:
        got = event["started"]
        if started:
            raise ValueError("'started' came twice")
        if not isinstance(got, list) or len(got) != len(ranks):
            raise ValueError(f"'started' must list this host's {len(ranks)} rank(s)")
        out["started"] = sorted({rank(r, "started") for r in got})
        if len(out["started"]) != len(ranks):
            raise ValueError("'started' names a rank twice")
    if "out" in event:
        lines = pairs(event["out"], "out", MAX_BATCH_LINES)
        if not all(isinstance(line, str) for _, line in lines):
            raise ValueError("'out' lines must be strings")
        out["out"] = [(rank(r, "out"), line) for r, line in lines]
    if "dropped" in event:
        out["dropped"] = [(rank(r, "dropped"), number(n, "dropped", 0, 2**40))
                          for r, n in pairs(event["dropped"], "dropped", len(ranks))]
    if "exit" in event:
        codes = {rank(r, "exit"): number(c, "exit", -2**31, 2**31)
                 for r, c in pairs(event["exit"], "exit", len(ranks))}
        first = event.get("first")
        if first is not None:
            first = pairs([first], "first", 1)[0]
            first = (rank(first[0], "first"), number(first[1], "first", -2**31, 2**31))
        out["exit"], out["first"] = codes, first
    if "ckpt" in event:
        entry = event["ckpt"]
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise ValueError("'ckpt' must be [name, sha256, size]")
        name, sha, size = entry
        check_name(name, "ckpt.name")
        if not is_sha256(sha):
            raise ValueError("'ckpt.sha256' must be 64 lowercase hex digits")
        out["ckpt"] = (name, sha, number(size, "ckpt.size", 0, MAX_CHECKPOINT_BYTES))
    if "sandbox" in event:
        text = event["sandbox"]
        if not isinstance(text, str) or len(text) > MAX_SANDBOX_TEXT or not text.isprintable():
            raise ValueError(f"'sandbox' must be printable text of at most {MAX_SANDBOX_TEXT} characters")
        out["sandbox"] = text
    if "ray" in event:  # a Ray job's node on this host (rayhost.py)
        node = event["ray"]
        if not isinstance(node, dict) or set(node) != {"cpus", "gpus", "memory", "object_store"}:
            raise ValueError("'ray' must be a map of cpus, gpus, memory and object_store")
        out["ray"] = {"cpus": number(node["cpus"], "ray.cpus", 0, 1 << 20),
                      "gpus": number(node["gpus"], "ray.gpus", 0, 1 << 10),
                      "memory": number(node["memory"], "ray.memory", 0, 2**50),
                      "object_store": number(node["object_store"], "ray.object_store", 0, 2**50)}
    if "usage" in event:
        usage = event["usage"]
        if not isinstance(usage, dict) or set(usage) - {"peak_memory", "cpu_seconds"}:
            raise ValueError("'usage' must be a map of peak_memory and cpu_seconds")
        peak, cpu = usage.get("peak_memory"), usage.get("cpu_seconds")
        if peak is not None:
            number(peak, "usage.peak_memory", 0, 2**50)
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, (int, float)) or not 0 <= cpu <= 1e9):
            raise ValueError("'usage.cpu_seconds' must be a number from 0 to 1e9")
        out["usage"] = {"peak_memory": peak, "cpu_seconds": None if cpu is None else float(cpu)}
    if "oom" in event:
        oom = event["oom"]
        if not isinstance(oom, dict) or not isinstance(oom.get("ranks"), list) or len(oom["ranks"]) > len(ranks):
            raise ValueError("'oom' must be a map with the list of ranks killed")
        limit = oom.get("limit")
        out["oom"] = {"ranks": [rank(r, "oom.ranks") for r in oom["ranks"]],
                      "limit": None if limit is None else number(limit, "oom.limit", 1, 2**50)}
    return out
