"""The routing core (swarmd/serve/balance.py): nearest tier, two choices, spill-over, ejection,
panic mode, hostile tables and the statistics."""

import json
import random
from collections import Counter

import pytest

from swarmd.serve.balance import MAX_REPLICAS, MAX_SERVICES, REPLICA_SAMPLES, SERVICE_SAMPLES, Balancer, Replica


def rep(key: str, rtt: float | None = 10.0, *, service: str = "llm", healthy: bool = True, port: int = 8000) -> Replica:
    return Replica(key=key, service=service, host=key.split("/")[0], address="10.0.0.1", port=port, rtt_ms=rtt,
                   healthy=healthy)


def balancer(*replicas: Replica, seed: int = 1, **kw) -> Balancer:
    b = Balancer(random.Random(seed), **kw)
    b.update(0.0, replicas)
    return b


def picks(b: Balancer, n: int, now: float = 1.0, *, start: bool = False, **kw) -> Counter:
    """``n`` picks; with ``start`` each is started (and stays in flight), so load spreads."""
    got = Counter()
    for _ in range(n):
        key = b.pick("llm", now, **kw).key
        got[key] += 1
        if start:
            b.started(key)
    return got


def fail(b: Balancer, key: str, now: float, times: int = 1) -> None:
    for _ in range(times):
        b.started(key)
        b.finished(key, now, ok=False, latency_s=None)


def succeed(b: Balancer, key: str, now: float, latency_s: float | None = 0.01) -> None:
    b.started(key)
    b.finished(key, now, ok=True, latency_s=latency_s)


# -- choosing ------------------------------------------------------------------------------------


def test_the_nearest_tier_takes_the_traffic():
    b = balancer(rep("far/1", 80.0), rep("near/1", 10.0), rep("near/2", 12.0), rep("mid/1", 30.0))
    assert picks(b, 100, start=True) == {"near/1": 50, "near/2": 50}  # 12 is within 25 % of 10; 30 is not


def test_the_tier_is_at_least_a_millisecond_wide():
    b = balancer(rep("a/1", 0.2), rep("b/1", 1.1), rep("c/1", 1.3))
    assert picks(b, 100, start=True) == {"a/1": 50, "b/1": 50}  # 0.2 + max(1, 0.05) = 1.2


def test_unknown_rtts_come_after_every_known_one():
    b = balancer(rep("unknown/1", None), rep("far/1", 500.0))
    assert set(picks(b, 50)) == {"far/1"}
    b = balancer(rep("unknown/1", None), rep("unknown/2", None))
    assert picks(b, 100, start=True) == {"unknown/1": 50, "unknown/2": 50}


def test_two_choices_favour_the_least_busy_by_the_expected_odds():
    # In flight 0, 1, 2, 3 in one tier: of the 6 pairs, the idlest wins 3, the next 2, then 1, then 0.
    b = balancer(*(rep(f"r/{i}", 10.0) for i in range(4)), seed=7)
    for i in range(4):
        for _ in range(i):
            b.started(f"r/{i}")
    n = 6000
    got = picks(b, n)
    for i, share in enumerate([3 / 6, 2 / 6, 1 / 6, 0.0]):
        assert abs(got[f"r/{i}"] / n - share) < 0.03, got


def test_two_choices_keep_two_equal_replicas_level():
    b = balancer(rep("a/1", 10.0), rep("b/1", 10.0))
    for _ in range(100):
        b.started(b.pick("llm", 1.0).key)
    stats = b.stats(1.0)["services"]["llm"]["replicas"]
    assert stats["a/1"]["in_flight"] == stats["b/1"]["in_flight"] == 50


def test_a_tie_in_flight_goes_to_the_nearer():
    b = balancer(rep("a/1", 10.0), rep("b/1", 11.0))
    assert set(picks(b, 50)) == {"a/1"}  # both idle: always the nearer of the two drawn


def test_a_saturated_tier_spills_over_to_the_next():
    b = balancer(rep("near/1", 5.0), rep("far/1", 50.0), max_in_flight_per_replica=2)
    assert [b.pick("llm", 1.0).key for _ in range(3)] == ["near/1"] * 3  # not started: not busy
    b.started("near/1")
    b.started("near/1")
    assert b.pick("llm", 1.0).key == "far/1"
    b.started("far/1")
    b.started("far/1")
    assert b.pick("llm", 1.0) is None  # every tier at the cap
    assert b.stats(1.0)["services"]["llm"]["saturated"] == 1
    b.finished("near/1", 2.0, ok=True, latency_s=0.1)
    assert b.pick("llm", 2.0).key == "near/1"


def test_a_slow_local_replica_with_a_request_in_flight_hands_the_next_to_a_farther_one():
    """Requests taking 250 ms: one already at the local replica means the next one's answer is
    ~250 ms away there, and ~40 ms from an idle replica 40 ms away, so it goes there; a replica
    answering in 1 ms keeps its requests until the 40 ms are worth it."""
    b = balancer(rep("local/1", 0.0), rep("far/1", 40.0), rep("far/2", 41.0))
    succeed(b, "local/1", 1.0, latency_s=0.25)
    assert b.pick("llm", 1.0).key == "local/1", "idle: the nearest"
    b.started("local/1")
    assert b.pick("llm", 1.0).key == "far/1", "busy and slow: the replica expected to answer sooner"
    assert b.stats(1.0)["services"]["llm"]["spilled"] == 1
    fast = balancer(rep("local/1", 0.0), rep("far/1", 40.0))
    succeed(fast, "local/1", 1.0, latency_s=0.001)
    for _ in range(39):
        fast.started("local/1")
    assert fast.pick("llm", 1.0).key == "local/1", "39 ahead at 1 ms each still beat 40 ms"
    fast.started("local/1")
    fast.started("local/1")
    assert fast.pick("llm", 1.0).key == "far/1"
    unknown = balancer(rep("local/1", 0.0), rep("far/1", None))
    succeed(unknown, "local/1", 1.0, latency_s=5.0)
    unknown.started("local/1")
    assert unknown.pick("llm", 1.0).key == "local/1", "a replica of unknown RTT is not expected sooner"


def test_unhealthy_and_excluded_replicas_are_not_picked():
    b = balancer(rep("a/1", 1.0, healthy=False), rep("b/1", 2.0), rep("c/1", 90.0))
    assert set(picks(b, 50, start=True)) == {"b/1"}
    assert b.pick("llm", 1.0, exclude={"b/1"}).key == "c/1"
    assert b.pick("llm", 1.0, exclude={"b/1", "c/1"}) is None
    assert b.pick("other", 1.0) is None


# -- ejection ------------------------------------------------------------------------------------


def test_consecutive_failures_eject_and_the_replica_returns_on_probation():
    b = balancer(rep("a/1", 1.0), rep("b/1", 50.0), consecutive_failures=3, base_ejection_s=30.0)
    fail(b, "a/1", 10.0, times=2)
    succeed(b, "a/1", 10.0)  # a success breaks the streak
    fail(b, "a/1", 11.0, times=2)
    assert b.ejected(11.0) == set()
    fail(b, "a/1", 12.0)
    assert b.ejected(12.0) == {"a/1"}
    assert set(picks(b, 20, now=13.0)) == {"b/1"}
    assert b.stats(13.0)["services"]["llm"]["replicas"]["a/1"]["ejected_for_s"] == 29.0
    assert b.ejected(41.9) == {"a/1"}
    assert b.ejected(42.0) == set()  # 30 s later: back
    assert b.pick("llm", 42.0).key == "a/1"
    fail(b, "a/1", 43.0)  # on probation: one failure ejects again, for 2 x 30 s
    assert b.ejected(43.0) == {"a/1"}
    assert b.ejected(102.9) == {"a/1"} and b.ejected(103.0) == set()
    succeed(b, "a/1", 104.0)  # probation passed
    fail(b, "a/1", 105.0, times=2)
    assert b.ejected(105.0) == set()


def test_the_ejection_time_grows_and_is_capped():
    b = balancer(rep("a/1"), consecutive_failures=1, base_ejection_s=30.0, max_ejection_s=100.0)
    now, durations = 0.0, []
    for _ in range(5):
        fail(b, "a/1", now)
        until = now + b.stats(now)["services"]["llm"]["replicas"]["a/1"]["ejected_for_s"]
        durations.append(until - now)
        now = until
    assert durations == [30.0, 60.0, 90.0, 100.0, 100.0]


def test_readmit_after_a_passed_health_check():
    b = balancer(rep("a/1"), consecutive_failures=2)
    fail(b, "a/1", 5.0, times=2)
    assert b.ejected(6.0) == {"a/1"}
    b.readmit("a/1")
    assert b.ejected(6.0) == set()
    assert b.pick("llm", 6.0).key == "a/1"
    fail(b, "a/1", 7.0)  # readmitted on probation
    assert b.ejected(7.0) == {"a/1"}
    b.readmit("gone/1")  # unknown keys are ignored


def test_failures_of_requests_in_flight_at_the_ejection_do_not_extend_it():
    b = balancer(rep("a/1"), consecutive_failures=2, base_ejection_s=30.0)
    for _ in range(5):
        b.started("a/1")
    for _ in range(5):
        b.finished("a/1", 1.0, ok=False, latency_s=None)
    assert b.stats(1.0)["services"]["llm"]["replicas"]["a/1"]["ejections"] == 1
    assert b.stats(1.0)["services"]["llm"]["replicas"]["a/1"]["failures"] == 5
    assert b.ejected(31.0) == set()


def test_panic_mode_picks_among_the_ejected_rather_than_fail():
    b = balancer(rep("a/1", 1.0), rep("b/1", 2.0), rep("sick/1", 0.5, healthy=False), consecutive_failures=1)
    fail(b, "a/1", 1.0)
    fail(b, "b/1", 1.0)
    assert b.ejected(1.0) == {"a/1", "b/1"}
    assert picks(b, 50, start=True) == {"a/1": 25, "b/1": 25}  # the unhealthy one is still not a candidate
    assert b.stats(1.0)["services"]["llm"]["panics"] == 50
    b = balancer(rep("sick/1", healthy=False))
    assert b.pick("llm", 1.0) is None


def test_update_keeps_the_state_of_replicas_that_stay():
    b = balancer(rep("a/1", 1.0), rep("b/1", 2.0), consecutive_failures=1)
    b.started("a/1")
    fail(b, "b/1", 1.0)
    b.update(2.0, [rep("a/1", 3.0), rep("b/1", 2.0), rep("c/1", 9.0)])
    stats = b.stats(2.0)["services"]["llm"]["replicas"]
    assert stats["a/1"]["in_flight"] == 1 and stats["a/1"]["rtt_ms"] == 3.0
    assert stats["b/1"]["ejected"] and stats["b/1"]["failures"] == 1
    b.update(3.0, [rep("c/1", 9.0)])
    b.finished("a/1", 3.0, ok=True, latency_s=0.1)  # gone meanwhile: ignored
    b.update(4.0, [rep("a/1", 3.0)])
    assert b.stats(4.0)["services"]["llm"]["replicas"]["a/1"]["in_flight"] == 0  # came back fresh


# -- hostile tables ------------------------------------------------------------------------------


def test_a_table_with_ten_thousand_replicas_keeps_the_nearest_healthy_ones():
    table = [rep(f"h{i}/1", float(10_000 - i), healthy=i % 2 == 0) for i in range(10_000)]
    table += [rep("h2/1", 0.0)]  # a repeated key
    b = balancer(*table)
    stats = b.stats(0.0)
    kept = stats["services"]["llm"]["replicas"]
    assert len(kept) == MAX_REPLICAS
    assert all(r["healthy"] for r in kept.values())
    assert min(r["rtt_ms"] for r in kept.values()) == 2.0
    assert stats["dropped"] == {"services": 0, "replicas": 10_000 - MAX_REPLICAS, "duplicates": 1, "bad_rtt": 0}


def test_a_table_with_five_thousand_services_keeps_the_known_ones_first():
    b = balancer(rep("z/1", service="zzz"))
    b.update(1.0, [rep(f"s{i}/1", service=f"svc-{i:05d}") for i in range(5000)] + [rep("z/1", service="zzz")])
    stats = b.stats(1.0)
    assert len(stats["services"]) == MAX_SERVICES
    assert "zzz" in stats["services"]
    assert stats["dropped"]["services"] == 5001 - MAX_SERVICES


def test_bad_rtts_count_as_unknown():
    b = balancer(rep("nan/1", float("nan")), rep("neg/1", -1.0), rep("inf/1", float("inf")), rep("ok/1", 900.0))
    assert set(picks(b, 20)) == {"ok/1"}
    assert b.stats(1.0)["dropped"]["bad_rtt"] == 3


# -- statistics ----------------------------------------------------------------------------------


def test_stats_report_known_quantiles_rates_and_counts():
    b = balancer(rep("a/1"), rep("b/1"))
    for ms in range(1, 101):  # 1..100 ms, shuffled into time order
        succeed(b, "a/1", 100.0 + ms * 0.1, latency_s=ms / 1000)
    fail(b, "b/1", 110.0)
    b.started("b/1")
    stats = b.stats(110.0)
    a = stats["services"]["llm"]["replicas"]["a/1"]
    assert (a["requests"], a["failures"], a["p50_ms"], a["p99_ms"]) == (100, 0, 50.0, 99.0)
    service = stats["services"]["llm"]
    assert (service["requests"], service["failures"], service["in_flight"]) == (101, 1, 1)
    assert service["rate_per_s"] == pytest.approx(101 / 60, abs=0.001)
    assert service["p50_ms"] == 50.0  # the failure had no latency
    assert b.stats(200.0)["services"]["llm"]["rate_per_s"] == 0.0  # a minute later
    json.dumps(stats)  # plain data


def test_stats_windows_are_bounded():
    b = balancer(rep("a/1"))
    for i in range(5000):
        succeed(b, "a/1", float(i), latency_s=1.0 if i < 4000 else 0.002)
    stats = b.stats(5000.0)["services"]["llm"]
    assert stats["replicas"]["a/1"]["p99_ms"] == 2.0  # the last REPLICA_SAMPLES only
    assert stats["p99_ms"] == 1000.0  # the service's window (1024) still holds some 1 s ones
    assert REPLICA_SAMPLES < 1000 < SERVICE_SAMPLES < 5000
    assert stats["requests"] == 5000


def test_the_core_imports_no_io():
    import ast
    import pathlib

    import swarmd.serve.balance as module

    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not names & {"asyncio", "trio", "socket", "time", "os", "threading", "aiohttp"}
