"""Bounded memory (no root needed): one daemon, many jobs, and a reader that never reads.

- RSS of the daemon at start (in a swarm, idle), after JOBS trivial jobs run one after the
  other to the end (each leaves a row, a log and a job directory behind: none of it may live
  in memory), and the growth per job.
- A `jobs.run` client that submits a job printing NOISE_MB of output and never reads its
  stream: the daemon's RSS while the job runs and after,. The log is on disk first; what the client does not read costs it lines,
  never the daemon's memory.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

import psutil

from swarmd.rpc.client import Client
from swarmd.rpc.framing import encode_frame

from .__main__ import start, stop

JOBS = 1000
NOISE_MB = 200
NOISY = ("import sys\nline = 'x' * 1023 + '\\n'\nfor _ in range({n}):\n    sys.stdout.write(line)\n"
         "sys.stdout.flush()\n")


def _rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def _run_to_end(c: Client, spec: dict) -> str:
    for event in c.stream("jobs.run", spec=spec):
        if "end" in event:
            return event["end"]["state"]
    raise RuntimeError("the job stream ended without an end")


def measure() -> dict[str, float]:
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        jobs_dir = base / "jobs"
        jobs_dir.mkdir(mode=0o711)
        proc, sock, _ = start(base / "d", extra=["--jobs-dir", str(jobs_dir)])
        try:
            with Client(str(sock), timeout=60) as c:
                c.call("swarm.init")
                deadline = time.monotonic() + 30
                while not c.call("status").get("record"):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the node never published its own record")
                    time.sleep(0.05)
                _run_to_end(c, {"cmd": ["true"], "nodes": 1})  # warm: the first job imports the executor's parts
                before = _rss_mb(proc.pid)
                t0 = time.monotonic()
                for i in range(JOBS):
                    state = _run_to_end(c, {"cmd": ["true"], "nodes": 1})
                    if state != "succeeded":
                        raise RuntimeError(f"bench job {i} ended {state}")
                took = time.monotonic() - t0
                after = _rss_mb(proc.pid)
            results |= {"rss_before_jobs_mb": before, f"rss_after_{JOBS}_jobs_mb": after,
                        "rss_growth_per_job_kb": (after - before) * 1024 / JOBS,
                        "jobs_per_s_sequential": JOBS / took}

            results |= _never_reads(proc.pid, sock)
        finally:
            stop(proc)
    return results


def _never_reads(pid: int, sock: Path) -> dict[str, float]:
    """A client submits a job that prints NOISE_MB and then stops reading."""
    before = _rss_mb(pid)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(str(sock))
    spec = {"cmd": ["python", "-c", NOISY.format(n=NOISE_MB * 1024)], "nodes": 1}
    s.sendall(encode_frame({"id": 1, "method": "jobs.run", "params": {"spec": spec}}))
    peak = before
    t0 = time.monotonic()
    with Client(str(sock), timeout=30) as c:
        while time.monotonic() - t0 < 300:
            peak = max(peak, _rss_mb(pid))
            jobs = c.call("jobs.ls")["jobs"]
            if jobs and jobs[0]["state"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.2)
        else:
            raise RuntimeError("the noisy job did not end within 300 s")
    s.close()
    return {"never_reads_rss_before_mb": before, f"never_reads_rss_peak_{NOISE_MB}mb_output_mb": peak,
            "never_reads_rss_after_mb": _rss_mb(pid)}

