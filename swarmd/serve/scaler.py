"""How many replicas a service should run, sans-IO: reactive on load, predictive on a learned season.

Theory of operation. The daemon sums what its gateways saw of a service (requests per second
entering, requests in flight, their p99 latency) into a ``Sample`` every 1-5 s and hands it to
``Scaler.observe``; once a control round it asks ``Scaler.decide(now, current=, ready=,
start_s=)`` for the count to run, and the service controller (control.py) starts or drains
replicas to match. The scaler never reads a clock (every call is given ``now``: the driver's
seconds, the same clock the samples were stamped with), never does I/O, and draws nothing at
random: the same samples and calls give the same decisions. What it learned of the season
survives a restart through ``to_json``/``from_json``.

Rules:
- Reactive, Knative's KPA (knative.dev/docs/serving/autoscaling/kpa-specific: a 60 s stable
  window, a 6 s panic window, a 200 % panic threshold), on Ray Serve's metric (docs.ray.io
  serve/advanced-guides/advanced-autoscaling: ``target_ongoing_requests``, requests in flight
  per replica). ``desired_stable = ceil(mean in flight over stable_s / target_inflight)``;
  ``desired_panic`` likewise over ``panic_s``. The means are time-weighted (samples come
  irregularly): a sample stands for the time since the one before it, at most ``MAX_COVER_S``
  (a longer gap is left out of the mean, not filled with a guess); the newest one holds until
  ``now``.
- Panic. ``desired_panic >= 2 x max(ready, 1)`` enters panic (the load just doubled what the
  serving replicas can take); in panic the count is ``max(desired_panic, current)``: it never
  goes down. Panic ends ``stable_s`` after the condition last held.
- Scale up at once; scale down slowly (Ray Serve's ``downscale_delay_s``, 600 s). The count
  only goes down to the largest count wanted over the last ``down_delay_s``, so it falls once
  the load has been lower that long. A fresh scaler (a daemon restart) counts ``current`` as
  wanted at its first decision: a restart never scales down at once.
- Idle. No requests at all (rate 0 and nothing in flight) for ``idle_s``: down to
  ``min_replicas`` at once ("idle 10 min"), without waiting for the down-delay.
- Latency SLO. With ``slo_p99_ms`` set, a p99 over it (the latest reported in the last quarter
  of the stable window) while the replicas are busy (at least ``SLO_BUSY`` of the target in
  flight each, over the stable window: a gateway's p99 spans minutes of requests, and in a
  trough it is the last peak's) asks for ``current + 1``; one step per
  ``max(stable_s / 4, start_s)`` (the new replica must start and show its effect first), and no
  step down meanwhile.
- Predictive (AWS EC2 Auto Scaling predictive scaling: a forecast from at least a season of
  history, capacity launched ahead of the forecast load by the instances' warm-up, and never a
  scale-in on the forecast). The rate is learned online as a seasonal profile, Holt-Winters'
  seasonal equation alone (no level, no trend): the season (``season_s``) is cut into bins
  (``season_s / 5 s``, 12 to 288: 5 min for a day); when a bin ends, its time-weighted mean
  rate ``y`` updates that bin's value, ``S[b] += GAMMA (y - S[b])`` (the first ``y`` seen sets
  it). The forecast for a time is ``S`` interpolated linearly between bin centres. It exists
  once a whole season was seen (at least 3/4 of its bins; the missing ones are interpolated),
  and is learned whether or not ``predictive`` is set, so ``serve show`` can show it before
  anyone trusts it. No level term: a day busier than usual shows in the reactive count at once
  and in the profile the next season; a level fitted online alongside the profile drifted
  against it once the pattern changed (level and profile ran off in opposite directions, the
  one-step forecasts still good and those a lead time ahead far off).
  The lead time is ``max(start_s, 5) + 10`` s (the replica's measured start, submit to
  healthy, plus a margin); ``planned = ceil(peak forecast rate over [now, now + lead] x
  latency / target_inflight)``, the latency as the gateways timed their requests (the sample's
  ``latency_s``, their median), else by Little's law (mean in flight / mean rate over the
  stable window); with no recent traffic the latency last seen, 0.1 s at first. When the
  forecast is trusted the count is ``max(reactive, planned)``: a forecast only ever raises the
  count; the count falls only on the reactive rules (and after the down-delay).
- Distrust. When a bin ends, the forecast the model held for it (unchanged since the bin's
  last season, so the very forecast the lead time looked at) is compared with what arrived:
  the symmetric relative error ``|f - y| / ((f + y) / 2)``, bins where both are under
  ``FLOOR_RATE`` left out (a near-empty bin's relative error says nothing). The mean over the
  last ``season bins / 8`` checks (at least 12) over ``DISTRUST_ABOVE`` (50 %) distrusts the
  forecast: reactive only, and the reason and ``view`` say so. It is trusted again when the
  mean both over those recent checks and over the last season's checks fall under
  ``TRUST_BELOW`` (30 %): quick to distrust, slow to trust again. The model keeps learning
  while distrusted.
- Odd input is missing input. A sample whose time, rate or in-flight count is not a finite
  number in range, or that is not newer than the last one, is ignored (a bad p99 alone is
  dropped); ``decide`` with a non-finite ``now`` returns the last decision; a ``current``,
  ``ready`` or ``start_s`` out of range is taken at the nearest sane value. Samples stamped
  well after ``now`` mean the clock stepped back: the recent window starts over. Only
  ``Policy.check`` (and so the constructor) raises, on a policy out of range: that is the
  caller's bug, not the traffic's.
- Bounded memory: the profile (one float per bin), the last season's observed bin means (for
  ``view``), the last season's error checks, at most ``MAX_SAMPLES`` raw samples (the last
  ``stable_s`` of them) and the down-delay's sliding maximum (at most one entry per count).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_REPLICAS = 64
STABLE_S = 60.0  # Knative KPA's stable window
PANIC_S = 6.0  # Knative's panic window: 10 % of the stable window
PANIC_FACTOR = 2.0  # Knative's panic threshold, 200 %: the load is twice what the ready replicas take
DOWN_DELAY_S = 600.0  # Ray Serve's downscale_delay_s
IDLE_S = 600.0
SEASON_S = 86_400.0  # a day: the period most services' load repeats with
BIN_MIN_S, MAX_BINS, MIN_BINS = 5.0, 288, 12  # a bin gets at least one sample; a day in 5 min bins
MAX_COVER_S = 15.0  # a sample stands for at most this long before it (samples come every 1-5 s)
MAX_SAMPLES = 4096  # raw samples kept, whatever the rate they come at
MAX_RATE = 1e9  # req/s or requests in flight: above it a sample is garbage, not load
LEAD_MIN_START_S, LEAD_MARGIN_S = 5.0, 10.0
DEFAULT_START_S = 30.0  # a start time that is missing or absurd
DEFAULT_LATENCY_S, MIN_LATENCY_S, MAX_LATENCY_S = 0.1, 0.001, 300.0
MIN_RATE = 0.01  # req/s: under it Little's law's latency is noise
GAMMA = 0.4  # the profile's smoothing per season: yesterday counts 40 %, the days before 60 %
SEEN_TO_TRUST = 0.75  # of a season's bins, seen before the forecast exists
FLOOR_RATE = 1.0  # req/s: a bin where forecast and arrival are both under it is not checked
DISTRUST_ABOVE, TRUST_BELOW = 0.5, 0.3
RECENT_CHECKS_MIN = 12
SLO_STEP_STABLE_FRACTION = 0.25
SLO_BUSY = 0.5  # of the target in flight per replica: busier than that, a p99 over the SLO adds a replica


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """A service's scaling policy; every field is checked by ``check``."""
    min_replicas: int  # >= 1
    max_replicas: int  # min_replicas..MAX_REPLICAS
    target_inflight: float = 4.0  # requests in flight per replica aimed at (Ray's target_ongoing_requests)
    slo_p99_ms: float | None = None  # a p99 over it, with load, adds one replica
    predictive: bool = False
    season_s: float = SEASON_S  # the forecast's season; tests and labs compress it (>= 60 s)
    stable_s: float = STABLE_S
    panic_s: float = PANIC_S
    down_delay_s: float = DOWN_DELAY_S  # a lower count must have held this long
    idle_s: float = IDLE_S  # no requests this long: down to min_replicas

    def check(self) -> None:
        """Raise ValueError, naming the field, on anything out of range."""
        for name in ("min_replicas", "max_replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r:.50}")
        if not 1 <= self.min_replicas <= MAX_REPLICAS:
            raise ValueError(f"min_replicas must be 1-{MAX_REPLICAS}, got {self.min_replicas}")
        if not self.min_replicas <= self.max_replicas <= MAX_REPLICAS:
            raise ValueError(f"max_replicas must be min_replicas ({self.min_replicas})-{MAX_REPLICAS}, "
                             f"got {self.max_replicas}")
        if not isinstance(self.predictive, bool):
            raise ValueError(f"predictive must be true or false, got {self.predictive!r:.50}")
        bounds = {"target_inflight": (0.0, 1000.0, False), "season_s": (60.0, 366 * 86_400.0, True),
                  "stable_s": (0.0, 3600.0, False), "panic_s": (0.0, self._number("stable_s"), False),
                  "down_delay_s": (0.0, 86_400.0, True), "idle_s": (0.0, 7 * 86_400.0, False)}
        if self.slo_p99_ms is not None:
            bounds["slo_p99_ms"] = (0.0, 3_600_000.0, False)
        for name, (low, high, low_ok) in bounds.items():
            value = self._number(name)
            if not (low <= value <= high if low_ok else low < value <= high):
                span = f"{low:g}-{high:g}" if low_ok else f"over {low:g} and at most {high:g}"
                raise ValueError(f"{name} must be {span}, got {value!r}")

    def _number(self, name: str) -> float:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r:.50}")
        return float(value)


@dataclass(frozen=True, slots=True)
class Sample:
    """What the gateways saw of the service, summed over all members, at ``at``."""
    at: float
    rate: float  # requests per second entering
    in_flight: float  # requests in flight (concurrency)
    p99_ms: float | None = None
    latency_s: float | None = None  # a request's typical time as the gateways measured it (their p50)


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int  # the count to run now, min_replicas..max_replicas
    reason: str  # one line for `serve show`
    mode: str  # "stable" | "panic" | "forecast" | "slo" | "idle" | "hold"
    forecast_rate: float | None = None  # the forecast's peak rate over the lead time, when trusted
    planned: int | None = None  # what the forecast alone asks for, when trusted


@dataclass(frozen=True, slots=True)
class _Raw:
    at: float
    since: float  # the start of the time this sample stands for
    rate: float
    in_flight: float
    p99_ms: float | None


def _finite(x: Any) -> bool:
    """A real number, neither NaN nor infinite (nor an int too large for a float)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _human(seconds: float) -> str:
    """A duration for a person: "45 s", "10 min", "2.5 h", "3 d"."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 120 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h".replace(".0 h", " h")
    return f"{seconds / 86_400:.1f} d".replace(".0 d", " d")


def _bins_for(season_s: float) -> int:
    return int(min(MAX_BINS, max(MIN_BINS, season_s // BIN_MIN_S)))


class _Season:
    """The rate's seasonal profile (Holt-Winters' seasonal equation), and the forecast's error checks."""

    def __init__(self, season_s: float) -> None:
        self.season_s = season_s
        self.n = _bins_for(season_s)
        self.bin_s = season_s / self.n
        self.recent_n = max(RECENT_CHECKS_MIN, self.n // 8)
        self.profile: list[float | None] = [None] * self.n
        self.observed: list[tuple[int, float] | None] = [None] * self.n  # (absolute bin, mean rate) for view
        self.first_k: int | None = None  # the first bin the model saw
        self.ready = False
        self.errors: deque[float] = deque(maxlen=self.n)
        self.distrusted: str | None = None
        self.open_k: int | None = None
        self.open_sum = self.open_dt = 0.0

    def add(self, since: float, at: float, rate: float) -> None:
        """The rate ``rate`` held over (since, at]."""
        if self.open_k is not None and math.floor(at / self.bin_s) < self.open_k:
            self.open_k, self.open_sum, self.open_dt = None, 0.0, 0.0  # the clock stepped back
        k = math.floor(since / self.bin_s)
        while True:
            start, end = max(since, k * self.bin_s), min(at, (k + 1) * self.bin_s)
            if end > start:
                if k != self.open_k:
                    self._close()
                    self.open_k, self.open_sum, self.open_dt = k, 0.0, 0.0
                self.open_sum += rate * (end - start)
                self.open_dt += end - start
            if (k + 1) * self.bin_s >= at:
                break
            k += 1

    def _close(self) -> None:
        if self.open_k is None or self.open_dt <= 0:
            return
        k, y = self.open_k, self.open_sum / self.open_dt
        b = k % self.n
        if self.first_k is None or k < self.first_k:
            self.first_k = k
        known = self.profile[b]
        if known is None:
            self.profile[b] = y
        else:
            if self.ready:
                self._check(known, y)
            self.profile[b] = known + GAMMA * (y - known)
        self.observed[b] = (k, y)
        if not self.ready and k - self.first_k + 1 >= self.n:
            seen = [i for i, v in enumerate(self.profile) if v is not None]
            if len(seen) >= SEEN_TO_TRUST * self.n:
                self._fill(seen)
                self.ready = True

    def _fill(self, seen: list[int]) -> None:
        """Bins never seen take the value interpolated (around the season) between their seen neighbours."""
        for i in range(self.n):
            if self.profile[i] is not None:
                continue
            before = max((s for s in seen if s < i), default=seen[-1])
            after = min((s for s in seen if s > i), default=seen[0])
            span = (after - before) % self.n or self.n
            w = ((i - before) % self.n) / span
            self.profile[i] = (1 - w) * self.profile[before] + w * self.profile[after]  # type: ignore[operator]

    def _check(self, forecast: float, arrived: float) -> None:
        if max(forecast, arrived) < FLOOR_RATE:
            return
        self.errors.append(abs(forecast - arrived) / max((forecast + arrived) / 2, FLOOR_RATE))
        recent = self.recent_error()
        if recent is None:
            return
        if self.distrusted is None and recent > DISTRUST_ABOVE:
            self.distrusted = f"off by {recent * 100:.0f} % lately"
        elif self.distrusted is not None and recent < TRUST_BELOW and self.season_error() < TRUST_BELOW:
            self.distrusted = None

    def recent_error(self) -> float | None:
        if len(self.errors) < self.recent_n:
            return None
        return sum(list(self.errors)[-self.recent_n:]) / self.recent_n

    def season_error(self) -> float:
        return sum(self.errors) / len(self.errors) if self.errors else 0.0

    def forecast(self, at: float) -> float | None:
        if not self.ready:
            return None
        pos = (at % self.season_s) / self.bin_s - 0.5
        i = math.floor(pos)
        w = pos - i
        low, high = self.profile[i % self.n], self.profile[(i + 1) % self.n]
        return max(0.0, (1 - w) * low + w * high)  # type: ignore[operator]

    def peak(self, start: float, end: float) -> tuple[float, float] | None:
        """(the highest forecast rate over [start, end], when): the forecast is linear between bin
        centres, so its peak is at an end or a centre."""
        if not self.ready:
            return None
        times = [start, end]
        centre = (math.floor(start / self.bin_s - 0.5) + 1.5) * self.bin_s
        while centre < end and len(times) < self.n + 2:
            times.append(centre)
            centre += self.bin_s
        best: tuple[float, float] | None = None
        for t in sorted(times):
            rate = self.forecast(t) or 0.0
            if best is None or rate > best[0]:
                best = (rate, t)
        return best

    def seen_fraction(self) -> float:
        return sum(v is not None for v in self.profile) / self.n

    def to_json(self) -> dict[str, Any]:
        return {"season_s": self.season_s, "bins": self.n, "profile": list(self.profile),
                "observed": [list(o) if o else None for o in self.observed], "first_k": self.first_k,
                "ready": self.ready, "errors": list(self.errors), "distrusted": self.distrusted}

    @classmethod
    def from_json(cls, season_s: float, data: Any) -> _Season | None:
        """The model ``data`` describes, or None when it is not exactly one of this season's."""
        s = cls(season_s)
        if not isinstance(data, Mapping) or data.get("season_s") != season_s or data.get("bins") != s.n:
            return None
        profile, observed = data.get("profile"), data.get("observed")
        first_k, ready, errors, distrusted = data.get("first_k"), data.get("ready"), data.get("errors"), \
            data.get("distrusted")
        if not (isinstance(ready, bool) and isinstance(profile, list) and len(profile) == s.n
                and all(v is None or (_finite(v) and 0 <= v <= MAX_RATE) for v in profile)
                and isinstance(observed, list) and len(observed) == s.n
                and isinstance(errors, list) and len(errors) <= s.n
                and all(_finite(e) and 0 <= e <= 2 for e in errors)
                and (first_k is None or (isinstance(first_k, int) and not isinstance(first_k, bool)))
                and (distrusted is None or (isinstance(distrusted, str) and len(distrusted) <= 100))):
            return None
        if ready and any(v is None for v in profile):
            return None
        for i, o in enumerate(observed):
            if o is None:
                continue
            if not (isinstance(o, list) and len(o) == 2 and isinstance(o[0], int) and not isinstance(o[0], bool)
                    and o[0] % s.n == i and _finite(o[1]) and 0 <= o[1] <= MAX_RATE):
                return None
            s.observed[i] = (o[0], float(o[1]))
        s.ready, s.first_k, s.distrusted = ready, first_k, distrusted
        s.profile = [None if v is None else float(v) for v in profile]
        s.errors.extend(float(e) for e in errors)
        return s


class Scaler:
    """The scaling decisions for one service (see the module's rules)."""

    def __init__(self, policy: Policy) -> None:
        policy.check()
        self.policy = policy
        self._season = _Season(float(policy.season_s))
        self._raw: deque[_Raw] = deque(maxlen=MAX_SAMPLES)
        self._last_at: float | None = None
        self._quiet_since: float | None = None  # the first sample of the current run without requests
        self._latency = DEFAULT_LATENCY_S
        self._measured_latency: float | None = None  # the latest the samples carried
        self._panic_last: float | None = None  # when the panic condition last held
        self._slo_step_at: float | None = None
        self._wanted: deque[tuple[float, int]] = deque()  # the down-delay's sliding maximum: counts decrease
        self._last: Decision | None = None
        self._last_now: float | None = None
        self._lead = LEAD_MIN_START_S + LEAD_MARGIN_S

    # -- input

    def observe(self, sample: Sample) -> None:
        """Take one sample: into the recent window and the seasonal profile. An odd one is ignored."""
        at, rate, in_flight, p99 = sample.at, sample.rate, sample.in_flight, sample.p99_ms
        if not (_finite(at) and _finite(rate) and _finite(in_flight)
                and 0 <= rate <= MAX_RATE and 0 <= in_flight <= MAX_RATE):
            return
        if self._last_at is not None and at <= self._last_at:
            return
        if not (_finite(p99) and 0 <= p99 <= MAX_RATE):  # type: ignore[operator]
            p99 = None
        latency = sample.latency_s
        if _finite(latency) and MIN_LATENCY_S <= latency <= MAX_LATENCY_S:  # type: ignore[operator]
            self._measured_latency = float(latency)  # type: ignore[arg-type]
        since = at if self._last_at is None else max(self._last_at, at - MAX_COVER_S)
        self._last_at = at
        self._raw.append(_Raw(float(at), float(since), float(rate), float(in_flight),
                              None if p99 is None else float(p99)))
        while self._raw and self._raw[0].at < at - self.policy.stable_s - MAX_COVER_S:
            self._raw.popleft()
        if rate > 0 or in_flight > 0:
            self._quiet_since = None
        elif self._quiet_since is None:
            self._quiet_since = float(at)
        if at > since:
            self._season.add(since, at, float(rate))

    # -- the forecast

    def forecast(self, at: float) -> float | None:
        """The learned rate (req/s) at ``at``; None until a whole season was seen."""
        return self._season.forecast(at) if _finite(at) else None

    def trusted(self) -> bool:
        """Predictive, a whole season seen, and the forecast not distrusted."""
        return self.policy.predictive and self._season.ready and self._season.distrusted is None

    # -- the decision

    def decide(self, now: float, *, current: int, ready: int, start_s: float) -> Decision:
        """The count to run now. ``current``: the count wanted so far (the last decision);
        ``ready``: the replicas serving healthy; ``start_s``: a replica's measured start time
        (submit to healthy), the forecast's lead."""
        p = self.policy
        if not _finite(now):
            return self._last or Decision(self._clamp(current), "no valid clock reading: holding", "hold")
        now = float(now)  # an int beyond a float's precision compares exactly, and unlike its float
        cur = self._clamp(current)
        ready_n = int(min(max(ready, 0), MAX_REPLICAS)) if _finite(ready) else 0
        start = float(start_s) if _finite(start_s) and 0 <= start_s <= 86_400 else DEFAULT_START_S
        lead = min(max(start, LEAD_MIN_START_S) + LEAD_MARGIN_S, p.season_s / 2)
        self._lead = lead
        if self._last_at is not None and self._last_at > now + MAX_COVER_S:
            self._restart_clock()  # samples from the future: the clock stepped back
        if self._last_now is None or now < self._last_now:
            self._wanted.clear()
            self._wanted.append((now, cur))  # a fresh scaler (or clock) never scales down at once
        self._last_now = now

        stable = self._mean(now, p.stable_s)
        if stable is None:
            gap = "yet" if self._last_at is None else f"for {_human(now - self._last_at)}"
            want, mode, reason = cur, "hold", f"no load samples {gap}: holding"
        else:
            want, mode, reason = self._reactive(now, cur, ready_n, stable)
            if self._measured_latency is not None:  # as the gateways timed their requests
                self._latency = self._measured_latency
            elif stable[0] >= MIN_RATE:  # Little's law: latency = in flight / arrival rate
                self._latency = min(max(stable[1] / stable[0], MIN_LATENCY_S), MAX_LATENCY_S)
            slo = self._slo(now, cur, start)
            if slo is not None and slo[0] > want:
                want, mode, reason = slo
        want = self._clamp(want)  # the reactive count within the range first: a forecast that only
        forecast_rate = planned = None  # equals the minimum is no reason of its own
        if self.trusted():
            peak = self._season.peak(now, now + lead)
            if peak is not None:
                forecast_rate, when = peak
                planned = self._clamp(math.ceil(forecast_rate * self._latency / p.target_inflight - 1e-9))
                if planned > want:
                    want, mode = planned, "forecast"
                    reason = f"forecast: {forecast_rate:.0f} req/s in {_human(max(when - now, 0))}"
        want = self._clamp(want)

        while self._wanted and self._wanted[-1][1] <= want:
            self._wanted.pop()
        self._wanted.append((now, want))
        while len(self._wanted) > 1 and self._wanted[0][0] < now - p.down_delay_s:
            self._wanted.popleft()
        replicas = want
        if want < cur and mode not in ("idle", "hold"):
            since, most = self._wanted[0]
            replicas = min(cur, most)
            if replicas > want:
                reason = (f"{reason}; held at {replicas} by the {_human(p.down_delay_s)} down-delay "
                          f"({_human(since + p.down_delay_s - now)} left)")
                mode = "hold"
        if mode == "slo" and replicas > cur:
            self._slo_step_at = now
        reason += self._forecast_note()
        self._last = Decision(replicas, reason, mode, forecast_rate, planned)
        return self._last

    def _reactive(self, now: float, cur: int, ready: int, stable: tuple[float, float]) -> tuple[int, str, str]:
        p = self.policy
        if self._quiet_since is not None and now - self._quiet_since >= p.idle_s:
            return p.min_replicas, "idle", f"idle {_human(now - self._quiet_since)}"
        in_flight = stable[1]
        desired_stable = math.ceil(in_flight / p.target_inflight - 1e-9)
        panic_in_flight = (self._mean(now, p.panic_s) or stable)[1]
        desired_panic = math.ceil(panic_in_flight / p.target_inflight - 1e-9)
        if desired_panic >= PANIC_FACTOR * max(ready, 1):
            self._panic_last = now
        if self._panic_last is not None and 0 <= now - self._panic_last < p.stable_s:
            ratio = panic_in_flight / (p.target_inflight * max(ready, 1))
            return max(desired_panic, cur), "panic", f"panic: in-flight {ratio:.1f}× target"
        self._panic_last = None
        return desired_stable, "stable", f"stable: {in_flight:.1f} in flight / {p.target_inflight:g} per replica"

    def _slo(self, now: float, cur: int, start: float) -> tuple[int, str, str] | None:
        p = self.policy
        if p.slo_p99_ms is None:
            return None
        recent = [r for r in self._raw if r.at >= now - p.stable_s * SLO_STEP_STABLE_FRACTION and r.at <= now]
        p99 = next((r.p99_ms for r in reversed(recent) if r.p99_ms is not None), None)
        # busy: at least half the target in flight per replica. A gateway's p99 spans its last
        # thousand requests (minutes at a few a second): over the SLO in a trough it is the last
        # peak's, and a replica more would not bring it down
        stable = self._mean(now, p.stable_s)
        loaded = stable is not None and stable[1] >= SLO_BUSY * p.target_inflight * max(cur, 1)
        if p99 is None or p99 <= p.slo_p99_ms or not loaded:
            return None
        reason = f"p99 {p99:.0f} ms over the {p.slo_p99_ms:g} ms SLO"
        wait = max(p.stable_s * SLO_STEP_STABLE_FRACTION, start)
        if self._slo_step_at is not None and 0 <= now - self._slo_step_at < wait:
            return cur, "slo", reason + f" (the last replica added {_human(now - self._slo_step_at)} ago)"
        return cur + 1, "slo", reason

    def _mean(self, now: float, window: float) -> tuple[float, float] | None:
        """(rate, in flight) time-weighted over [now - window, now]; None when the newest sample is
        older than ``MAX_COVER_S`` (the gateways went quiet: no data is not zero load)."""
        if self._last_at is None or not self._raw or now - self._last_at > MAX_COVER_S:
            return None
        start = now - window
        total = rate = in_flight = 0.0
        for r in self._raw:
            lo, hi = max(r.since, start), min(r.at, now)
            if hi > lo:
                total += hi - lo
                rate += r.rate * (hi - lo)
                in_flight += r.in_flight * (hi - lo)
        last = self._raw[-1]
        if now > last.at:
            lo = max(last.at, start)
            total += now - lo
            rate += last.rate * (now - lo)
            in_flight += last.in_flight * (now - lo)
        if total <= 0:
            return last.rate, last.in_flight
        return rate / total, in_flight / total

    def _restart_clock(self) -> None:
        self._raw.clear()
        self._last_at = self._quiet_since = self._panic_last = self._slo_step_at = None

    def _clamp(self, n: Any) -> int:
        p = self.policy
        if not _finite(n):
            return self._last.replicas if self._last else p.min_replicas
        return int(min(max(math.floor(n), p.min_replicas), p.max_replicas))

    def _forecast_note(self) -> str:
        s = self._season
        if not self.policy.predictive:
            return ""
        if not s.ready:
            return f"; forecast learning ({s.seen_fraction() * 100:.0f} % of a season seen)"
        if s.distrusted is not None:
            return f"; forecast distrusted ({s.distrusted}): reactive only"
        return ""

    # -- for `serve show`, and across restarts

    def view(self, now: float) -> dict[str, Any]:
        """Plain JSON data for ``serve show``: the last season's observed rate per bin, the forecast
        over the next lead time and stable window, whether it is trusted (``error_pct``: the mean
        error of the recent checks, the figure that distrusts it), and the last decision."""
        s = self._season
        history: list[list[float]] = []
        forecast: list[list[float]] = []
        if _finite(now):
            k_now = math.floor(now / s.bin_s)
            history = [[round((k + 0.5) * s.bin_s, 3), round(y, 3)]
                       for k, y in sorted(o for o in s.observed if o is not None) if k_now - s.n < k <= k_now]
            if s.ready:
                span = self._lead + self.policy.stable_s
                forecast = [[round(now + span * i / 6, 3), round(s.forecast(now + span * i / 6) or 0.0, 3)]
                            for i in range(7)]
        error = s.recent_error()
        last = self._last
        return {"history": history, "forecast": forecast, "trusted": self.trusted(),
                "distrusted_because": s.distrusted,
                "error_pct": None if error is None else round(error * 100, 1),
                "last": None if last is None else {"replicas": last.replicas, "reason": last.reason,
                                                   "mode": last.mode, "at": self._last_now}}

    def to_json(self) -> dict[str, Any]:
        return {"version": 1, "season": self._season.to_json(), "latency_s": self._latency}

    @classmethod
    def from_json(cls, policy: Policy, data: Any) -> Scaler:
        """A scaler that knows what ``data`` (a ``to_json``) learned; anything not exactly that (a
        corrupt or hostile file, another season's) gives a fresh one. Never raises on ``data``."""
        scaler = cls(policy)
        if not isinstance(data, Mapping) or data.get("version") != 1:
            return scaler
        season = _Season.from_json(float(policy.season_s), data.get("season"))
        latency = data.get("latency_s")
        if season is None or not (_finite(latency) and MIN_LATENCY_S <= latency <= MAX_LATENCY_S):
            return scaler
        scaler._season, scaler._latency = season, float(latency)
        return scaler
