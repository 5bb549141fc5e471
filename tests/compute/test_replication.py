"""A job's record on its replicas (replication.py): the store on disk survives whatever a
previous life left, the handler refuses what a misbehaving member sends (and says why),
and the coordinator's writer reaches every replica and gathers the newest record."""

from __future__ import annotations

import os
import time

import msgpack
import pytest
import trio
from libp2p.peer.id import ID

from swarmd.compute.coordinator import replication as rp
from swarmd.compute.succession import MAX_RECORD, Record
from swarmd.p2p.signed import seal
from swarmd.p2p.streams import PeerError

from .test_succession import JOB, PEER, charter, record, sign

CERT = b"a certificate"


def store(tmp_path, name: str) -> rp.Store:
    s = rp.Store(PEER[name], tmp_path / name / "replicas")
    s.load()
    return s


def handler(s: rp.Store) -> rp.Handler:
    async def member(req, peer, stream):
        return req.get("cert") == CERT

    return rp.Handler(s, check_member=member, reject=lambda reason, peer, detail: None)


# --- the store ----------------------------------------------------------------------------

def test_a_record_is_on_disk_and_read_back_by_the_next_life(tmp_path):
    s = store(tmp_path, "h2")
    r = record(charter(), 0, 3)
    assert s.put(r) is None
    again = store(tmp_path, "h2")
    assert again.get(r.charter.key) == r and again.removed == 0


def test_a_start_removes_whatever_is_not_a_record_to_keep(tmp_path):
    s = store(tmp_path, "h2")
    c = charter()
    good = record(c, 0, 1)
    s.put(good)
    d = s.dir
    (d / ".x.rec.123.tmp").write_bytes(b"half a write")  # a crash mid-write
    (d / "junk.rec").write_bytes(os.urandom(64))
    (d / "deep").mkdir()
    (d / "deep" / "a").mkdir()  # a directory, walked without recursion (trees.remove)
    (d / "link.rec").symlink_to("/etc/passwd")
    other = record(c, 0, 2)
    (d / rp.file_name((PEER["h3"], JOB))).write_bytes(other.blob)  # named for another job
    stale = rp.file_name((PEER["h4"], "0123456789ac"))
    (d / stale).write_bytes(b"x")
    old = time.time() - rp.RETENTION - 60
    os.utime(d / stale, (old, old))
    again = store(tmp_path, "h2")
    assert again.removed == 6 and sorted(os.listdir(d)) == [rp.file_name(c.key)]
    assert again.get(c.key) == good
    assert os.path.exists("/etc/passwd")


def test_a_record_not_rewritten_within_the_retention_is_let_go(tmp_path):
    s = store(tmp_path, "h2")
    r = record(charter(), 0, 1)
    s.put(r)
    again = rp.Store(PEER["h2"], s.dir)
    assert again.load(now=time.time() + rp.RETENTION + 60) == 0 and again.removed == 1


def test_a_refused_record_leaves_the_file_alone(tmp_path):
    s = store(tmp_path, "h2")
    c = charter()
    s.put(record(c, 1, 5))
    assert s.put(record(c, 0, 9)) == "stale"
    assert Record.open((s.dir / rp.file_name(c.key)).read_bytes()).version == (1, 5)
    assert store(tmp_path, "x").put(record(c, 0, 1)) == "not_replica"


# --- the handler: what a misbehaving member sends -----------------------------------------

async def ask(h: rp.Handler, req, peer: str = "h3"):
    return await h.answer(req, PEER[peer])


@pytest.mark.parametrize("req, reason", [
    ("not a map", "malformed"),
    ({"op": "delete"}, "malformed"),
    ({"op": "put"}, "malformed"),
    ({"op": "put", "record": b"junk"}, "malformed"),
    ({"op": "put", "record": "text"}, "malformed"),
    ({"op": "get", "origin": "nope", "job": JOB}, "malformed"),
    ({"op": "get", "origin": 5, "job": JOB}, "malformed"),
    ({"op": "get", "origin": PEER["o"], "job": "../etc"}, "malformed"),
])
async def test_malformed_requests_are_refused_and_counted(tmp_path, req, reason):
    h = handler(store(tmp_path, "h2"))
    assert (await ask(h, req))["reason"] == reason
    assert h.refused == {reason: 1}


async def test_a_record_signed_by_anyone_but_its_epochs_coordinator_is_refused(tmp_path):
    h = handler(store(tmp_path, "h2"))
    c = charter()
    forged = seal({"charter": c.blob, "epoch": 1, "seq": 1, "body": b"x"}, sign("h3"))  # h2's epoch, h3's key
    assert (await ask(h, {"op": "put", "record": forged}))["reason"] == "signature"
    assert h.store.get(c.key) is None


async def test_a_replica_cannot_change_the_jobs_charter_or_go_back(tmp_path):
    h = handler(store(tmp_path, "h2"))
    c = charter()
    assert await ask(h, {"op": "put", "record": record(c, 1, 2).blob}) == {}
    rewritten = charter(hosts=("h2", "h3", "x"))  # same job, other replicas: the origin's key is not h3's
    assert (await ask(h, {"op": "put", "record": record(rewritten, 0, 9).blob}))["reason"] == "charter_changed"
    assert (await ask(h, {"op": "put", "record": record(c, 0, 9).blob}))["reason"] == "stale"
    assert h.store.get(c.key).version == (1, 2)


async def test_only_a_replica_of_the_job_may_read_its_record(tmp_path):
    h = handler(store(tmp_path, "h2"))
    c = charter()
    r = record(c, 0, 1)
    await ask(h, {"op": "put", "record": r.blob}, "o")
    got = await ask(h, {"op": "get", "origin": PEER["o"], "job": JOB}, "h3")
    assert got == {"record": r.blob}
    assert (await ask(h, {"op": "get", "origin": PEER["o"], "job": JOB}, "x"))["reason"] == "not_replica"
    assert await ask(h, {"op": "get", "origin": PEER["o"], "job": "0123456789ac"}, "x") == {"record": None}


# --- the writer, over an in-memory network -------------------------------------------------

class Net:
    """Requests delivered to each replica's handler; ``down`` ones are unreachable, ``slow``
    ones never answer."""

    def __init__(self, handlers: dict[str, rp.Handler]) -> None:
        self.handlers = handlers
        self.down: set[str] = set()
        self.slow: set[str] = set()

    def request_from(self, me: str):
        async def request(peer: ID, protocol: str, obj, limit: int):
            assert protocol == rp.PROTOCOL and len(msgpack.packb(obj)) <= limit
            name = next(n for n, p in PEER.items() if p == str(peer))
            if name in self.down:
                raise PeerError("cannot open")
            if name in self.slow:
                await trio.sleep_forever()
            return await self.handlers[name].answer(obj, PEER[me])
        return request


def swarm(tmp_path, names=("o", "h2", "h3", "h4")):
    stores = {n: store(tmp_path, n) for n in names}
    net = Net({n: handler(s) for n, s in stores.items()})
    writers = {n: rp.Writer(stores[n], me=PEER[n], sign=sign(n), request=net.request_from(n), cert=lambda: CERT)
               for n in names}
    return stores, net, writers


async def test_a_write_reaches_every_replica_and_says_which_did_not_take_it(tmp_path, autojump_clock):
    stores, net, writers = swarm(tmp_path)
    net.down.add("h3")
    net.slow.add("h4")
    c = charter()
    r = writers["o"].record(c, 0, 1, {"state": "running"})
    out = await writers["o"].write(r)
    assert out == {PEER["o"]: None, PEER["h2"]: None, PEER["h3"]: "unreachable", PEER["h4"]: "timeout"}
    assert stores["h2"].get(c.key) == r and stores["h3"].get(c.key) is None
    assert msgpack.unpackb(stores["h2"].get(c.key).body) == {"state": "running"}


async def test_a_successor_gathers_the_newest_record_any_replica_holds(tmp_path, autojump_clock):
    stores, net, writers = swarm(tmp_path)
    c = charter()
    await writers["o"].write(writers["o"].record(c, 0, 1, {}))
    net.down.add("h2")
    await writers["o"].write(writers["o"].record(c, 0, 2, {}))  # h2 missed it
    net.down = {"o"}
    got = await writers["h2"].gather(c.key, c.replicas)
    assert got is not None and got.version == (0, 2)
    net.down = {"o", "h3", "h4"}
    assert (await writers["h2"].gather(c.key, c.replicas)).version == (0, 1)  # its own, all it can reach


async def test_a_superseded_coordinator_learns_it_from_the_replicas(tmp_path, autojump_clock):
    stores, net, writers = swarm(tmp_path)
    c = charter()
    await writers["h2"].write(writers["h2"].record(c, 1, 1, {}))
    out = await writers["o"].write(writers["o"].record(c, 0, 7, {}))
    assert set(out.values()) == {"stale"}


async def test_a_reply_that_is_not_a_record_of_the_job_is_not_taken(tmp_path, autojump_clock):
    stores, net, writers = swarm(tmp_path)
    c = charter()

    class Liar:
        async def answer(self, req, peer):
            return {"record": record(charter(hosts=("h2", "x")), 0, 99).blob}

    net.handlers["h3"] = Liar()
    await writers["o"].write(writers["o"].record(c, 0, 1, {}))
    got = await writers["h2"].gather(c.key, c.replicas)
    assert got.version == (0, 1)


def test_a_record_as_large_as_allowed_fits_a_frame():
    r = record(charter(), 0, 1, body=b"x" * MAX_RECORD)
    assert len(r.blob) < rp.MAX_FRAME


# --- the handler's stream: one request, one answer, whatever comes ---------------------------

async def test_a_stream_gets_one_answer_and_an_outsider_none(tmp_path):
    from tests.fake_stream import FakeStream
    h = handler(store(tmp_path, "h2"))
    r = record(charter(), 0, 1)
    s = FakeStream(PEER["o"], [{"cert": CERT, "op": "put", "record": r.blob}])
    await h.handle(s)
    assert s.replies() == [{}] and h.store.get(r.charter.key) == r
    outsider = FakeStream(PEER["x"], [{"cert": b"forged", "op": "get", "origin": PEER["o"], "job": JOB}])
    await h.handle(outsider)
    assert outsider.replies() == []  # the gate answers outsiders (and counts them), not the handler


async def test_an_oversize_frame_or_a_silent_peer_costs_a_count_and_nothing_else(tmp_path, autojump_clock):
    from swarmd.rpc.framing import HEADER
    from tests.fake_stream import FakeStream
    h = handler(store(tmp_path, "h2"))
    await h.handle(FakeStream(PEER["o"], [], raw=HEADER.pack(rp.MAX_FRAME + 1)))
    assert h.refused == {"too_large": 1}
    silent = FakeStream(PEER["o"], [], hang=True)
    with trio.move_on_after(rp.TIMEOUT + 1) as waited:
        await h.handle(silent)
    assert not waited.cancelled_caught and silent.replies() == []


def test_a_full_store_makes_room_with_the_oldest_ended_job_of_that_origin(tmp_path):
    import msgpack as mp
    from swarmd.compute.succession import Charter

    s = rp.Store(PEER["h2"], tmp_path / "replicas")
    s.held.max_per_origin = 2
    s.load()

    def job(j: str, state: str, origin: str = "o") -> Record:
        c = Charter.make(origin=PEER[origin], job=j, owner_uid=1, spec="ab" * 32, hosts=[PEER["h2"]],
                         sign=sign(origin))
        return record(c, 0, 1, body=mp.packb({"run": {"state": state}}))

    running, done = job("0123456789ab", "running"), job("0123456789ac", "succeeded")
    assert s.put(running) is None and s.put(done) is None
    later = job("0123456789ad", "running")
    assert s.put(later) is None  # the ended job went
    assert s.get(done.charter.key) is None and not (s.dir / rp.file_name(done.charter.key)).exists()
    assert s.get(running.charter.key) == running and s.get(later.charter.key) == later
    assert s.put(job("0123456789ae", "running")) == "full"  # only running jobs left: nothing is evicted


def test_puts_from_many_threads_at_once_keep_one_consistent_store(tmp_path):
    # the replica's answers and the coordinator's own writes both put from worker threads
    import threading

    s = rp.Store(PEER["h2"], tmp_path / "replicas")
    s.held.max_per_origin = 4
    s.load()
    from swarmd.compute.succession import Charter

    made = [Charter.make(origin=PEER["o"], job=f"0123456789{a}{b}", owner_uid=1, spec="ab" * 32, hosts=[PEER["h2"]],
                         sign=sign("o")) for a in "ab" for b in "cdef"]
    results: list = []
    threads = [threading.Thread(target=lambda c=c: results.append(s.put(record(c, 0, 1)))) for c in made]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results, key=str) == [None] * 4 + ["full"] * 4
    assert len(s.held) == 4 and len(os.listdir(s.dir)) == 4
