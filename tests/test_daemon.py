"""The daemon as systemd and a provider meet it: readiness, watchdog, metrics, stop."""

import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import SWARMD, wait_until
from swarmd.rpc.client import RemoteError


def test_sigterm_stops_within_5_s_and_removes_the_socket(daemon):
    assert daemon.socket.exists()
    started = time.monotonic()
    assert daemon.stop(signal.SIGTERM) == 0
    assert time.monotonic() - started < 5
    assert not daemon.socket.exists()
    assert '"event": "stopped"' in daemon.log.read_text()


def test_notify_ready_only_once_the_socket_accepts_then_watchdog(make_daemon, tmp_path):
    notify_path = tmp_path / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(30)
    d = make_daemon(env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "200000"}, start=False)
    d.start(wait=False)
    try:
        first = notify.recv(4096).decode()
        assert "READY=1" in first.splitlines()
        assert d.ready()  # READY=1 was sent after the socket accepted: no race for systemctl
        messages = [notify.recv(4096).decode() for _ in range(3)]  # 0.1 s apart (half of 200 ms)
        assert all("WATCHDOG=1" in m for m in messages)
        d.stop()
        rest = []
        while "STOPPING=1" not in rest:
            rest += notify.recv(4096).decode().splitlines()
    finally:
        notify.close()


def scrape(host_port: str) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://{host_port}/metrics", timeout=10).read().decode()
    return {k: float(v) for k, _, v in (line.rpartition(" ") for line in body.splitlines())
            if k and not k.startswith("#")}


def test_metrics_endpoint_counts_requests_and_errors(make_daemon):
    d = make_daemon(args=["--metrics-addr", "127.0.0.1:0"])
    status = d.call("status")
    before = scrape(status["metrics_addr"])
    for _ in range(3):
        d.call("status")
    with d.client() as c, pytest.raises(RemoteError):
        c.call("log.level", level="loud")
    after = scrape(status["metrics_addr"])
    key = 'swarmd_rpc_requests_total{method="status"}'
    assert after[key] - before[key] == 3
    assert after['swarmd_rpc_errors_total{code="invalid_params",method="log.level"}'] == 1
    assert after["swarmd_uptime_seconds"] > 0
    assert f'swarmd_info{{peer_id="{status["peer_id"]}",version="0.1.0"}}' in after


def test_a_second_daemon_on_the_same_socket_is_refused(daemon, make_daemon):
    other = make_daemon("other", start=False)
    other.socket = daemon.socket
    other.start(wait=False)
    assert other.proc.wait(30) == 1
    assert "is served by another process (is swarmd already running?)" in other.log.read_text()
    assert daemon.call("status")  # the first one is untouched


def test_a_stale_socket_file_is_replaced(make_daemon):
    d = make_daemon(start=False)
    d.socket.parent.mkdir(parents=True, exist_ok=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(d.socket))  # bound, never listening: what a crashed daemon leaves
    stale.close()
    d.start()
    assert d.call("status")


def test_bootstrap_peer_is_dialed_over_noise(make_daemon):
    first = make_daemon("a")
    addr = first.call("status")["listen_addrs"][0]
    second = make_daemon("b", args=["--bootstrap", addr])
    wait_until(lambda: second.call("status")["connected_peers"] == 1, 30, "bootstrap connection")
    wait_until(lambda: first.call("status")["connected_peers"] == 1, 30, "inbound connection")


def test_plaintext_is_not_offered(daemon):
    """A peer asking for /plaintext/2.0.0 gets 'na' from multistream-select."""
    addr = daemon.call("status")["listen_addrs"][0].split("/")
    host, port = addr[2], int(addr[4])
    with socket.create_connection((host, port), timeout=10) as s:
        def line(text: str) -> bytes:
            data = text.encode() + b"\n"
            return bytes([len(data)]) + data  # uvarint length < 128

        s.sendall(line("/multistream/1.0.0") + line("/plaintext/2.0.0"))
        got = b""
        deadline = time.monotonic() + 10
        while b"na\n" not in got and b"/plaintext/2.0.0\n" not in got[20:] and time.monotonic() < deadline:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
    assert b"/multistream/1.0.0\n" in got
    assert b"na\n" in got


def test_help_is_fast_and_does_not_start_anything():
    proc = subprocess.run([*SWARMD, "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    assert "--metrics-addr" in proc.stdout and "SWARMD_" in proc.stdout


@pytest.mark.parametrize("flag", ["--version"])
def test_version_flag(flag):
    proc = subprocess.run([*SWARMD, flag], capture_output=True, text=True, timeout=30)
    assert proc.stdout.startswith("swarmd ")
