"""The fence on a 3-host lab (issue 13): a daemon SIGKILLed while its host runs ranks of a
job leaves none of them running unsupervised. Its reaper (sandbox/reaper.py) kills them,
and what they left in the job's cgroup, within seconds, without waiting for the daemon's
next start; the other hosts' ranks are the coordinator's business."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

import pytest

from sim.netlab.lab import netns_pids

from .support import job_logs, rank_lines, swarmctl, three_hosts, until

pytestmark = [pytest.mark.netlab, pytest.mark.slow]
GONE_WITHIN = 5.0

# a rank, and a child of it that left its group (only the job's cgroup still holds it)
SLEEPER = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[0]], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def fl():
    with three_hosts("f", mesh=False) as lab:
        yield lab


def job_processes(lab, host: str, script: str) -> dict[int, bytes]:
    """The processes of the job on `host` (in its network namespace, `script` in their
    argv), with their argv."""
    found = {}
    for pid in netns_pids(f"/run/netns/{lab.state.host(host).netns}"):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if script.encode() in argv:
            found[pid] = argv
    return found


def test_a_daemon_killed_with_sigkill_takes_its_ranks_with_it(fl, tmp_path):
    script = f"fence_{uuid.uuid4().hex[:8]}.py"
    work = tmp_path / "work"
    work.mkdir()
    (work / script).write_text(SLEEPER)
    r = swarmctl(fl, "h1", "jobs", "run", "--detach", "--nodes", "3", "--workdir", str(work), "--", "python", script)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    until(lambda: len(rank_lines(job_logs(fl, "h1", job))) == 3, 60, "all 3 ranks ready")
    until(lambda: any(b"time.sleep(600)" in argv for argv in job_processes(fl, "h2", script).values()), 10,
          "the rank's setsid'd child on h2")

    fl.kill("h2", signal.SIGKILL)
    took = until(lambda: not job_processes(fl, "h2", script), GONE_WITHIN,
                 "h2's ranks and what they left gone with their daemon", interval=0.02,
                 detail=lambda: f"left: {job_processes(fl, 'h2', script)}")
    print(f"h2's job processes gone {took:.2f} s after its daemon's SIGKILL")
    fl.start("h2")  # the module's lab whole again
