"""What a lab is made of, decided before anything is created (pure, unit-tested).

One point-to-point segment per host pair gives an exact latency matrix, triangle-inequality
violations included (DESIGN). Each host has one underlay address, ``10.200.0.I/32`` on its
loopback, reached from every peer through that pair's segment by a host route; each segment
is a /30 in ``10.250.0.0/16``. Addresses only need to be unique within a lab: every lab
lives in its own namespaces.
"""

from __future__ import annotations

import csv
import gzip
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

COUNTRY_DATA = Path(__file__).resolve().parent.parent / "data" / "country_rtt_stat.csv.gz"
MAX_HOSTS = 60  # 10.250.P.0/30 per pair: P < 2048 keeps the plan simple
SAME_COUNTRY_FALLBACK_MS = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Host:
    name: str  # h1 … hN
    index: int  # 1-based
    address: str  # underlay address, on the host's loopback
    country: str | None = None


@dataclass(slots=True, kw_only=True)
class Link:
    a: str
    b: str
    pair: int  # 0-based pair number: names the switches, wirefilter and subnet
    a_addr: str  # a's end of the segment
    b_addr: str
    rtt_ms: float
    loss_pct: float = 0.0
    bandwidth_mbit: float | None = None
    up: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


def host_address(index: int) -> str:
    return f"10.200.{index // 256}.{index % 256}"


def segment(pair: int) -> tuple[str, str]:
    base = f"10.250.{pair // 64}.{(pair % 64) * 4}"
    prefix = base.rsplit(".", 1)[0]
    last = int(base.rsplit(".", 1)[1])
    return f"{prefix}.{last + 1}", f"{prefix}.{last + 2}"


def plan(n: int, rtt_ms: Callable[[Host, Host], float], *, loss_pct: float = 0.0,
         bandwidth_mbit: float | None = None, countries: Sequence[str] | None = None
         ) -> tuple[list[Host], list[Link]]:
    if not 1 <= n <= MAX_HOSTS:
        raise ValueError(f"--hosts must be between 1 and {MAX_HOSTS}, got {n}")
    hosts = [Host(name=f"h{i}", index=i, address=host_address(i),
                  country=countries[(i - 1) % len(countries)] if countries else None)
             for i in range(1, n + 1)]
    links = []
    for pair, (a, b) in enumerate(itertools.combinations(hosts, 2)):
        a_addr, b_addr = segment(pair)
        links.append(Link(a=a.name, b=b.name, pair=pair, a_addr=a_addr, b_addr=b_addr,
                          rtt_ms=round(rtt_ms(a, b), 2), loss_pct=loss_pct, bandwidth_mbit=bandwidth_mbit))
    return hosts, links


def uniform(ms: float) -> Callable[[Host, Host], float]:
    return lambda a, b: ms


def from_matrix_csv(path: Path) -> Callable[[Host, Host], float]:
    """A CSV of RTTs in ms, one row per host, no header: row i, column j = RTT(h{i+1}, h{j+1})."""
    with open(path, newline="") as f:
        rows = [[float(x) for x in row] for row in csv.reader(f) if row]
    size = len(rows)
    if any(len(r) != size for r in rows):
        raise ValueError(f"{path}: the RTT matrix must be square ({size} rows)")

    def rtt(a: Host, b: Host) -> float:
        if max(a.index, b.index) > size:
            raise ValueError(f"{path}: the matrix has {size} hosts, the lab more")
        return rows[a.index - 1][b.index - 1]
    return rtt


def country_table(path: Path = COUNTRY_DATA) -> dict[frozenset[str], float]:
    with gzip.open(path, "rt", newline="") as f:
        return {frozenset((r["cty1"], r["cty2"])): float(r["rtt_avg"]) for r in csv.DictReader(f)}


def from_countries(table: Mapping[frozenset[str], float]) -> Callable[[Host, Host], float]:
    def rtt(a: Host, b: Host) -> float:
        assert a.country and b.country
        key = frozenset((a.country, b.country))
        if key in table:
            return table[key]
        if a.country == b.country:
            return SAME_COUNTRY_FALLBACK_MS
        raise ValueError(f"no measured RTT between {a.country} and {b.country} in the country data")
    return rtt


def check_countries(codes: Sequence[str], table: Mapping[frozenset[str], float]) -> list[str]:
    known = set().union(*table)
    codes = [c.strip().upper() for c in codes if c.strip()]
    unknown = [c for c in codes if c not in known]
    if unknown:
        raise ValueError(f"unknown country codes {', '.join(unknown)} (ISO 3166 alpha-2, e.g. DE, US, JP)")
    return codes
