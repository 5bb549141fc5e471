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
