"""The autoscaler's decisions (swarmd/serve/scaler.py) on a fake clock: the reactive rules as
tables, the forecast and its distrust on synthetic seasonal traces (a day compressed to 240 s),
the saved state against hostile files."""

import ast
import json
import math
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmd.serve.scaler import Decision, Policy, Sample, Scaler

LATENCY = 0.1  # s: in flight = rate x latency (Little's law), what the traces' replicas take per request
SEASON = 240.0


def policy(**kw) -> Policy:
    return Policy(**{"min_replicas": 1, "max_replicas": 10, **kw})


class Sim:
    """A service under a scaler: one sample and one decision per step, the decision becoming the
    next step's ``current``; replicas are ready at once unless ``lag`` (then a count is ready
    ``start_s`` after it was wanted)."""

    def __init__(self, p: Policy, *, start_s: float = 20.0, current: int | None = None, scaler: Scaler | None = None):
        self.scaler = scaler or Scaler(p)
        self.start_s = start_s
        self.current = p.min_replicas if current is None else current
        self.log: list[tuple[float, Decision]] = []

    def step(self, t: float, rate: float, in_flight: float | None = None, p99: float | None = None) -> Decision:
        self.scaler.observe(Sample(t, rate, rate * LATENCY if in_flight is None else in_flight, p99))
        d = self.scaler.decide(t, current=self.current, ready=self.current, start_s=self.start_s)
        self.current = d.replicas
        self.log.append((t, d))
        return d

    def run(self, t0: float, t1: float, load, dt: float = 1.0) -> Decision:
        """Steps every ``dt`` over [t0, t1); ``load(t)`` is the rate, or (rate, in flight)."""
        d = None
        t = t0
        while t < t1:
            x = load(t)
            d = self.step(t, *(x if isinstance(x, tuple) else (x,)))
            t += dt
        assert d is not None
        return d

    def first(self, t0: float, t1: float, cond) -> float | None:
        return next((t for t, d in self.log if t0 <= t < t1 and cond(d)), None)


def sine(t: float, sign: float = 1.0) -> float:
    return 100 + sign * 80 * math.sin(2 * math.pi * t / SEASON)


def noisy(f, seed: int = 7):
    rng = random.Random(seed)
    return lambda t: max(0.0, f(t) + rng.gauss(0, 5))


# -- reactive (Knative's KPA, Ray's target)

@pytest.mark.parametrize("in_flight, target, lo, hi, expected", [
    (11.8, 4.0, 1, 10, 3),  # ceil(11.8 / 4)
    (12.0, 4.0, 1, 10, 3),  # exactly on target: no extra replica
    (12.1, 4.0, 1, 10, 4),
    (0.5, 4.0, 1, 10, 1),
    (0.5, 4.0, 2, 10, 2),  # never under min
    (30.0, 10.0, 1, 10, 3),
    (3.0, 0.5, 1, 64, 6),
])
def test_steady_load_runs_ceil_in_flight_over_target(in_flight, target, lo, hi, expected):
    sim = Sim(Policy(min_replicas=lo, max_replicas=hi, target_inflight=target), current=expected)
    d = sim.run(0, 120, lambda t: (10.0, in_flight))
    assert (d.replicas, d.mode) == (expected, "stable")
    assert d.reason == f"stable: {in_flight:.1f} in flight / {target:g} per replica"


def test_a_load_over_max_stays_at_max_in_panic():
    sim = Sim(policy(max_replicas=8), current=8)
    d = sim.run(0, 120, lambda t: (10.0, 400.0))
    assert (d.replicas, d.mode) == (8, "panic"), "100 replicas' worth: twice what 8 take, for good"
    assert d.reason == "panic: in-flight 12.5× target"


def test_steady_load_from_min_scales_up_at_once_to_the_stable_count():
    sim = Sim(policy())
    sim.run(0, 70, lambda t: (10.0, 11.8))
    assert sim.current == 3
    assert sim.first(0, 70, lambda d: d.replicas == 3) is not None
    assert all(d.replicas <= 3 for _, d in sim.log), "no overshoot on a steady load"


def test_a_burst_panics_and_scales_up_within_the_panic_window_and_never_down_during_panic():
    sim = Sim(policy())
    sim.run(0, 120, lambda t: (20.0, 2.0))
    assert sim.current == 1
    d = sim.step(120, 200.0, 20.0)
    assert d.mode == "panic" and d.replicas >= 2, "the first burst sample doubles the count"
    assert d.reason.startswith("panic: in-flight ") and d.reason.endswith("× target")
    sim.run(121, 126, lambda t: (200.0, 20.0))
    assert sim.current == 5, "within the 6 s panic window: ceil(20 / 4)"
    # the stable window alone would still ask for ceil(mean of 60 s / 4) = 2 here
    sim.run(126, 140, lambda t: (20.0, 2.0))
    assert sim.current == 5 and {d.mode for t, d in sim.log if 126 <= t < 140} == {"panic"}
    sim.run(140, 200, lambda t: (20.0, 2.0))
    calm = sim.first(140, 200, lambda d: d.mode != "panic")
    assert calm is not None and 120 + 60 <= calm <= 126 + 60, "panic ends stable_s after its condition last held"


def test_load_gone_the_count_stays_up_for_the_down_delay_then_goes_down():
    sim = Sim(policy(), current=5)
    sim.run(0, 120, lambda t: (200.0, 20.0))
    assert sim.current == 5
    sim.run(120, 120 + 600 + 120, lambda t: (20.0, 2.0))
    held = [d for t, d in sim.log if 120 <= t < 120 + 600]
    assert all(d.replicas == 5 for d in held), "nothing comes down within the 600 s down-delay"
    assert held[-1].mode == "hold" and "down-delay" in held[-1].reason
    down = sim.first(120, 1000, lambda d: d.replicas < 5)
    # the stable mean falls under 4 in flight ~50 s after the drop, then 600 s of lower load
    assert down is not None and 120 + 600 <= down <= 120 + 600 + 60
    assert sim.current == 1 and sim.log[-1][1].mode == "stable"


def test_a_restarted_scaler_does_not_scale_down_at_once():
    sim = Sim(policy(), current=6)
    sim.run(0, 30, lambda t: (20.0, 2.0))
    assert sim.current == 6 and sim.log[-1][1].mode == "hold"


def test_idle_for_idle_s_goes_to_min_at_once_and_says_so():
    sim = Sim(policy(min_replicas=2, down_delay_s=900), current=5)
    sim.run(0, 120, lambda t: (200.0, 20.0))
    sim.run(120, 120 + 599, lambda t: (0.0, 0.0))
    assert sim.current == 5, "the down-delay (900 s) holds it until idle"
    d = sim.run(120 + 599, 120 + 605, lambda t: (0.0, 0.0))
    assert (d.replicas, d.mode, d.reason) == (2, "idle", "idle 10 min")
    d = sim.run(726, 726 + 6, lambda t: (200.0, 20.0))
    assert d.replicas == 5 and d.mode == "panic", "load back: up within the panic window"


def test_no_samples_holds_the_count():
    s = Scaler(policy())
    d = s.decide(100.0, current=4, ready=4, start_s=20)
    assert (d.replicas, d.mode) == (4, "hold") and d.reason == "no load samples yet: holding"
    s.observe(Sample(100.0, 50.0, 5.0))
    d = s.decide(200.0, current=4, ready=4, start_s=20)
    assert (d.replicas, d.mode, d.reason) == (4, "hold", "no load samples for 100 s: holding")


def test_a_p99_over_the_slo_with_load_adds_one_replica_per_start_time():
    sim = Sim(policy(slo_p99_ms=500), start_s=20.0, current=2)
    d = sim.step(0, 10.0, 6.0, p99=620)
    assert (d.replicas, d.mode, d.reason) == (3, "slo", "p99 620 ms over the 500 ms SLO")
    sim.run(1, 20, lambda t: (10.0, 6.0), dt=1.0)
    assert sim.current == 3, "the new replica starts first (no p99 since: the last one holds)"
    sim.scaler.observe(Sample(20.5, 10.0, 6.0, 620))
    d = sim.scaler.decide(20.5, current=3, ready=3, start_s=20)
    assert d.replicas == 4
    quiet = Sim(policy(slo_p99_ms=500), current=2)
    d = quiet.step(0, 0.0, 0.0, p99=900)
    assert d.replicas == 2 and d.mode != "slo", "no load: a stale p99 adds nothing"
    trough = Sim(policy(slo_p99_ms=500), current=3)
    d = trough.step(0, 3.0, 0.5, p99=900)
    assert d.mode != "slo", "a trough (0.5 in flight for 3 replicas of 4 each): the p99 is the last peak's"
    under = Sim(policy(slo_p99_ms=500), current=2)
    assert under.step(0, 10.0, 2.0, p99=400).mode != "slo"


# -- predictive (AWS predictive scaling)

def test_the_forecast_is_none_until_a_whole_season_then_within_20_percent_of_a_noisy_sine():
    p = policy(predictive=True, season_s=SEASON)
    s = Scaler(p)
    rng = random.Random(3)
    load = noisy(sine)
    t = 0.0
    while t < 2 * SEASON:
        if t < SEASON - 10:
            assert s.forecast(t + 30) is None and not s.trusted()
        s.observe(Sample(t, load(t), load(t) * LATENCY))
        t += rng.uniform(0.5, 4.0)  # irregular samples
    assert s.trusted()
    errors = [abs(s.forecast(t) - sine(t)) / sine(t) for t in range(480, 720)]
    assert sum(errors) / len(errors) < 0.20
    assert s.view(t)["error_pct"] < 20


def test_the_predictive_scaler_rises_before_the_daily_peak_and_the_reactive_one_after():
    def peak(t):
        return 200.0 if 120 <= t % SEASON < 160 else 20.0  # 5 replicas' worth at the peak, 1 otherwise
    start_s = 20.0
    sims = {predictive: Sim(policy(predictive=predictive, season_s=SEASON, down_delay_s=20), start_s=start_s)
            for predictive in (True, False)}
    for sim in sims.values():
        sim.run(0, 3 * SEASON, peak)
    day3_peak = 2 * SEASON + 120
    early = sims[True].first(2 * SEASON, day3_peak + 1, lambda d: d.replicas > 1)
    late = sims[False].first(2 * SEASON, day3_peak + 1, lambda d: d.replicas > 1)
    assert early is not None and early <= day3_peak - start_s, "ready by the time the peak comes"
    assert late == day3_peak, "the reactive scaler only sees the peak when it arrives"
    d = dict(sims[True].log)[early]
    assert d.mode == "forecast" and d.reason.startswith("forecast: ") and d.reason.endswith(" s")
    assert d.planned == d.replicas and d.forecast_rate > 20
    assert dict(sims[True].log)[day3_peak].replicas == 5
    assert sims[True].scaler.trusted()


def test_a_low_forecast_never_scales_in_below_the_reactive_count():
    twins = [Sim(policy(predictive=True, season_s=SEASON), current=1),
             Sim(policy(predictive=False, season_s=SEASON), current=1)]
    for sim in twins:
        sim.run(0, 2 * SEASON, lambda t: 10.0)
        sim.run(2 * SEASON, 2 * SEASON + 15, lambda t: (100.0, 30.0))  # an unforecast surge
    assert twins[0].scaler.trusted(), "(a longer surge would have the forecast distrusted: reactive anyway)"
    (_, with_forecast), (_, reactive) = twins[0].log[-1], twins[1].log[-1]
    assert with_forecast.replicas == reactive.replicas == 8
    assert with_forecast.mode in ("stable", "panic") and with_forecast.planned < 8
    assert [d.replicas for _, d in twins[0].log] == [d.replicas for _, d in twins[1].log]


def test_a_changed_pattern_is_distrusted_then_trusted_again_once_relearned():
    sim = Sim(policy(predictive=True, season_s=SEASON, max_replicas=20), current=5)
    sim.run(0, 2 * SEASON, noisy(sine))
    assert sim.scaler.trusted()
    flipped = noisy(lambda t: sine(t, -1.0), seed=8)
    t = 2 * SEASON
    while sim.scaler.trusted() and t < 3 * SEASON:
        d = sim.step(t, flipped(t))
        t += 1
    assert t < 2.5 * SEASON, "found out within half a season"
    assert d.reason.endswith("): reactive only") and "; forecast distrusted (off by " in d.reason
    assert d.planned is None and d.forecast_rate is None and d.mode != "forecast"
    v = sim.scaler.view(t)
    assert v["trusted"] is False and v["distrusted_because"].startswith("off by ") and v["error_pct"] > 50
    sim.run(t, 3 * SEASON, flipped)
    back = None
    for day in range(3, 12):
        sim.run(day * SEASON, (day + 1) * SEASON, flipped)
        if sim.scaler.trusted():
            back = day
            break
    assert back is not None and back >= 4, "trusted again only after it relearned, not on a lucky stretch"
    errors = [abs(sim.scaler.forecast(t) - sine(t, -1.0)) / sine(t, -1.0) for t in range(0, int(SEASON))]
    assert sum(errors) / len(errors) < 0.30
    assert sim.scaler.view(sim.log[-1][0])["distrusted_because"] is None


def test_a_learning_forecast_says_so_and_a_non_predictive_policy_never_uses_one():
    sim = Sim(policy(predictive=True, season_s=SEASON))
    d = sim.run(0, SEASON / 2, lambda t: 20.0)
    assert "forecast learning (" in d.reason and d.planned is None
    plain = Sim(policy(season_s=SEASON))
    plain.run(0, 2 * SEASON, lambda t: 200.0 if t % SEASON > 200 else 20.0)
    assert plain.scaler.forecast(500) is not None, "learned anyway, for serve show"
    assert not plain.scaler.trusted() and all(d.mode != "forecast" and d.planned is None for _, d in plain.log)


# -- view, state across restarts

def test_view_is_plain_json_with_a_bounded_history():
    p = policy(predictive=True, season_s=86_400.0)
    s = Scaler(p)
    for i in range(3000):  # a day and a bit of samples 30 s apart
        s.observe(Sample(i * 30.0, 10.0, 1.0))
    s.decide(89_970.0, current=1, ready=1, start_s=60)
    v = s.view(89_970.0)
    json.dumps(v, allow_nan=False)
    assert 250 <= len(v["history"]) <= 288 and len(v["forecast"]) <= 10
    assert v["forecast"][-1][0] - v["forecast"][0][0] == pytest.approx(60 + 10 + 60)
    assert v["last"]["mode"] == "stable" and v["last"]["at"] == 89_970.0
    fresh = Scaler(p).view(0.0)
    assert fresh == {"history": [], "forecast": [], "trusted": False, "distrusted_because": None,
                     "error_pct": None, "last": None}


def test_the_learned_season_survives_a_restart():
    p = policy(predictive=True, season_s=SEASON)
    sim = Sim(p)
    sim.run(0, 2 * SEASON, noisy(sine))
    saved = json.loads(json.dumps(sim.scaler.to_json(), allow_nan=False))
    again = Scaler.from_json(p, saved)
    assert again.trusted()
    assert [again.forecast(t) for t in range(480, 720, 7)] == [sim.scaler.forecast(t) for t in range(480, 720, 7)]
    assert again.to_json() == saved
    assert not Scaler.from_json(policy(predictive=True, season_s=2 * SEASON), saved).trusted(), \
        "another season's profile is not this one's"


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=10), inner, max_size=6),
    max_leaves=30)


def _state() -> dict:
    sim = Sim(policy(predictive=True, season_s=60.0))
    sim.run(0, 130, lambda t: 50.0 + 40 * math.sin(t / 10))
    return sim.scaler.to_json()


VALID = _state()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=JSONISH)
def test_from_json_survives_any_data(data):
    _usable(Scaler.from_json(policy(predictive=True, season_s=60.0), data))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(["version", "latency_s", "season_s", "bins", "profile", "observed",
                            "first_k", "ready", "errors", "distrusted"]),
       value=JSONISH | st.lists(st.floats() | st.none() | st.integers(), min_size=12, max_size=12),
       index=st.integers(0, 11))
def test_from_json_survives_a_corrupted_saved_state(key, value, index):
    data = json.loads(json.dumps(VALID))
    target = data if key in ("version", "latency_s") else data["season"]
    if isinstance(target.get(key), list) and target[key] and index < len(target[key]):
        target[key][index] = value  # one element wrong
    else:
        target[key] = value
    _usable(Scaler.from_json(policy(predictive=True, season_s=60.0), data))


def _usable(s: Scaler) -> None:
    f = s.forecast(100.0)
    assert f is None or (math.isfinite(f) and f >= 0)
    s.observe(Sample(1.0, 5.0, 1.0))
    d = s.decide(1.0, current=3, ready=3, start_s=10)
    assert 1 <= d.replicas <= 10
    json.dumps(s.view(1.0), allow_nan=False)
    json.dumps(s.to_json(), allow_nan=False)


# -- odd input, the policy's checks

ODD = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**30, 10**30), st.none(),
                st.booleans(), st.just(1e308))


@settings(max_examples=100, deadline=None)
@given(samples=st.lists(st.tuples(ODD, ODD, ODD, ODD), max_size=20), now=ODD, current=ODD, ready=ODD, start=ODD)
def test_odd_input_is_missing_input_and_never_raises(samples, now, current, ready, start):
    s = Scaler(policy(min_replicas=2, max_replicas=6, slo_p99_ms=100, predictive=True, season_s=60.0))
    for at, rate, in_flight, p99 in samples:
        s.observe(Sample(at, rate, in_flight, p99))
    d = s.decide(now, current=current, ready=ready, start_s=start)
    assert 2 <= d.replicas <= 6 and d.mode in ("stable", "panic", "forecast", "slo", "idle", "hold")
    json.dumps(s.view(now), allow_nan=False)


def test_out_of_order_and_non_finite_samples_are_ignored():
    s = Scaler(policy())
    s.observe(Sample(10.0, 10.0, 8.0))
    for bad in (Sample(9.0, 1000.0, 1000.0), Sample(10.0, 1000.0, 1000.0), Sample(11.0, math.nan, 1000.0),
                Sample(11.0, 10.0, math.inf), Sample(11.0, -1.0, 1000.0), Sample(math.nan, 10.0, 1000.0)):
        s.observe(bad)
    assert s.decide(11.0, current=2, ready=2, start_s=10).replicas == 2


def test_samples_from_the_future_mean_the_clock_stepped_back():
    s = Scaler(policy())
    s.observe(Sample(10_000.0, 10.0, 40.0))
    d = s.decide(100.0, current=3, ready=3, start_s=10)
    assert (d.replicas, d.mode) == (3, "hold")
    s.observe(Sample(101.0, 10.0, 8.0))
    assert s.decide(101.0, current=3, ready=3, start_s=10).replicas >= 2, "samples are taken again"


@pytest.mark.parametrize("kw, field", [
    ({"min_replicas": 0}, "min_replicas"),
    ({"min_replicas": 1.5}, "min_replicas"),
    ({"min_replicas": True}, "min_replicas"),
    ({"min_replicas": 5, "max_replicas": 4}, "max_replicas"),
    ({"max_replicas": 65}, "max_replicas"),
    ({"target_inflight": 0}, "target_inflight"),
    ({"target_inflight": 1001}, "target_inflight"),
    ({"target_inflight": math.nan}, "target_inflight"),
    ({"slo_p99_ms": -1}, "slo_p99_ms"),
    ({"slo_p99_ms": "fast"}, "slo_p99_ms"),
    ({"predictive": "yes"}, "predictive"),
    ({"season_s": 59}, "season_s"),
    ({"season_s": math.inf}, "season_s"),
    ({"stable_s": 0}, "stable_s"),
    ({"panic_s": 61}, "panic_s"),
    ({"panic_s": 0}, "panic_s"),
    ({"down_delay_s": -1}, "down_delay_s"),
    ({"idle_s": 0}, "idle_s"),
])
def test_policy_check_names_the_field(kw, field):
    p = Policy(**{"min_replicas": 1, "max_replicas": 10, **kw})
    with pytest.raises(ValueError, match=field):
        p.check()
    with pytest.raises(ValueError, match=field):
        Scaler(p)


def test_the_defaults_are_the_anchors_and_pass():
    p = Policy(min_replicas=1, max_replicas=64)
    p.check()
    assert (p.stable_s, p.panic_s, p.down_delay_s, p.idle_s, p.season_s) == (60.0, 6.0, 600.0, 600.0, 86_400.0)


def test_the_scaler_is_sans_io():
    """Standard library arithmetic only: no clock, no I/O, no trio (tests/test_sans_io.py's rule)."""
    path = Path(__file__).resolve().parents[2] / "swarmd" / "serve" / "scaler.py"
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "math", "statistics", "collections", "dataclasses", "typing"}


def test_a_scale_down_is_never_put_down_to_the_forecast():
    """A forecast asking for the minimum while the reactive count falls to it is not the reason."""
    p = Policy(min_replicas=1, max_replicas=3, target_inflight=1.0, predictive=True, season_s=60.0, stable_s=6.0,
               panic_s=2.0, down_delay_s=8.0)
    s = Scaler(p)
    cur, t, modes = 1, 0.0, []
    while t < 180:
        rate = 12.0 if 25 <= t % 60 < 43 else 0.0  # nothing at all between the peaks
        s.observe(Sample(at=t, rate=rate, in_flight=rate * 0.3))
        d = s.decide(t, current=cur, ready=cur, start_s=8.0)
        if d.replicas < cur:
            modes.append(d.mode)
        cur, t = d.replicas, t + 0.5
    assert modes and "forecast" not in modes, modes


def test_the_forecast_plans_with_the_peaks_latency_not_the_low_ratio_right_after_it():
    """Right after a peak the arrival rate (a window's count) lags the requests in flight, which
    end at once: in flight / rate reads far under the real latency for a few seconds. The quiet
    hours' own requests (0.3 s each, as at the peak) set it right again, so the next peak's plan
    starts enough replicas before it."""
    p = Policy(min_replicas=1, max_replicas=4, target_inflight=1.0, predictive=True, season_s=60.0, stable_s=6.0,
               panic_s=2.0, down_delay_s=8.0)
    s = Scaler(p)
    cur, t, rises = 1, 0.0, []
    while t < 85:
        phase = t % 60
        if 25 <= phase < 43:
            rate, in_flight = 12.0, 3.6
        elif 43 <= phase < 51:  # the window still counts the peak; nothing is in flight any more
            rate, in_flight = 12.0 - 1.4 * (phase - 43), 0.02
        else:
            rate, in_flight = 0.5, 0.15
        s.observe(Sample(at=t, rate=rate, in_flight=in_flight))
        d = s.decide(t, current=cur, ready=cur, start_s=8.0)
        if d.replicas > cur and t >= 60:
            rises.append((t, d.replicas, d.mode))
        cur, t = d.replicas, t + 0.5
    assert rises and rises[0][2] == "forecast" and max(n for _, n, _ in rises) >= 3, rises


def test_the_forecast_plans_with_the_gateways_measured_latency_when_in_flight_looks_are_too_coarse():
    """At half a request a second the in-flight looks (once a second) mostly see nothing: Little's
    law would say the requests take no time and plan one replica for the peak. The gateways'
    median latency (0.3 s) plans what the peak needs."""
    p = Policy(min_replicas=1, max_replicas=4, target_inflight=1.0, predictive=True, season_s=60.0, stable_s=6.0,
               panic_s=2.0, down_delay_s=8.0)
    s = Scaler(p)
    cur, t, rises = 1, 0.0, []
    while t < 85:
        peak = 25 <= t % 60 < 43
        s.observe(Sample(at=t, rate=12.0 if peak else 0.5, in_flight=3.6 if peak else 0.0, latency_s=0.3))
        d = s.decide(t, current=cur, ready=cur, start_s=8.0)
        if d.replicas > cur and t >= 60:
            rises.append((t, d.replicas, d.mode))
        cur, t = d.replicas, t + 0.5
    assert rises and rises[0][0] < 85 and rises[0][2] == "forecast" and max(n for _, n, _ in rises) >= 3, rises
