"""What the lab tests share: a 3-host lab for a module, calling a host's daemon and its
swarmctl, and waiting for a condition."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from sim.netlab import lab as labmod
from sim.netlab import topology
from swarmd.rpc.client import Client


def call(lab, host: str, method: str, **params):
    with Client(lab.state.host(host).socket, timeout=10) as c:
        return c.call(method, **params)


def job_logs(lab, host: str, job: str) -> str:
    """A job's output as `swarmctl jobs logs` prints it (``[rank K] text`` lines), read over the
    host's socket in this process: what a wait polls, for a poll by a swarmctl process (Python's
    start-up, half a core while a wait lasts) takes a core from the lab's ranks. The text is
    swarmctl's (test_jobs_local.py and the lab's job tests read swarmctl's own)."""
    with Client(lab.state.host(host).socket, timeout=30) as c:
        return "".join(f"[rank {r}] {text}\n" for event in c.stream("jobs.logs", id=job, follow=False)
                       for r, text in event.get("out", ()))


def until(predicate, timeout: float, what: str, interval: float = 0.05, detail=None) -> float:
    """Seconds until ``predicate()`` holds; fails naming ``what`` (and ``detail()``, if given).
    Between looks it waits ``interval``, or as long as the look itself took if that is longer:
    a predicate that runs `swarmctl` (a Python process) must not take a core from the lab."""
    start = time.monotonic()
    while True:
        began = time.monotonic()
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}" + (f"; {detail()}" if detail else ""))
        time.sleep(max(interval, time.monotonic() - began))


def handed_over_and_back(lab, job: str, replicas: Sequence[str] = ("h2", "h3")) -> None:
    """h1, the job's submitter, crashes: one of ``replicas`` takes the job over; h1 comes back
    (revived even when the wait fails) and follows the successor as the owner's front end."""
    lab.crash("h1")
    try:
        until(lambda: any(job in call(lab, h, "status")["jobs"]["coordinating"] for h in replicas), 30,
              "a replica coordinates the job", interval=0.3)
    finally:
        lab.revive("h1")
    h1 = lab.state.host("h1").peer_id
    until(lambda: (call(lab, "h1", "jobs.show", id=job).get("handover") or {}).get("coordinator") not in (None, h1),
          60, "h1 follows the successor", interval=0.5, detail=lambda: call(lab, "h1", "jobs.show", id=job))


def in_netns(lab, host: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", lab.state.host(host).netns, *argv],
                          capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def formed(prefix: str, n: int, rtt_ms: Callable[[Any, Any], float], *, mesh: bool,
           daemon_args: Sequence[str] = ()) -> Iterator[labmod.Lab]:
    """A formed lab of ``n`` hosts, links by ``rtt_ms(a, b)``, for a module's tests; always torn
    down. `daemon_args`: extra swarmd flags for every host."""
    if os.geteuid() != 0:
        pytest.skip("netlab needs root (network namespaces); CI runs as root")
    name = f"{prefix}{uuid.uuid4().hex[:6]}"
    hosts, links = topology.plan(n, rtt_ms)
    lab = labmod.Lab.up(name, hosts, links, mesh=mesh, daemon_args=daemon_args)
    try:
        lab.wait_formed()
        yield lab
    finally:
        labmod.down(name)


def three_hosts(prefix: str, *, mesh: bool, daemon_args: Sequence[str] = (), rtt_ms: float = 10.0
                ) -> contextlib.AbstractContextManager[labmod.Lab]:
    """A formed 3-host lab on uniform links (`rtt_ms`)."""
    return formed(prefix, 3, topology.uniform(rtt_ms), mesh=mesh, daemon_args=daemon_args)


def swarmctl(lab, host: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The real swarmctl against a lab host's daemon, as its user would run it."""
    env = {**os.environ, "SWARMD_SOCKET": lab.state.host(host).socket, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "swarmctl.main", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def workdir(tmp_path: Path, script: str) -> Path:
    """A job's workdir holding `script` as job.py."""
    d = tmp_path / "work"
    d.mkdir(exist_ok=True)
    (d / "job.py").write_text(script)
    return d


def rank_lines(stdout: str) -> dict[int, list[str]]:
    """A job's output as swarmctl prints it (`[rank K] text`), by rank."""
    out: dict[int, list[str]] = {}
    for line in stdout.splitlines():
        if line.startswith("[rank "):
            head, _, text = line.partition("] ")
            out.setdefault(int(head[6:]), []).append(text)
    return out
