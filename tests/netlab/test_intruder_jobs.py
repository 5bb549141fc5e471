"""A certified member turned bad attacks a host's jobs (sim/netlab/intruder.py, job-*): every
attack is refused and counted, and the victim stays healthy with nothing lost (a real job
running through the attack finishes with all its output, and a new one runs afterwards).

h1 is the victim, h2 a real coordinator, and the intruder runs in h3's namespace with a
certificate it issued itself with the owner key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sim.netlab.lab import SWARMD_PORT

from .support import call, job_logs, swarmctl, three_hosts, until

pytestmark = [pytest.mark.netlab, pytest.mark.slow]

# a real job that outlives the attacks: ready, a while, then done
STEADY = "import time; print('ready', flush=True); time.sleep({s}); print('done', flush=True)"


@pytest.fixture(scope="module")
def jl():
    with three_hosts("i", mesh=False) as lab:
        yield lab


def intruder(lab, attack: str, *extra: str, timeout: float = 120) -> str:
    h1 = lab.state.host("h1")
    proc = subprocess.run(
        ["ip", "netns", "exec", lab.state.host("h3").netns, sys.executable, "-m", "sim.netlab.intruder", attack,
         "--target", f"/ip4/{h1.address}/tcp/{SWARMD_PORT}/p2p/{h1.peer_id}", "--owner-dir", h1.state_dir, *extra],
        capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(proc.stdout.strip().splitlines()) == 1, proc.stdout
    return proc.stdout


def rejected(lab) -> dict[str, int]:
    return call(lab, "h1", "status")["gossip"]["rejected"]


def jobs_status(lab, host: str = "h1") -> dict:
    return call(lab, host, "status")["jobs"]


def steady_job(lab, seconds: float) -> str:
    """A 3-node job coordinated by h2 (so it has ranks on the victim); its id once all run."""
    r = swarmctl(lab, "h2", "jobs", "run", "--detach", "--nodes", "3", "--", "python", "-c", STEADY.format(s=seconds))
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    until(lambda: job_logs(lab, "h2", job).count("ready") == 3, 60, "all 3 ranks ready")
    return job


def finishes_whole(lab, job: str) -> None:
    until(lambda: call(lab, "h2", "jobs.show", id=job)["state"] not in ("running", "starting"), 120, "job ended")
    shown = call(lab, "h2", "jobs.show", id=job)
    assert shown["state"] == "succeeded", shown
    logs = swarmctl(lab, "h2", "jobs", "logs", job).stdout
    assert logs.count("ready") == 3 and logs.count("done") == 3, logs


def healthy(lab) -> None:
    """The victim is up, its slots are free again, and a new job runs there."""
    slots = jobs_status(lab)
    until(lambda: jobs_status(lab)["slots_free"] == slots["slots"] and jobs_status(lab)["ranks_here"] == 0, 30,
          "the victim's slots free", detail=lambda: jobs_status(lab))
    r = swarmctl(lab, "h1", "jobs", "run", "--nodes", "3", "--", "python", "-c", "print('still here')")
    assert r.returncode == 0 and r.stdout.count("still here") == 3, r.stderr[-3000:]


def test_path_like_and_oversize_job_ids_are_refused_and_nothing_is_made(jl):
    jobs_dir = Path(jl.state.host("h1").state_dir).with_name("state-jobs")
    planted = Path("/tmp/swarmd-intruder-x")
    subprocess.run(["rm", "-rf", str(planted)], check=True)
    before, entries = rejected(jl), set(os.listdir(jobs_dir)) if jobs_dir.exists() else set()
    out = intruder(jl, "job-ids")
    assert "8 refused" in out, out
    until(lambda: rejected(jl).get("job_id", 0) >= before.get("job_id", 0) + 8, 10, "bad ids counted",
          detail=lambda: rejected(jl))
    assert not planted.exists(), "a job id never becomes a path"
    assert not os.path.exists("/var/lib/swarmd/work") and not os.path.exists("/etc/work")
    after = set(os.listdir(jobs_dir)) if jobs_dir.exists() else set()
    assert after - entries == set(), "no directory was made for a refused id"
    healthy(jl)


def test_start_without_commit_is_refused(jl):
    before = rejected(jl)
    out = intruder(jl, "job-no-commit")
    assert "never committed" in out, out
    until(lambda: rejected(jl).get("not_committed", 0) > before.get("not_committed", 0), 10, "counted")
    healthy(jl)


def test_another_coordinators_job_cannot_be_started_cancelled_or_released(jl):
    job = steady_job(jl, 25)
    before = rejected(jl)
    out = intruder(jl, "job-foreign", "--job", job)
    assert "3 refused" in out and "another coordinator" in out, out
    until(lambda: rejected(jl).get("not_holder", 0) >= before.get("not_holder", 0) + 3, 10, "counted")
    assert call(jl, "h2", "jobs.show", id=job)["state"] == "running", "the job went on"
    finishes_whole(jl, job)
    healthy(jl)


def test_more_ranks_than_reserved_are_refused(jl):
    before = rejected(jl)
    out = intruder(jl, "job-ranks")
    assert "reserved 1 rank(s) here, 8 asked" in out, out
    until(lambda: rejected(jl).get("ranks", 0) > before.get("ranks", 0), 10, "counted")
    healthy(jl)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_coordinator_that_never_reads_costs_lines_not_memory(jl):
    pid = jl.state.host("h1").pid
    job = steady_job(jl, 40)  # a real job beside it keeps every line
    dropped = jobs_status(jl)["output_dropped"]
    baseline = rss_mib(pid)
    peak = [baseline]
    proc = subprocess.Popen(
        ["ip", "netns", "exec", jl.state.host("h3").netns, sys.executable, "-m", "sim.netlab.intruder", "job-no-read",
         "--target", f"/ip4/{jl.state.host('h1').address}/tcp/{SWARMD_PORT}/p2p/{jl.state.host('h1').peer_id}",
         "--owner-dir", jl.state.host("h1").state_dir, "--seconds", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def over() -> bool:
        peak[0] = max(peak[0], rss_mib(pid))
        return proc.poll() is not None

    until(over, 90, "the intruder done", interval=0.2)
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    until(lambda: jobs_status(jl)["output_dropped"] > dropped, 30, "lines left off the stream, counted",
          detail=lambda: jobs_status(jl))
    growth = peak[0] - baseline
    print(f"victim RSS: {baseline:.0f} MiB before, {peak[0]:.0f} MiB at peak (+{growth:.0f} MiB); "
          f"{jobs_status(jl)['output_dropped'] - dropped} lines dropped from the stream")
    assert growth < 32, f"the daemon grew by {growth:.0f} MiB under a coordinator that never reads"
    finishes_whole(jl, job)
    healthy(jl)
