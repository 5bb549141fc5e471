"""What the lab tests share: calling a host's daemon, and waiting for a condition."""

from __future__ import annotations

import subprocess
import time

from swarmd.rpc.client import Client


def call(lab, host: str, method: str, **params):
    with Client(lab.state.host(host).socket, timeout=10) as c:
        return c.call(method, **params)


def until(predicate, timeout: float, what: str, interval: float = 0.05, detail=None) -> float:
    """Seconds until ``predicate()`` holds; fails naming ``what`` (and ``detail()``, if given)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}" + (f"; {detail()}" if detail else ""))
        time.sleep(interval)
    return time.monotonic() - start


def in_netns(lab, host: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", lab.state.host(host).netns, *argv],
                          capture_output=True, text=True, timeout=timeout)
