"""A `swarm-sim run` scenario: TOML in, frozen dataclasses out, every field checked.

Rules:
- Every key is known (a typo is an error, not a silently ignored setting), every value has
  a type and a range, and an error names the file, the table and the field, what is allowed
  and what was given, on one line: ``small.toml: [network] loss: must be 0..0.5, got 2``.
- Nothing here runs anything: :func:`load` reads and checks; :func:`place` puts nodes in
  countries (seeded) and checks what needs the placement (a partition naming a country
  with no nodes); the runner (``sim/runner.py``) plays the events on a swarm.
- Events may repeat: ``every = S`` and ``times = K`` make K copies S seconds apart (the
  lab's 8 kills and 30 changes are two tables, not 38).

Schema (sim/scenarios/*.toml are examples)::

    name = "lab-5-countries"
    mode = "membership"      # membership (the cores on the network) | disseminate (one record, no cores)
    seconds = 600            # simulated (membership mode)
    nodes = 5
    timing = "wan"           # wan | lan  (membership.Timing presets)
    [timing_overrides]       # what-if: any membership.Timing field, on top of the preset
    suspicion_mult = 2.0     # (numbers > 0; the whole-number fields take whole numbers >= 1)
    seed = 1                 # --seed overrides
    [network]
    countries = ["DE", "US"] # node i in countries[i % len]; or "weighted" (+ top = N); or absent
    latency_csv = "m.csv"    # or: a square RTT matrix in ms (node i on row i % rows), relative to the file
    rtt_ms = 30              # or: one RTT on every link
    loss = 0.01              # per link, 0..0.5
    jitter_ms = 2.0
    [[events]]               # one of: crash, kill, leave, partition, churn_per_min, change, congest
    at = 60
    crash = 10               # N random running nodes go silent; revive_after = S: each back S s later
    [[events]]               # kill = N: processes die, hosts stay up (connections reset: lab kill -9)
    at = 100                 # leave = N: graceful leaves; change = N: capacity changes
    until = 160              # (partition, churn_per_min, congest: from at until `until`)
    partition = [["DE"], ["US"]]     # region A cut from region B (country lists)
    [[events]]
    at = 0
    until = 600
    churn_per_min = 10       # joins + leaves per minute, half each
    [[events]]
    at = 300
    until = 400
    congest = 1              # N nodes whose messages are delayed by delay_ms (Lifeguard)
    delay_ms = 800
    every = 30               # any event: repeat every 30 s ...
    times = 3                # ... 3 times in all
"""

from __future__ import annotations

import csv
import math
import random
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from swarmd.gossip.membership import Timing

MODES = ("membership", "disseminate")
TIMINGS = ("wan", "lan")
MAX_NODES = {"membership": 100_000, "disseminate": 1_000_000}
MAX_SECONDS = 86_400.0
MAX_LOSS = 0.5  # beyond it TCP (what libp2p runs on) is no longer a transport
MAX_JITTER_MS = 1_000.0
MAX_RTT_MS = 10_000.0
MAX_DELAY_MS = 60_000.0
MAX_CHURN_PER_MIN = 100_000.0
MAX_REPEATS = 10_000
MAX_MATRIX = 1_000  # rows of a latency CSV (a row per site; nodes share rows)
# the lab's data (sim/netlab/topology.py reads the same file; importing it would pull in libp2p)
COUNTRY_DATA = Path(__file__).resolve().parent / "data" / "country_rtt_stat.csv.gz"
SHIPPED = Path(__file__).resolve().parent / "scenarios"


class ScenarioError(ValueError):
    """A scenario the simulator cannot run; ``str()`` is the one line the CLI prints."""

    def __init__(self, file: str, where: str, message: str) -> None:
        self.file, self.where, self.message = file, where, message
        super().__init__(f"{file}: {where + ': ' if where else ''}{message}")


# --- what a scenario is ---------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class Network:
    countries: tuple[str, ...] = ()  # listed: node i in countries[i % len]
    weighted: bool = False  # countries drawn from the data, weighted by its sample counts
    top: int | None = None  # with weighted: only the N countries with the most samples (default: all
    # those between which the data has every RTT: the 91 heaviest)
    latency: tuple[tuple[float, ...], ...] = ()  # a latency CSV's RTTs in ms: node i on row i % rows
    latency_csv: str | None = None  # its path, as given (for the report)
    rtt_ms: float | None = None  # one RTT on every link
    loss: float = 0.0  # per link: each lost attempt costs a TCP retransmission timeout
    jitter_ms: float = 0.0

    @property
    def by_country(self) -> bool:
        return bool(self.countries) or self.weighted


@dataclass(frozen=True, slots=True, kw_only=True)
class Crash:
    """``count`` random running nodes stop. ``kill``: the process dies but the host stays up, so
    peers' connections break at once (the lab's ``kill -9``); else the host goes silent (``lab
    crash``: no FIN, no RST, found only by probes)."""
    at: float
    count: int
    revive_after: float | None = None
    kill: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Leave:
    at: float
    count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Partition:
    at: float
    until: float
    a: tuple[str, ...]  # region A (countries) is cut from region B
    b: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Churn:
    at: float
    until: float
    per_min: float  # joins + leaves per minute, half each


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    at: float
    count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Congest:
    at: float
    until: float
    count: int
    delay_ms: float


Event = Crash | Leave | Partition | Churn | Change | Congest


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    name: str
    file: str
    mode: str = "membership"
    seconds: float
    nodes: int
    timing: str = "wan"
    seed: int = 1
    network: Network = field(default_factory=Network)
    overrides: tuple[tuple[str, float | int], ...] = ()  # [timing_overrides], sorted by field
    events: tuple[Event, ...] = ()  # repeats expanded, ordered by time (file order among equals)

    @property
    def joins(self) -> int:
        """Nodes that churn will start (half of each churn event's arrivals, rounded up)."""
        return sum(math.ceil(ev.per_min * (ev.until - ev.at) / 60 / 2) + 1
                   for ev in self.events if isinstance(ev, Churn))

    def with_seed(self, seed: int) -> Scenario:
        return replace(self, seed=seed)


# --- reading --------------------------------------------------------------------------

_TOP = ("name", "mode", "seconds", "nodes", "timing", "seed", "network", "timing_overrides", "events")
_NETWORK = ("countries", "top", "latency_csv", "rtt_ms", "loss", "jitter_ms")
# event kind -> (its keys besides at/every/times, whether it has an end)
_KINDS: dict[str, tuple[tuple[str, ...], bool]] = {
    "crash": (("revive_after",), False),
    "kill": (("revive_after",), False),
    "leave": ((), False),
    "partition": ((), True),
    "churn_per_min": ((), True),
    "change": ((), False),
    "congest": (("delay_ms",), True),
}
_MISSING = object()
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")


def _show(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, float) and value.is_integer():
        return f"{value:g}"
    if isinstance(value, dict):
        return "a table"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _range(low: float, high: float) -> str:
    return f"{low:g}..{high:g}"


class _Table:
    """One TOML table being read: typed getters that name the field in their errors."""

    def __init__(self, file: str, where: str, raw: Any, allowed: Sequence[str]) -> None:
        if not isinstance(raw, dict):
            raise ScenarioError(file, where, f"must be a table, got {_show(raw)}")
        self.file, self.where, self.raw = file, where, raw
        unknown = [k for k in raw if k not in allowed]
        if unknown:
            raise ScenarioError(file, self._at(unknown[0]), f"unknown key (allowed: {', '.join(allowed)})")

    def _at(self, key: str) -> str:
        return f"{self.where} {key}" if self.where else key

    def fail(self, key: str, message: str) -> ScenarioError:
        return ScenarioError(self.file, self._at(key), message)

    def has(self, key: str) -> bool:
        return key in self.raw

    def number(self, key: str, low: float, high: float, default: Any = _MISSING, *,
               whole: bool = False, above: bool = False) -> Any:
        """A number in low..high (``above``: strictly more than low); ``whole``: an integer."""
        value = self.raw.get(key, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise self.fail(key, f"missing (a {'whole ' if whole else ''}number, {self._allowed(low, high, above)})")
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"must be a number, got {_show(value)}")
        if whole and not (isinstance(value, int) or value.is_integer()):
            raise self.fail(key, f"must be a whole number, got {_show(value)}")
        if not math.isfinite(value) or value < low or value > high or (above and value <= low):
            raise self.fail(key, f"must be {self._allowed(low, high, above)}, got {_show(value)}")
        return int(value) if whole else float(value)

    @staticmethod
    def _allowed(low: float, high: float, above: bool) -> str:
        return f"more than {low:g} and at most {high:g}" if above else _range(low, high)

    def choice(self, key: str, allowed: Sequence[str], default: str) -> str:
        value = self.raw.get(key, default)
        if value not in allowed or not isinstance(value, str):
            raise self.fail(key, f"must be one of {', '.join(allowed)}, got {_show(value)}")
        return value

    def name(self, key: str, default: str) -> str:
        """A name that can also name a directory (the default output is sim-out/NAME)."""
        value = self.raw.get(key, default)
        if not isinstance(value, str) or not _NAME.fullmatch(value):
            raise self.fail(key, f"must be 1..100 letters, digits, '.', '_' or '-' (not starting with '.'), "
                                 f"got {_show(value)}")
        return value


def shipped() -> list[str]:
    """The names of the scenarios that come with swarm-sim (sim/scenarios/NAME.toml)."""
    return sorted(p.stem for p in SHIPPED.glob("*.toml"))


def load(path: str | Path) -> Scenario:
    """Read and check a scenario file (or a shipped one, by name). Raises :class:`ScenarioError`."""
    path = Path(path)
    if not path.exists() and path.name == str(path) and (SHIPPED / f"{path.name}.toml").is_file():
        path = SHIPPED / f"{path.name}.toml"
    file = str(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ScenarioError(file, "", f"no such file (or name a shipped scenario: {', '.join(shipped())})") from None
    except IsADirectoryError:
        raise ScenarioError(file, "", "is a directory, not a scenario file") from None
    except OSError as exc:
        raise ScenarioError(file, "", f"cannot read it: {exc.strerror or exc}") from None
    try:
        raw = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ScenarioError(file, "", "not TOML: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(file, "", f"not TOML: {exc}") from None
    return parse(raw, file=file, base=path.parent)


def parse(raw: Mapping[str, Any], *, file: str = "scenario", base: Path = Path(".")) -> Scenario:
    top = _Table(file, "", dict(raw), _TOP)
    mode = top.choice("mode", MODES, "membership")
    nodes = top.number("nodes", 2, MAX_NODES[mode], whole=True)
    if mode == "disseminate" and top.has("seconds"):
        raise top.fail("seconds", "mode = \"disseminate\" follows one record until it is everywhere: no seconds")
    seconds = 0.0 if mode == "disseminate" else top.number("seconds", 0, MAX_SECONDS, above=True)
    scenario = dict(
        name=top.name("name", re.sub(r"[^A-Za-z0-9._-]", "-", Path(file).stem).lstrip(".")[:100] or "scenario"), file=file, mode=mode, nodes=nodes, seconds=seconds,
        timing=top.choice("timing", TIMINGS, "wan"), seed=top.number("seed", 0, 2**63 - 1, 1, whole=True))
    table = country_weights()
    network = _network(_Table(file, "[network]", raw.get("network", {}), _NETWORK), base, table, mode)
    events = raw.get("events", [])
    if not isinstance(events, list):
        raise ScenarioError(file, "events", "must be an array of tables ([[events]])")
    if events and mode == "disseminate":
        raise ScenarioError(file, "[[events]]", "mode = \"disseminate\" takes no events (one record, no cores)")
    parsed: list[tuple[float, int, Event]] = []
    for i, ev in enumerate(events, 1):
        for e in _event(file, f"[[events]] #{i}", ev, seconds, nodes, network):
            parsed.append((e.at, len(parsed), e))
    parsed.sort(key=lambda x: (x[0], x[1]))
    overrides = _overrides(_Table(file, "[timing_overrides]", raw.get("timing_overrides", {}), _TIMING_FIELDS))
    if overrides and mode == "disseminate":
        raise ScenarioError(file, "[timing_overrides]", "mode = \"disseminate\" runs no cores: no timing")
    out = Scenario(**scenario, network=network, overrides=overrides, events=tuple(e for _, _, e in parsed))
    if nodes + out.joins > MAX_NODES[mode]:
        raise ScenarioError(file, "[[events]] churn_per_min", f"would start {out.joins:,} more nodes; a scenario "
                                                              f"runs at most {MAX_NODES[mode]:,} in all")
    return out


_TIMING_FIELDS = tuple(sorted(f.name for f in fields(Timing)))
_WHOLE = frozenset(f.name for f in fields(Timing) if f.type in ("int", int))


def _overrides(t: _Table) -> tuple[tuple[str, float | int], ...]:
    """[timing_overrides]: membership.Timing fields set on top of the preset (what-if runs)."""
    return tuple((key, t.number(key, 1, 1e6, whole=True) if key in _WHOLE else t.number(key, 0, 1e6, above=True))
                 for key in sorted(t.raw))


def _network(t: _Table, base: Path, table: Mapping[str, float], mode: str) -> Network:
    given = [k for k in ("countries", "latency_csv", "rtt_ms") if t.has(k)]
    if len(given) > 1:
        raise t.fail(given[1], f"give one of countries, latency_csv, rtt_ms (got {' and '.join(given)})")
    if mode == "disseminate" and "countries" not in given and given:
        raise t.fail(given[0], "mode = \"disseminate\" places nodes by countries (listed or \"weighted\")")
    out: dict[str, Any] = dict(loss=t.number("loss", 0, MAX_LOSS, 0.0),
                               jitter_ms=t.number("jitter_ms", 0, MAX_JITTER_MS, 0.0))
    if t.has("top") and t.raw.get("countries") != "weighted":
        raise t.fail("top", "only with countries = \"weighted\"")
    if t.has("countries"):
        value = t.raw["countries"]
        if value == "weighted":
            out["weighted"] = True
            most = complete_top()  # beyond it the data lacks the RTT of some pair
            out["top"] = t.number("top", 1, most, most, whole=True)
        elif isinstance(value, list) and value and all(isinstance(c, str) for c in value):
            out["countries"] = tuple(_country(t, "countries", c, table) for c in value)
            gap = missing_pair(out["countries"])
            if gap:
                raise t.fail("countries", f"the RTT data has no measurement between {gap[0]} and {gap[1]}: "
                                          f"list countries it measured between (the weighted draw does)")
        else:
            raise t.fail("countries", f"must be a list of country codes (e.g. [\"DE\", \"US\"]) or \"weighted\", "
                                      f"got {_show(value)}")
    elif t.has("latency_csv"):
        name = t.raw["latency_csv"]
        if not isinstance(name, str) or not name:
            raise t.fail("latency_csv", f"must be a file name, got {_show(name)}")
        out["latency_csv"] = name
        out["latency"] = _matrix(t, base / name)
    elif t.has("rtt_ms"):
        out["rtt_ms"] = t.number("rtt_ms", 0, MAX_RTT_MS, above=True)
    elif mode == "disseminate":
        raise t.fail("countries", "missing (mode = \"disseminate\" needs countries: a list or \"weighted\")")
    else:
        out["rtt_ms"] = 20.0  # like `swarm-sim lab up` without --rtt-ms
    return Network(**out)


def _country(t: _Table, key: str, code: str, table: Mapping[str, float]) -> str:
    up = code.strip().upper()
    if up not in table:
        raise t.fail(key, f"unknown country code {_show(code)} (ISO 3166 alpha-2 present in the RTT data, "
                          f"e.g. DE, US, JP)")
    return up


def _matrix(t: _Table, path: Path) -> tuple[tuple[float, ...], ...]:
    where = f"latency_csv {str(path)!r}"
    try:
        with open(path, newline="") as f:
            rows = [row for row in csv.reader(f) if row and any(c.strip() for c in row)]
    except FileNotFoundError:
        raise t.fail("latency_csv", f"no such file: {path}") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise t.fail("latency_csv", f"cannot read {path}: {exc}") from None
    if not rows or len(rows) > MAX_MATRIX:
        raise t.fail("latency_csv", f"{where}: must have 1..{MAX_MATRIX} rows, has {len(rows)}")
    out = []
    for i, row in enumerate(rows, 1):
        if len(row) != len(rows):
            raise t.fail("latency_csv", f"{where}: must be square: row {i} has {len(row)} values, "
                                        f"there are {len(rows)} rows")
        try:
            values = tuple(float(x) for x in row)
        except ValueError:
            raise t.fail("latency_csv", f"{where}: row {i}: RTTs must be numbers in ms") from None
        if not all(0 <= v <= MAX_RTT_MS for v in values):
            raise t.fail("latency_csv", f"{where}: row {i}: RTTs must be 0..{MAX_RTT_MS:g} ms")
        out.append(values)
    return tuple(out)


def _event(file: str, where: str, raw: Any, seconds: float, nodes: int, network: Network) -> list[Event]:
    if not isinstance(raw, dict):
        raise ScenarioError(file, where, f"must be a table, got {_show(raw)}")
    kinds = [k for k in _KINDS if k in raw]
    named = kinds or list(_KINDS)  # none named: every key of every kind is known, the kind is what's missing
    allowed = ["at", *named, *dict.fromkeys(k for kind in named for k in _KINDS[kind][0])]
    if any(_KINDS[kind][1] for kind in named):
        allowed.append("until")
    t = _Table(file, where, raw, (*allowed, "every", "times"))
    if len(kinds) != 1:
        raise ScenarioError(file, where, f"needs exactly one of {', '.join(_KINDS)}"
                                         + (f" (got {' and '.join(kinds)})" if kinds else ""))
    kind = kinds[0]
    at = t.number("at", 0, seconds)
    until = None
    if _KINDS[kind][1]:
        until = t.number("until", at, seconds, above=True)
    times = t.number("times", 1, MAX_REPEATS, 1, whole=True)
    every = t.number("every", 0, seconds, None, above=True)
    if times > 1 and every is None:
        raise t.fail("times", "needs every = S (seconds between repeats)")
    if every is not None and at + every * (times - 1) > seconds:
        raise t.fail("times", f"the last repeat would start at {at + every * (times - 1):g} s, after the "
                              f"scenario's end ({seconds:g} s)")
    if until is not None and every is not None and until + every * (times - 1) > seconds:
        raise t.fail("times", f"the last repeat would end at {until + every * (times - 1):g} s, after the "
                              f"scenario's end ({seconds:g} s)")

    def one(start: float, end: float | None) -> Event:
        if kind in ("crash", "kill"):
            return Crash(at=start, count=t.number(kind, 1, nodes - 1, whole=True), kill=kind == "kill",
                         revive_after=t.number("revive_after", 0, MAX_SECONDS, None, above=True))
        if kind == "leave":
            return Leave(at=start, count=t.number("leave", 1, nodes - 1, whole=True))
        if kind == "change":
            return Change(at=start, count=t.number("change", 1, nodes, whole=True))
        if kind == "churn_per_min":
            return Churn(at=start, until=end, per_min=t.number("churn_per_min", 0, MAX_CHURN_PER_MIN, above=True))
        if kind == "congest":
            return Congest(at=start, until=end, count=t.number("congest", 1, nodes, whole=True),
                           delay_ms=t.number("delay_ms", 0, MAX_DELAY_MS, above=True))
        a, b = _regions(t, network)
        return Partition(at=start, until=end, a=a, b=b)

    step = every or 0.0
    return [one(at + k * step, None if until is None else until + k * step) for k in range(times)]


def _regions(t: _Table, network: Network) -> tuple[tuple[str, ...], tuple[str, ...]]:
    value = t.raw["partition"]
    shape = "two lists of country codes, e.g. [[\"DE\", \"FR\"], [\"US\"]]"
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(r, list) and r for r in value)
            and all(isinstance(c, str) for r in value for c in r)):
        raise t.fail("partition", f"must be {shape}, got {_show(value)}")
    if not network.by_country:
        raise t.fail("partition", "cuts countries: needs [network] countries (a list or \"weighted\")")
    table = country_weights()
    a, b = (tuple(_country(t, "partition", c, table) for c in region) for region in value)
    both = sorted(set(a) & set(b))
    if both:
        raise t.fail("partition", f"{', '.join(both)} is on both sides")
    if network.countries:
        absent = [c for c in a + b if c not in network.countries]
        if absent:
            raise t.fail("partition", f"no nodes in {', '.join(absent)} ([network] countries: "
                                      f"{', '.join(network.countries)})")
    return a, b


# --- placement ------------------------------------------------------------------------

_DATA: tuple[dict[str, float], set[frozenset[str]]] | None = None


def _data() -> tuple[dict[str, float], set[frozenset[str]]]:
    global _DATA
    if _DATA is None:
        import gzip

        weights: dict[str, float] = {}
        pairs: set[frozenset[str]] = set()
        with gzip.open(COUNTRY_DATA, "rt", newline="") as f:
            for r in csv.DictReader(f):
                a, b = r["cty1"], r["cty2"]
                if len(a) != 2 or len(b) != 2:  # "None": probes of unknown country, no place to put a node
                    continue
                pairs.add(frozenset((a, b)))
                for c in (a, b):
                    weights[c] = weights.get(c, 0.0) + float(r["rtt_cnt"])
        _DATA = dict(sorted(weights.items())), pairs
    return _DATA


def country_weights() -> dict[str, float]:
    """Country code -> its sample count in the bundled RTT data (pairs it takes part in)."""
    return _data()[0]


def by_weight() -> list[str]:
    weights = country_weights()
    return sorted(weights, key=lambda c: (-weights[c], c))


def missing_pair(codes: Sequence[str]) -> tuple[str, str] | None:
    """A pair of distinct countries among ``codes`` the data has no RTT for (the data has
    6,827 of the 14,535 pairs: the rest were never measured), or None."""
    pairs = _data()[1]
    unique = list(dict.fromkeys(codes))
    for i, a in enumerate(unique):
        for b in unique[i + 1:]:
            if frozenset((a, b)) not in pairs:
                return a, b
    return None


def complete_top() -> int:
    """The most countries, taken by weight, between all of which the data has RTTs."""
    order = by_weight()
    low, high = 1, len(order)
    while low < high:  # a prefix missing a pair stays missing it: bisect
        mid = (low + high + 1) // 2
        if missing_pair(order[:mid]) is None:
            low = mid
        else:
            high = mid - 1
    return low


def place(scenario: Scenario, rng: random.Random, total: int | None = None) -> list[str] | None:
    """Each node's country (None: the network is not by country); ``total`` nodes (default:
    the scenario's; more when churn needs nodes to join). Checks what needs the placement:
    a partition naming a country none of the starting nodes was placed in."""
    net = scenario.network
    if not net.by_country:
        return None
    total = scenario.nodes if total is None else total
    if net.countries:
        placed = [net.countries[i % len(net.countries)] for i in range(total)]
    else:
        weights = country_weights()
        codes = by_weight()[:net.top or len(weights)]
        placed = rng.choices(codes, weights=[weights[c] for c in codes], k=total)
    present = set(placed[:scenario.nodes])
    for i, ev in enumerate(scenario.events, 1):
        if isinstance(ev, Partition):
            absent = [c for c in ev.a + ev.b if c not in present]
            if absent:
                raise ScenarioError(scenario.file, f"[[events]] partition at {ev.at:g} s",
                                    f"no nodes in {', '.join(absent)} (with this seed's placement of "
                                    f"{scenario.nodes} nodes)")
    return placed
