"""Elastic jobs on a 4-host lab: real daemons, the WireGuard mesh, real torch ranks; a host is
powered off silently (`lab crash`) or its daemon SIGKILLed mid-training, and the job goes on
from its last checkpoint, on a replacement host or on the survivors."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from sim.netlab import lab as labmod
from sim.netlab import topology

from .support import call, job_logs, rank_lines, swarmctl, until, workdir

pytestmark = [pytest.mark.netlab, pytest.mark.slow]
EXAMPLES = Path(__file__).parents[2] / "examples"
DIGITS = ["--workdir", str(EXAMPLES), "--env", "TORCH_CPP_LOG_LEVEL=ERROR", "--", "python", "ddp_digits.py",
          "--epochs", "14", "--min-epoch-s", "1"]

FAILS_EVERY_TIME = """
import os, sys, time
print("attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], "world", os.environ["WORLD_SIZE"], flush=True)
if os.environ["RANK"] == "1":
    sys.exit(1)
time.sleep(600)
"""

STUBBORN = """
import os, signal, sys, time
if os.environ["RANK"] == "1":
    print("failing", flush=True)
    sys.exit(1)
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopped only by the SIGKILL after the grace
print("stubborn", flush=True)
time.sleep(600)
"""


STEPS = """
import os, sys, time
for i in range(int(sys.argv[1])):
    print("step", i, "of rank", os.environ["RANK"], "attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
    time.sleep(0.5)
"""


@pytest.fixture(scope="module")
def el():
    if os.geteuid() != 0:
        pytest.skip("netlab needs root (network namespaces); CI runs as root")
    name = f"e{uuid.uuid4().hex[:6]}"
    hosts, links = topology.plan(4, topology.uniform(10.0))
    lab = labmod.Lab.up(name, hosts, links, mesh=True)
    try:
        lab.wait_formed()
        yield lab
    finally:
        labmod.down(name)


@pytest.fixture
def healthy(el):
    """Every host up and seen alive by h1 after the test (a crashed or killed one comes back)."""
    yield el
    for h in el.state.hosts:
        if h.crashed:
            el.revive(h.name)
        elif labmod.process_state(h.pid) == "dead":
            el.start(h.name)
    el.wait_formed(timeout=90)


def host_of(lab, peer: str) -> str:
    return next(h.name for h in lab.state.hosts if h.peer_id == peer)


def submit(lab, tmp_path: Path | None, *args: str) -> str:
    r = swarmctl(lab, "h1", "jobs", "run", "--detach", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip()


def show(lab, job: str) -> dict:
    return call(lab, "h1", "jobs.show", id=job)


def a_replicated_checkpoint(lab, job: str) -> bool:
    j = show(lab, job)
    return j["state"] == "running" and any(len(c["holders"]) >= 2 for c in j["checkpoints"])


def wait_end(lab, job: str, timeout: float = 240) -> dict:
    until(lambda: show(lab, job)["state"] in ("succeeded", "failed", "cancelled"), timeout, f"job {job} ends",
          interval=0.5, detail=lambda: show(lab, job)["state"])
    return show(lab, job)


def logs(lab, job: str) -> str:
    return job_logs(lab, "h1", job)


def accuracy(out: str) -> float:
    line = [t for t in rank_lines(out).get(0, []) if t.startswith("test accuracy")]
    assert line, out[-3000:]
    return float(line[-1].split()[2])


def daemon_said(lab, host: str, job: str) -> list[str]:
    """The last lines `host`'s daemon logged about `job`: a failed assertion on its attempts says why."""
    lines = Path(lab.state.host(host).log).read_text(errors="replace").splitlines()
    return [line[:400] for line in lines if job in line][-40:]


def a_job_host_not(lab, job: str, *spared: str) -> str:
    nodes = show(lab, job)["nodes"]
    return next(host_of(lab, p) for p in nodes if host_of(lab, p) not in spared)


def test_a_crashed_host_is_replaced_and_training_resumes_from_its_last_checkpoint(healthy, tmp_path):
    lab = healthy
    job = submit(lab, tmp_path, "--nodes", "3", "--max-restarts", "2", *DIGITS)
    until(lambda: a_replicated_checkpoint(lab, job), 120, "a checkpoint on two hosts", interval=0.2)
    first = show(lab, job)
    victim = a_job_host_not(lab, job, "h1")  # h1 coordinates: its loss ends the job
    spare = next(h.name for h in lab.state.hosts if h.peer_id not in first["nodes"])
    lab.crash(victim)
    j = wait_end(lab, job)
    out = logs(lab, job)
    assert (j["state"], j["exit_code"]) == ("succeeded", 0), (j["reason"], out[-3000:])
    assert len(j["attempts"]) == 2, j["attempts"]
    one, two = j["attempts"]
    assert one["why"].startswith(f"host {lab.state.host(victim).peer_id[-8:]} lost"), one
    assert {host_of(lab, p) for p in two["nodes"]} == {host_of(lab, p) for p in first["nodes"]} - {victim} | {spare}
    assert two["resumed_from"] and two["resumed_from"].startswith("epoch-"), two
    resumed = [t for t in rank_lines(out)[0] if t.startswith("resumed from epoch")]
    assert resumed and int(resumed[0].split()[3]) >= 1, out[-3000:]
    assert "[swarmd] restart 1/2 after host" in out
    assert accuracy(out) > 0.9  # an uninterrupted run of the same epochs reaches about 0.96
    assert "world 3" in out.split("[swarmd] restart")[1], "the new attempt has 3 nodes again"


def test_with_no_spare_host_the_job_shrinks_to_its_survivors(healthy, tmp_path):
    lab = healthy
    lab.crash("h4")  # the swarm is three hosts now
    h4 = lab.state.host("h4").peer_id

    def h4_dead() -> bool:
        return any(p["peer"] == h4 and p["state"] == "dead" for p in call(lab, "h1", "peers")["peers"])

    until(h4_dead, 30, "h1 sees h4 dead", interval=0.2)
    job = submit(lab, tmp_path, "--nodes", "2:3", "--max-restarts", "1", *DIGITS)
    until(lambda: a_replicated_checkpoint(lab, job), 120, "a checkpoint on two hosts", interval=0.2)
    assert len(show(lab, job)["nodes"]) == 3, "an elastic job starts on as many hosts as fit"
    lab.crash(a_job_host_not(lab, job, "h1"))
    j = wait_end(lab, job)
    out = logs(lab, job)
    assert j["state"] == "succeeded", (j["reason"], out[-3000:])
    assert [len(a["nodes"]) for a in j["attempts"]] == [3, 2]
    assert "world 2" in out.split("[swarmd] restart")[1] and "resumed from epoch" in out
    assert accuracy(out) > 0.9


def test_a_shrunk_job_grows_back_at_its_next_checkpoint_once_a_host_is_free_again(healthy, tmp_path):
    """Issue 28: shrunk to its survivors, a 2:3 job takes a revived host back at the first
    checkpoint after h1 sees it alive: one restart from that checkpoint, not counted as one."""
    lab = healthy
    lab.crash("h4")
    h4 = lab.state.host("h4").peer_id

    def h4_is(state: str) -> bool:
        return any(p["peer"] == h4 and p["state"] == state for p in call(lab, "h1", "peers")["peers"])

    until(lambda: h4_is("dead"), 30, "h1 sees h4 dead", interval=0.2)
    epochs = DIGITS.index("--epochs") + 1
    job = submit(lab, tmp_path, "--nodes", "2:3", "--max-restarts", "1",
                 *DIGITS[:epochs], "30", *DIGITS[epochs + 1:])
    until(lambda: a_replicated_checkpoint(lab, job), 120, "a checkpoint on two hosts", interval=0.2)
    lab.crash(a_job_host_not(lab, job, "h1"))
    until(lambda: len(show(lab, job)["attempts"]) == 2, 60, "the job shrinks to its survivors", interval=0.2)
    lab.revive("h4")
    until(lambda: h4_is("alive"), 30, "h1 sees h4 alive again", interval=0.2)
    j = wait_end(lab, job)
    out = logs(lab, job)
    assert (j["state"], j["exit_code"]) == ("succeeded", 0), (j["reason"], out[-3000:])
    assert [len(a["nodes"]) for a in j["attempts"]] == [3, 2, 3], \
        ([(len(a["nodes"]), a["why"]) for a in j["attempts"]], daemon_said(lab, "h1", job))
    shrunk, grew = j["attempts"][1:]
    assert shrunk["why"].startswith("growing from 2 to 3 nodes at checkpoint epoch-") and h4[-8:] in shrunk["why"]
    assert h4 in grew["nodes"] and grew["resumed_from"] and grew["resumed_from"] in shrunk["why"]
    assert j["restarts"][0] == 1, "the growth spent no restart"
    assert "[swarmd] growing from 2 to 3 nodes at checkpoint" in out
    assert "world 3" in out.split("[swarmd] growing from")[1], "the grown attempt has 3 nodes"
    shown = swarmctl(lab, "h1", "jobs", "show", job).stdout
    assert "growing from 2 to 3 nodes" in shown and "at most once per 5m" in shown, shown
    assert accuracy(out) > 0.9


def test_a_daemon_killed_with_sigkill_takes_its_ranks_with_it_and_the_job_moves(healthy, tmp_path):
    lab = healthy
    job = submit(lab, tmp_path, "--nodes", "3", "--max-restarts", "1", *DIGITS)
    until(lambda: a_replicated_checkpoint(lab, job), 120, "a checkpoint on two hosts", interval=0.2)
    victim = a_job_host_not(lab, job, "h1")
    netns = lab.state.host(victim).netns
    lab.kill(victim, signal.SIGKILL)

    def ranks_left() -> list[int]:
        return [p for p in labmod.netns_pids(f"/run/netns/{netns}")
                if "ddp_digits" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]

    until(lambda: not ranks_left(), 10, f"the ranks on {victim} stopped with their daemon", detail=ranks_left)
    j = wait_end(lab, job)
    assert j["state"] == "succeeded" and len(j["attempts"]) == 2, (j["reason"], logs(lab, job)[-3000:])
    assert victim not in {host_of(lab, p) for p in j["attempts"][1]["nodes"]}


def test_a_rank_failing_every_attempt_is_restarted_max_restarts_times_then_fails(healthy, tmp_path):
    lab = healthy
    work = tmp_path / "w"
    work.mkdir()
    (work / "job.py").write_text(FAILS_EVERY_TIME)
    r = swarmctl(lab, "h1", "jobs", "run", "--nodes", "3", "--max-restarts", "2", "--workdir", str(work), "--",
                 "python", "job.py", timeout=240)
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    j = call(lab, "h1", "jobs.ls")["jobs"][0]
    assert j["state"] == "failed" and len(j["attempts"]) == 3
    assert "restarts exhausted (2/2)" in j["reason"] and "#1 rank 1 on" in j["reason"] and "#3 rank 1" in j["reason"]
    assert "restarting (1/2)" in r.stderr and "restarting (2/2)" in r.stderr, r.stderr[-3000:]
    attempts = sorted({t.split()[1] for texts in rank_lines(r.stdout).values() for t in texts if t.startswith("attempt")})
    assert attempts == ["0", "1", "2"], "TORCHELASTIC_RESTART_COUNT counts the attempts"


def test_cancel_during_a_restart_stops_everything(healthy, tmp_path):
    lab = healthy
    work = tmp_path / "w"
    work.mkdir()
    (work / "job.py").write_text(STUBBORN)
    job = submit(lab, tmp_path, "--nodes", "3", "--max-restarts", "3", "--workdir", str(work), "--", "python", "job.py")
    until(lambda: show(lab, job)["state"] == "restarting", 60, "the job restarting", interval=0.05)
    assert swarmctl(lab, "h1", "jobs", "cancel", job).returncode == 0
    j = wait_end(lab, job, timeout=60)
    assert j["state"] == "cancelled" and j["exit_code"] == 130, j
    left = subprocess.run(["pgrep", "-f", "job.py"], capture_output=True, text=True).stdout.strip()
    assert left == "", "no rank of any attempt is left"
    assert len(j["attempts"]) == 1, "nothing was started after the cancel"


def views(lab, among: tuple[str, ...]) -> dict:
    """What each of `among` sees of every member (a failed wait for a successor shows why)."""
    names = {h.peer_id: h.name for h in lab.state.hosts}
    out = {}
    for h in among:
        try:
            out[h] = {names.get(p["peer"], p["peer"][-8:]): p["state"] for p in call(lab, h, "peers")["peers"]}
        except Exception as exc:  # noqa: BLE001 - a daemon that does not answer says so
            out[h] = repr(exc)[:200]
    return out


def steps_job(lab, tmp_path: Path, steps: int) -> str:
    """A detached 3-host job submitted from h1 and placed on h2-h4 (so h1 is no host of it),
    each rank printing `steps` numbered steps; returned once every rank printed."""
    work = tmp_path / "w"
    work.mkdir()
    (work / "job.py").write_text(STEPS)
    hosts = [f"--host={lab.state.host(h).peer_id}" for h in ("h2", "h3", "h4")]
    job = submit(lab, tmp_path, "--nodes", "3", "--max-restarts", "1", *hosts, "--workdir", str(work), "--",
                 "python", "job.py", str(steps))
    until(lambda: len(rank_lines(logs(lab, job))) == 3, 60, "every rank's first steps", interval=0.3)
    return job


def coordinator_of(lab, job: str, among: tuple[str, ...]) -> str | None:
    """The host among `among` whose daemon coordinates `job` now (its status lists it)."""
    for h in among:
        try:
            if job in call(lab, h, "status")["jobs"]["coordinating"]:
                return h
        except Exception:  # a crashed or restarting daemon
            continue
    return None


def test_a_detached_job_outlives_its_submitter_and_its_owner_sees_all_of_it_later(healthy, tmp_path):
    lab = healthy
    job = steps_job(lab, tmp_path, 60)
    first = show(lab, job)
    assert set(first["replicas"]["replicas"]) == {h.peer_id for h in lab.state.hosts}, first["replicas"]
    lab.crash("h1")
    took = until(lambda: coordinator_of(lab, job, ("h2", "h3", "h4")) is not None, 30,
                 "a replica coordinates the job", interval=0.2)
    assert took < 15, f"the successor took {took:.1f} s (target 5 s)"
    successor = coordinator_of(lab, job, ("h2", "h3", "h4"))
    until(lambda: coordinator_of(lab, job, (successor,)) is None, 90, "the job ends on its successor", interval=0.5)
    lab.revive("h1")
    until(lambda: show(lab, job)["state"] in ("succeeded", "failed", "cancelled"), 60, "the owner sees the end",
          interval=0.5, detail=lambda: show(lab, job))
    j = show(lab, job)
    out = logs(lab, job)
    assert (j["state"], j["exit_code"]) == ("succeeded", 0), (j["reason"], out[-3000:])
    assert len(j["attempts"]) == 1, "the ranks went on: no restart"
    successor_id = lab.state.host(successor).peer_id
    assert j["handover"]["coordinator"] == successor_id and j["handover"]["epoch"] >= 1, j
    by_rank = rank_lines(out)
    said = [t for t in by_rank[0] if t.startswith("[swarmd]")]
    assert len(said) == 1 and "took the job over at epoch" in said[0], said
    for rank in (0, 1, 2):
        steps = [t for t in by_rank[rank] if not t.startswith("[swarmd]")]
        assert steps == [f"step {i} of rank {rank} attempt 0" for i in range(60)], \
            f"rank {rank}'s output, every line once and in order: {steps}"
    shown = swarmctl(lab, "h1", "jobs", "show", job).stdout
    assert f"epoch {j['handover']['epoch']}" in shown and successor_id[-8:] in shown, shown


def test_a_partitioned_submitter_stands_down_and_the_job_runs_once(healthy, tmp_path):
    lab = healthy
    job = steps_job(lab, tmp_path, 120)  # 60 s: it outlasts the partition and h1's standing down
    cut = time.monotonic()
    for other in ("h2", "h3", "h4"):  # h1 isolated, not killed: it goes on believing it coordinates
        lab.set_link("h1", other, up=False)
    until(lambda: coordinator_of(lab, job, ("h2", "h3", "h4")) is not None, 30, "a replica coordinates the job",
          interval=0.2)
    successor = coordinator_of(lab, job, ("h2", "h3", "h4"))
    # the partition lasts 30 s (it was 60: make test's time), past h1's job timers (its hosts' streams count
    # as silent after 2 s) and, in the runs seen, its suspicion of the hosts (10-15 s; the crash test once saw
    # 27 s): all along, one coordinator on the hosts' side
    while time.monotonic() - cut < 30:
        acting = [h for h in ("h2", "h3", "h4") if coordinator_of(lab, job, (h,))]
        assert acting == [successor], acting
        time.sleep(1)
    for other in ("h2", "h3", "h4"):
        lab.set_link("h1", other, up=True)
    until(lambda: coordinator_of(lab, job, ("h1",)) is None, 60, "h1 stands down once it sees the higher epoch",
          interval=0.5)
    until(lambda: show(lab, job)["state"] in ("succeeded", "failed", "cancelled"), 120, "the owner sees the end",
          interval=0.5, detail=lambda: show(lab, job))
    j, out = show(lab, job), logs(lab, job)
    assert (j["state"], j["exit_code"]) == ("succeeded", 0), (j["reason"], out[-3000:])
    assert len(j["attempts"]) == 1, "the job ran once: no restart by either side"
    assert j["handover"]["coordinator"] == lab.state.host(successor).peer_id, j["handover"]
    for rank, texts in rank_lines(out).items():
        steps = [t for t in texts if not t.startswith("[swarmd]")]
        assert steps == [f"step {i} of rank {rank} attempt 0" for i in range(120)], \
            f"rank {rank}: every step once, none stopped by h1: {steps[-5:]}"


def restart_detail(lab, job: str, successor: str) -> dict:
    """A failed wait's evidence: the job as its owner (h1) follows it, the views of the members,
    and the successor's log lines about the job (its placement's refusals among them)."""
    out: dict = {"views": views(lab, ("h1", "h2", "h3", "h4"))}
    try:
        j = show(lab, job)
        out["job"] = {k: j.get(k) for k in ("state", "phase", "reason", "node_state", "nodes", "handover")}
    except Exception as exc:  # noqa: BLE001 - evidence only: the wait has failed already
        out["job"] = repr(exc)[:200]
    with open(lab.state.host(successor).log, errors="replace") as f:
        out["successor_log"] = [line.strip()[:400] for line in f if job in line][-12:]
    return out


def test_a_coordinator_crashing_mid_restart_hands_the_restart_over(healthy, tmp_path):
    """The restart is held open by capacity, not by timing: h1's two slots are taken by jobs h2
    coordinates, so once a host of the 3-node job is lost the restart waits for a third host
    (`--wait`). h1, the coordinator, crashes while it waits; a replica takes the restart over and
    places it on h1 once h1 is back with its slots free."""
    lab = healthy
    idle = workdir(tmp_path, "import time\ntime.sleep(600)\n")
    on_h1 = f"--host={lab.state.host('h1').peer_id}"
    blockers = []
    for _ in range(2):
        r = swarmctl(lab, "h2", "jobs", "run", "--detach", "--nodes", "1", on_h1, "--workdir", str(idle), "--",
                     "python", "job.py")
        assert r.returncode == 0, r.stderr[-3000:]
        blockers.append(r.stdout.strip())
    until(lambda: all(call(lab, "h2", "jobs.show", id=b)["state"] == "running" for b in blockers), 60,
          "h1's two slots taken", interval=0.2)
    job = submit(lab, tmp_path, "--nodes", "3", "--max-restarts", "2", "--wait", "5m", *DIGITS)
    until(lambda: a_replicated_checkpoint(lab, job), 120, "a checkpoint on two hosts", interval=0.2)
    assert "h1" not in {host_of(lab, p) for p in show(lab, job)["nodes"]}
    victim = host_of(lab, show(lab, job)["nodes"][-1])  # not rank 0's host, which wrote the checkpoints
    lab.crash(victim)
    # the lost host leaves the job's quorum (a majority of the four replicas, and of the three
    # left): two of them are then enough for a successor, so the coordinator may go next
    until(lambda: lab.state.host(victim).peer_id in (show(lab, job)["replicas"] or {}).get("removed", []), 30,
          "the lost host out of the job's quorum", interval=0.2,
          detail=lambda: {k: show(lab, job)[k] for k in ("state", "phase", "node_state", "replicas", "reason")})
    until(lambda: (show(lab, job)["state"], show(lab, job)["phase"]) == ("restarting", "placing"), 30,
          "the restart waiting for a third host", interval=0.2, detail=lambda: show(lab, job))
    lab.crash("h1")  # the coordinator goes too, in the middle of the restart
    survivors = tuple(h for h in ("h2", "h3", "h4") if h != victim)
    # wide: what this test is about is the restart handed over, not how soon (the outlives test and
    # make bench time that); once, in 7 runs, membership took over 27 s to suspect h1 here
    until(lambda: coordinator_of(lab, job, survivors) is not None, 90, "a replica takes the restart over",
          interval=0.2, detail=lambda: views(lab, survivors))
    successor = coordinator_of(lab, job, survivors)
    lab.revive("h1")  # its slots are free again: the blockers' ranks died with it
    until(lambda: coordinator_of(lab, job, (successor,)) is None, 240, "the job ends on its successor", interval=0.5,
          detail=lambda: restart_detail(lab, job, successor))
    until(lambda: show(lab, job)["state"] in ("succeeded", "failed", "cancelled"), 60, "the owner sees the end",
          interval=0.5, detail=lambda: show(lab, job))
    j, out = show(lab, job), logs(lab, job)
    assert (j["state"], j["exit_code"]) == ("succeeded", 0), (j["reason"], out[-3000:])
    assert j["handover"]["coordinator"] == lab.state.host(successor).peer_id, j["handover"]
    assert len(j["attempts"]) == 2, j["attempts"]
    assert {host_of(lab, p) for p in j["attempts"][1]["nodes"]} == {*survivors, "h1"}, j["attempts"]
    assert j["attempts"][1]["resumed_from"] and j["attempts"][1]["resumed_from"].startswith("epoch-"), j["attempts"]
    assert "world 3" in out.split("[swarmd] restart")[-1] and "resumed from epoch" in out, out[-3000:]
    assert accuracy(out) > 0.9
