"""How services look to a person: `serve ls` and `serve show`. Everything in them came from a
peer's record or a gateway (names, hosts, paths): cells are plain text, never markup."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .render import cell, key_values, plain


def _peer(p: str | None) -> str:
    return "-" if not p else p[-8:]


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v:.1f} ms"


def services(rows: list[Mapping[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not rows:
        console.print("no services yet: swarmctl serve up NAME --replicas 2 --workdir DIR -- python app.py")
        return
    table = Table(title_justify="left")
    for column in ("name", "serving", "controller", "access", "note"):
        table.add_column(column)
    for s in rows:
        notes = (["controller gone: replicas serve on"] if s.get("orphaned") else []) + \
                [f"also claimed by {_peer(p)} (no traffic for it)" for p in s.get("contenders") or []]
        table.add_row(cell(s["name"]), f"{s['serving']}/{s['replicas']}",
                      cell(_peer(s["controller"]) + (" (this node)" if s.get("mine") else "")),
                      cell(s.get("access") or "-"), cell("; ".join(notes) or ""))
    console.print(table)


def service(s: Mapping[str, Any]) -> None:
    g = s.get("gateway") or {}
    key_values(f"service {s['name']}", [
        ("controller", _peer(s["controller"]) + ("; gone, its replicas serve on" if s.get("orphaned") else "")),
        ("access", s.get("access")), ("health", s.get("health")),
        ("replicas", None if s.get("replicas_wanted") is None else
         f"{sum(1 for r in s['replicas'] if r.get('healthy'))} healthy of {s['replicas_wanted']} wanted"
         + (f" (generation {s['generation']})" if s.get("generation") else "")),
        ("this gateway", None if not g else f"{g.get('requests') or 0} requests, {g.get('failures') or 0} failed, "
                                            f"{g.get('in_flight') or 0} in flight, p50 {_ms(g.get('p50_ms'))}, "
                                            f"p99 {_ms(g.get('p99_ms'))}, {g.get('rate_per_s') or 0:.1f}/s"),
        ("contenders", [f"{_peer(p)} claims the name too: no traffic for it" for p in s.get("contenders") or []]),
        *_autoscale(s.get("autoscale")),
    ])
    _events((s.get("autoscale") or {}).get("events") or [])
    rows = s.get("replicas") or []
    if not rows:
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title_justify="left")
    near = any(r.get("demand_rtt_ms") is not None for r in rows)
    for column in ("#", "host", "path", "rtt", *(["to demand"] if near else []), "health", "in flight", "requests",
                   "p50", "p99", "rate"):
        table.add_column(column)
    for r in rows:
        health = "draining" if r.get("draining") else "healthy" if r.get("healthy") else \
            "ejected" if r.get("ejected") else "not yet" if r.get("host") is None else "failing"
        style = {"healthy": "green", "failing": "red", "ejected": "red", "draining": "yellow"}.get(health, "")
        table.add_row(str(r["index"]), cell(_peer(r.get("host"))), cell(r.get("path") or "-"),
                      _ms(r.get("rtt_ms")), *([_ms(r.get("demand_rtt_ms"))] if near else []),
                      Text(plain(health), style=style), str(r.get("in_flight") or 0),
                      str(r.get("requests") or 0), _ms(r.get("p50_ms")), _ms(r.get("p99_ms")),
                      f"{r.get('rate_per_s') or 0:.1f}/s")
    Console().print(table)


SPARKS = "▁▂▃▄▅▆▇█"


def spark(values: list[float], width: int = 48) -> str:
    """A rate history as one line of block characters (the last ``width`` values)."""
    values = [max(0.0, float(v)) for v in values[-width:]]
    if not values:
        return ""
    top = max(values) or 1.0
    return "".join(SPARKS[min(len(SPARKS) - 1, int(v / top * (len(SPARKS) - 1) + 0.5))] for v in values)


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:g}h" if seconds >= 3600 and seconds % 3600 == 0 else \
        f"{seconds / 60:g}m" if seconds >= 60 and seconds % 60 == 0 else f"{seconds:g}s"


def _autoscale(a: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    """`serve show`'s autoscaling lines: the policy, the demand, the decision and why, the forecast."""
    if not a or not a.get("policy"):
        return []
    p = a["policy"]
    policy = f"{p['min']}-{p['max']} replicas, {p.get('target_inflight', 4):g} in flight each" + \
        (f", SLO p99 {p['slo_p99_ms']:g} ms" if p.get("slo_p99_ms") else "") + \
        (f", predictive (season {_duration(p.get('season_s', 86400))})" if p.get("predictive") else ", reactive")
    d = a.get("demand") or {}
    points = d.get("points") or []
    total = sum(w for _, w in points) or 1.0
    demand = None if not d else (
        f"{d.get('rate_per_s', 0):.1f} req/s, {d.get('in_flight', 0):.1f} in flight, p99 {_ms(d.get('p99_ms'))}"
        + (f", entering at {', '.join(f'{_peer(peer)} {100 * w / total:.0f} %' for peer, w in points[:4])}"
           if points else ""))
    decision = a.get("decision") or {}
    scaler = a.get("scaler") or {}
    history = [rate for _, rate in scaler.get("history") or []]
    forecast = [rate for _, rate in scaler.get("forecast") or []]
    trust = None
    if p.get("predictive"):
        trust = ("trusted" if scaler.get("trusted") else
                 f"distrusted: {scaler['distrusted_because']}" if scaler.get("distrusted_because") else
                 "learning (a whole season of history first)")
        if scaler.get("error_pct") is not None:
            trust += f", off by {scaler['error_pct']:.0f} % lately"
    return [
        ("autoscale", policy),
        ("now", None if not decision else f"{a.get('replicas')} replica(s): {decision.get('reason')}"
         + (f" (forecast alone: {decision['planned']})" if decision.get("planned") is not None else "")),
        ("demand", demand),
        ("requests/s", None if not history else f"{spark(history)}  last {max(history[-48:]):.1f}/s at most"),
        ("forecast", None if trust is None else trust + (f"; next {spark(forecast, 16)} up to {max(forecast):.1f}/s"
                                                         if forecast else "")),
        ("replica start", f"{a.get('start_s', 0):.1f} s" + (f" (median of {a['measured_starts']} measured)"
                                                            if a.get("measured_starts") else " (assumed: none measured yet)")),
    ]


def _events(events: list[Mapping[str, Any]]) -> None:
    if not events:
        return
    import datetime

    from rich.console import Console
    from rich.table import Table

    table = Table(title="scaling", title_justify="left")
    for column in ("at", "replicas", "why"):
        table.add_column(column)
    for e in events[-10:]:
        at = datetime.datetime.fromtimestamp(e.get("at") or 0).strftime("%H:%M:%S")
        table.add_row(at, f"{e.get('from')} → {e.get('to')}", cell(e.get("reason") or ""))
    Console().print(table)
