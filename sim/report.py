"""report.json: a run's figures as deterministic bytes, and the summary's rows.

Rules: the same scenario and seed give the same bytes, in any process: keys sorted, floats
rounded to 6 decimal places (microseconds), NaN and infinities written as null, numpy
values as plain numbers, and nothing from the wall clock (the wall time goes to the
printed summary only)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import scenario as sc
from .runner import Outcome

VERSION = 1
DIGITS = 6


def clean(value: Any) -> Any:
    """Plain JSON data: floats rounded, non-finite as None, tuples as lists, numpy as Python."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float) or hasattr(value, "dtype"):
        if hasattr(value, "tolist"):
            value = value.tolist()
            if isinstance(value, list):
                return [clean(v) for v in value]
            if isinstance(value, bool | int):
                return value
        f = float(value)
        if not math.isfinite(f):
            return None
        r = round(f, DIGITS)
        return 0.0 if r == 0 else r  # no -0.0
    if isinstance(value, Mapping):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    raise TypeError(f"report: cannot write {type(value).__name__}")


def describe(s: sc.Scenario) -> dict:
    """The scenario as it ran (after its defaults and repeats), for the report."""
    net = asdict(s.network)
    net.pop("latency")  # the matrix itself: the file's name says which
    events = []
    for ev in s.events:
        events.append({"kind": type(ev).__name__.lower(), **asdict(ev)})
    return {"name": s.name, "mode": s.mode, "seconds": s.seconds, "nodes": s.nodes, "timing": s.timing,
            "seed": s.seed, "network": net, "timing_overrides": dict(s.overrides), "events": events}


def build(outcome: Outcome) -> dict:
    return clean({"version": VERSION, "scenario": describe(outcome.scenario),
                  "max_one_way_s": outcome.max_one_way_s, **outcome.figures})


def dumps(report: Mapping) -> str:
    return json.dumps(clean(report), sort_keys=True, indent=1, allow_nan=False) + "\n"


def write(path: Path, report: Mapping) -> None:
    """Atomically: a reader never sees half a report."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(report))
    tmp.replace(path)


# --- the summary ----------------------------------------------------------------------

def _s(v: float | None, unit: str = "s") -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.2f} s"
    return f"{v:,.1f}"


def rows(report: Mapping) -> list[tuple[str, str, str]]:
    """(figure, value, what it is) for the printed summary table."""
    out: list[tuple[str, str, str]] = []
    scen = report["scenario"]
    if scen["mode"] == "disseminate":
        out.append(("scenario", f"{scen['name']}: {scen['nodes']:,} nodes, seed {scen['seed']}",
                    "one record over the gossipsub model, no cores"))
    else:
        out.append(("scenario", f"{scen['name']}: {scen['nodes']:,} nodes, {scen['seconds']:g} s, "
                                f"seed {scen['seed']}", f"timing {scen['timing']}" + "".join(f", {k} {v:g}" for k, v in scen.get("timing_overrides", {}).items())))
    if "dissemination_s" in report:
        d = report["dissemination_s"]
        out.append(("record reached", f"{d['reached']:,} / {d['nodes']:,}", "nodes"))
        for q in (50, 90, 99, 100):
            out.append((f"reached {q} %", _s(d[f"t{q}"]), "after the publish"))
        out.append(("longest one-way delay", _s(report["max_one_way_s"]), "between any two nodes"))
        return out
    ev = ", ".join(f"{k} {v:,}" for k, v in sorted(report["events"].items()) if v)
    out.append(("events", ev or "-", "what the timeline did"))
    det = report["detection"]
    po, ba = det["per_observer_s"], det["by_all_s"]
    out.append(("crashes", f"{det['crashes']}", f"{po['n']:,} (crash, observer) pairs, {det['missed']} missed"))
    out.append(("detection p50 / p99 / max", f"{_s(po['p50'])} / {_s(po['p99'])} / {_s(po['max'])}",
                "crash to an observer's DEAD (target p99 < 5 s)"))
    out.append(("detected by all p50 / p99", f"{_s(ba['p50'])} / {_s(ba['p99'])}", "per crash, the last observer"))
    fd = report["false_dead"]
    ex = fd["excused"]
    out.append(("false dead", f"{fd['count']}", f"DEAD about a reachable node, target 0 ({ex['down']} down, "
                                                 f"{ex['partition']} partitioned, {ex['revived']} revived: not false)"))
    su = report["suspicions"]
    out.append(("suspicions", f"{su['declared']:,}", f"refuted {su['refuted']}, cleared by an ack {su['cleared']}"))
    cv = report["convergence_s"]
    out.append(("changes", f"{cv['changes']}", f"{cv['incomplete']} not everywhere by the end"))
    for q in (50, 99, 100):
        t = cv[f"t{q}"]
        out.append((f"change reached {q} % p50 / p99", f"{_s(t['p50'])} / {_s(t['p99'])}",
                    f"over the {t['n']} changes that got there"))
    ex = cv["excess"]
    out.append(("change beyond its one-way p50 / p99", f"{_s(ex['p50'])} / {_s(ex['p99'])}",
                "reached 100 % minus the longest one-way delay from the changer (target < 1 s)"))
    out.append(("longest one-way delay", _s(report["max_one_way_s"]), "between any two nodes"))
    tr = report["traffic"]
    for name, label in (("msgs_sent", "messages sent"), ("msgs_recv", "messages received"),
                        ("bytes_sent", "bytes sent"), ("bytes_recv", "bytes received")):
        f = tr[f"{name}_per_s"]
        out.append((f"{label} /node/s", f"{_s(f['mean'], '')} (p99 {_s(f['p99'], '')})",
                    f"mean across nodes, from {tr['from_s']:g} s"))
    for kind, f in tr.get("bytes_recv_by_kind_per_s", {}).items():
        out.append((f"  of which {kind}", f"{_s(f['mean'], '')} (p99 {_s(f['p99'], '')})",
                    "bytes received /node/s of this kind"))
    core = report["core"]
    shown = ", ".join(f"{k} {v:,}" for k, v in sorted(core.items()) if v)
    out.append(("core counters", shown or "-", "summed over every core"))
    return out
