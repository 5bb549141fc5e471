"""Output for people (rich, imported only when a table is drawn) and for programs (JSON).

Most of what is drawn was written by someone else: a member's labels and GPU names, a host's
error, a rank's output. Such text reaches the terminal as text, never as Rich markup (a label
`[/x]` once crashed `swarmctl peers` for every operator) and never as a control sequence (an
OSC 52 escape writes the clipboard, a carriage return paints a fake "succeeded" over a line):
`plain` shows every C0/C1 control and bidi override as a visible escape, and `cell` makes a
table cell of it. JSON output escapes controls by itself and is left as it is.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any


# C0 but tab and newline, DEL, C1, and the bidi controls that reorder what a reader sees
# (Trojan Source, CVE-2021-42574)
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def plain(text: Any) -> str:
    """`text` safe for a terminal: each control character shown as an escape (``\\x1b``)."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}",
                         str(text))


def cell(value: Any) -> Any:
    """A table cell of text from elsewhere: Rich's Text (never parsed as markup), controls shown."""
    from rich.text import Text

    return Text(plain(value))


def as_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def key_values(title: str, rows: Iterable[tuple[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(plain(title)), show_header=False, title_justify="left", box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in rows:  # values are plain text: a peer's words (a host's error) are never markup
        table.add_row(key, Text(plain(_text(value))))
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
    parts += [f"{secs}s"] * bool(secs)
    return " ".join(parts) or "0s"


def when(ts: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ts))


def swarm_warnings(s: Mapping[str, Any]) -> list[str]:
    """Lines a person must not miss: this node revoked, or its certificate about to expire."""
    swarm = s.get("swarm") or {}
    out = []
    if swarm.get("revoked"):
        reason = swarm["revoked"].get("reason")
        out.append("REVOKED: the swarm's owner revoked this node's membership" + (f" ({reason})" if reason else "")
                   + "; members refuse it. Join again with a new invite, under a new identity.")
    elif swarm.get("cert_expiring"):
        left = swarm.get("cert_expires_in_s", 0)
        what = f"expires in {duration(left)}" if left > 0 else "has EXPIRED"
        line = f"WARNING: this node's certificate {what} ({when(swarm['cert_expires'])})"
        if swarm.get("renewal_error"):
            line += f"; renewal from the owner failed: {swarm['renewal_error']}"
        out.append(line + ". It renews automatically; to try now: swarmctl swarm renew")
    if swarm.get("record_error"):
        out.append(f"NOT PUBLISHING: {swarm['record_error']}")
    return out


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
        *swarm_rows(s),
        *mesh_rows(s.get("mesh")),
        *reach_rows(s.get("reach")),
        *routing_rows(s.get("routing")),
        *job_rows(s.get("jobs")),
        *sandbox_rows(s.get("sandbox")),
    ])
    for line in swarm_warnings(s):
        print(plain(line))


def job_rows(j: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    if not j:
        return []
    gpus = f", GPUs free {','.join(map(str, j['gpus_free']))}" if j["gpus_free"] else ""
    return [("jobs here", f"{j['slots'] - j['slots_free']} of {j['slots']} slots used, {j['ranks_here']} ranks"
                          f"{gpus}; ranks run as {j['user'] or 'this user'}"),
            ("coordinating", j["coordinating"] or "-"),
            ("slots held by", ", ".join(f"{h['job']} ({h['state']}, for …{h['coordinator'][-8:]})"
                                        for h in j.get("holding") or ()) or "-")]


def sandbox_rows(sb: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    """Whether jobs here are confined, and each part: what it is, or 'off: why'."""
    if not sb:
        return []
    if sb.get("mode") == "off":
        return [("sandbox", "off (sandbox = off): jobs run unconfined as the job user")]
    parts = sb.get("parts", {})
    state = "complete" if sb.get("complete") else "partial" if sb.get("active") else "inactive"
    head = f"{state} (sandbox = {sb.get('mode')})"
    if sb.get("mode") == "required" and not sb.get("complete"):
        head += ": jobs are refused"
    return [("sandbox", head), *((f"  {name}", text) for name, text in parts.items())]


def mesh_rows(m: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    if not m:
        return []
    if "interface" not in m:
        return [("mesh", f"off: {m.get('off')}")]
    state = "up" if m["up"] else f"down: {m['error']}" if m.get("error") else "waiting to join a swarm"
    return [
        ("mesh", f"{m['interface']} ({m['backend']}), {state}"),
        ("overlay address", [a for a in (m.get("address"), m.get("address6")) if a]),
        ("wireguard key", m["public_key"]),
    ]


def reach_rows(r: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    """How members reach this node, who confirmed it, and whether the router mapped a port."""
    if not r:
        return []
    rows: list[tuple[str, Any]] = [("reached", r.get("reach"))]
    if r.get("reflexive"):
        rows.append(("  seen from outside as", r["reflexive"]))
    if r.get("confirmed_by"):
        rows.append(("  confirmed by", ", ".join(str(p)[-8:] for p in r["confirmed_by"])))
    if "port_mapping" in r:
        rows.append(("  port mapping", r["port_mapping"] or "none (no UPnP/NAT-PMP asked: see the README)"))
    return rows


def routing_rows(r: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    """This node's network coordinate, the paths it relays, and whether it relays for others."""
    if not r:
        return []
    coord, vivaldi, relay = r.get("coordinate") or {}, r.get("vivaldi") or {}, r.get("relay") or {}
    relayed, legs = r.get("relayed_paths") or {}, r.get("legs") or {}
    why = ", ".join(f"{reason} {n}" for reason, n in sorted((vivaldi.get("rejections") or {}).items()))
    rows: list[tuple[str, Any]] = [
        ("coordinate", f"error {coord.get('error', 0):.2f} after {vivaldi.get('updates', 0)} RTTs"
                       + (f" ({vivaldi['rejected']} rejected{': ' + why if why else ''})"
                          if vivaldi.get("rejected") else "")
                       + (f" ({vivaldi['resets']} resets)" if vivaldi.get("resets") else "")),
        ("relayed paths", [f"{peer[-8:]} via {via[-8:]}" for peer, via in relayed.items()] or "none: all direct"),
    ]
    if legs:  # relay legs asked of the peers we choose for (paths.py AskLegs), and answered for others
        rows.append(("relay legs", f"asked {legs.get('asked', 0)}, taken {legs.get('taken', 0)}, dropped "
                                   f"{legs.get('dropped', 0)}, unanswered {legs.get('failed', 0)}; "
                                   f"answered {legs.get('served', 0)} for others"
                                   + (f", refused {legs['refused']}" if legs.get("refused") else "")))
    if relay.get("offered"):
        text = (f"on: {relay.get('pairs', 0)} pairs, up to {relay.get('cap_mbit')} Mbit/s, "
                f"ports {relay.get('ports')}" + (f"; rules failed: {relay['error']}" if relay.get("error") else ""))
    else:
        text = f"off ({relay.get('mode')})" + (f": {relay['off']}" if relay.get("off") else "")
    return [*rows, ("relaying for others", text)]


def swarm_rows(s: Mapping[str, Any]) -> list[tuple[str, Any]]:
    swarm = s.get("swarm")
    if not swarm:
        return [("swarm", "none: `swarmctl swarm init` or `swarmctl swarm join TOKEN`")]
    members = swarm.get("members", {})
    rows: list[tuple[str, Any]] = [
        ("swarm", swarm["id"] + (" (owner)" if swarm.get("owner") else "")),
        ("members", ", ".join(f"{n} {state}" for state, n in members.items() if n) or "no peers yet"),
    ]
    if swarm.get("cert_expires"):
        rows.append(("certificate", f"expires {when(swarm['cert_expires'])}"
                     + (f", overlay {swarm['cert_addr4']}" if swarm.get("cert_addr4") else "")
                     + (" (revoked)" if swarm.get("revoked") else "")))
    record = s.get("record")
    if record:
        labels = ", ".join(f"{k}={v}" for k, v in sorted(record["labels"].items())) or "-"
        rows += [("advertised", record["summary"]), ("labels", labels), ("record seq", record["seq"])]
    return rows


STATE_STYLE = {"alive": "green", "suspect": "yellow", "dead": "red", "left": "dim", "stale": "yellow"}


def peers(result: Mapping[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    if result.get("swarm") is None:
        console.print("not in a swarm: run `swarmctl swarm init` or `swarmctl swarm join TOKEN`")
        return
    table = Table(title=cell(f"swarm {result['swarm']}"), title_justify="left")
    for column in ("peer", "state", "rtt", "gpus", "cpu free", "memory free", "labels", "record age"):
        table.add_column(column, no_wrap=column not in ("gpus", "labels"))
    for p in result["peers"]:
        res = p["resources"]
        state = "stale" if p.get("stale") and p["state"] == "alive" else p["state"]  # no record within its ttl
        style = STATE_STYLE.get(state, "")
        table.add_row(
            cell(p["peer"][-8:]), Text(plain(state), style=style), rtt(p["rtt_ms"], p.get("rtt_source")),
            cell(gpus(res.get("gpus", []))),
            f"{res['cpu_free']:g}/{res['cpu_count']}",
            f"{res['memory_free_mb'] / 1024:.1f}/{res['memory_total_mb'] / 1024:.1f} GiB",
            cell(", ".join(f"{k}={v}" for k, v in sorted(p["labels"].items())) or "-"),
            duration(p["record_age_s"]),
        )
    console.print(table)
    if not result["peers"]:
        console.print("no other members known yet")
    elif any(p.get("rtt_source") == "estimated" for p in result["peers"]):
        console.print(ESTIMATE_LEGEND)


ESTIMATE_LEGEND = "~ RTT estimated from network coordinates: this node does not probe that member itself"


def rtt(value: float | None, source: str | None = "measured") -> str:
    """A measured RTT as measured ("42.1 ms"); an estimate rounded and marked ("~40 ms")."""
    if value is None:
        return "-"
    return f"~{value:.0f} ms" if source == "estimated" else f"{value:.1f} ms"


def gpus(items: list[Mapping[str, Any]]) -> str:
    if not items:
        return "-"
    by_model: dict[str, list[Mapping[str, Any]]] = {}
    for g in items:
        by_model.setdefault(g["name"], []).append(g)
    return "\n".join(f"{len(gs)}× {name} ({sum(g['memory_free_mb'] for g in gs) / 1024:.0f} GiB free)"
                     for name, gs in by_model.items())


def mesh(result: Mapping[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=cell(f"{result['interface']} ({result['backend']}) {result['address']} "
                             f"key {result['public_key']}"), title_justify="left")
    for column in ("peer", "overlay", "endpoint", "path", "rtt", "direct", "estimate", "handshake", "rx", "tx"):
        table.add_column(column, no_wrap=True)
    for p in result["peers"]:
        age = p["handshake_age_s"]
        table.add_row(
            cell((p["peer"] or "?")[-8:]), cell(p["overlay"] or "-"), cell(p["endpoint"] or "-"), cell(path(p)),
            rtt(p.get("path_rtt_ms")), rtt(p.get("direct_rtt_ms")), rtt(p.get("estimate_ms"), "estimated"),
            "never" if age is None else f"{duration(age)} ago" if age >= 1 else "just now",
            size(p["rx_bytes"]), size(p["tx_bytes"]),
        )
    console.print(table)
    if not result["peers"]:
        console.print("no peers yet: the mesh follows the swarm's alive members")


def path(p: Mapping[str, Any]) -> str:
    """`direct`, `direct (punched)` (WireGuard sends to the peer's reflexive endpoint, its NAT's
    mapping: the mesh row's `reflexive`) or `via <relay> (<reason>)` (routing's path_row: faster,
    no direct path, symmetric NAT); a relay chosen whose session is not active (yet, or any
    more) is named with its state: `direct (via 9r3ANaba requesting)`."""
    text, relay, state = p.get("path") or "-", p.get("relay"), p.get("relay_state")
    if text == "direct" and p.get("reflexive"):
        text = "direct (punched)"
    if not relay or state == "active":
        return text
    return f"{text} ({state or 'not asked yet'})" if text.startswith("via") \
        else f"{text} (via {relay[-8:]} {state or 'not asked yet'})"


def size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)



ROLES = {
    "chooser": "this node: the lower peer id of a pair chooses, and announces the choice in its record",
    "follower": "the peer (the lower peer id of the pair): this node follows what its record announces",
}


def route(r: Mapping[str, Any]) -> None:
    """`swarmctl route PEER`: the path to one peer and why (Routing.explain)."""
    from rich.console import Console
    from rich.table import Table

    direct = r.get("direct_ms")
    source = r.get("direct_source")
    rows: list[tuple[str, Any]] = [
        ("path", route_path(r)),
        *([("why", REASONS.get(r["reason"], r["reason"]))] if r.get("reason") else []),
        *direct_rows(r.get("direct_path"), r.get("nated_pair")),
        ("path RTT", rtt(r.get("path_ms"))),
        ("direct RTT", rtt(direct) + (f" ({source})" if direct is not None and source != "measured" else "")),
        ("estimate", rtt(r.get("estimate_ms"), "estimated")),
        ("decided by", ROLES.get(r.get("role") or "", r.get("role"))),
    ]
    if r.get("role") == "follower":
        announced = r.get("announced")
        rows.append(("announced", "direct" if announced is None else f"via {announced[-8:]}"))
        if r.get("refused"):
            rows.append(("not followed", r["refused"]))
    else:
        rows.append(("hysteresis", hysteresis(r.get("hysteresis"))))
    if r.get("busy"):
        rows.append(("traffic", "heavy now: not moved for latency while it lasts, only if the path fails"))
    if r.get("thresholds"):
        rows.append(("rule", rule(r["thresholds"])))
    if r.get("held_down"):
        rows.append(("held down", [f"{relay[-8:]} for {left:.0f} s more (it failed)"
                                   for relay, left in r["held_down"].items()]))
    key_values(f"route to {r['peer']}", rows)
    candidates = r.get("candidates") or []
    if not candidates:
        print("no relay considered: no member that offers relaying reports a leg to this peer")
        return
    table = Table(title="relays considered (legs measured; coordinates only shortlist; leg 2 from the peer's "
                        "record, or asked of it)", title_justify="left")
    for column in ("relay", "leg 1 (here → relay)", "leg 2 (relay → peer)", "total", "estimate", "vs direct"):
        table.add_column(column, no_wrap=True)
    for c in candidates:
        total = c.get("total_ms")
        gain = "-" if total is None or not direct else f"{(total / direct - 1) * 100:+.0f} %"
        note = " (in use)" if c["relay"] == r.get("current") else "" if c.get("usable", True) \
            else f" (not usable: {c['why_not']})" if c.get("why_not") else " (not usable)"
        leg2 = rtt(c.get("leg2_ms")) + (" (asked)" if c.get("leg2_source") == "asked" else "")
        table.add_row(cell(c["relay"][-8:] + note), rtt(c.get("leg1_ms")), leg2, rtt(total),
                      rtt(c.get("estimate_ms"), "estimated"), gain)
    Console().print(table)


REASONS = {
    "faster": "faster: the relay's two legs beat the direct path by the switch rule",
    "no direct path": "no direct path: WireGuard completed no handshake on it (a NAT or firewall in between)",
    "symmetric NAT": "symmetric NAT: an end's NAT maps each destination to a new port, so no punch holds",
}
NATS = {"public": "public", "eim": "behind NAT (endpoint-independent)", "edm": "behind NAT (symmetric)",
        "firewall": "behind a firewall", None: "not measured"}


def direct_rows(d: Mapping[str, Any] | None, nated: Any) -> list[tuple[str, Any]]:
    """Whether the direct path works (routing/direct.py's row), and each end's NAT."""
    state = (d or {}).get("state")
    if not d or (state == "ok" and not nated):
        return []  # a direct path that works between two public members: nothing to explain
    if state == "ok":
        text = "works (a WireGuard handshake on it)"
    elif state == "unproven":
        text = f"no handshake yet, for {d.get('unproven_for_s')} s (relayed after {d.get('grace_s')} s)"
    elif state == "trying again":
        text = "none before; trying it again now"
    else:
        text = "none" + (" (the two NATs rule it out; tried again when a record changes)" if d.get("impossible")
                         else f" ({d.get('failures', 0)} tries failed; next in {d.get('retry_in_s')} s)")
    rows: list[tuple[str, Any]] = [("direct path", text)]
    if d.get("nat_here") is not None or d.get("nat_peer") is not None:
        rows.append(("NAT", f"here {NATS.get(d.get('nat_here'), d.get('nat_here'))}, "
                            f"peer {NATS.get(d.get('nat_peer'), d.get('nat_peer'))}"
                            + (": only publicly reachable members relay" if nated else "")))
    return rows


def route_path(r: Mapping[str, Any]) -> str:
    """The path traffic takes now, and the relay session behind a chosen relay."""
    relay, session = r.get("current"), r.get("session") or {}
    if relay is None:
        return "direct"

    state = session.get("state") or "not asked yet"
    detail = f"relay session {state}" + (f", port {session['port']}" if session.get("port") else "")
    detail += f": {session['error']}" if session.get("error") else ""
    if r.get("in_use", "").startswith("via"):
        return f"via {relay[-8:]} ({detail})"
    return f"direct, switching to via {relay[-8:]} ({detail})"


def hysteresis(h: Mapping[str, Any] | None) -> str:
    """Where the chooser's switch rule stands: the move wanted, for how many of the rounds needed."""
    if not h or not h.get("wants"):
        return "settled: no move wanted"
    target = "direct" if h.get("wants") == "direct" or h.get("candidate") is None else f"via {h['candidate'][-8:]}"
    return f"wants {target}: {h.get('rounds', 0)} of {h.get('needed', '?')} rounds in a row"


def rule(t: Mapping[str, Any]) -> str:
    return (f"to a relay at ≤ {t['switch_ratio'] * 100:.0f} % of the path and ≥ {t['switch_min_gain_ms']:g} ms "
            f"faster, back to direct above {t['back_ratio'] * 100:.0f} % of it or under "
            f"{t['back_min_gain_ms']:g} ms gain; {t['stable_rounds']} rounds in a row")
