"""The hand-over core: charters, epochs, fencing, replicated records, the successor.

The property test at the end runs the unmodified core over random schedules of crashes,
revivals, partitions and heals in a small modelled swarm (an origin and three hosts, every
one a replica), and checks what the protocol promises: no host ever obeys two coordinators
at one epoch or an epoch lower than one it obeyed, every transition a host obeyed is in the
record its next coordinator continues from when no partition hid it, and once the network
heals every host obeys one coordinator again.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nacl.signing import SigningKey

from swarmd.compute import succession as sx
from swarmd.compute.succession import Charter, Fence, Record, Replicas, newest, takeover
from swarmd.p2p.signed import Invalid, peer_from_key, peer_str, seal, unseal

JOB = "0123456789ab"
DIGEST = "ab" * 32


def _key(i: int) -> SigningKey:
    return SigningKey(bytes([i + 1]) * 32)


KEYS = {name: _key(i) for i, name in enumerate(("o", "h2", "h3", "h4", "h5", "h6", "x"))}
PEER = {name: peer_str(peer_from_key(bytes(k.verify_key))) for name, k in KEYS.items()}
NAME = {peer: name for name, peer in PEER.items()}


def sign(name: str):
    return lambda data: KEYS[name].sign(data).signature


def charter(hosts=("h2", "h3", "h4"), origin="o", signer=None) -> Charter:
    return Charter.make(origin=PEER[origin], job=JOB, owner_uid=1000, spec=DIGEST, hosts=[PEER[h] for h in hosts],
                        sign=sign(signer or origin))


def body_of(c: Charter) -> dict:
    return unseal(c.blob)[0]


def forged(body: dict, by: str = "o") -> bytes:
    return seal(body, sign(by))


# --- the charter --------------------------------------------------------------------------

def test_a_charter_round_trips_and_names_the_origin_first():
    c = charter()
    assert Charter.open(c.blob) == c
    assert c.replicas == (PEER["o"], PEER["h2"], PEER["h3"], PEER["h4"]) and c.key == (PEER["o"], JOB)
    assert sx.spec_digest({"cmd": ["python", "x.py"]}) == sx.spec_digest({"cmd": ["python", "x.py"]})


def test_a_charter_keeps_at_most_five_replicas_and_no_peer_twice():
    c = charter(hosts=("h2", "o", "h2", "h3", "h4", "h5", "h6"))
    assert c.replicas == tuple(PEER[n] for n in ("o", "h2", "h3", "h4", "h5"))


@pytest.mark.parametrize("change, reason", [
    ({"job": "../../etc"}, "malformed"),
    ({"job": 12}, "malformed"),
    ({"owner_uid": -1}, "malformed"),
    ({"owner_uid": 1 << 40}, "malformed"),
    ({"owner_uid": True}, "malformed"),
    ({"spec": "not a digest"}, "malformed"),
    ({"replicas": []}, "malformed"),
    ({"replicas": ["h2"]}, "malformed"),  # the origin is not first
    ({"replicas": ["o", "h2", "h2"]}, "malformed"),
    ({"replicas": ["o", "h2", "h3", "h4", "h5", "h6"]}, "malformed"),
    ({"replicas": ["o", "not a peer"]}, "malformed"),
    ({"replicas": ["o", 7]}, "malformed"),
])
def test_a_malformed_charter_is_refused_naming_the_field(change, reason):
    body = body_of(charter())
    if "replicas" in change:
        change = {"replicas": [PEER.get(p, p) if isinstance(p, str) else p for p in change["replicas"]]}
    with pytest.raises(Invalid) as exc:
        Charter.open(forged({**body, **change}))
    assert exc.value.reason == reason


def test_a_charter_signed_by_anyone_but_its_origin_is_refused():
    # a replica rewriting the command's digest, the owner or the replicas must sign as the origin
    body = body_of(charter())
    for change in ({"spec": "cd" * 32}, {"owner_uid": 0}, {"replicas": [PEER["o"], PEER["x"]]}):
        with pytest.raises(Invalid) as exc:
            Charter.open(forged({**body, **change}, by="h2"))
        assert exc.value.reason == "signature"
    with pytest.raises(Invalid):
        Charter.open(b"\x00" * 100)
    with pytest.raises(Invalid):
        Charter.open("text")


# --- epochs and the successor -------------------------------------------------------------

def test_each_epoch_has_one_coordinator_in_the_charters_order():
    c = charter()
    assert [NAME[c.coordinator(e)] for e in range(6)] == ["o", "h2", "h3", "h4", "o", "h2"]


def test_the_next_epoch_skips_gone_coordinators_and_none_is_left_when_all_are():
    c = charter()
    gone = {PEER["h2"], PEER["h3"]}
    assert c.next_epoch(0, gone.__contains__) == 3
    assert c.next_epoch(0, lambda p: True) is None


def test_only_the_successor_of_a_gone_coordinator_takes_over():
    c = charter()
    dead_origin = {PEER["o"]}.__contains__
    assert takeover(PEER["h2"], c, 0, dead_origin, acting=False) == 1
    assert takeover(PEER["h3"], c, 0, dead_origin, acting=False) is None  # h2 is next
    assert takeover(PEER["h3"], c, 0, {PEER["o"], PEER["h2"]}.__contains__, acting=False) == 2
    assert takeover(PEER["h2"], c, 0, lambda p: False, acting=False) is None  # the origin is alive
    assert takeover(PEER["h2"], c, 0, dead_origin, acting=True) is None
    assert takeover(PEER["x"], c, 0, dead_origin, acting=False) is None  # not a replica


def test_a_restarted_coordinator_never_resumes_its_past_epoch():
    c = charter()
    # the newest epoch the replicas hold is the origin's own (0): nobody took over while it
    # restarted, so it goes on at a fresh epoch of its own (4), never at 0 again
    assert takeover(PEER["o"], c, 0, lambda p: False, acting=False) == 4
    assert takeover(PEER["o"], c, 0, lambda p: p != PEER["o"], acting=False) == 4
    # h2 took over meanwhile (the replicas hold epoch 1): the origin is a front end
    assert takeover(PEER["o"], c, 1, lambda p: False, acting=False) is None


# --- fencing ------------------------------------------------------------------------------

def test_a_host_obeys_only_the_highest_epoch_it_has_seen():
    c, fence = charter(), Fence()
    assert fence.admit(c, PEER["o"], 0) is None
    assert fence.admit(c, PEER["h2"], 1) is None
    assert fence.admit(c, PEER["o"], 0) == "stale_epoch"  # the old coordinator came back
    assert fence.admit(c, PEER["h2"], 1) is None
    assert fence.seen(c.key).coordinator == PEER["h2"]
    assert fence.refused == {"stale_epoch": 1}


@pytest.mark.parametrize("peer, epoch, reason", [
    ("x", 1, "not_replica"),  # a member that is not a replica
    ("h3", 1, "not_its_epoch"),  # a replica claiming another's epoch
    ("o", 0, "stale_epoch"),
    ("h2", 1, "stale_epoch"),
])
def test_false_claims_of_coordination_are_refused_and_counted(peer, epoch, reason):
    c, fence = charter(), Fence()
    assert fence.admit(c, PEER["h4"], 3) is None
    assert fence.admit(c, PEER[peer], epoch) == reason
    assert fence.seen(c.key).epoch == 3 and fence.refused == {reason: 1}
    assert fence.admit(c, PEER["h2"], 5) is None  # the next round's h2 is obeyed


def test_a_different_charter_for_the_same_job_is_refused():
    c, fence = charter(), Fence()
    fence.admit(c, PEER["o"], 0)
    other = charter(hosts=("h2", "x"))
    assert fence.admit(other, PEER["o"], 0) == "charter_changed"
    fence.forget(c.key)
    assert fence.seen(c.key) is None


# --- records ------------------------------------------------------------------------------

def record(c: Charter, epoch: int, seq: int, by: str | None = None, body: bytes = b"state") -> Record:
    return Record.make(c, epoch, seq, body, sign(by or NAME[c.coordinator(epoch)]))


def test_a_record_is_signed_by_its_epochs_coordinator():
    c = charter()
    r = record(c, 1, 7)
    assert Record.open(r.blob) == r and Record.open(r.blob, c).version == (1, 7)
    with pytest.raises(Invalid) as exc:
        record(c, 1, 8, by="h3")  # h3 writing at h2's epoch
    assert exc.value.reason == "signature"
    with pytest.raises(Invalid) as exc:
        Record.open(r.blob, charter(hosts=("h2", "x")))
    assert exc.value.reason == "charter_changed"


@pytest.mark.parametrize("change, reason", [
    ({"epoch": -1}, "bad_epoch"), ({"epoch": 1 << 40}, "bad_epoch"), ({"epoch": "1"}, "bad_epoch"),
    ({"epoch": True}, "bad_epoch"), ({"seq": -1}, "malformed"), ({"seq": 1 << 60}, "malformed"),
    ({"body": "text"}, "malformed"), ({"body": b"x" * (sx.MAX_RECORD + 1)}, "too_large"),
    ({"charter": b"junk"}, "malformed"),
])
def test_a_malformed_record_is_refused_naming_what(change, reason):
    c = charter()
    body = {"charter": c.blob, "epoch": 0, "seq": 1, "body": b"x", **change}
    with pytest.raises(Invalid) as exc:
        Record.open(forged(body))
    assert exc.value.reason == reason


def test_a_replica_keeps_the_newest_record_and_refuses_older_ones():
    c = charter()
    store = Replicas(PEER["h3"])
    assert store.offer(record(c, 0, 1)) is None
    assert store.offer(record(c, 0, 2)) is None
    assert store.offer(record(c, 0, 2)) == "stale"
    assert store.offer(record(c, 1, 0)) is None  # a new epoch starts its own count
    assert store.offer(record(c, 0, 9)) == "stale"  # the superseded coordinator learns it here
    assert store.get(c.key).version == (1, 0)
    assert Replicas(PEER["x"]).offer(record(c, 0, 1)) == "not_replica"
    assert newest([None, record(c, 0, 5), record(c, 1, 1), record(c, 0, 9)]).version == (1, 1)


def test_a_replica_holds_a_bounded_number_of_jobs_per_origin():
    store = Replicas(PEER["h2"], max_jobs=4, max_per_origin=2)
    jobs = ["0123456789a" + ch for ch in "bcdefg"]
    made = [Charter.make(origin=PEER["o"], job=j, owner_uid=1, spec=DIGEST, hosts=[PEER["h2"]], sign=sign("o"))
            for j in jobs]
    assert [store.offer(record(c, 0, 1)) for c in made[:3]] == [None, None, "full"]
    mine = Charter.make(origin=PEER["h3"], job=jobs[0], owner_uid=1, spec=DIGEST, hosts=[PEER["h2"]],
                        sign=sign("h3"))
    assert store.offer(record(mine, 0, 1)) is None  # another origin's job still has room
    assert len(store) == 3


# --- the model: the unmodified core on a modelled swarm -------------------------------------

class Node:
    def __init__(self, name: str) -> None:
        self.name, self.peer = name, PEER[name]
        self.up = True
        self.store = Replicas(self.peer)  # on disk: survives a crash
        self.fence = Fence()  # on disk too: a restarted host still knows the highest epoch
        self.acting: int | None = None  # the epoch it coordinates at, in this life
        self.seq = 0
        self.obeyed: list[tuple[int, int, str]] = []  # (epoch, seq, coordinator) of each command obeyed


class World:
    """Origin ``o`` and hosts h2-h4, all replicas; ``group`` is each node's side of a partition."""

    def __init__(self) -> None:
        self.nodes = {n: Node(n) for n in ("o", "h2", "h3", "h4")}
        self.charter = charter()
        self.group = {n: 0 for n in self.nodes}
        self.partitioned = False
        self.acted: list[tuple[str, int, int]] = []  # (coordinator, epoch, seq) of every transition acted on
        origin = self.nodes["o"]
        origin.acting = 0
        self.write(origin)

    def reach(self, a: str, b: str) -> bool:
        return self.nodes[a].up and self.nodes[b].up and self.group[a] == self.group[b]

    def gone(self, me: str):
        """Membership as ``me`` will come to see it: whoever it cannot reach is dead."""
        return lambda peer: not self.reach(me, NAME[peer])

    def write(self, n: Node) -> bool:
        """Write-ahead: the next transition to every reachable replica; False if superseded."""
        n.seq += 1
        r = record(self.charter, n.acting, n.seq)
        ok = True
        for other in self.nodes.values():
            if self.reach(n.name, other.name) and other.store.offer(r) == "stale" and other.store.get(
                    self.charter.key).epoch > n.acting:
                ok = False
        return ok

    def transition(self, name: str) -> None:
        n = self.nodes[name]
        if not n.up or n.acting is None:
            return
        if not self.write(n):
            n.acting = None  # a replica holds a higher epoch: stand down
            return
        self.acted.append((name, n.acting, n.seq))
        for host in ("h2", "h3", "h4"):
            h = self.nodes[host]
            if not self.reach(name, host):
                continue
            if h.fence.admit(self.charter, n.peer, n.acting) is None:
                h.obeyed.append((n.acting, n.seq, name))
            else:
                n.acting = None  # the host saw a higher epoch: stand down at once
                return

    def tick(self, name: str) -> None:
        """``name`` looks at membership: the successor of a gone coordinator takes over."""
        n = self.nodes[name]
        if not n.up:
            return
        known = newest(o.store.get(self.charter.key) for o in self.nodes.values() if self.reach(name, o.name))
        epoch = known.epoch if known is not None else 0
        e = takeover(n.peer, self.charter, epoch, self.gone(name), acting=n.acting is not None)
        if e is None:
            return
        if not self.partitioned:  # no partition hid a transition: the successor has all the live hosts obeyed
            obeyed = [(ep, s) for h in self.nodes.values() if h.up for ep, s, _ in h.obeyed]
            assert known is not None and all((ep, s) <= known.version for ep, s in obeyed), \
                f"{name} would take over at {e} from {known and known.version}, hosts obeyed {max(obeyed, default=None)}"
        n.acting, n.seq = e, known.seq if known is not None else 0  # the record's state goes on
        self.write(n)
        self.transition(name)  # the announcement: every reachable host now fences at e

    def crash(self, name: str) -> None:
        n = self.nodes[name]
        n.up, n.acting = False, None

    def revive(self, name: str) -> None:
        self.nodes[name].up = True  # a new life: no role until it takes one over as a successor

    def split(self, side: frozenset[str]) -> None:
        self.group = {n: int(n in side) for n in self.nodes}
        self.partitioned = True

    def heal(self) -> None:
        self.group = {n: 0 for n in self.nodes}

    def check(self) -> None:
        for h in self.nodes.values():
            versions = [(e, s) for e, s, _ in h.obeyed]
            assert versions == sorted(versions), f"{h.name} obeyed an older command after a newer one: {versions}"
            by_epoch: dict[int, set[str]] = {}
            for e, _, who in h.obeyed:
                by_epoch.setdefault(e, set()).add(who)
            assert all(len(who) == 1 for who in by_epoch.values()), f"{h.name}: two coordinators at one epoch"
        acting = [(n.acting, n.name) for n in self.nodes.values() if n.acting is not None]
        assert len({e for e, _ in acting}) == len(acting), f"two nodes acting at one epoch: {acting}"


NAMES = ("o", "h2", "h3", "h4")
step = st.one_of(
    st.tuples(st.just("transition"), st.sampled_from(NAMES)),
    st.tuples(st.just("tick"), st.sampled_from(NAMES)),
    st.tuples(st.just("crash"), st.sampled_from(NAMES)),
    st.tuples(st.just("revive"), st.sampled_from(NAMES)),
    st.tuples(st.just("split"), st.frozensets(st.sampled_from(NAMES), min_size=1, max_size=3)),
    st.tuples(st.just("heal"), st.none()),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, max_size=40))
def test_any_schedule_of_crashes_and_partitions_keeps_one_coordinator_per_host_and_every_transition(schedule):
    w = World()
    for op, arg in schedule:
        if op == "split":
            w.split(arg)
        elif op == "heal":
            w.heal()
        else:
            getattr(w, op)(arg)
        w.check()
    # the network heals and everyone comes back: one coordinator again, obeyed by every host
    w.heal()
    for name in NAMES:
        w.revive(name)
    for _ in range(3):
        for name in NAMES:
            w.tick(name)
            w.transition(name)
        w.check()
    for name in NAMES:
        w.transition(name)
    w.check()
    latest = {h: w.nodes[h].fence.seen(w.charter.key) for h in ("h2", "h3", "h4")}
    assert len({s.epoch for s in latest.values() if s is not None}) == 1, latest
    acting = [n.name for n in w.nodes.values() if n.acting is not None]
    assert len(acting) == 1, f"after healing, coordinating: {acting}"
    epoch = w.nodes[acting[0]].acting
    assert all(s is not None and s.epoch == epoch for s in latest.values()), (latest, epoch)


def test_the_model_hands_over_after_the_origin_crashes():
    w = World()
    w.transition("o")
    w.crash("o")
    for name in NAMES:
        w.tick(name)
    assert w.nodes["h2"].acting == 1 and [n for n in NAMES if w.nodes[n].acting is not None] == ["h2"]
    w.revive("o")
    w.transition("h2")
    w.tick("o")
    assert w.nodes["o"].acting is None  # it learned epoch 1 and stays a front end
    assert all(w.nodes[h].fence.seen(w.charter.key).coordinator == PEER["h2"] for h in ("h2", "h3", "h4"))


def test_an_isolated_coordinator_is_refused_once_the_hosts_saw_the_successor():
    w = World()
    w.split(frozenset({"o"}))
    for name in NAMES:
        w.tick(name)
    assert w.nodes["h2"].acting == 1 and w.nodes["o"].acting == 0  # both think they coordinate
    w.heal()
    w.transition("o")  # its first command after the heal meets epoch 1
    assert w.nodes["o"].acting is None
    assert all(who == "h2" for h in ("h2", "h3", "h4") for _, _, who in w.nodes[h].obeyed)


# --- quorums (joint consensus over the replicas membership removes) -------------------------

def test_a_quorum_is_a_majority_of_every_configuration_the_write_spans():
    a, b, c, d = (PEER[n] for n in ("o", "h2", "h3", "h4"))
    everyone = (a, b, c, d)
    assert not sx.quorum(everyone, [set()], {a, b}) and sx.quorum(everyone, [set()], {a, b, c})
    # taking d out needs a majority of the four and of the three left
    assert sx.quorum(everyone, [set(), {d}], {a, b, c}) and not sx.quorum(everyone, [set(), {d}], {a, b})
    # once d is out, two of the three are enough, and the origin may go next (two one after another)
    assert sx.quorum(everyone, [{d}], {b, c}) and sx.quorum(everyone, [{d}, {a, d}], {b, c})
    assert not sx.quorum(everyone, [{a, b, c, d}], {a})  # an empty configuration never has a majority


@settings(max_examples=300, deadline=None)
@given(st.sets(st.sampled_from(range(5)), max_size=3), st.sets(st.sampled_from(range(5))),
       st.sets(st.sampled_from(range(5))), st.sets(st.sampled_from(range(5))), st.sets(st.sampled_from(range(5))))
def test_two_writes_that_each_met_a_quorum_share_a_replica(committed, more1, more2, acks1, acks2):
    """Whatever each coordinator removes on top of the committed configuration (a partition
    makes each see the other side gone), two writes that both met their quorum meet in a
    replica: the older epoch's coordinator finds the newer one there and stands down."""
    replicas = [PEER[n] for n in ("o", "h2", "h3", "h4", "h5")]
    pick = lambda ix: {replicas[i] for i in ix}  # noqa: E731
    base = pick(committed)
    first = sx.quorum(replicas, [base, base | pick(more1)], pick(acks1))
    second = sx.quorum(replicas, [base, base | pick(more2)], pick(acks2))
    if first and second:
        assert pick(acks1) & pick(acks2)
