"""Concurrent streams per peer (p2p/limits.Streams): the one per-peer stream limit that
gossip's gate and the job protocol use."""

from __future__ import annotations

from swarmd.p2p.limits import Streams


def test_a_peer_at_its_limit_is_refused_naming_it_and_others_go_on():
    streams = Streams(2, what="job streams")
    assert streams.acquire("greedy") is None and streams.acquire("greedy") is None
    assert streams.acquire("greedy") == "2 job streams from this peer are already open"
    assert streams.acquire("other") is None
    streams.release("greedy")
    assert streams.acquire("greedy") is None, "a stream that ended frees its place"
    assert streams.open == {"greedy": 2, "other": 1}


def test_the_total_bounds_every_peer_together():
    streams = Streams(3, total=4)
    for peer in ("a", "b", "c", "d"):
        assert streams.acquire(peer) is None
    assert streams.acquire("e") == "this host already serves 4 streams"
    streams.release("a")
    assert streams.acquire("e") is None


def test_a_peer_with_nothing_open_holds_no_entry_and_aside_gives_its_place_back_for_a_while():
    streams = Streams(1)
    assert streams.acquire("p") is None
    with streams.aside("p"):
        assert streams.acquire("p") is None, "a forward counts elsewhere while it lasts"
        streams.release("p")
    assert streams.open == {"p": 1}
    streams.release("p")
    assert streams.open == {}, "a flood of peer ids costs nothing once their streams end"
