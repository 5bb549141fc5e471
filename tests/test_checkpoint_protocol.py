"""Checkpoints over the job protocol (ckpt_put, ckpt_get, the start frame's `checkpoints`):
a host's handler driven in-process, the coordinator's RemoteHost talking to it through an
in-memory duplex stream, and a real start whose ranks find and write checkpoints."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import msgpack
import pytest
import trio
import trio.testing

from swarmd.compute.host import service
from swarmd.compute.checkpoints.cache import CheckpointError, CkptCache
from swarmd.compute.ledger import Ledger
from swarmd.compute.messages import role_to_wire
from swarmd.compute.coordinator.hosts import HostError, LocalHost, RemoteHost
from swarmd.compute.host.service import JOB_PROTOCOL, JobHandler
from swarmd.compute.torchenv import NodeRole
from swarmd.compute.host import worker as worker_mod
from swarmd.compute.host.worker import StartRequest, Worker, WorkerError
from swarmd.compute.workdir import Cache
from swarmd.p2p.transfer import CHUNK
from swarmd.rpc.framing import HEADER, encode_frame
from fake_stream import FakeStream
from swarmd.testing import FakeNet

JOB = "0123456789ab"
PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # the host, as the coordinator names it


class Host:
    """A JobHandler over a real Worker; every peer is a member."""

    def __init__(self, root: Path, *, user: str | None = None, checkpoint_max: int = 64 << 20,
                 jobs_dir: Path | None = None) -> None:
        self.jobs_dir = jobs_dir or root / "jobs"
        self.jobs_dir.mkdir(exist_ok=True)
        self.worker = Worker(ledger=Ledger(2), cache=Cache(root / "cache"), jobs_dir=self.jobs_dir, user=user,
                             checkpoint_max=checkpoint_max)
        self.rejected: Counter[str] = Counter()

        async def member(req, peer, stream) -> bool:
            return True

        self.handler = JobHandler(self.worker, check_member=member, submitters=(),
                                  rejected=lambda reason, peer, detail: self.rejected.update([reason]))

    async def ask(self, peer: str, *frames) -> list:
        stream = FakeStream(peer, list(frames))
        await self.handler.handle(stream)
        return stream.replies()

    def remote(self, nursery: trio.Nursery, me: str) -> RemoteHost:
        """The coordinator `me`'s proxy for this host, over an in-memory network."""
        net = FakeNet(nursery)
        net.host(PEER).set_stream_handler(JOB_PROTOCOL, self.handler.handle)
        return RemoteHost(PEER, net.host(me), b"cert")  # type: ignore[arg-type]

    def cached(self, coordinator: str) -> list[str]:
        return CkptCache(self.worker.job_dir(JOB, coordinator)).shas()

    def leftovers(self, coordinator: str) -> list[str]:
        root = CkptCache(self.worker.job_dir(JOB, coordinator)).root
        return [p.name for p in root.iterdir()] if root.exists() else []


async def hold(remote: RemoteHost) -> None:
    """A committed reservation of JOB: what a checkpoint put needs."""
    await remote.reserve(JOB, 0, 1, 60.0)
    await remote.commit(JOB, False)


def req(op: str, job: str = JOB, **fields) -> dict:
    return {"op": op, "job": job, "cert": b"member", **fields}


def checkpoint(tmp_path: Path, data: bytes, name: str = "e1.pt") -> tuple[Path, str]:
    path = tmp_path / name
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


async def test_a_put_then_a_get_round_trips_the_bytes_and_a_second_put_sends_nothing(tmp_path):
    host = Host(tmp_path)
    data = os.urandom(CHUNK * 2 + 12345)  # three chunks
    path, sha = checkpoint(tmp_path, data)
    async with trio.open_nursery() as nursery:
        coord = host.remote(nursery, "coord")
        await hold(coord)
        await coord.put_checkpoint(JOB, "e1.pt", sha, len(data), path)
        assert host.cached("coord") == [sha]
        dest = tmp_path / "back"
        await coord.get_checkpoint(JOB, sha, len(data), dest)
        assert dest.read_bytes() == data
        sent = host.handler._transfers.copy()
        assert await host.ask("coord", req("ckpt_put", name="e1.pt", sha256=sha, size=len(data))) == [{"have": True}]
        assert "is 2109497 bytes, not 5" in \
            (await host.ask("coord", req("ckpt_put", name="e1.pt", sha256=sha, size=5)))[0]["error"]
        assert host.rejected == {"checkpoint_size": 1}
        host.rejected.clear()
    assert host.rejected == {} and host.handler._transfers == {} and sent == {}


async def test_a_member_that_is_not_the_coordinator_reaches_none_of_its_checkpoints(tmp_path):
    host = Host(tmp_path)
    path, sha = checkpoint(tmp_path, b"coord's weights")
    async with trio.open_nursery() as nursery:
        coord, mallory = host.remote(nursery, "coord"), host.remote(nursery, "mallory")
        await hold(coord)
        await coord.put_checkpoint(JOB, "e1.pt", sha, 15, path)
        with pytest.raises(HostError, match="is not on this host"):
            await mallory.get_checkpoint(JOB, sha, 15, tmp_path / "stolen")
        assert not (tmp_path / "stolen").exists()
        with pytest.raises(HostError, match="holds no committed reservation"):
            await mallory.put_checkpoint(JOB, "e1.pt", "f" * 64, 15, path)
        assert host.rejected == {"no_reservation": 1}
        # holding the same id itself, it puts into its own cache, never the coordinator's
        await hold(mallory)
        bad, bad_sha = checkpoint(tmp_path, b"poisoned", "bad.pt")
        await mallory.put_checkpoint(JOB, "e1.pt", bad_sha, 8, bad)
        assert host.cached("coord") == [sha] and host.cached("mallory") == [bad_sha]
        with pytest.raises(HostError, match="is not on this host"):
            await coord.get_checkpoint(JOB, bad_sha, 8, tmp_path / "x")


async def test_a_put_without_a_hold_is_refused_and_nothing_is_stored(tmp_path):
    host = Host(tmp_path)
    path, sha = checkpoint(tmp_path, b"weights")
    replies = await host.ask("coord", req("ckpt_put", name="e1.pt", sha256=sha, size=7), {"data": b"weights"},
                             {"end": True})
    assert len(replies) == 1 and "holds no committed reservation" in replies[0]["error"]
    assert host.rejected == {"no_reservation": 1} and list(host.jobs_dir.iterdir()) == []


@pytest.mark.parametrize("announced, frames, reason, why", [
    # the bytes of another checkpoint than the sha named
    (dict(sha256=hashlib.sha256(b"other").hexdigest(), size=7), [{"data": b"weights"}, {"end": True}],
     "checkpoint_sha256", "not the"),
    (dict(size=8), [{"data": b"weights"}, {"end": True}], "checkpoint_size", "ended after 7 of its 8 bytes"),
    (dict(size=6), [{"data": b"weights"}, {"end": True}], "checkpoint_size", "more than its 6 bytes"),
    (dict(size=7), [{"data": "weights"}, {"end": True}], "malformed", "must be {data: bytes}"),
    (dict(size=7), [["weights"]], "malformed", "must be a map"),
    (dict(size=65 << 20), [], "too_large", "over this host's checkpoint_max"),
    (dict(sha256="A" * 64, size=7), [], "malformed", "'sha256' must be"),
    (dict(name="e1.pt.tmp", size=7), [], "malformed", "'name' must be"),
    (dict(name="../../etc/passwd", size=7), [], "malformed", "'name' must be"),
    (dict(size=-1), [], "malformed", "'size' must be"),
])
async def test_a_put_that_does_not_match_is_refused_and_nothing_is_kept(tmp_path, announced, frames, reason, why):
    host = Host(tmp_path)
    assert await host.ask("coord", req("reserve", gpus=0, ranks=1, lease=60.0)) == [{"gpus": []}]
    assert await host.ask("coord", req("commit")) == [{"gpus": []}]
    fields = dict(name="e1.pt", sha256=hashlib.sha256(b"weights").hexdigest()) | announced
    replies = await host.ask("coord", req("ckpt_put", **fields), *frames)
    assert why in replies[-1]["error"]
    assert host.rejected == {reason: 1}
    assert host.leftovers("coord") == [], "nothing stored, no temporary left"
    assert host.handler._transfers == {}


@pytest.fixture
def patient_clock():
    """Autojump only after 0.2 s of real idleness: the handler's file I/O runs in threads,
    which a threshold of 0 would jump over (to the transfer's whole timeout)."""
    return trio.testing.MockClock(autojump_threshold=0.2)


async def test_a_stalled_put_is_given_up_after_the_chunk_timeout(tmp_path, patient_clock):
    host = Host(tmp_path)
    path, sha = checkpoint(tmp_path, b"weights")
    async with trio.open_nursery() as nursery:
        coord = host.remote(nursery, "coord")
        await hold(coord)
        client = await coord.host.new_stream(PEER, [JOB_PROTOCOL])
        await client.write(encode_frame(req("ckpt_put", name="e1.pt", sha256=sha, size=7)))
        await client.write(encode_frame({"data": b"wei"}))
        began = trio.current_time()
        got = await service.read_frame(client, 1024)
        assert got == {"have": False}
        got = await service.read_frame(client, 1024)
        assert "no checkpoint chunk" in got["error"]
        assert trio.current_time() - began == pytest.approx(service.CHUNK_TIMEOUT)
    assert host.rejected == {"timeout": 1} and host.leftovers("coord") == []


async def test_a_get_that_does_not_match_what_the_coordinator_expects_fails_and_leaves_no_file(tmp_path):
    host = Host(tmp_path)
    path, sha = checkpoint(tmp_path, b"weights")
    async with trio.open_nursery() as nursery:
        coord = host.remote(nursery, "coord")
        await hold(coord)
        await coord.put_checkpoint(JOB, "e1.pt", sha, 7, path)
        for sha_ in ("nope", "A" * 64):
            with pytest.raises(HostError, match="'sha256' must be"):
                await coord.get_checkpoint(JOB, sha_, 7, tmp_path / "dest")
        assert host.rejected == {"malformed": 2}
        with pytest.raises(HostError, match="is 7 bytes there, not 8"):
            await coord.get_checkpoint(JOB, sha, 8, tmp_path / "dest")
        assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("listed, why", [
    ("e1.pt", "'checkpoints' must be a list"),
    ([["e1.pt", "a" * 64]], r"'checkpoints\[0\]' must be \[name, sha256, size\]"),
    ([["../e1.pt", "a" * 64, 1]], r"'checkpoints\[0\].name' must be"),
    ([["e1.pt", "a" * 63, 1]], r"'checkpoints\[0\].sha256' must be"),
    ([["e1.pt", "a" * 64, 2**40]], r"'checkpoints\[0\].size' must be"),
    ([["e1.pt", "a" * 64, 1]] * 17, "at most 16"),
])
async def test_a_start_with_a_malformed_checkpoint_list_is_refused_saying_what(tmp_path, listed, why):
    import re

    host = Host(tmp_path)
    assert await host.ask("coord", req("reserve", gpus=0, ranks=1, lease=60.0)) == [{"gpus": []}]
    assert await host.ask("coord", req("commit")) == [{"gpus": []}]
    role = role_to_wire(NodeRole(job_id=JOB, node_rank=0, nnodes=1, procs_per_node=1, master_addr="10.211.0.1",
                                 master_port=29500, ifname=None, gpus=(), node_ips=("10.211.0.1",),
                                 checkpoint_dir=""))
    body = {"role": role, "cmd": ["true"], "env": {}, "python": None, "workdir": None, "checkpoints": listed}
    replies = await host.ask("coord", req("start"), body)
    assert len(replies) == 1 and re.search(why, replies[0]["error"]) and replies[0]["error"].startswith("start: ")
    assert host.rejected == {"malformed": 1} and host.worker.ledger.state_of(JOB, "coord") == "committed"


# --- a real start: the ranks find the listed checkpoints and their new ones are told -------

SCRIPT = """
import os, sys
d = os.environ["SWARM_CHECKPOINT_DIR"]
print("found", sorted(os.listdir(d)), open(os.path.join(d, "e1.pt")).read(), flush=True)
try:
    open(os.path.join(d, "e1.pt"), "a").write("tampered")
except OSError as exc:
    print("cannot change it:", exc.errno, flush=True)
with open(os.path.join(d, "e2.pt.tmp"), "w") as f:
    f.write("epoch 2")
os.rename(os.path.join(d, "e2.pt.tmp"), os.path.join(d, "e2.pt"))
os.unlink(os.path.join(d, "e1.pt"))
"""


@pytest.fixture
def reachable_jobs_dir():
    """A jobs directory the job user reaches (pytest's own tmp_path is root's, 0700)."""
    jobs = Path(tempfile.mkdtemp(prefix="swarmd-test-ckpt-"))
    jobs.chmod(0o711)
    yield jobs
    subprocess.run(["rm", "-rf", str(jobs)], check=False)


def start_request(listed, cmd) -> StartRequest:
    role = NodeRole(job_id=JOB, node_rank=0, nnodes=1, procs_per_node=1, master_addr="127.0.0.1",
                    master_port=29500, ifname=None, gpus=(), node_ips=("127.0.0.1",), checkpoint_dir="")
    return StartRequest(job=JOB, coordinator="coord", role=role, cmd=tuple(cmd), env={}, python=None,
                        workdir=None, checkpoints=tuple(listed))


@pytest.mark.skipif(os.geteuid() != 0, reason="ranks run as a job user only when the daemon is root")
async def test_a_start_installs_the_listed_checkpoints_and_tells_the_new_one_before_the_exit(tmp_path,
                                                                                           reachable_jobs_dir):
    import sys

    host = Host(tmp_path, user="nobody", jobs_dir=reachable_jobs_dir)
    w = host.worker
    w.hubs.add(("coord", JOB))  # this node coordinates the job: its cache outlives the ranks here
    path, sha = checkpoint(tmp_path, b"epoch 1")
    w.reserve(JOB, "coord", 0, 1, 60.0)
    await LocalHost("coord", w).put_checkpoint(JOB, "e1.pt", sha, 7, path)
    w.commit(JOB, "coord")
    events: list = []

    async def emit(event) -> None:
        events.append(event)

    with trio.fail_after(30):
        codes = await w.start(start_request([("e1.pt", sha, 7)], [sys.executable, "-c", SCRIPT]), emit)
    lines = [line for e in events if "out" in e for _, line in e["out"]]
    assert codes == {0: 0}, lines
    assert lines[0] == "found ['e1.pt'] epoch 1" and lines[1].startswith("cannot change it: 13")
    new = hashlib.sha256(b"epoch 2").hexdigest()
    told = [e["ckpt"] for e in events if "ckpt" in e]
    assert told == [["e2.pt", new, 7]], "the new checkpoint, once; never the installed one"
    assert [i for i, e in enumerate(events) if "ckpt" in e][0] < [i for i, e in enumerate(events) if "exit" in e][0]
    cache = CkptCache(w.job_dir(JOB, "coord"))
    assert cache.shas() == sorted([sha, new]) and (cache.root / sha).read_bytes() == b"epoch 1", "not tampered"
    assert w.checkpoint_path(JOB, "coord", new) == cache.root / new


@pytest.mark.skipif(os.geteuid() != 0, reason="ranks run as a job user only when the daemon is root")
async def test_a_hosts_cache_of_another_coordinators_job_goes_a_while_after_its_ranks_end(tmp_path, reachable_jobs_dir):
    """The hub (the coordinator) keeps the job's checkpoints and puts them back on any host of
    a later attempt: a host's own copy would only hold its checkpoint budget for a week."""
    import sys

    host = Host(tmp_path, user="nobody", jobs_dir=reachable_jobs_dir)
    w = host.worker
    path, sha = checkpoint(tmp_path, b"epoch 1")
    w.reserve(JOB, "coord", 0, 1, 60.0)
    w.commit(JOB, "coord")
    await LocalHost("coord", w).put_checkpoint(JOB, "e1.pt", sha, 7, path)

    async def emit(event) -> None:
        pass

    with trio.fail_after(30):
        assert await w.start(start_request([("e1.pt", sha, 7)], [sys.executable, "-c", SCRIPT]), emit) == {0: 0}
    cache = CkptCache(w.job_dir(JOB, "coord"))
    assert len(cache.shas()) == 2, "kept a while: the hub may still be fetching the one told before the exit"
    assert w.lingered(trio.current_time() + 1) == []
    due = w.lingered(trio.current_time() + worker_mod.CHECKPOINT_LINGER + 1)
    assert due == [(JOB, "coord")]
    w.drop_checkpoints(*due[0])
    assert w.checkpoint_path(JOB, "coord", sha) is None and cache.shas() == []
    assert w.checkpoint_budget.used() == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="ranks run as a job user only when the daemon is root")
async def test_a_start_naming_a_checkpoint_not_here_fails_naming_it(tmp_path):
    host = Host(tmp_path, user="nobody")
    w = host.worker
    w.reserve(JOB, "coord", 0, 1, 60.0)
    w.commit(JOB, "coord")

    async def emit(event) -> None:
        pass

    with pytest.raises(WorkerError, match=f"checkpoint e9.pt \\({'d' * 12}\\) is not on this host"):
        await w.start(start_request([("e9.pt", "d" * 64, 7)], ["true"]), emit)
    assert w.ledger.state_of(JOB, "coord") == "committed", "nothing started"


# --- the fuzz: any checkpoint request, any frames after it ---------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

junk = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                 st.text(max_size=20), st.binary(max_size=20), st.lists(st.integers(-9, 9), max_size=3),
                 st.dictionaries(st.text(max_size=5), st.integers(-9, 9), max_size=3))
WEIGHTS = hashlib.sha256(b"weights").hexdigest()
ckpt_requests = st.fixed_dictionaries(
    {"op": st.sampled_from(["ckpt_put", "ckpt_get", "reserve", "commit"]), "job": st.sampled_from([JOB, "../x"]),
     "cert": st.just(b"member")},
    optional={"name": st.one_of(st.sampled_from(["e1.pt", "e1.pt.tmp", "../e", ".h"]), junk),
              "sha256": st.one_of(st.just(WEIGHTS), st.just("0" * 64), junk),
              "size": st.one_of(st.integers(-1, 10), st.just(2**40), junk),
              "gpus": st.just(0), "ranks": st.just(1), "lease": st.just(60.0)})
ckpt_frames = st.lists(st.one_of(st.fixed_dictionaries({"data": st.one_of(st.just(b"weights"), st.binary(max_size=9),
                                                                           junk)}),
                                 st.just({"end": True}), st.fixed_dictionaries({"end": junk}), junk), max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["coordA", "coordB"]), ckpt_requests, ckpt_frames), min_size=1, max_size=6))
def test_no_checkpoint_message_escapes_the_handler_or_leaves_a_partial_file(sequence):
    with tempfile.TemporaryDirectory() as tmp:
        host = Host(Path(tmp))

        async def main() -> None:
            for peer, first, more in sequence:
                with trio.fail_after(120):
                    await host.ask(peer, first, *more)
            assert host.handler._transfers == {} and host.handler.streams.open == {}
            for top in host.jobs_dir.iterdir():
                cache = CkptCache(top)
                for p in cache.root.iterdir():
                    assert p.name == WEIGHTS and p.read_bytes() == b"weights", "only whole, verified checkpoints"

        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0.2))


async def test_the_hub_keeps_what_the_coordinator_asks_however_old_and_prunes_the_rest(tmp_path):
    w = Host(tmp_path).worker
    shas = []
    for i in range(4):
        path, sha = checkpoint(tmp_path, b"epoch %d" % i, f"e{i}.pt")
        await w.store_checkpoint(JOB, "coord", sha, 7, path)
        shas.append(sha)
        if i == 1:
            w.keep_checkpoints(JOB, "coord", [shas[0]])
        os.utime(w.checkpoint_path(JOB, "coord", sha), ns=(i * 10**9, i * 10**9))
    assert sorted(CkptCache(w.job_dir(JOB, "coord")).shas()) == sorted([shas[0], shas[2], shas[3]])
    with pytest.raises(WorkerError, match="not the"):
        await w.store_checkpoint(JOB, "coord", "e" * 64, 7, path)
    with pytest.raises(WorkerError, match="checkpoint_max"):
        await w.store_checkpoint(JOB, "coord", "e" * 64, 2**40, path)


async def test_a_checkpoint_crosses_real_libp2p_both_ways(tmp_path):
    """The same round trip between two in-process libp2p hosts (Noise, yamux): 1 MiB chunks
    in frames over a real stream, the handler keyed by the peer id Noise authenticated."""
    from libp2p.peer.peerinfo import PeerInfo
    from multiaddr import Multiaddr

    from swarmd.p2p.host import make_host
    from swarmd.identity import load_or_create

    host = Host(tmp_path)
    h_ident, _ = load_or_create(tmp_path / "h")
    c_ident, _ = load_or_create(tmp_path / "c")
    h_p2p, c_p2p = make_host(h_ident, ["/ip4/127.0.0.1/tcp/0"]), make_host(c_ident, ["/ip4/127.0.0.1/tcp/0"])
    data = os.urandom(3 * CHUNK + 1)
    path, sha = checkpoint(tmp_path, data)
    async with h_p2p.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]), c_p2p.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        h_p2p.set_stream_handler(service.JOB_PROTOCOL, host.handler.handle)
        await c_p2p.connect(PeerInfo(h_p2p.get_id(), h_p2p.get_addrs()))
        coord = str(c_p2p.get_id())
        remote = RemoteHost(str(h_p2p.get_id()), c_p2p, b"cert")
        with trio.fail_after(60):
            await hold(remote)
            await remote.put_checkpoint(JOB, "e1.pt", sha, len(data), path)
            assert host.cached(coord) == [sha]
            await remote.get_checkpoint(JOB, sha, len(data), tmp_path / "back")
        assert (tmp_path / "back").read_bytes() == data
        await c_p2p.disconnect(h_p2p.get_id())
    assert host.rejected == {}


async def test_a_fetch_into_the_hubs_incoming_file_is_moved_into_the_cache_and_a_bad_one_leaves_nothing(tmp_path):
    """The coordinator's fetch: `incoming_checkpoint` gives a temporary inside the job's
    cache, RemoteHost.get_checkpoint fills it, `store_checkpoint` renames it into place (no
    second copy); a temporary whose bytes do not match is removed, and one left behind (a
    fetch that died) goes at the cache's next prune once stale."""
    (tmp_path / "h").mkdir()
    (tmp_path / "hub").mkdir()
    host, hub = Host(tmp_path / "h"), Host(tmp_path / "hub")
    data = os.urandom(CHUNK + 7)
    path, sha = checkpoint(tmp_path, data)
    w = hub.worker
    async with trio.open_nursery() as nursery:
        coord = host.remote(nursery, "hub")
        await coord.reserve(JOB, 0, 1, 60.0)
        await coord.commit(JOB, False)
        await coord.put_checkpoint(JOB, "e1.pt", sha, len(data), path)
        dest = w.incoming_checkpoint(JOB, "hub", len(data))
        root = w.checkpoint_cache(JOB, "hub").root
        assert dest.parent == root and dest.name.startswith(".tmp-") and dest.stat().st_size == 0
        await coord.get_checkpoint(JOB, sha, len(data), dest)
        inode = dest.stat().st_ino
        stored = await w.store_checkpoint(JOB, "hub", sha, len(data), dest)
        assert stored == root / sha and stored.stat().st_ino == inode, "moved, not copied"
        assert stored.read_bytes() == data and stat.S_IMODE(stored.stat().st_mode) == 0o444
        assert sorted(p.name for p in root.iterdir()) == [sha], "no temporary left"

        bad = w.incoming_checkpoint(JOB, "hub", 3)
        bad.write_bytes(b"abc")
        with pytest.raises(WorkerError, match="not the"):
            await w.store_checkpoint(JOB, "hub", "e" * 64, 3, bad)
        big = w.incoming_checkpoint(JOB, "hub", 3)
        with pytest.raises(WorkerError, match="checkpoint_max"):
            await w.store_checkpoint(JOB, "hub", "e" * 64, w.checkpoint_max + 1, big)
        assert sorted(p.name for p in root.iterdir()) == [sha], "a failed store removes its temporary"
        with pytest.raises(WorkerError, match="checkpoint_max"):
            w.incoming_checkpoint(JOB, "hub", w.checkpoint_max + 1)

        left = w.incoming_checkpoint(JOB, "hub", 3)  # a fetch that died: nobody stores it
        os.utime(left, (1, 1))
        w.checkpoint_cache(JOB, "hub").prune(2)
        assert sorted(p.name for p in root.iterdir()) == [sha]


class Scripted:
    """An IHost whose every stream reads `frames` then the bytes `raw` (then ends)."""

    def __init__(self, frames: list, raw: bytes = b"") -> None:
        self.frames, self.raw = frames, raw

    async def new_stream(self, peer, protocols):
        stream = FakeStream(PEER, self.frames)
        stream.inbound += self.raw
        return stream


HUGE = HEADER.pack(2**32 - 1)  # a frame header announcing 4 GiB


async def test_whatever_a_host_sends_or_a_local_file_does_a_remote_host_raises_only_host_error(tmp_path):
    """Reviewer's #1: an oversized frame, a malformed answer, or this host's own file gone
    (a checkpoint pruned between checkpoint_path and the open) leave a RemoteHost method as
    a HostError naming the host, never FrameTooLarge, KeyError or FileNotFoundError."""
    shown = PEER[-8:]
    path, sha = checkpoint(tmp_path, b"weights")
    role = NodeRole(job_id=JOB, node_rank=0, nnodes=1, procs_per_node=1, master_addr="10.211.0.1",
                    master_port=29500, ifname=None, gpus=(), node_ips=("10.211.0.1",), checkpoint_dir="")
    start = StartRequest(job=JOB, coordinator="me", role=role, cmd=("true",), env={}, python=None, workdir=None)

    async def emit(event) -> None:
        pass

    calls = [
        (Scripted([], HUGE), lambda r: r.reserve(JOB, 0, 1, 60.0), "reserve: a 4294967295-byte frame"),
        (Scripted([{}]), lambda r: r.reserve(JOB, 0, 1, 60.0), "'gpus' must be a list"),
        (Scripted([{"gpus": [True]}]), lambda r: r.reserve(JOB, 0, 1, 60.0), "'gpus' must be a list"),
        (Scripted([{"gpus": [0], "port": "x"}]), lambda r: r.commit(JOB, True), "'port' must be 1-65535"),
        (Scripted([], HUGE), lambda r: r.release(JOB), "a 4294967295-byte frame"),
        (Scripted([], HUGE), lambda r: r.get_checkpoint(JOB, sha, 7, tmp_path / "dest"), "a 4294967295-byte frame"),
        (Scripted([{"size": 7}], HUGE), lambda r: r.get_checkpoint(JOB, sha, 7, tmp_path / "dest"),
         "a 4294967295-byte frame"),
        (Scripted([{"size": 7}]), lambda r: r.get_checkpoint(JOB, sha, 7, tmp_path / "no" / "dest"),
         "No such file or directory"),
        (Scripted([{"size": 7}, {"data": b"weights!"}]), lambda r: r.get_checkpoint(JOB, sha, 7, tmp_path / "dest"),
         "more than its 7 bytes, or a malformed chunk"),
        (Scripted([{"size": 7}, {"data": "weights"}]), lambda r: r.get_checkpoint(JOB, sha, 7, tmp_path / "dest"),
         "more than its 7 bytes, or a malformed chunk"),
        (Scripted([{"size": 7}, {"data": b"wei"}, {"error": "the disk went away"}]),
         lambda r: r.get_checkpoint(JOB, sha, 7, tmp_path / "dest"), "the disk went away"),
        (Scripted([{"size": 7}, {"data": b"wei"}, {"end": True}]),
         lambda r: r.get_checkpoint(JOB, sha, 7, tmp_path / "dest"), "arrived as 3 bytes with sha256"),
        (Scripted([], HUGE), lambda r: r.put_checkpoint(JOB, "e1.pt", sha, 7, path), "a 4294967295-byte frame"),
        (Scripted([{"have": False}]), lambda r: r.put_checkpoint(JOB, "e1.pt", sha, 7, tmp_path / "pruned"),
         "No such file or directory"),
        (Scripted([{"have": False}], HUGE), lambda r: r.put_checkpoint(JOB, "e1.pt", sha, 7, path),
         "a 4294967295-byte frame"),
        (Scripted([{"started": [0]}], HUGE), lambda r: r.start(start, emit), "a 4294967295-byte frame"),
        (Scripted([], HUGE), lambda r: r.ship(JOB, "a" * 64, path, lambda n: None), "a 4294967295-byte frame"),
        (Scripted([{"have": True}]), lambda r: r.ship(JOB, "a" * 64, tmp_path / "gone.tar.gz", lambda n: None),
         "No such file or directory"),
    ]
    for host, call, why in calls:
        with pytest.raises(HostError, match=why) as raised, trio.fail_after(5):
            await call(RemoteHost(PEER, host, b"cert"))  # type: ignore[arg-type]
        assert str(raised.value).startswith(shown)
    assert not (tmp_path / "dest").exists()


async def test_a_local_host_raises_only_host_error_for_its_files(tmp_path):
    host = Host(tmp_path)
    path, sha = checkpoint(tmp_path, b"weights")
    local = LocalHost("coord", host.worker)
    with pytest.raises(HostError, match="pruned"):
        await local.put_checkpoint(JOB, "e1.pt", sha, 7, tmp_path / "pruned")
    await local.put_checkpoint(JOB, "e1.pt", sha, 7, path)
    with pytest.raises(HostError, match="No such file or directory"):
        await local.get_checkpoint(JOB, sha, 7, tmp_path / "no" / "dest")
    with pytest.raises(HostError, match="is 7 bytes here, not 8"):
        await local.get_checkpoint(JOB, sha, 8, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()
    with pytest.raises(HostError, match="No such file or directory"):
        await local.ship(JOB, "a" * 64, tmp_path / "gone.tar.gz", lambda n: None)


JOB2 = "0123456789ac"


async def test_a_put_needs_a_committed_hold_and_a_cache_filled_for_a_hold_that_never_started_goes_with_it(
        tmp_path, patient_clock):
    """Reviewer's #4: a lease is not enough to put (a member reserving fresh ids could fill
    the disk); checkpoints put for a hold released or lapsed before its job started here are
    removed at once, not kept for gc's retention. A job that ran here keeps its cache, and
    the hub's own cache (stored, never put) is no peer's to lose."""
    from swarmd.compute.host.worker import START_WITHIN

    host = Host(tmp_path)
    w = host.worker
    path, sha = checkpoint(tmp_path, b"weights")
    async with trio.open_nursery() as nursery:
        coord = host.remote(nursery, "coord")
        await coord.reserve(JOB, 0, 1, 60.0)
        with pytest.raises(HostError, match="holds no committed reservation"):
            await coord.put_checkpoint(JOB, "e1.pt", sha, 7, path)
        assert host.rejected == {"no_reservation": 1} and not w.job_dir(JOB, "coord").exists()
        await coord.commit(JOB, False)
        await coord.put_checkpoint(JOB, "e1.pt", sha, 7, path)
        assert host.cached("coord") == [sha]
        await coord.release(JOB)
        assert not w.job_dir(JOB, "coord").exists(), "released before it started: the cache went with the hold"

        await hold(coord)  # lapses: committed, never started within START_WITHIN
        await coord.put_checkpoint(JOB, "e1.pt", sha, 7, path)
        nursery.start_soon(w.sweep)
        await trio.sleep(START_WITHIN + 1)
        assert w.ledger.state_of(JOB, "coord") is None and not w.job_dir(JOB, "coord").exists()

        await hold(coord)  # the job ran here before (a start made its work/): its cache stays
        await coord.put_checkpoint(JOB, "e1.pt", sha, 7, path)
        (w.job_dir(JOB, "coord") / "work").mkdir()
        await coord.release(JOB)
        assert host.cached("coord") == [sha]

        await w.store_checkpoint(JOB2, "me", sha, 7, path)  # the hub's own, its own hold released unstarted
        await LocalHost("me", w).reserve(JOB2, 0, 1, 60.0)
        await LocalHost("me", w).release(JOB2)
        assert w.checkpoint_path(JOB2, "me", sha) is not None
        nursery.cancel_scope.cancel()


async def fill_budget(coord: RemoteHost, files: list[tuple[Path, str]]) -> None:
    """`coord` holds JOB and JOB2 committed and puts two of `files` into each."""
    for job in (JOB, JOB2):
        await coord.reserve(job, 0, 1, 60.0)
        await coord.commit(job, False)
    for job, (path, sha) in zip((JOB, JOB, JOB2, JOB2), files):
        await coord.put_checkpoint(job, "e.pt", sha, 100, path)


async def test_all_checkpoint_caches_together_stay_within_the_hosts_budget(tmp_path):
    """Reviewer's #4: puts, the hub's fetches and the watcher's copies all count against one
    budget for the host's caches (4 × checkpoint_max), shared per job (issue 23 #4): a
    copy that would take its job's cache over its share, with nothing of its own to give,
    is refused saying why, leaving nothing behind, and room comes back when a cache goes."""
    host = Host(tmp_path, checkpoint_max=100)
    w = host.worker
    assert w.checkpoint_budget.limit == 400
    files = [checkpoint(tmp_path, bytes([i]) * 100, f"e{i}.pt") for i in range(5)]
    async with trio.open_nursery() as nursery:
        coord = host.remote(nursery, "coord")
        await fill_budget(coord, files)
        w.keep_checkpoints(JOB, "coord", [sha for _, sha in files[:2]])  # as a start listing them would
        assert w.checkpoint_budget.used() == 400
        path, sha = files[4]
        over = "over their budget of 400, and this job's cache to 300 bytes, over its share of 200"
        with pytest.raises(HostError, match=over):
            await coord.put_checkpoint(JOB, "e4.pt", sha, 100, path)
        with pytest.raises(WorkerError, match=over):
            w.incoming_checkpoint(JOB, "coord", 100)
        with pytest.raises(WorkerError, match=over):
            await w.store_checkpoint(JOB, "coord", sha, 100, path)
        rank_dir = tmp_path / "rank"
        rank_dir.mkdir()
        (rank_dir / "e4.pt").write_bytes(bytes([4]) * 100)
        fd = os.open(rank_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(CheckpointError, match=over):
                w.checkpoint_cache(JOB, "coord").snapshot(fd, "e4.pt", seen=None, job_uid=None, max_size=100)
        finally:
            os.close(fd)
        assert w.checkpoint_budget.used() == 400, "no temporary left, no claim kept"
        assert len(host.leftovers("coord")) == 2
        await coord.release(JOB2)  # never started: its cache goes, and its bytes with it
        await coord.put_checkpoint(JOB, "e4.pt", sha, 100, path)
        assert w.checkpoint_budget.used() == 300 and sha in host.cached("coord")

async def test_a_member_filling_the_budget_does_not_stop_another_jobs_checkpoints(tmp_path):
    """Issue 23 #4: a member fills the host's whole checkpoint budget with puts for its own
    holds; another coordinator's job running here still has every checkpoint it writes
    copied and told (it takes its share back from the member's older copies), and the member
    cannot take it again."""
    from swarmd.compute.checkpoints.cache import Watcher

    host = Host(tmp_path, checkpoint_max=100)
    w = host.worker
    job3 = "0123456789ad"
    files = [checkpoint(tmp_path, bytes([i]) * 100, f"m{i}.pt") for i in range(5)]
    rank_dir = tmp_path / "rank"
    rank_dir.mkdir()
    watcher = Watcher(w.checkpoint_cache(job3, "coord2"), rank_dir, job_uid=None, max_size=100,
                      keep=w.checkpoint_keep, protect=lambda: w.kept_checkpoints(job3, "coord2"), rate=1 << 30)
    async with trio.open_nursery() as nursery:
        member = host.remote(nursery, "member")
        await fill_budget(member, files)
        assert w.checkpoint_budget.used() == w.checkpoint_budget.limit == 400
        told = []
        for i in range(4):  # the other job keeps checkpointing
            data = f"epoch {i}".encode().ljust(60, b".")
            (rank_dir / f"e{i}.pt").write_bytes(data)
            assert await watcher.poll() == []  # seen once: the two-scan rule
            told += await watcher.poll()
            assert told[-1:] == [(f"e{i}.pt", hashlib.sha256(data).hexdigest(), 60)], f"checkpoint {i} not copied"
        ours = w.checkpoint_cache(job3, "coord2").shas()
        assert sorted(sha for _, sha, _ in told[-2:]) == ours, "its newest two, as its prune keeps"
        assert w.checkpoint_budget.used() <= 400
        share = 400 // 3
        for job in (JOB, JOB2):
            held = sum(os.path.getsize(p) for p in w.checkpoint_cache(job, "member").root.iterdir())
            assert 0 < held <= share, "the member keeps its share, no more"
        path, sha = files[4]
        with pytest.raises(HostError, match=f"over its share of {share}"):
            await member.put_checkpoint(JOB, "m4.pt", sha, 100, path)
        nursery.cancel_scope.cancel()
