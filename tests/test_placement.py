"""Placement on synthetic views: latency ranking, labels, slots, determinism, explanations."""

from __future__ import annotations

import itertools
import random
import time

from swarmd.compute.placement import Candidate, NoFit, Placement, place
from swarmd.compute.spec import build


def spec(**fields):
    return build({"cmd": ["python", "x.py"], **fields}, {})


def node(peer, *, state="alive", gpus=0, slots=2, cpu=4.0, mem=16000, labels=None, load=0.0):
    return Candidate(peer=peer, state=state, gpus_free=gpus, gpu_model="H100" if gpus else None, slots_free=slots,
                     cpu_free=cpu, memory_free_mb=mem, labels=labels or {}, load=load)


def matrix(pos: dict[str, float]):
    """Hosts on a line: the RTT is the distance."""
    return lambda a, b: abs(pos[a] - pos[b])


def test_the_tightest_set_wins():
    pos = {"a": 0, "b": 1, "c": 2, "x": 100, "y": 101, "z": 150}
    result = place(spec(nodes=3), [node(p) for p in pos], matrix(pos))
    assert result == Placement(("b", "a", "c"), 2.0), "b sits between a and c: it hosts rank 0"


def test_load_breaks_ties_then_peer_ids():
    rtt = lambda a, b: 10.0  # noqa: E731 - every pair alike
    result = place(spec(nodes=2), [node("a", load=3), node("b"), node("c"), node("d", load=1)], rtt)
    assert result.peers == ("b", "c")


def test_labels_gpus_slots_cpu_and_memory_filter():
    view = [node("eu1", labels={"region": "eu"}, gpus=2), node("eu2", labels={"region": "eu"}, gpus=1),
            node("us1", labels={"region": "us"}, gpus=8), node("eu3", labels={"region": "eu"}, gpus=4, slots=0),
            node("eu4", labels={"region": "eu"}, gpus=4, cpu=0.5), node("eu5", labels={"region": "eu"}, gpus=2)]
    result = place(spec(nodes=2, gpus_per_node=2, labels={"region": "eu"}, cpus=1), view, lambda a, b: 5.0)
    assert isinstance(result, Placement) and set(result.peers) == {"eu1", "eu5"}


def test_no_fit_says_what_was_asked_and_why_each_member_is_out():
    view = [node("12D3KooWaaaaaaaaaaaa1111", gpus=1), node("12D3KooWbbbbbbbbbbbb2222", gpus=1),
            node("12D3KooWcccccccccccc3333"), node("12D3KooWdddddddddddd4444", state="suspect", gpus=1)]
    result = place(spec(nodes=3, gpus_per_node=1), view, lambda a, b: 1.0)
    assert isinstance(result, NoFit)
    assert result.reason == ("need 3 nodes with ≥1 free GPU; 2 alive members fit: 12D3Ko…1111, 12D3Ko…2222; "
                             "2 others: 12D3Ko…3333 (0 free GPUs of 1 needed); 12D3Ko…4444 (suspect)")


def test_excluded_hosts_are_left_out_and_said_so():
    result = place(spec(nodes=2), [node("a"), node("b"), node("c")], lambda a, b: 1.0, exclude={"b", "c"})
    assert isinstance(result, NoFit) and "b (refused the last reservation)" in result.reason


def test_unknown_rtts_lose_to_known_ones_but_still_place():
    known = {frozenset("ab"): 50.0}
    rtt = lambda a, b: known.get(frozenset((a, b)))  # noqa: E731
    assert place(spec(nodes=2), [node("a"), node("b"), node("c")], rtt).peers == ("a", "b")
    result = place(spec(nodes=2), [node("x"), node("y")], lambda a, b: None)
    assert result == Placement(("x", "y"), None)


def test_the_same_view_in_any_order_gives_the_same_placement():
    rng = random.Random(7)
    pos = {f"p{i:03d}": rng.uniform(0, 200) for i in range(12)}
    view = [node(p, load=rng.choice([0, 1, 2])) for p in pos]
    first = place(spec(nodes=4), view, matrix(pos))
    for _ in range(20):
        rng.shuffle(view)
        assert place(spec(nodes=4), view, matrix(pos)) == first


def test_a_large_view_is_placed_quickly_and_well():
    rng = random.Random(1)
    clusters = [rng.uniform(0, 1000) for _ in range(30)]
    pos = {f"p{i:03d}": clusters[i % 30] + rng.uniform(0, 3) for i in range(300)}
    started = time.perf_counter()
    result = place(spec(nodes=8), [node(p) for p in pos], matrix(pos))
    took = time.perf_counter() - started
    assert isinstance(result, Placement) and took < 5, f"{took:.2f} s"
    assert result.worst_rtt_ms is not None and result.worst_rtt_ms < 20, "eight hosts of one cluster (10 each)"


def test_greedy_agrees_with_exact_search_on_small_views(monkeypatch):
    import swarmd.compute.placement as placement

    rng = random.Random(3)
    for _ in range(30):
        pos = {f"p{i}": rng.uniform(0, 100) for i in range(9)}
        exact = place(spec(nodes=3), [node(p) for p in pos], matrix(pos))
        monkeypatch.setattr(placement, "EXACT_LIMIT", 0)
        greedy = place(spec(nodes=3), [node(p) for p in pos], matrix(pos))
        monkeypatch.undo()
        best = min(max(abs(pos[a] - pos[b]) for a, b in itertools.combinations(g, 2))
                   for g in itertools.combinations(pos, 3))
        assert exact.worst_rtt_ms == best
        assert greedy.worst_rtt_ms <= 2 * best + 1e-9, "on a line, greedy is within twice the best"
