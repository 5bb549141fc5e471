"""Whether a pair's direct path works (swarmd/routing/direct.py): the grace, theory's verdicts,
the retries and their back-off, a record's change, on a fake clock."""

import ast
from pathlib import Path

import pytest

from swarmd.routing import direct as dp

FP = (("eim", "1.2.3.4:5"), ("eim", "5.6.7.8:9"))


def watch() -> dp.DirectWatch:
    return dp.DirectWatch(grace_s=10, retry_s=300, retry_max_s=1200)


def test_a_pair_without_a_handshake_for_the_grace_lacks_a_direct_path():
    w = watch()
    for t in range(0, 10):
        w.observe(float(t), "b", on_direct=True, unshaken=True, fingerprint=FP, nats=("eim", "eim"))
        assert w.lacking("b") is None, t
    assert w.why("b") == dp.NO_DIRECT, "unproven: a follower following now records the lack"
    w.observe(10.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=("eim", "eim"))
    assert w.lacking("b") == dp.NO_DIRECT and w.declared == 1
    assert w.row(10.0, "b")["state"] == "none" and w.row(10.0, "b")["retry_in_s"] == 30, "soon: an end may lag"


def test_a_handshake_within_the_grace_is_a_direct_path():
    w = watch()
    w.observe(0.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=("eim", None))
    w.observe(5.0, "b", on_direct=True, unshaken=False, fingerprint=FP, nats=("eim", None))
    w.observe(60.0, "b", on_direct=True, unshaken=False, fingerprint=FP, nats=("eim", None))
    assert w.lacking("b") is None and w.why("b") == dp.FASTER and w.row(60.0, "b")["state"] == "ok"


def test_the_grace_starts_on_the_direct_path():
    w = watch()
    w.observe(0.0, "b", on_direct=False, unshaken=True, fingerprint=FP, nats=("eim", "eim"))
    w.observe(20.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=("eim", "eim"))
    assert w.lacking("b") is None, "a pair that just went direct is given the whole grace"


@pytest.mark.parametrize(("a", "b", "ruled_out"), [
    ("edm", "edm", True), ("edm", "firewall", True), ("firewall", "edm", True), ("edm", "eim", False),
    ("eim", "eim", False), ("edm", "public", False), ("edm", None, False), ("firewall", "firewall", False)])
def test_theory(a, b, ruled_out):
    assert dp.impossible(a, b) is ruled_out
    assert dp.reason(a, b) == (dp.SYMMETRIC if "edm" in (a, b) else dp.NO_DIRECT)


def test_a_pairing_theory_rules_out_is_relayed_at_once_and_not_retried_on_a_timer():
    w = watch()
    fp = (("edm", "1.1.1.1:1"), ("edm", "2.2.2.2:2"))
    w.observe(0.0, "b", on_direct=True, unshaken=True, fingerprint=fp, nats=("edm", "edm"))
    assert w.lacking("b") == dp.SYMMETRIC
    for t in (600.0, 5000.0, 100000.0):
        w.observe(t, "b", on_direct=False, unshaken=False, fingerprint=fp, nats=("edm", "edm"))
        assert w.lacking("b") == dp.SYMMETRIC and not w.trying("b")


def tries_of(w: dp.DirectWatch, nats: tuple, until: float) -> list[float]:
    """When each try of the direct path began, every try failing (no handshake), from t=10."""
    tries, t, on_direct = [], 10.0, False
    while t < until:
        t += 1.0
        w.observe(t, "b", on_direct=on_direct, unshaken=True, fingerprint=FP, nats=nats)
        if w.trying("b") and not on_direct:
            tries.append(t)
        on_direct = w.trying("b")  # paths.py moves the pair direct for a try, to a relay otherwise
    return tries


def test_retries_are_rare_and_back_off():
    w = watch()
    w.observe(0.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=("edm", "eim"))
    w.observe(10.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=("edm", "eim"))
    assert w.lacking("b") == dp.SYMMETRIC
    tries = tries_of(w, ("edm", "eim"), 4000)
    gaps = [round(b - a) for a, b in zip(tries, tries[1:])]
    assert tries[0] == 40.0 and gaps[0] == 41, \
        "CHANGE_TRIES in all soon (an end may have lagged: the first was the set-up), the next after 2 x retry_s"
    assert dp.CHANGE_TRIES == 3 and gaps[1:4] == [611, 1211, 1211], \
        "doubling (plus the try's grace), capped at retry_max_s"
    assert w.lacking("b") in (None, dp.SYMMETRIC) and w.tries == len(tries)


def test_a_pair_with_an_unmeasured_end_keeps_trying_soon_then_backs_off():
    # CI: a symmetric NAT relayed to both public members at a loaded start-up was never measured
    # (a relayed observer attests nothing), so it stayed unknown and relayed for the whole lab
    w = watch()
    w.observe(0.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=("public", None))
    w.observe(10.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=("public", None))
    assert w.lacking("b") == dp.NO_DIRECT
    tries = tries_of(w, ("public", None), 4000)
    gaps = [round(b - a) for a, b in zip(tries, tries[1:])]
    quick = dp.QUICK_TRIES + dp.CHANGE_TRIES - 2
    assert tries[0] == 40.0 and gaps[:quick] == [41] * quick, \
        "every quick_s (plus the try's grace) while an end is unmeasured"
    assert gaps[quick] == 1211, "then the back-off, at its cap"
    measured = watch()
    measured.observe(0.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=("public", "edm"))
    measured.observe(10.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=("public", "edm"))
    both = tries_of(measured, ("public", "edm"), 2000)
    assert [round(b - a) for a, b in zip(both, both[1:])][:2] == [41, 611], \
        "a measured pair backs off after its quick tries"


def test_a_pair_whose_direct_path_worked_as_things_are_keeps_trying_soon_then_backs_off():
    # CI: an address-restricted cone and a symmetric NAT, direct for minutes, failed three tries during
    # a loaded Ray start and stayed relayed for the back-off's 10 minutes
    w = watch()
    nats = ("eim", "edm")
    w.observe(0.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=nats)
    w.observe(2.0, "b", on_direct=True, unshaken=False, fingerprint=FP, nats=nats)  # punched: it shook hands
    w.observe(500.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=nats)  # lost (e.g. roamed to a relay)
    w.observe(510.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=nats)
    assert w.lacking("b") == dp.SYMMETRIC
    tries = tries_of(w, nats, 4000)
    gaps = [round(b - a) for a, b in zip(tries, tries[1:])]
    quick = dp.QUICK_TRIES + dp.CHANGE_TRIES - 2
    assert gaps[:quick] == [41] * quick and gaps[quick] == 1211, "every quick_s for QUICK_TRIES, then the back-off"
    assert [what for _, what in w.take_changes()][:4] == ["lacking", "trying", "lacking", "trying"]
    assert w.take_changes() == [], "drained"
    elsewhere = watch()  # it worked, but at another mapping: as a pair that never worked
    elsewhere.observe(0.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=nats)
    elsewhere.observe(2.0, "b", on_direct=True, unshaken=False, fingerprint=FP, nats=nats)
    moved = (FP[0], ("edm", "5.6.7.0:9"))
    for t in (500.0, 510.0, 511.0, 521.0):
        elsewhere.observe(t, "b", on_direct=True, unshaken=True, fingerprint=moved, nats=nats)
    for t in (552.0, 553.0, 563.0, 594.0, 595.0, 605.0):
        elsewhere.observe(t, "b", on_direct=t not in (552.0, 594.0), unshaken=True, fingerprint=moved, nats=nats)
    assert elsewhere.row(605.0, "b")["retry_in_s"] == 600, "the back-off after CHANGE_TRIES"


def test_a_try_that_shakes_hands_ends_the_lack():
    w = watch()
    w.observe(0.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=("eim", "eim"))
    w.observe(10.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=("eim", "eim"))
    w.observe(310.0, "b", on_direct=False, unshaken=False, fingerprint=FP, nats=("eim", "eim"))
    assert w.trying("b") and w.lacking("b") is None
    w.observe(311.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=("eim", "eim"))
    w.observe(313.0, "b", on_direct=True, unshaken=False, fingerprint=FP, nats=("eim", "eim"))
    assert not w.trying("b") and w.lacking("b") is None and w.row(313.0, "b")["state"] == "ok"
    assert [what for _, what in w.take_changes()] == ["lacking", "trying", "works"], "for the driver's log"


def test_a_changed_mapping_or_verdict_retries_at_once():
    w = watch()
    w.observe(0.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=("eim", "eim"))
    w.observe(10.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=("eim", "eim"))
    assert w.lacking("b") == dp.NO_DIRECT
    moved = (FP[0], ("eim", "5.6.7.8:10"))  # the peer's NAT rebound
    w.observe(11.0, "b", on_direct=False, unshaken=False, fingerprint=moved, nats=("eim", "eim"))
    assert w.lacking("b") is None and w.trying("b"), "direct again, a new grace"
    w.observe(12.0, "b", on_direct=True, unshaken=True, fingerprint=moved, nats=("eim", "eim"))
    w.observe(21.0, "b", on_direct=True, unshaken=True, fingerprint=moved, nats=("eim", "eim"))
    assert w.lacking("b") is None
    w.observe(22.0, "b", on_direct=True, unshaken=True, fingerprint=moved, nats=("eim", "eim"))
    assert w.lacking("b") == dp.NO_DIRECT and w.row(22.0, "b")["retry_in_s"] == 30, "once more soon: an end may lag"
    w.observe(52.0, "b", on_direct=False, unshaken=False, fingerprint=moved, nats=("eim", "eim"))
    w.observe(53.0, "b", on_direct=True, unshaken=True, fingerprint=moved, nats=("eim", "eim"))
    w.observe(63.0, "b", on_direct=True, unshaken=True, fingerprint=moved, nats=("eim", "eim"))
    assert w.lacking("b") == dp.NO_DIRECT and w.row(63.0, "b")["retry_in_s"] == 30, "CHANGE_TRIES in all soon"
    w.observe(93.0, "b", on_direct=False, unshaken=False, fingerprint=moved, nats=("eim", "eim"))
    w.observe(94.0, "b", on_direct=True, unshaken=True, fingerprint=moved, nats=("eim", "eim"))
    w.observe(104.0, "b", on_direct=True, unshaken=True, fingerprint=moved, nats=("eim", "eim"))
    assert w.lacking("b") == dp.NO_DIRECT and w.row(104.0, "b")["retry_in_s"] == 600, "then the back-off"
    edm = ((("edm", "1.1.1.1:1"), ("edm", "2.2.2.2:3")))
    w.observe(105.0, "b", on_direct=False, unshaken=False, fingerprint=edm, nats=("edm", "edm"))
    assert w.trying("b"), "a change is tried even where theory rules it out: the records may be wrong"
    w.observe(106.0, "b", on_direct=True, unshaken=True, fingerprint=edm, nats=("edm", "edm"))
    w.observe(116.0, "b", on_direct=True, unshaken=True, fingerprint=edm, nats=("edm", "edm"))
    assert w.lacking("b") == dp.SYMMETRIC and w.row(116.0, "b")["retry_in_s"] is None


def test_forget_and_bad_config():
    w = watch()
    w.observe(0.0, "b", on_direct=True, unshaken=True, fingerprint=FP, nats=(None, "edm"))
    w.forget(["c"])
    assert w.row(0.0, "b")["state"] == "ok" and w.why("b") == dp.FASTER
    with pytest.raises(ValueError):
        dp.DirectWatch(grace_s=0)
    with pytest.raises(ValueError):
        dp.DirectWatch(retry_s=10, retry_max_s=5)


def test_direct_is_a_pure_core():
    tree = ast.parse(Path(dp.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not names & {"trio", "socket", "time", "asyncio", "random"}, names


def test_the_fingerprint_keeps_a_symmetric_nats_ip_only():
    edm1, edm2 = ("edm", "203.0.113.2:31813"), ("edm", "203.0.113.2:49113")
    assert dp.fingerprint(("eim", "1.2.3.4:5"), edm1) == dp.fingerprint(("eim", "1.2.3.4:5"), edm2)
    assert dp.fingerprint(("eim", "1.2.3.4:5"), edm1) != dp.fingerprint(("eim", "1.2.3.4:6"), edm1)
    assert dp.fingerprint(("eim", None), ("eim", "1.2.3.4:5"), "1.2.3.4:5") \
        != dp.fingerprint(("eim", None), ("eim", "1.2.3.4:5"), None)


def test_a_new_endpoint_during_the_grace_restarts_it():
    # a node restarted behind a rebound NAT: its new reflexive endpoint is known 9 s in, and its
    # peer needs a moment to send there; lacking at 10 s would relay a pair that is about to punch
    w = watch()
    for t in range(0, 9):
        w.observe(float(t), "b", on_direct=True, unshaken=True, fingerprint=FP, nats=("eim", "firewall"))
    moved = (("eim", "1.2.3.4:7"), FP[1])
    for t in range(9, 19):
        w.observe(float(t), "b", on_direct=True, unshaken=True, fingerprint=moved, nats=("eim", "firewall"))
        assert w.lacking("b") is None, t
    w.observe(19.0, "b", on_direct=True, unshaken=True, fingerprint=moved, nats=("eim", "firewall"))
    assert w.lacking("b") == dp.NO_DIRECT, "10 s from the change"


ROW = {"endpoint": "198.51.100.5:40001", "direct": False, "reflexive": True, "elsewhere": False,
       "handshake_age_s": 4.0}


def test_a_fresh_handshake_at_the_peers_own_endpoint_shows_the_direct_path_works():
    assert dp.shaken(ROW, since=None, wall=1000.0, arrived=False)
    assert dp.shaken(ROW, since=990.0, wall=1000.0, arrived=False), "made after the move back from a relay"
    assert not dp.shaken(ROW, since=999.0, wall=1000.0, arrived=False), "a session carried over from the relay"
    assert dp.shaken(ROW, since=999.0, wall=1000.0, arrived=True), "but its packets keep coming from there"
    assert not dp.shaken({**ROW, "handshake_age_s": None}, since=None, wall=1000.0, arrived=True)
    assert not dp.shaken({**ROW, "handshake_age_s": dp.SESSION_S}, since=None, wall=1000.0, arrived=True)


def test_a_handshake_that_roamed_wireguard_onto_a_relay_proves_nothing_of_the_direct_path():
    # the other end still relayed: its handshake came through the relay and WireGuard roamed there
    relayed = {**ROW, "endpoint": "203.0.113.1:7001", "reflexive": False, "elsewhere": True}
    assert not dp.shaken(relayed, since=None, wall=1000.0, arrived=False)
    assert not dp.shaken(relayed, since=990.0, wall=1000.0, arrived=True)
