"""wireguard-go between two network namespaces, each backend owned by a process inside its
namespace (tests/netlab/wg_child.py), as the daemon will own it.

Underlay: a veth pair, 10.78.0.1/24 and 10.78.0.2/24. Overlay: 10.211.0.1/16 and .2/16, plus
fd11::1/64 and ::2/64, on interfaces with random names (the UAPI socket directory is shared by
all namespaces).
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nacl.public import PrivateKey

from conftest import wait_until
from swarmd.wg.userspace import SOCKET_DIR

pytestmark = [pytest.mark.netlab, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("wg_child.py")
PORT = 51820
CALL_TIMEOUT = 30.0  # a start on a loaded 2-core machine: python import + wireguard-go spawn


class Child:
    """A wg_child.py process in a namespace; ``call`` sends one request and waits for its reply."""

    def __init__(self, ns: str, iface: str, log: Path, quiet: bool = False) -> None:
        self.log = log
        env = {**os.environ, "PYTHONPATH": str(ROOT), **({"WG_CHILD_QUIET": "1"} if quiet else {})}
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(CHILD), iface],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         cwd=ROOT, env=env)
        self._buf = b""

    def call(self, op: str, timeout: float = CALL_TIMEOUT, **args) -> dict:
        reply = self.request(op, timeout, **args)
        assert reply.pop("ok"), f"{op} failed: {reply['error']}"
        return reply

    def request(self, op: str, timeout: float = CALL_TIMEOUT, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no reply to {op} within {timeout} s; log:\n{self.log.read_text()}")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise AssertionError(f"child exited ({self.proc.wait()}) during {op}; log:\n"
                                         f"{self.log.read_text()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def stop(self, timeout: float = 10.0) -> None:
        """EOF on stdin: the child closes its backend and exits; SIGKILL if it does not."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass  # a write buffered for a dead child


@dataclass
class Host:
    ns: str
    iface: str
    underlay: str
    overlay: str
    overlay6: str
    log: Path
    key: PrivateKey = field(default_factory=PrivateKey.generate)
    child: Child | None = None
    wg_pids: set[int] = field(default_factory=set)  # every wireguard-go seen, for cleanup

    @property
    def public(self) -> bytes:
        return bytes(self.key.public_key)

    @property
    def socket(self) -> Path:
        return SOCKET_DIR / f"{self.iface}.sock"

    def spawn(self, quiet: bool = False) -> Child:
        self.child = Child(self.ns, self.iface, self.log, quiet)
        return self.child

    @property
    def addresses(self) -> list[str]:
        return [f"{self.overlay}/16", f"{self.overlay6}/64"]

    def start(self) -> None:
        self.spawn().call("start", private_key=bytes(self.key).hex(), listen_port=PORT,
                          addresses=self.addresses, mtu=1420)
        self.info()

    def peer_with(self, other: Host, keepalive: int | None = None) -> None:
        self.child.call("set_peers", peers=[{"public": other.public.hex(), "endpoint": f"{other.underlay}:{PORT}",
                                             "allowed_ips": [f"{other.overlay}/32", f"{other.overlay6}/128"],
                                             "keepalive": keepalive}])

    def info(self) -> dict:
        info = self.child.call("info")
        if info["pid"]:
            self.wg_pids.add(info["pid"])
        return info

    def ping(self, other: Host, count: int = 3, v6: bool = False) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.ns, "ping", "-n", "-c", str(count), "-i", "0.2",
                               "-W", "2", other.overlay6 if v6 else other.overlay], capture_output=True, text=True)

    def reaches(self, other: Host) -> bool:
        return self.ping(other, count=1).returncode == 0

    def link_exists(self) -> bool:
        return subprocess.run(["ip", "-n", self.ns, "link", "show", self.iface],
                              capture_output=True).returncode == 0


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def pair(tmp_path):
    tag = uuid.uuid4().hex[:6]
    names = [f"wg{tag}a", f"wg{tag}b"]
    hosts = [Host(ns=n, iface=f"swt{secrets.token_hex(3)}", underlay=f"10.78.0.{i + 1}",
                  overlay=f"10.211.0.{i + 1}", overlay6=f"fd11::{i + 1}", log=tmp_path / f"{n}.log")
             for i, n in enumerate(names)]
    try:
        for n in names:
            subprocess.run(["ip", "netns", "add", n], check=True)
        subprocess.run(["ip", "link", "add", f"v{tag}a", "netns", names[0], "type", "veth", "peer", "name",
                        f"v{tag}b", "netns", names[1]], check=True)
        for h, end in zip(hosts, "ab"):
            batch = f"link set lo up\nlink set v{tag}{end} up\naddr add {h.underlay}/24 dev v{tag}{end}\n"
            subprocess.run(["ip", "-n", h.ns, "-batch", "-"], input=batch, text=True, check=True)
        yield hosts
    finally:
        for h in hosts:
            if h.child is not None:
                h.child.stop()
            # An orphaned wireguard-go exits when its socket goes; kill it anyway if it lingers.
            h.socket.unlink(missing_ok=True)
            for pid in h.wg_pids:
                try:
                    if alive(pid) and b"wireguard-go" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass  # gone meanwhile
        for n in names:
            subprocess.run(["ip", "netns", "del", n], check=False)


def mesh(a: Host, b: Host, keepalive: int | None = None) -> None:
    a.start()
    b.start()
    a.peer_with(b, keepalive)
    b.peer_with(a, keepalive)


def test_ping_both_ways_and_handshake(pair):
    a, b = pair
    mesh(a, b)
    for src, dst, v6 in ((a, b, False), (b, a, False), (a, b, True), (b, a, True)):
        result = src.ping(dst, v6=v6)
        assert result.returncode == 0, f"{src.ns} -> {dst.ns} (v6={v6}):\n{result.stdout}{result.stderr}"
        # wireguard-go queues packets while the first handshake runs: none is lost.
        assert " 0% packet loss" in result.stdout, result.stdout
    shown = subprocess.run(["ip", "netns", "exec", a.ns, "wg", "show", a.iface, "latest-handshakes"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert shown[0] == base64.b64encode(b.public).decode() and int(shown[1]) > 0, shown
    human = subprocess.run(["ip", "netns", "exec", a.ns, "wg", "show", a.iface], capture_output=True,
                           text=True, check=True).stdout
    assert "latest handshake:" in human, human
    state = a.child.call("state")
    peer = state["peers"][b.public.hex()]
    assert state["listen_port"] == PORT
    assert peer["endpoint"] == f"{b.underlay}:{PORT}"
    assert sorted(peer["allowed_ips"]) == [f"{b.overlay}/32", f"{b.overlay6}/128"]
    assert peer["last_handshake"] > time.time() - 60 and peer["rx_bytes"] > 0 and peer["tx_bytes"] > 0
    # The overlay routes come from the addresses' prefixes.
    for family, prefix in (("-4", "10.211.0.0/16"), ("-6", "fd11::/64")):
        route = subprocess.run(["ip", family, "-n", a.ns, "route", "show", "dev", a.iface], capture_output=True,
                               text=True, check=True).stdout
        assert prefix in route, route


def test_killed_wireguard_go_is_restarted_and_peers_repushed(pair):
    a, b = pair
    mesh(a, b, keepalive=25)
    # Both sides initiate a handshake at once here (turning a keepalive on sends one). When the
    # two initiations cross, the tunnel waits for WireGuard's retry after REKEY_TIMEOUT (5 s):
    # measured in 9 of 20 simultaneous configurations. So wait rather than assert.
    wait_until(lambda: a.reaches(b), 30, "A reaching B over the overlay")
    old = a.info()["pid"]
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: (i := a.info())["restarts"] == 1 and i["pid"] not in (None, old), 30,
               "the supervisor to restart wireguard-go")
    assert not alive(old)
    # the supervisor counts the restart, then re-pushes the peers (the owner's on_restart): a
    # reading in between has none (a fresh clone's make test caught one)
    wait_until(lambda: a.child.call("state")["peers"].keys() == {b.public.hex()}, 10, "the peers re-pushed")
    addr = subprocess.run(["ip", "-n", a.ns, "addr", "show", a.iface], capture_output=True, text=True).stdout
    assert all(x in addr for x in a.addresses) and "mtu 1420" in addr and ",UP" in addr, addr
    # B still holds a session A forgot; A's re-pushed keepalive starts a new handshake, so B
    # gets through without A sending anything first.
    wait_until(lambda: b.reaches(a), 30, "B reaching A over the overlay after A's restart")
    wait_until(lambda: a.reaches(b), 30, "A reaching B over the overlay after its restart")


def test_overlay_address_moves_and_survives_a_restart(pair):
    a, b = pair
    mesh(a, b)
    assert a.ping(b).returncode == 0
    a.overlay = "10.211.0.11"  # as when a member with precedence claims ours
    a.child.call("set_addresses", addresses=a.addresses)
    b.peer_with(a)
    addr = subprocess.run(["ip", "-n", a.ns, "addr", "show", a.iface], capture_output=True, text=True).stdout
    assert "10.211.0.11/16" in addr and "10.211.0.1/16" not in addr and "fd11::1/64" in addr, addr
    assert b.ping(a).returncode == 0 and a.ping(b).returncode == 0
    old = a.info()["pid"]
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: a.info()["restarts"] == 1, 30, "the supervisor to restart wireguard-go")
    addr = subprocess.run(["ip", "-n", a.ns, "addr", "show", a.iface], capture_output=True, text=True).stdout
    assert "10.211.0.11/16" in addr and "10.211.0.1/16" not in addr, addr
    wait_until(lambda: a.reaches(b), 30, "A reaching B from its new address after the restart")


def test_close_leaves_no_interface_and_no_socket(pair):
    a, b = pair
    mesh(a, b)
    assert a.reaches(b)
    pid = a.info()["pid"]
    assert a.link_exists() and a.socket.exists()
    a.child.call("close")
    assert not a.link_exists(), f"{a.iface} still exists in {a.ns}"
    assert not a.socket.exists()
    assert not alive(pid)
    assert a.info() == {"pid": None, "restarts": 0}
    assert not a.reaches(b)
    a.child.call("close")  # twice is fine


def test_leftovers_of_a_crashed_daemon_are_cleaned_at_start(pair):
    a, b = pair
    # as a daemon runs it: wireguard-go writes errors only to the pipe its daemon reads (a verbose
    # one's next line after the daemon's death would end it with SIGPIPE: no orphan to clean)
    a.spawn(quiet=True).call("start", private_key=bytes(a.key).hex(), listen_port=PORT, addresses=a.addresses,
                             mtu=1420)
    orphan = a.info()["pid"]
    a.child.kill()  # the daemon dies with SIGKILL; its wireguard-go lives on
    assert alive(orphan) and a.link_exists()
    # b's previous wireguard-go died with SIGKILL too: a socket file nobody listens on.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(b.socket))
    stale.close()
    a.spawn().call("start", private_key=bytes(a.key).hex(), listen_port=PORT, addresses=a.addresses, mtu=1420)
    assert not alive(orphan), "the orphaned wireguard-go survived"
    assert a.info()["pid"] != orphan
    b.start()
    a.peer_with(b)
    b.peer_with(a)
    assert a.ping(b).returncode == 0 and b.ping(a).returncode == 0


def test_interface_name_used_in_another_namespace_is_refused(pair):
    a, b = pair
    a.start()
    pid = a.info()["pid"]
    clash = Host(ns=b.ns, iface=a.iface, underlay=b.underlay, overlay=b.overlay, overlay6=b.overlay6, log=b.log)
    b.child = clash.spawn()
    reply = b.child.request("start", private_key=bytes(clash.key).hex(), listen_port=PORT,
                            addresses=clash.addresses, mtu=1420)
    assert not reply["ok"]
    assert re.search(r"belongs to a wireguard-go running in another network namespace .*distinct interface name",
                     reply["error"]), reply["error"]
    assert alive(pid) and a.socket.exists() and a.link_exists()
    b.child.call("close")  # must not touch what is not its own
    assert alive(pid) and a.socket.exists() and a.link_exists()
