"""A running job's events on a host (sink.py): to its coordinator, and after it is gone to a
successor, in order and none lost; without a successor the ranks stop as before."""

from __future__ import annotations

import pytest
import trio

from swarmd.compute.host.sink import CoordinatorGone, Sink


class Stream:
    """A coordinator's stream: what it took; ``broken`` raises, ``stuck`` never returns."""

    def __init__(self) -> None:
        self.got: list[int] = []
        self.broken = False
        self.stuck = False

    async def emit(self, event: dict) -> None:
        await trio.lowlevel.checkpoint()
        if self.broken:
            raise CoordinatorGone("stream closed")
        if self.stuck:
            await trio.sleep_forever()
        self.got.append(event["n"])


async def test_without_a_successor_a_broken_stream_stops_the_job_at_once():
    old = Stream()
    sink = Sink(old.emit)
    await sink.send({"n": 1})
    old.broken = True
    with pytest.raises(CoordinatorGone, match="stream closed"):
        await sink.send({"n": 2})
    assert old.got == [1]


async def test_a_coordinator_that_takes_nothing_is_gone_after_the_emit_timeout(autojump_clock):
    old = Stream()
    old.stuck = True
    sink = Sink(old.emit, emit_timeout=60.0)
    t0 = trio.current_time()
    with pytest.raises(CoordinatorGone, match="took no event for 60 s"):
        await sink.send({"n": 1})
    assert trio.current_time() - t0 == pytest.approx(60.0)


async def test_a_successor_gets_the_event_that_failed_and_every_one_after(autojump_clock):
    old, new = Stream(), Stream()
    sink = Sink(old.emit, patience=30.0)
    await sink.send({"n": 1})
    old.broken = True
    async with trio.open_nursery() as nursery:
        async def sender():
            for n in (2, 3, 4):
                await sink.send({"n": n})

        nursery.start_soon(sender)
        await trio.sleep(10)
        assert sink.orphaned == "stream closed" and new.got == []
        sink.attach(new.emit)
    assert old.got == [1] and new.got == [2, 3, 4] and sink.orphaned is None and sink.handovers == 1


async def test_no_successor_within_the_patience_stops_the_job(autojump_clock):
    old = Stream()
    old.broken = True
    sink = Sink(old.emit, patience=30.0)
    t0 = trio.current_time()
    with pytest.raises(CoordinatorGone, match="no successor took the job over within 30 s"):
        await sink.send({"n": 1})
    assert trio.current_time() - t0 == pytest.approx(30.0)


async def test_membership_saying_the_coordinator_is_gone_cuts_a_stuck_send_short(autojump_clock):
    old, new = Stream(), Stream()
    old.stuck = True
    sink = Sink(old.emit, patience=30.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sink.send, {"n": 1})
        await trio.sleep(2)
        sink.orphan("membership declared the coordinator dead")
        await trio.sleep(1)
        assert sink.orphaned == "membership declared the coordinator dead"
        sink.attach(new.emit)
    assert new.got == [1]


async def test_an_attach_while_the_old_stream_hangs_moves_the_event_to_the_successor(autojump_clock):
    # a partitioned coordinator: its stream neither breaks nor takes anything; the successor's
    # higher epoch wins at once
    old, new = Stream(), Stream()
    old.stuck = True
    sink = Sink(old.emit, patience=30.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sink.send, {"n": 1})
        await trio.sleep(5)
        sink.attach(new.emit)
    assert new.got == [1] and old.got == []
    await sink.send({"n": 2})
    assert new.got == [1, 2]


async def test_a_second_hand_over_works_like_the_first(autojump_clock):
    a, b, c = Stream(), Stream(), Stream()
    sink = Sink(a.emit, patience=30.0)
    await sink.send({"n": 1})
    a.broken = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sink.send, {"n": 2})
        await trio.sleep(1)
        sink.attach(b.emit)
    b.broken = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sink.send, {"n": 3})
        await trio.sleep(1)
        sink.attach(c.emit)
    assert (a.got, b.got, c.got) == ([1], [2], [3]) and sink.handovers == 2
