"""What a host accepts as a node's role from a peer: the coordinator's own role round-trips,
and numbers out of range or addresses that are not IPs are refused naming the field."""

from __future__ import annotations

import pytest

from swarmd.compute.messages import role_from_wire, role_to_wire
from swarmd.compute.torchenv import NodeRole

ROLE = NodeRole(job_id="0123456789ab", node_rank=1, nnodes=2, procs_per_node=2, master_addr="10.211.0.1",
                master_port=29500, ifname=None, gpus=(), node_ips=("10.211.0.1", "10.211.0.2"), checkpoint_dir="")


def test_the_coordinators_role_round_trips():
    assert role_from_wire(role_to_wire(ROLE)) == ROLE


@pytest.mark.parametrize("change, field", [
    ({"procs_per_node": 100_000}, "role.procs_per_node"),
    ({"procs_per_node": True}, "role.procs_per_node"),
    ({"node_rank": 2}, "role.node_rank"),
    ({"nnodes": 0}, "role.nnodes"),
    ({"master_port": 70000}, "role.master_port"),
    ({"master_addr": "rank0.example; rm -rf /"}, "role.master_addr"),
    ({"node_ips": ["10.211.0.1"]}, "role.node_ips"),
    ({"node_ips": ["10.211.0.1", "nope"]}, "role.node_ips"),
    ({"node_ips": ["10.211.0.1", "fe80::1%eth0"]}, "role.node_ips"),
    ({"master_addr": "2600::1%lo"}, "role.master_addr"),
    ({"job_id": ""}, "role.job_id"),
    ({"job_id": "../x"}, "role.job_id"),
])
def test_a_peers_role_out_of_range_is_refused(change, field):
    with pytest.raises(ValueError, match=field):
        role_from_wire(role_to_wire(ROLE) | change)


# --- the handler, driven in-process ------------------------------------------------------

import functools  # noqa: E402
import tempfile  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import msgpack  # noqa: E402
import trio  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from swarmd.compute.coordinator import hosts
from swarmd.compute.host import service  # noqa: E402
from swarmd.compute.ids import host_dir, is_host_dir  # noqa: E402
from swarmd.compute.ledger import Ledger  # noqa: E402
from swarmd.compute.host.service import JobHandler  # noqa: E402
from swarmd.compute.host.worker import Worker  # noqa: E402
from swarmd.compute.workdir import Cache, pack  # noqa: E402
from fake_stream import FakeStream  # noqa: E402
from swarmd.rpc.framing import HEADER, encode_frame  # noqa: E402

JOB = "0123456789ab"


class Host:
    """A JobHandler over a real Worker in a temporary directory; every peer is a member."""

    def __init__(self, root: Path, slots: int = 2) -> None:
        self.jobs_dir = root / "jobs"
        self.jobs_dir.mkdir()
        self.worker = Worker(ledger=Ledger(slots), cache=Cache(root / "cache"), jobs_dir=self.jobs_dir, user=None)
        self.rejected: Counter[str] = Counter()
        self.member_checks = 0

        async def check_member(req, peer, stream) -> bool:
            self.member_checks += 1
            return True

        self.handler = JobHandler(self.worker, check_member=check_member, submitters=(),
                                  rejected=lambda reason, peer, detail: self.rejected.update([reason]))

    async def ask(self, peer: str, *frames, **kw) -> list:
        stream = FakeStream(peer, list(frames), **kw)
        await self.handler.handle(stream)
        return stream.replies()


def req(op: str, job: str = JOB, **fields) -> dict:
    return {"op": op, "job": job, "cert": b"member", **fields}


def start_body(procs: int = 1, job: str = JOB) -> dict:
    role = role_to_wire(NodeRole(job_id=job, node_rank=0, nnodes=1, procs_per_node=procs,
                                 master_addr="10.211.0.1", master_port=29500, ifname=None, gpus=(),
                                 node_ips=("10.211.0.1",), checkpoint_dir=""))
    return {"role": role, "cmd": ["true"], "env": {}, "python": None, "workdir": None}


@pytest.mark.parametrize("job", [
    "/var/lib/swarmd", "../x", "/tmp/x", ".", "..", "", "0" * 13, "0" * 5000,
    "０１２３４５６７８９ab", "0123456789aI", "0123456789aß", "0123456789a\u0301", "0123456789ab\n",
    "0123456789a/", 12, None, b"0123456789ab",
])
@pytest.mark.parametrize("op", ["reserve", "commit", "release", "cancel", "start", "workdir"])
async def test_a_job_id_that_is_not_the_coordinators_format_is_refused_at_the_boundary(tmp_path, op, job):
    host = Host(tmp_path)
    replies = await host.ask("peerA", req(op, job, gpus=0, ranks=1, lease=30.0), start_body())
    assert len(replies) == 1 and "must be a job id" in replies[0]["error"]
    assert host.rejected == {"job_id": 1}
    assert list(host.jobs_dir.iterdir()) == [] and host.worker.ledger.slots_free == 2


async def test_start_needs_a_commit_by_the_same_coordinator_and_at_most_the_ranks_reserved(tmp_path):
    host = Host(tmp_path)
    assert await host.ask("coord", req("reserve", gpus=0, ranks=1, lease=30.0)) == [{"gpus": []}]
    assert "never committed" in (await host.ask("coord", req("start"), start_body()))[0]["error"]
    assert (await host.ask("coord", req("commit"))) == [{"gpus": []}]
    for peer, body, reason in [("intruder", start_body(), "not_holder"), ("coord", start_body(procs=2), "ranks")]:
        before = host.rejected[reason]
        assert "error" in (await host.ask(peer, req("start"), body))[0]
        assert host.rejected[reason] == before + 1
    for op in ("cancel", "release"):
        assert "another coordinator" in (await host.ask("intruder", req(op)))[0]["error"]
    assert host.rejected["not_holder"] == 3 and host.worker.ledger.state_of(JOB, "coord") == "committed"
    assert (await host.ask("coord", req("release"))) == [{}] and host.worker.ledger.slots_free == 2
    assert list(host.jobs_dir.iterdir()) == [], "nothing was prepared for a refused start"


async def run_job(host: Host, peer: str) -> list:
    assert await host.ask(peer, req("reserve", gpus=0, ranks=1, lease=30.0)) == [{"gpus": []}]
    assert await host.ask(peer, req("commit")) == [{"gpus": []}]
    return await host.ask(peer, req("start"), start_body())


async def test_a_member_replaying_a_finished_jobs_id_gets_its_own_directory(tmp_path):
    """Finding 8 A: a member that learned coordinator C's job id (it was one of its hosts)
    reserves, commits and starts that id on a host after the job ended there: C's
    directory, output log and checkpoints stay as they were."""
    host = Host(tmp_path)
    await run_job(host, "coord")  # as root with no job user its ranks are refused, its directory made
    theirs = host.jobs_dir / host_dir(JOB, "coord")
    (theirs / "checkpoints" / "step-100").write_text("weights")
    log = (theirs / "output.log").read_bytes() if (theirs / "output.log").exists() else None
    await run_job(host, "mallory")
    assert (theirs / "checkpoints" / "step-100").read_text() == "weights", "C's checkpoints are untouched"
    assert ((theirs / "output.log").read_bytes() if (theirs / "output.log").exists() else None) == log
    assert sorted(p.name for p in host.jobs_dir.iterdir()) == sorted([host_dir(JOB, "coord"),
                                                                       host_dir(JOB, "mallory")])


async def test_a_member_holding_a_coordinators_id_does_not_block_its_reservation(tmp_path):
    """Finding 8 B: a member reserves C's job id first on a host; C still reserves it."""
    host = Host(tmp_path)
    assert await host.ask("mallory", req("reserve", gpus=0, ranks=1, lease=30.0)) == [{"gpus": []}]
    assert await host.ask("coord", req("reserve", gpus=0, ranks=1, lease=30.0)) == [{"gpus": []}]
    assert "never committed" in (await host.ask("mallory", req("start"), start_body()))[0]["error"]
    assert host.worker.ledger.state_of(JOB, "coord") == "leased"


async def test_a_reservation_must_say_how_many_ranks(tmp_path):
    host = Host(tmp_path)
    for ranks in (None, 0, 257, -1, "1"):
        fields = {"gpus": 0, "lease": 30.0} | ({} if ranks is None else {"ranks": ranks})
        assert "ranks" in (await host.ask("coord", req("reserve", **fields)))[0]["error"]
    assert host.rejected == {"malformed": 5} and host.worker.ledger.slots_free == 2


async def test_a_large_first_frame_is_refused_before_the_certificate_is_looked_at(tmp_path):
    host = Host(tmp_path)
    big = req("reserve", gpus=0, ranks=1, lease=30.0, pad=b"x" * (65 * 1024))
    assert await host.ask("coord", big) == []
    assert host.rejected == {"too_large": 1} and host.member_checks == 0
    # a length header alone announcing 16 MiB: nothing more is read
    assert await host.ask("coord", raw=HEADER.pack(16 * 1024 * 1024)) == []
    assert host.rejected == {"too_large": 2} and host.member_checks == 0


async def test_streams_beyond_a_members_cap_are_refused_at_once_and_counted(tmp_path):
    host = Host(tmp_path)
    cap = host.handler.streams.per_peer
    host.handler.streams.open["greedy"] = cap
    replies = await host.ask("greedy", req("reserve", gpus=0, ranks=1, lease=30.0))
    assert "already open" in replies[0]["error"] and host.rejected == {"too_many_streams": 1}
    assert host.handler.streams.open["greedy"] == cap and host.worker.ledger.slots_free == 2
    assert (await host.ask("other", req("reserve", gpus=0, ranks=1, lease=30.0))) == [{"gpus": []}]
    assert "other" not in host.handler.streams.open, "a stream that ended is no longer counted"


async def test_outsiders_cannot_use_up_the_members_stream_budget(tmp_path, autojump_clock):
    """Finding 6: outsiders (fresh peer ids, no certificate) open streams and send nothing,
    or a first frame the check refuses: none counts against the members' budget, each peer
    holds at most MAX_UNCHECKED_PER_PEER unchecked streams for FIRST_FRAME_TIMEOUT, and a
    member is served meanwhile."""
    host = Host(tmp_path)
    members = {"coord"}

    async def check_member(req, peer, stream) -> bool:
        return peer in members

    host.handler.check_member = check_member
    outsiders = [f"outsider{i}" for i in range(service.MAX_STREAMS)]
    got: dict[str, list] = {}
    async with trio.open_nursery() as nursery:
        for peer in outsiders:  # one silent stream each: as many as the members' whole budget
            nursery.start_soon(functools.partial(host.ask, peer, hang=True))
        for i in range(service.MAX_UNCHECKED_PER_PEER + 2):  # one outsider, many silent streams
            async def silent(i: int = i) -> None:
                got[f"s{i}"] = await host.ask("hoarder", hang=True)
            nursery.start_soon(silent)
        await trio.sleep(0.5)
        assert host.handler.streams.open == {}, "nothing unchecked counts against the members' budget"
        assert host.handler.unchecked.open["hoarder"] == service.MAX_UNCHECKED_PER_PEER
        began = trio.current_time()
        assert await host.ask("coord", req("reserve", gpus=0, ranks=1, lease=30.0)) == [{"gpus": []}]
        assert trio.current_time() == began, "the member was served at once"
    assert sum(1 for r in got.values() if r and "already open" in r[0]["error"]) == 2
    assert host.rejected["too_many_streams"] == 2
    assert host.rejected["timeout"] == service.MAX_UNCHECKED_PER_PEER + len(outsiders)
    assert host.handler.unchecked.open == {} and host.handler.streams.open == {}


async def reserved(host: Host, peer: str, job: str = JOB) -> None:
    assert await host.ask(peer, req("reserve", job, gpus=0, ranks=1, lease=300.0)) == [{"gpus": []}]


async def test_a_workdir_upload_that_stalls_is_given_up_after_the_chunk_timeout(tmp_path, autojump_clock):
    host = Host(tmp_path)
    await reserved(host, "coord")
    digest = "a" * 64
    started = trio.current_time()
    replies = await host.ask("coord", req("workdir", digest=digest, size=1000), {"data": b"x" * 10}, hang=True)
    assert replies == [{"have": False}, {"error": f"workdir: no workdir chunk for {service.CHUNK_TIMEOUT:g} s"}]
    assert host.rejected == {"timeout": 1} and trio.current_time() - started == pytest.approx(service.CHUNK_TIMEOUT)
    assert host.handler._uploading == {}, "the next upload of that tree may go ahead"
    assert [p.name for p in host.worker.cache.root.iterdir()] == [], "the spooled part is gone"


async def test_a_second_upload_of_the_same_tree_waits_for_the_first(tmp_path, autojump_clock):
    host = Host(tmp_path, slots=4)
    await reserved(host, "a")
    await reserved(host, "b")
    digest = "b" * 64
    got: dict[str, list] = {}
    async with trio.open_nursery() as nursery:
        async def first() -> None:
            got["first"] = await host.ask("a", req("workdir", digest=digest, size=1000), hang=True)

        nursery.start_soon(first)
        await trio.sleep(1)
        began = trio.current_time()
        got["other"] = await host.ask("b", req("workdir", digest=digest, size=1000))
        assert trio.current_time() == began, "another coordinator's upload of that digest holds nobody up"
        got["second"] = await host.ask("a", req("workdir", digest=digest, size=1000), hang=True)
    assert got["first"][0] == {"have": False} and "no workdir chunk" in got["first"][1]["error"]
    assert got["second"][0] == {"have": False}, "the first failed: the second uploads itself"


async def test_a_workdir_upload_needs_a_reservation_and_a_peer_uploads_two_at_once(tmp_path, autojump_clock):
    """Finding 7: a member sends workdirs for random digests without a reservation, or many
    at once: refused and counted, nothing spooled; a coordinator's honest upload (after
    reserving) arrives through a file on disk and its tree is kept for the reservation
    while others are uploaded."""
    host = Host(tmp_path, slots=4)
    for digest in ("1" * 64, "2" * 64):
        replies = await host.ask("mallory", req("workdir", digest=digest, size=64 * 1024 * 1024),
                                 {"data": b"x" * 1024})
        assert "holds no reservation" in replies[0]["error"]
    assert host.rejected == {"no_reservation": 2} and list(host.worker.cache.root.iterdir()) == []
    await reserved(host, "mallory")
    got: dict[int, list] = {}
    async with trio.open_nursery() as nursery:
        for i in range(service.MAX_UPLOADS_PER_PEER + 1):
            async def upload(i: int = i) -> None:
                got[i] = await host.ask("mallory", req("workdir", digest=f"{i}" * 64, size=1000), hang=True)
            nursery.start_soon(upload)
        await trio.sleep(1)
        spooled = [p for p in host.worker.cache.root.iterdir()]
        assert len(spooled) == service.MAX_UPLOADS_PER_PEER, "each upload under way is a file on disk"
    assert sum("already under way" in r[0].get("error", "") for r in got.values()) == 1
    assert host.rejected["too_many_uploads"] == 1

    # the honest coordinator: reserve, ship, and its tree outlives a flood of other trees
    host.worker.cache.keep = 1
    src = tmp_path / "src"
    src.mkdir()
    (src / "job.py").write_text("print('hi')\n")
    packed = pack(src)
    await reserved(host, "coord")
    chunks = [{"data": packed.data[i:i + 100]} for i in range(0, len(packed.data), 100)]
    assert await host.ask("coord", req("workdir", digest=packed.digest, size=len(packed.data)), *chunks,
                          {"end": True}) == [{"have": False}, {}]
    for i in range(3):
        other = tmp_path / f"other{i}"
        other.mkdir()
        (other / "f").write_text(str(i))
        p = pack(other)
        await trio.to_thread.run_sync(host.worker.cache.put, p.digest, p.data)
    assert host.worker.cache.has(packed.digest), "the reservation's tree is not evicted"
    assert await host.ask("coord", req("workdir", digest=packed.digest, size=len(packed.data))) == [{"have": True}]
    assert await host.ask("coord", req("release")) == [{}]
    assert host.worker.pins == {}, "released, the tree may go"


async def test_a_workdir_too_deep_to_walk_is_refused_and_the_next_start_comes_up(tmp_path):
    """Issue 23, finding 1: one reserve and 23 KB of workdir 1,200 directories deep made
    os.walk and rmtree raise RecursionError, left the half-unpacked tree, and the daemon's
    next start (Cache(), compute/service.py) died removing it. Refused before anything is
    made; the hold goes on; the next start comes up."""
    import hashlib

    import deep_trees

    try:
        host = Host(tmp_path)
        await reserved(host, "mallory")
        data = deep_trees.deep_archive()
        digest = hashlib.sha256(data).hexdigest()
        replies = await host.ask("mallory", req("workdir", digest=digest, size=len(data)), {"data": data},
                                 {"end": True})
        assert replies[0] == {"have": False}
        assert "names deep: at most 64 are accepted" in replies[1]["error"], replies
        assert host.rejected["workdir"] == 1, "counted, as every refusal of a member's input"
        assert list(host.worker.cache.root.iterdir()) == [], "nothing half-unpacked is left"
        Cache(tmp_path / "cache")  # the daemon's next start
        assert host.worker.ledger.state_of(JOB, "mallory") == "leased"
        assert await host.ask("mallory", req("release")) == [{}]
    finally:
        deep_trees.remove(tmp_path)  # pytest's own removal would recurse into what the old code left


# --- the fuzz: any one message, any field -------------------------------------------------

IDS = ["0123456789ab", "0123456789ac"]
junk = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                 st.text(max_size=20), st.binary(max_size=20), st.lists(st.integers(-9, 9), max_size=3),
                 st.dictionaries(st.text(max_size=5), st.integers(-9, 9), max_size=3))
jobs = st.one_of(st.sampled_from(IDS), st.sampled_from(["/var/lib/swarmd", "../x", ".", "０１２３４５６７８９ab"]), junk)
roles = st.one_of(junk, st.builds(lambda job, procs, rank, nnodes, port, ip: {
    "job_id": job, "node_rank": rank, "nnodes": nnodes, "procs_per_node": procs, "master_addr": ip,
    "master_port": port, "node_ips": [ip] * (nnodes if isinstance(nnodes, int) and 0 < nnodes < 4 else 1),
    "restart_count": 0}, jobs, st.one_of(st.integers(-1, 300), junk), st.integers(-1, 2), st.integers(-1, 3),
    st.integers(-1, 70000), st.sampled_from(["10.211.0.1", "::1", "nope", ""])))
bodies = st.fixed_dictionaries({}, optional={
    "role": roles, "cmd": st.one_of(st.just(["true"]), st.just([]), junk),
    "env": st.one_of(st.just({}), st.just({"A=B": "x"}), st.just({"A": "\0"}), junk),
    "python": st.one_of(st.none(), st.just("python3"), junk), "workdir": st.one_of(st.just("c" * 64), junk)})
requests = st.fixed_dictionaries(
    {"op": st.one_of(st.sampled_from(["reserve", "commit", "release", "cancel", "workdir", "start"]), junk),
     "job": jobs, "cert": st.just(b"member")},
    optional={"gpus": st.one_of(st.integers(-1, 3), junk), "ranks": st.one_of(st.integers(-1, 300), junk),
              "lease": st.one_of(st.floats(-1, 400), junk), "port": junk, "digest": st.one_of(st.just("d" * 64), junk),
              "size": st.one_of(st.integers(-1, 2**27), junk)})
messages = st.tuples(st.sampled_from(["coordA", "coordB"]), requests,
                     st.lists(st.one_of(bodies, st.fixed_dictionaries({"data": st.binary(max_size=64)}),
                                        st.just({"end": True}), junk), max_size=3))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(messages, min_size=1, max_size=8))
def test_no_message_escapes_the_handler_and_no_count_goes_negative(sequence):
    with tempfile.TemporaryDirectory() as tmp:
        host = Host(Path(tmp))

        async def main() -> None:
            for peer, first, more in sequence:
                with trio.fail_after(60):
                    await host.ask(peer, first, *more)
                assert all(n >= 0 for n in host.rejected.values())
                assert all(n > 0 for n in host.handler.streams.open.values())
                assert 0 <= host.worker.ledger.slots_free <= host.worker.ledger.slots
            assert host.handler.streams.open == host.handler.unchecked.open == host.handler._uploading == {}
            assert host.worker.running == {}
            assert all(p.name[:12] in IDS and is_host_dir(p.name) for p in host.jobs_dir.iterdir()), \
                "only job ids, bound to a coordinator, name a directory"

        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# --- the coordinator's side: what it takes from a host -------------------------------------

from swarmd.compute.events import checked_event  # noqa: E402
from swarmd.compute import output  # noqa: E402
from swarmd.compute.output import MAX_BATCH_LINES  # noqa: E402
from swarmd.compute.coordinator.hosts import HostError, RemoteHost  # noqa: E402
from swarmd.compute.coordinator.store import JobStore  # noqa: E402

HOST_RANKS = range(2, 4)  # node 1 of a job with two ranks a node


@pytest.mark.parametrize("event, why", [
    ({"started": list(range(860_000))}, "'started' must list"),
    ({"started": [0, 1]}, "not one of this host's 2-3"),
    ({"started": [2, 2]}, "names a rank twice"),
    ({"exit": [[0, 0]], "first": None}, "not one of this host's"),
    ({"exit": [[2, 0], [3, 0]], "first": [7, 1]}, "'first' names rank 7"),
    ({"exit": [[2, "0"]]}, "'exit' must be an integer"),
    ({"out": [[2, ""]] * (MAX_BATCH_LINES + 1)}, "at most 4096 pairs"),
    ({"out": [[2, b"bytes"]]}, "lines must be strings"),
    ({"out": [[9, "x"]]}, "not one of this host's"),
    ({"dropped": [[2, -1]]}, "'dropped' must be an integer"),
    ("nope", "must be a map"),
    ({"sandbox": "x" * 201}, "'sandbox' must be printable text"),
    ({"sandbox": "uid\x1b[2J"}, "'sandbox' must be printable text"),
    ({"usage": {"peak_memory": -1}}, "'usage.peak_memory' must be an integer"),
    ({"usage": {"cpu_seconds": float("nan")}}, "'usage.cpu_seconds' must be a number"),
    ({"usage": {"peak_memory": 1, "extra": 2}}, "'usage' must be a map"),
    ({"oom": {"ranks": [0], "limit": 1}}, "not one of this host's"),
    ({"oom": {"ranks": [2, 2, 3]}}, "'oom' must be a map"),
    ({"oom": {"ranks": [2], "limit": 0}}, "'oom.limit' must be an integer"),
    ({"ckpt": ["e.pt", "a" * 64]}, "'ckpt' must be \\[name, sha256, size\\]"),
    ({"ckpt": "e.pt"}, "'ckpt' must be \\[name, sha256, size\\]"),
    ({"ckpt": ["../../etc/passwd", "a" * 64, 1]}, "'ckpt.name' must be 1-128"),
    ({"ckpt": [".e.pt.tmp", "a" * 64, 1]}, "'ckpt.name' must be 1-128"),
    ({"ckpt": ["e.pt", "A" * 64, 1]}, "'ckpt.sha256' must be 64 lowercase hex"),
    ({"ckpt": ["e.pt", "a" * 64, 2**50 + 1]}, "'ckpt.size' must be an integer"),
    ({"ckpt": ["e.pt", "a" * 64, True]}, "'ckpt.size' must be an integer"),
])
def test_a_host_speaks_only_for_its_own_ranks_in_bounded_batches(event, why):
    """Finding 4: a host's events naming other hosts' ranks, a huge 'started', a million
    empty lines, lines that are not strings: each refused, saying what."""
    with pytest.raises(ValueError, match=why):
        checked_event(event, HOST_RANKS, started=False)


def test_an_honest_hosts_events_pass_and_started_counts_once():
    assert checked_event({"started": [3, 2]}, HOST_RANKS, started=False) == {"started": [2, 3]}
    with pytest.raises(ValueError, match="came twice"):
        checked_event({"started": [2, 3]}, HOST_RANKS, started=True)
    assert checked_event({"out": [[2, "a"], [3, ""]]}, HOST_RANKS, started=True) == {"out": [(2, "a"), (3, "")]}
    assert checked_event({"exit": [(2, 0), (3, -9)], "first": [3, -9]}, HOST_RANKS, started=True) == \
        {"exit": {2: 0, 3: -9}, "first": (3, -9)}


def test_an_honest_hosts_account_of_the_job_passes():
    event = {"exit": [(2, 137), (3, 143)], "first": [2, 137], "sandbox": "uid, cgroup, namespaces, firewall",
             "usage": {"peak_memory": 300 << 20, "cpu_seconds": 1.5}, "oom": {"ranks": [2], "limit": 256 << 20}}
    got = checked_event(event, HOST_RANKS, started=True)
    assert got["usage"] == {"peak_memory": 300 << 20, "cpu_seconds": 1.5}
    assert got["oom"] == {"ranks": [2], "limit": 256 << 20} and got["sandbox"] == event["sandbox"]


@pytest.mark.parametrize("limits, why", [
    ({"cpus": -1}, "'limits.cpus'"), ({"cpus": True}, "'limits.cpus'"), ({"cpus": 1e9}, "'limits.cpus'"),
    ({"mem_mb": 1.5}, "'limits.mem_mb'"), ({"mem_mb": -5}, "'limits.mem_mb'"), ({"mem_mb": 2**62}, "'limits.mem_mb'"),
    ({"disk": 1}, "'limits' must be a map"), ("4G", "'limits' must be a map"),
])
def test_a_peers_limits_out_of_range_are_refused(limits, why):
    from swarmd.compute.messages import limits_from_wire

    with pytest.raises(ValueError, match=why):
        limits_from_wire(limits)
    assert limits_from_wire({"cpus": 2, "mem_mb": 4096}) == {"cpus": 2.0, "mem_mb": 4096} and limits_from_wire(None) == {}


def test_a_batch_of_lines_is_one_append(tmp_path, monkeypatch):
    store = JobStore(tmp_path)
    writes = []
    real = output.append
    monkeypatch.setattr(output, "append", lambda *a, **k: writes.append(1) or real(*a, **k))
    store.append_logs("0123456789ab", [(2, b"")] * MAX_BATCH_LINES)
    assert len(writes) == 1
    lines, _ = store.read_log("0123456789ab")
    assert len(lines) == MAX_BATCH_LINES and lines[0] == (2, "")


class _FakeHost:
    """An IHost whose every new stream is `stream`."""

    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream

    async def new_stream(self, peer, protocols):
        return self.stream


PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


async def test_a_host_gone_silent_fails_its_node_naming_it(autojump_clock):
    """Finding 4: a host that started and then says nothing (no heartbeat) is lost after
    EVENT_TIMEOUT, not left running forever; one that never starts, after FIRST_EVENT_TIMEOUT."""
    req_ = service.StartRequest(job=JOB, coordinator="me", role=NodeRole(
        job_id=JOB, node_rank=0, nnodes=1, procs_per_node=1, master_addr="10.211.0.1", master_port=29500,
        ifname=None, gpus=(), node_ips=("10.211.0.1",), checkpoint_dir=""), cmd=("true",), env={},
        python=None, workdir=None)
    for frames, patience in (([{"started": [0]}], hosts.EVENT_TIMEOUT), ([], hosts.FIRST_EVENT_TIMEOUT)):
        events: list = []

        async def emit(event) -> None:
            events.append(event)

        remote = RemoteHost(PEER, _FakeHost(FakeStream("x", frames, hang=True)), b"cert")
        began = trio.current_time()
        with pytest.raises(HostError, match=f"{PEER[-8:]}: silent for {patience:g} s"):
            await remote.start(req_, emit)
        assert events == frames and trio.current_time() - began == pytest.approx(patience)


async def test_a_ship_the_host_never_answers_gives_up(tmp_path, autojump_clock):
    archive = tmp_path / "w.tar.gz"
    archive.write_bytes(b"x" * 10)
    remote = RemoteHost(PEER, _FakeHost(FakeStream("x", [{"have": False}], hang=True)), b"cert")
    with pytest.raises(HostError, match="not taken within"):
        await remote.ship(JOB, "a" * 64, archive, lambda n: None)


async def test_the_checkpoint_replicator_outlives_any_hosts_misbehaviour(tmp_path):
    """Reviewer's #1 and #6: a host whose answer to ckpt_get is an oversized frame (or anything
    else) costs that copy, never the daemon; only rank 0's host's checkpoints count; one
    over checkpoint_max is ignored."""
    from swarmd.compute.coordinator.hub import Hub
    from swarmd.compute.ledger import Ledger
    from swarmd.compute.coordinator.run import Run
    from swarmd.compute.host.worker import Worker
    from swarmd.compute.workdir import Cache
    from swarmd.rpc.framing import FrameTooLarge

    asked: list[str] = []

    class Hostile:
        async def get_checkpoint(self, job, sha, size, dest):
            asked.append(sha)
            raise FrameTooLarge("a frame of 4294967295 bytes is over the 1048576 allowed")

    jobs_dir = tmp_path / "jobs"
    jobs_dir.mkdir()
    worker = Worker(ledger=Ledger(1), cache=Cache(tmp_path / "cache"), jobs_dir=jobs_dir, user=None,
                    checkpoint_max=1 << 20)
    hosts = {"rank0host": Hostile(), "otherhost": Hostile()}
    hub = Hub(JOB, worker=worker, me="coordinator", host=hosts.__getitem__)
    run = Run(job=JOB, max_restarts=1)
    run.to("reserving")
    run.placed(("rank0host", "otherhost"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.replicator, run, lambda: hosts, lambda: (lambda a, b: None))
        hub.announced(run, "otherhost", "e1.pt", "b" * 64, 10)
        hub.announced(run, "rank0host", "big.pt", "c" * 64, (1 << 20) + 1)
        assert hub.checkpoints == [], "not rank 0's host, or over checkpoint_max: ignored"
        hub.announced(run, "rank0host", "e2.pt", "a" * 64, 10)
        with trio.fail_after(5):
            while not asked:
                await trio.sleep(0.01)
        hub.announced(run, "rank0host", "e3.pt", "d" * 64, 10)
        with trio.fail_after(5):
            while len(asked) < 2:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert asked == ["a" * 64, "d" * 64], "each failed copy cost only itself; the replicator went on"
    assert [c.name for c in hub.checkpoints] == ["e2.pt", "e3.pt"]


    class Gone:
        async def get_checkpoint(self, job, sha, size, dest):
            raise HostError("rank0host: checkpoint get: stream closed")

    with pytest.raises(HostError, match="no live host gave checkpoint e3.pt: rank0host: checkpoint get"):
        await hub.fetch(run, {"rank0host": Gone()}, hub.checkpoints[-1])
    assert await hub.put_all(run, {"rank0host": Gone()}, ("rank0host",)) == (), "never resumed from a lost copy"


async def test_a_start_that_breaks_on_this_host_tells_its_coordinator_what_broke_and_gives_the_slot_back(tmp_path):
    """An error nobody foresaw (here a full disk as the job's directory is prepared) reaches the
    coordinator as the start's error, naming it, instead of a closed stream it can only call a
    lost host; the slot is free again and the handler serves the next request."""
    host = Host(tmp_path, slots=1)

    def full(*args):
        raise OSError(28, "No space left on device", str(tmp_path / "jobs"))

    host.worker._prepare = full
    replies = await run_job(host, "coord")
    assert replies == [{"error": "start: this host failed: OSError: No space left on device"}], "no path of the host's"
    assert host.worker.ledger.slots_free == 1 and not host.rejected
    assert await host.ask("coord", req("reserve", gpus=0, ranks=1, lease=30.0)) == [{"gpus": []}]


async def test_a_coordinator_resetting_the_stream_as_the_host_answers_is_not_the_hosts_failure(tmp_path):
    """The stream breaking under the answer is the peer's doing: the handler ends quietly, and
    nothing is logged as this host failing (a coordinator resets the stream once it has the exit)."""
    from libp2p.network.stream.exceptions import StreamReset
    from structlog.testing import capture_logs

    from fake_stream import FakeStream

    class Resetting(FakeStream):
        async def write(self, data: bytes) -> None:
            raise StreamReset("reset by the peer")

    host = Host(tmp_path)
    with capture_logs() as logged:
        await host.handler.handle(Resetting("coord", [req("reserve", gpus=0, ranks=1, lease=30.0)]))
    assert not [e for e in logged if "failed on this host" in e["event"]], logged
    assert host.worker.ledger.state_of(JOB, "coord") == "leased", "the reservation stands until its lease ends"
