"""A service controller's decisions (swarmd/serve/control.py), on a fake clock: scale, replace,
roll out, drain."""

from swarmd.serve.control import BACKOFF_MAX_S, DRAIN_S, START_DEFAULT_S, Controller, Observed, Slot, StartReplica, StopReplica


def run(c: Controller, now: float, seen: dict) -> list:
    """One step, the trio side's part played: each started slot gets job id j<index>.<generation>."""
    actions = c.step(now, seen)
    for a in actions:
        if isinstance(a, StartReplica):
            c.started(a.index, f"j{a.index}.{a.generation}")
    return actions


def up(c: Controller, host=lambda i: f"h{i}", healthy=True) -> dict:
    return {s.job: Observed(state="running", host=host(s.index), healthy=healthy) for s in c.slots.values() if s.job}


def test_a_new_service_starts_its_replicas_at_the_lowest_indexes_and_assigns_them_once_running():
    c = Controller(replicas=3, generation=1)
    assert run(c, 0.0, {}) == [StartReplica(0, 1), StartReplica(1, 1), StartReplica(2, 1)]
    assert run(c, 1.0, {}) == [] and c.assigned({}) == ()
    seen = up(c)
    assert c.assigned(seen) == ((0, "h0"), (1, "h1"), (2, "h2"))


def test_a_replica_whose_job_ended_is_started_again_after_a_growing_back_off():
    c = Controller(replicas=1, generation=1)
    run(c, 0.0, {})
    failed = {"j0.1": Observed(state="failed")}
    assert run(c, 10.0, failed) == [], "one second's back-off first"
    assert c.slots[0].job is None and run(c, 11.0, {}) == [StartReplica(0, 1)]
    for _ in range(10):
        run(c, 12.0, failed)
        c.slots[0].retry_at = 0.0  # skip the waits
        run(c, 12.0, {})
    run(c, 100.0, failed)
    assert c.slots[0].retry_at - 100.0 == BACKOFF_MAX_S
    c.slots[0].retry_at = 0.0
    run(c, 101.0, {})
    run(c, 102.0, up(c))
    assert c.slots[0].failures == 0, "healthy again: the count starts over"


def test_scaling_down_drains_the_highest_indexes_first_then_stops_them():
    c = Controller(replicas=3, generation=1)
    run(c, 0.0, {})
    c.replicas = 1
    seen = up(c)
    assert run(c, 1.0, seen) == []
    assert c.assigned(seen) == ((0, "h0"),), "draining replicas leave the claim at once"
    busy = {j: Observed(state="running", host="h", healthy=True) for j in seen}
    assert run(c, DRAIN_S, busy) == [], "requests in flight finish first"
    assert sorted(run(c, 1.0 + DRAIN_S, busy), key=lambda a: a.index) == [StopReplica(1, "j1.1"), StopReplica(2, "j2.1")]
    assert run(c, 2.0 + DRAIN_S, busy) == [], "asked once"
    run(c, 3.0 + DRAIN_S, {**seen, "j1.1": Observed(state="cancelled"), "j2.1": Observed(state="cancelled")})
    assert sorted(c.slots) == [0]


def test_a_roll_out_replaces_one_replica_at_a_time_once_the_new_one_is_healthy():
    c = Controller(replicas=2, generation=1)
    run(c, 0.0, {})
    c.generation = 2
    assert run(c, 1.0, up(c)) == [StartReplica(2, 2)], "one surge replica"
    seen = {**up(c), "j2.2": Observed(state="running", host="h2", healthy=False)}
    assert run(c, 2.0, seen) == [] and all(s.draining_since is None for s in c.slots.values()), "not healthy yet"
    seen = up(c)
    run(c, 3.0, seen)
    assert [s.index for s in c.slots.values() if s.draining_since is not None] == [0]
    assert c.assigned(seen) == ((1, "h1"), (2, "h2"))
    assert run(c, 4.0, seen) == [StartReplica(3, 2)], "the next surge while the first old one drains"
    run(c, 5.0, up(c))
    gens = sorted((s.index, s.generation, s.draining_since is not None) for s in c.slots.values())
    assert gens == [(0, 1, True), (1, 1, True), (2, 2, False), (3, 2, False)]


def test_slots_survive_a_restart_and_a_drain_under_way_goes_on():
    s = Slot.from_json(Slot(index=4, generation=2, job="abc", draining_since=5.0).to_json())
    assert (s.index, s.generation, s.job) == (4, 2, "abc") and s.draining_since == float("-inf")
    c = Controller(replicas=0, generation=2, slots={4: s})
    assert run(c, 0.0, {"abc": Observed(state="running", host="h")}) == [StopReplica(4, "abc")]
    for bad in ({"index": 1000, "generation": 1, "job": None}, {"index": 0, "generation": -1, "job": None},
                {"index": "0", "generation": 1, "job": None}, {"index": 0, "generation": 1, "job": 7}):
        try:
            Slot.from_json(bad)
        except ValueError:
            continue
        raise AssertionError(bad)


def test_a_replicas_start_time_is_measured_from_its_job_asked_for_to_its_first_healthy_check():
    c = Controller(replicas=2, generation=1)
    assert c.start_s == START_DEFAULT_S, "nothing measured yet"
    run(c, 100.0, {})
    run(c, 110.0, up(c, healthy=False))
    run(c, 112.0, {"j0.1": Observed(state="running", host="h0", healthy=True),
                   "j1.1": Observed(state="running", host="h1", healthy=False)})
    run(c, 130.0, up(c))
    run(c, 140.0, up(c))  # healthy again: not a new start
    assert sorted(c.start_times) == [12.0, 30.0]
    c.replicas = 3
    run(c, 200.0, up(c))
    run(c, 204.0, up(c))
    assert sorted(c.start_times) == [4.0, 12.0, 30.0] and c.start_s == 12.0, "the median of the last few"


def test_a_replica_moved_is_replaced_like_a_roll_out_a_surge_first_then_the_far_one_drained():
    c = Controller(replicas=2, generation=1)
    run(c, 0.0, {})
    run(c, 1.0, up(c))
    c.relocate(1)
    assert run(c, 2.0, up(c)) == [StartReplica(2, 1)], "a surge replica, placed anew"
    assert c.slots[1].draining_since is None, "the far one serves until the new one is healthy"
    seen = up(c, healthy=False)
    run(c, 3.0, {**seen, "j0.1": Observed(state="running", host="h0", healthy=True),
                 "j1.1": Observed(state="running", host="h1", healthy=True)})
    assert c.slots[1].draining_since is None
    run(c, 4.0, up(c))
    assert c.slots[1].draining_since == 4.0 and c.assigned(up(c)) == ((0, "h0"), (2, "h2"))
    assert Slot.from_json({**c.slots[1].to_json()}).moving, "a move survives a restart"
