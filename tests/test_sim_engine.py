"""The simulator's clock: one heap, events in time order, ties in the order scheduled."""

from sim.engine import Engine


def test_events_run_in_time_order_and_ties_in_the_order_scheduled():
    e = Engine()
    seen = []
    for t, name in [(2.0, "c"), (1.0, "a"), (2.0, "d"), (1.5, "b"), (3.0, "late")]:
        e.at(t, seen.append, name)
    e.run_until(2.5)
    assert seen == ["a", "b", "c", "d"]
    assert e.now == 2.5 and e.events == 4 and len(e) == 1


def test_an_event_in_the_past_runs_now_and_time_never_goes_back():
    e = Engine()
    times = []
    e.run_until(5.0)
    e.at(1.0, lambda _: times.append(e.now))
    e.after(0.5, lambda _: times.append(e.now))
    e.run_until(10.0)
    assert times == [5.0, 5.5]


def test_an_event_may_schedule_more_within_the_same_run():
    e = Engine()
    seen = []

    def tick(k):
        seen.append((e.now, k))
        if k < 3:
            e.after(1.0, tick, k + 1)
    e.at(0.0, tick, 0)
    e.run_until(2.5)
    assert seen == [(0.0, 0), (1.0, 1), (2.0, 2)]
    assert e.next_time() == 3.0
