"""Shared fixtures: real swarmd processes on loopback, each with its own state and socket."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from swarmd.rpc.client import Client, DaemonUnreachable

SWARMD = [sys.executable, "-m", "swarmd.main"]
START_TIMEOUT = 30.0  # generous: libp2p's import alone is ~1 s on an idle 2-core machine


@pytest.fixture
def own_firewall_table(monkeypatch) -> None:
    """A sandbox a test opens in its own process gets a job table no daemon sweeps: a daemon
    removes `swarmd_jobs_<pid>` when that pid runs no swarmd (a killed daemon's), and pytest's is
    none, so another worker's daemon starting deleted a test's table while its job opened. A
    table a killed test run left (its pid gone) is deleted here instead."""
    import re
    import shutil

    from swarmd.compute.host.sandbox import firewall

    if os.geteuid() == 0 and shutil.which("nft"):
        listed = subprocess.run(["nft", "list", "tables", "inet"], capture_output=True, text=True).stdout
        for pid in re.findall(r"^table inet swarmd_test_([1-9][0-9]{0,9})$", listed, re.M):
            if not os.path.exists(f"/proc/{pid}"):
                subprocess.run(["nft", "delete", "table", "inet", f"swarmd_test_{pid}"], capture_output=True)
    monkeypatch.setattr(firewall, "table_for", lambda pid: f"swarmd_test_{pid}")


def port_to_give() -> int:
    """A TCP port on 127.0.0.1 for a process a test starts to listen on: free now, and below both
    the kernel's ephemeral range (ip_local_port_range, 32768 up by default), so no process's
    outgoing connection takes it before the listener binds (a port bound to 0 and let go returns
    to that pool: under two workers a job's server then failed to bind), and the serve ports a
    daemon hands its replicas (30000-30999 by default), which another worker's daemon may use."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    top = min(30_000, low)
    if top <= 10_000:
        raise RuntimeError(f"the ephemeral range starts at {low}: no room below it for a port to give")
    for _ in range(200):
        port = random.randrange(10_000, top)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 10000-{top - 1}")


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02, detail=None):
    """Poll ``predicate`` until it returns a truthy value; fail naming ``what`` (and ``detail()``,
    if given). Between looks it waits ``interval``, or as long as the look took if longer (a
    look may run a process)."""
    deadline = time.monotonic() + timeout
    while True:
        began = time.monotonic()
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}" + (f"; {detail()}" if detail else ""))
        time.sleep(max(interval, time.monotonic() - began))


@dataclass
class Daemon:
    state_dir: Path
    socket: Path
    log: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [*SWARMD, "--state-dir", str(self.state_dir), "--socket", str(self.socket),
                "--listen", "/ip4/127.0.0.1/tcp/0", "--metrics-addr", "off",
                "--config", str(self.state_dir.parent / "empty.toml"), "--mdns", "off",
                "--gossip-timing", "local", "--mesh", "off", "--gateway-listen", "off", *self.args]

    def start(self, wait: bool = True) -> Daemon:
        (self.state_dir.parent / "empty.toml").touch()
        env = {**os.environ, "SWARMD_LOG_FORMAT": "json", **self.env}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=log, env=env)
        if wait:
            wait_until(self.ready, START_TIMEOUT, f"swarmd on {self.socket} (log: {self.log})")
        return self

    def ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"swarmd exited with {self.proc.returncode}:\n{self.log.read_text()}")
        try:
            with Client(str(self.socket), timeout=2) as c:
                c.call("status")
            return True
        except DaemonUnreachable:
            return False

    def client(self, timeout: float = 5.0) -> Client:
        return Client(str(self.socket), timeout=timeout)

    def call(self, method: str, **params):
        with self.client() as c:
            return c.call(method, **params)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def short_lived_invite(owner: Daemon, cert_ttl: float) -> str:
    """An invite token for one node whose certificate lasts ``cert_ttl`` seconds, shorter than
    `swarm invite` grants (a minute at least), so that a test sees a certificate renewed or
    lapse in seconds. Made as `swarm invite` makes one: signed with the owner's key, naming its
    listen addresses, and recorded in its invites (read from disk at each join)."""
    from swarmd.gossip import swarmstate
    from swarmd.gossip.cert import make_token, read_ticket
    from swarmd.p2p.signed import peer_bytes

    status = owner.call("status")
    me = status["peer_id"]
    m = swarmstate.load(owner.state_dir, peer_bytes(me))
    assert m is not None and m.is_owner, "short_lived_invite: the node is not a swarm's owner"
    addrs = [a if "/p2p/" in a else f"{a}/p2p/{me}" for a in status["listen_addrs"]]
    token = make_token(swarmstate.owner_signer(m), m.owner_public, addrs, now=time.time(), expires_in=600.0,
                       cert_ttl=cert_ttl)
    ticket = read_ticket(token.ticket, owner_public=m.owner_public, now=time.time())
    invites = swarmstate.load_invites(owner.state_dir)
    invites.add(ticket.nonce, uses=ticket.uses, expires=ticket.expires, now=time.time())
    swarmstate.save_invites(owner.state_dir, invites)
    return token.encode()


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator:
    made: list[Daemon] = []

    def make(name: str = "d", args: list[str] | None = None, env: dict[str, str] | None = None,
             start: bool = True) -> Daemon:
        base = tmp_path / name
        base.mkdir(exist_ok=True)
        d = Daemon(state_dir=base / "state", socket=base / "swarmd.sock", log=base / "swarmd.log",
                   args=args or [], env=env or {})
        made.append(d)
        return d.start() if start else d

    yield make
    for d in made:
        d.kill()


@pytest.fixture
def daemon(make_daemon) -> Daemon:
    return make_daemon()


def root_only() -> pytest.MarkDecorator:
    return pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runs a client as another uid)")
