from swarmd.gossip.syncmerge import SYNC_MARGIN, max_records, select_sync_records


def test_blobs_we_hold_byte_for_byte_are_not_verified_again():
    held = {b"a", b"b"}
    assert select_sync_records([b"a", b"c", b"b", b"d"], held, view_size=2) == [b"c", b"d"]


def test_copies_within_one_payload_are_verified_once():
    # the reviewer's flood: 23,000 copies of one valid record cost 6.6 s to verify
    assert select_sync_records([b"r"] * 23_000, set(), view_size=10) == [b"r"]


def test_at_most_twice_the_view_plus_a_margin():
    blobs = [i.to_bytes(4, "big") for i in range(10_000)]
    got = select_sync_records(blobs, set(), view_size=100)
    assert got == blobs[:200 + SYNC_MARGIN] and len(got) == max_records(100)
    assert len(select_sync_records(blobs, set(), view_size=0)) == SYNC_MARGIN  # a new node still learns a swarm


def test_entries_that_are_not_bytes_are_left_for_the_verifier_to_refuse():
    assert select_sync_records([1, None, b"x", b"x"], set(), view_size=1) == [1, None, b"x"]


def test_a_held_blob_does_not_use_up_the_cap():
    held = {i.to_bytes(4, "big") for i in range(1000)}
    blobs = sorted(held) + [b"new"]
    assert select_sync_records(blobs, held, view_size=0) == [b"new"]


# --- digests first (sync protocol 3) -------------------------------------------------------------

from dataclasses import dataclass  # noqa: E402

from hypothesis import given, settings, strategies as st  # noqa: E402

from swarmd.gossip.membership import MAX_SEQ  # noqa: E402
from swarmd.gossip.syncmerge import MAX_PEER, digest, newer, read_digest, read_want, wanted  # noqa: E402


@dataclass(frozen=True)
class Rec:
    peer: str
    seq: int

    @property
    def blob(self) -> bytes:
        return f"{self.peer}@{self.seq}".encode()


def records(view: dict[str, int]) -> list[Rec]:
    return [Rec(p, s) for p, s in view.items()]


def sync(requester: dict[str, int], responder: dict[str, int]) -> tuple[list[Rec], list[Rec]]:
    """One sync through the pure steps, as sync.py runs them over the wire: what each side
    receives (the requester's records to the responder, the wanted ones back)."""
    theirs, problem = read_digest(digest(records(responder)), len(requester) + 1)
    assert problem is None
    to_responder = [Rec(*b.decode().split("@")) for b in newer(records(requester), theirs)]
    want, problem = read_want(wanted(requester, theirs), len(responder))
    assert problem is None
    held = {r.peer: r for r in records(responder)}
    return to_responder, [held[p] for p in want if p in held]


views = st.dictionaries(st.sampled_from([f"p{i}" for i in range(30)]), st.integers(0, 5), max_size=30)


@settings(max_examples=300, deadline=None)
@given(views, views)
def test_a_digest_sync_converges_both_views_and_never_sends_what_the_other_holds_as_new(a, b):
    to_b, to_a = sync(a, b)
    for got, receiver in ((to_b, b), (to_a, a)):
        for r in got:
            assert int(r.seq) > receiver.get(r.peer, -1), f"{r} sent to a side holding seq {receiver.get(r.peer)}"
    for r in to_b:
        b[r.peer] = max(b.get(r.peer, -1), int(r.seq))
    for r in to_a:
        a[r.peer] = max(a.get(r.peer, -1), int(r.seq))
    assert a == b


def test_a_converged_pair_trades_no_records():
    view = {f"p{i}": i for i in range(100)}
    assert sync(dict(view), dict(view)) == ([], [])


def test_a_hostile_digest_keeps_only_peer_ids_with_seqs_in_range():
    raw = [["a", 1], ["a", 3], ["a", 2], ["b", True], ["c", -1], ["d", MAX_SEQ], ["e" * (MAX_PEER + 1), 1],
           ["f/../g", 1], ["h", 1.5], "x", ["i"], ["j", 1, 2], [b"k", 1], ["l", MAX_SEQ - 1]]
    got, problem = read_digest(raw, view_size=10)
    assert got == {"a": 3, "l": MAX_SEQ - 1}
    assert problem == "sync digest: 10 entries not [peer id, seq in 0..2^63)"


def test_a_digest_longer_than_the_view_can_explain_is_read_up_to_its_cap():
    raw = [[f"p{i}", 1] for i in range(10_000)]
    got, problem = read_digest(raw, view_size=10)
    assert len(got) == max_records(10) and "10000 entries for a view of 10" in problem
    assert read_digest({"p": 1}, 10) == ({}, "sync digest: expected a list of [peer, seq], got dict")


def test_a_hostile_want_gets_each_record_once_and_at_most_one_per_record_held():
    want, problem = read_want(["a", "a", "b", 7, None, "c" * 65, "d"], view_size=10)
    assert want == ["a", "b", "d"] and problem == "sync want: entries that are not peer ids"
    want, problem = read_want(["a"] * 1000, view_size=5)
    assert want == ["a"] and problem == "sync want: 1000 peers asked of 6 records"
    assert read_want("a", 5) == ([], "sync want: expected a list of peer ids, got str")


def test_excluded_peers_are_not_wanted():
    assert wanted({"a": 1}, {"a": 2, "b": 1, "c": 1}, skip={"b"}) == ["a", "c"]
