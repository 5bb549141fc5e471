"""Output for people (rich, imported only when a table is drawn) and for programs (JSON)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping
from typing import Any


def as_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def key_values(title: str, rows: Iterable[tuple[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, _text(value))
    Console().print(table)


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "\n".join(map(str, value)) or "-"
    if value is None:
        return "-"
    return str(value)


def duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{days}d"] * bool(days) + [f"{hours}h"] * bool(hours) + [f"{minutes}m"] * bool(minutes)
    return " ".join(parts + [f"{secs}s"]) if parts or secs or not seconds else "0s"


def status(s: Mapping[str, Any]) -> None:
    key_values("swarmd", [
        ("peer id", s.get("peer_id")),
        ("version", s.get("version")),
        ("uptime", duration(s.get("uptime_s", 0))),
        ("pid", s.get("pid")),
        ("listening", s.get("listen_addrs")),
        ("connected peers", s.get("connected_peers")),
        ("state dir", s.get("state_dir")),
        ("socket", s.get("socket")),
        ("metrics", s.get("metrics_addr")),
        ("log level", s.get("log_level")),
    ])
