"""The autoscale bench's pure parts: the trace, the figures, the Ray driver's lines (the lab run
itself is `python -m bench.autoscale`)."""

import math

from bench.autoscale import (BASE, BURST, PEAK, SEASON_S, SEASONS, SLO_MS, changes, figures, integrate, rate,
                             ray_replicas, statuses, trace)


def test_the_trace_is_the_same_every_time_a_base_a_daily_peak_and_a_burst_in_the_last_season_only():
    assert trace() == trace() and trace(seed=1) != trace()
    arrivals = trace()
    assert arrivals == sorted(arrivals) and 0 <= arrivals[0] and arrivals[-1] < SEASON_S * SEASONS
    assert rate(0.0) == BASE and math.isclose(rate(0.75 * SEASON_S), PEAK)
    assert rate(0.75 * SEASON_S) == rate(1.75 * SEASON_S), "the same peak each season"
    burst = (SEASONS - 1 + 0.4) * SEASON_S
    assert rate(burst) == BURST and rate(burst - SEASON_S) == BASE, "the burst is not in the seasons before"
    # Poisson at the rate: the count of a season within a few standard deviations of its integral
    want = sum(rate(t / 100) for t in range(int(SEASON_S * 100))) / 100
    got = sum(1 for a in arrivals if a < SEASON_S)
    assert abs(got - want) < 4 * math.sqrt(want), (got, want)


def test_replica_seconds_count_each_sample_until_the_next_within_the_window():
    assert integrate([(0.0, 1), (10.0, 3)], 5.0, 20.0) == 5 * 1 + 10 * 3
    assert integrate([(-5.0, 2)], 0.0, 10.0) == 20.0, "a sample before the window holds into it"
    assert integrate([(30.0, 2)], 0.0, 10.0) == 0.0
    assert changes([1, 1, 2, 3, 3, 1]) == 3 and changes([]) == 0


def test_a_request_over_the_slo_or_failed_is_a_violation():
    rows = [[0.0, 0.1, 200], [1.0, SLO_MS / 1000 + 0.01, 200], [2.0, 0.1, 503], [3.0, 0.05, 0], [9.0, 0.1, 200]]
    got = figures(rows, 0.0, 5.0)
    assert got["requests"] == 4 and got["over_slo"] == 3 and got["failed"] == 2 and got["over_slo_pct"] == 75.0
    assert statuses(rows) == {"200": 3, "503": 1, "0": 1}


def test_the_ray_drivers_replica_lines_are_read_from_the_jobs_logs():
    logs = ('[rank 0] serving on port 8000\n[rank 0] REPLICAS 1795000000.25 2 {"RUNNING": 1, "STARTING": 1}\n'
            "[rank 0] REPLICAS? KeyError('work')\n[rank 0] REPLICAS soon 2 {}\nREPLICAS 1795000001.00 3 {}\n")
    assert ray_replicas(logs) == [(1795000000.25, 2.0), (1795000001.0, 3.0)]
