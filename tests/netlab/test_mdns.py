"""Two members on one LAN segment find each other with mDNS alone (no bootstrap, no token)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import wait_until
from sim.netlab.lab import _make_swarm
from swarmd.identity import load_or_create
from swarmd.rpc.client import Client

pytestmark = [pytest.mark.netlab, pytest.mark.slow]


@pytest.fixture
def lan(tmp_path: Path):
    """Two namespaces on one veth segment, 10.77.0.1 and 10.77.0.2."""
    tag = uuid.uuid4().hex[:6]
    names = [f"md{tag}a", f"md{tag}b"]
    for n in names:
        subprocess.run(["ip", "netns", "add", n], check=True)
    try:
        subprocess.run(["ip", "link", "add", f"v{tag}a", "netns", names[0], "type", "veth", "peer", "name",
                        f"v{tag}b", "netns", names[1]], check=True)
        for i, (n, end) in enumerate(zip(names, "ab")):
            batch = f"link set lo up\nlink set v{tag}{end} up\naddr add 10.77.0.{i + 1}/24 dev v{tag}{end}\n"
            subprocess.run(["ip", "-n", n, "-batch", "-"], input=batch, text=True, check=True)
        yield names
    finally:
        for n in names:
            subprocess.run(["ip", "netns", "del", n], check=False)


def test_members_on_a_lan_find_each_other_by_mdns(lan, tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    peers = [str(load_or_create(d)[0].peer_id) for d in dirs]
    _make_swarm(dirs, peers)  # same swarm, and no bootstrap peers anywhere
    (tmp_path / "empty.toml").touch()
    procs = []
    try:
        for netns, d in zip(lan, dirs):
            log = open(d / "swarmd.log", "wb")
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", netns, sys.executable, "-m", "swarmd.main", "--config",
                 str(tmp_path / "empty.toml"), "--state-dir", str(d), "--socket", str(d / "sock"),
                 "--listen", "/ip4/0.0.0.0/tcp/4001", "--metrics-addr", "off", "--mdns", "on",
                 "--gossip-timing", "lan", "--mesh", "off"],  # both would claim interface swarm0
                stdout=log, stderr=log))

        def sees(d: Path, other: str):
            try:
                with Client(str(d / "sock"), timeout=2) as c:
                    return {p["peer"]: p["state"] for p in c.call("peers")["peers"]}.get(other) == "alive"
            except Exception:
                return False
        wait_until(lambda: sees(dirs[0], peers[1]) and sees(dirs[1], peers[0]), 30, "mDNS discovery both ways")
        with Client(str(dirs[0] / "sock")) as c:
            row = c.call("peers")["peers"][0]
        assert row["addrs"] == ["/ip4/10.77.0.2/tcp/4001"]  # the announce address, not 0.0.0.0
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
