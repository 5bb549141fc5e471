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
    ])
    rows = s.get("replicas") or []
    if not rows:
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title_justify="left")
    for column in ("#", "host", "path", "rtt", "health", "in flight", "requests", "p50", "p99", "rate"):
        table.add_column(column)
    for r in rows:
        health = "draining" if r.get("draining") else "healthy" if r.get("healthy") else \
            "ejected" if r.get("ejected") else "not yet" if r.get("host") is None else "failing"
        style = {"healthy": "green", "failing": "red", "ejected": "red", "draining": "yellow"}.get(health, "")
        table.add_row(str(r["index"]), cell(_peer(r.get("host"))), cell(r.get("path") or "-"),
                      _ms(r.get("rtt_ms")), Text(plain(health), style=style), str(r.get("in_flight") or 0),
                      str(r.get("requests") or 0), _ms(r.get("p50_ms")), _ms(r.get("p99_ms")),
                      f"{r.get('rate_per_s') or 0:.1f}/s")
    Console().print(table)
