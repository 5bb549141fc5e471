"""The lab's NAT routers, without daemons: UDP from WireGuard's port between every pair of
hosts, each sending to the other's reflexive endpoint (what a public observer saw), both
sides at once, as a punch does. Theory (RFC 4787; DESIGN, "NAT traversal") says which pairs
connect directly; the matrix here is what the routers' rulesets really do. Also: a rebind
gives a host a new external port, and an unrefreshed mapping is forgotten after the
router's UDP timeout."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from sim.netlab import lab as labmod
from sim.netlab import nat as natmod
from sim.netlab import topology

from .support import until

pytestmark = [pytest.mark.netlab, pytest.mark.slow]

PORT = 51820  # WireGuard's, the daemon's default mesh_port
AGENT = Path(__file__).with_name("udp_agent.py")
SIM = [sys.executable, "-m", "sim.cli", "lab"]
# h1 is the observer (a STUN server's role) and h8 the stranger; two symmetric NATs for their pairing
CLASSES = {"h1": "public", "h2": "eim", "h3": "eim-adf", "h4": "eim-apdf", "h5": "edm", "h6": "edm",
           "h7": "firewall", "h8": "public"}
UDP_TIMEOUT = 4  # short, so the expiry test is quick; every punch below starts right after its observation
# the pairs theory says need a relay: a symmetric NAT's port for a peer is not the one the observer saw,
# so it gets through only where the other side admits any port of a contacted address (or anyone)
NOT_DIRECT = {frozenset(p) for p in (("edm", "eim-apdf"), ("edm", "edm"), ("edm", "firewall"))}


class Agent:
    """udp_agent.py in a host's namespace; what it receives is collected by a thread."""

    def __init__(self, lab: labmod.Lab, host: str) -> None:
        self.host = host
        self.proc = subprocess.Popen(["ip", "netns", "exec", lab.state.host(host).netns, sys.executable, str(AGENT),
                                      str(PORT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        assert json.loads(self.proc.stdout.readline()) == {"ready": PORT}, f"the agent on {host} did not start"
        self.got: list[dict] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._lock:
                self.got.append(json.loads(line))

    def send(self, address: str, port: int, text: str, *, new_flow: bool = False) -> None:
        with self._lock:
            self.proc.stdin.write(f"{'sendnew' if new_flow else 'send'} {address} {port} {text}\n")
            self.proc.stdin.flush()

    def received(self, tag: str) -> list[dict]:
        """The datagrams whose text ends with `tag`."""
        with self._lock:
            return [g for g in self.got if g["data"].split(" ")[-1] == tag]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def nat_lab():
    if os.geteuid() != 0:
        pytest.skip("netlab needs root (network namespaces); CI runs as root")
    name = f"n{uuid.uuid4().hex[:6]}"
    hosts, links = topology.plan(len(CLASSES), topology.uniform(4.0))
    lab = labmod.Lab.up(name, hosts, links, daemons=False, nat={h: c for h, c in CLASSES.items() if c != "public"},
                        nat_timeouts=natmod.Timeouts(udp=UDP_TIMEOUT, udp_stream=60))
    agents: dict[str, Agent] = {}
    try:
        for h in lab.state.hosts:
            agents[h.name] = Agent(lab, h.name)
        yield lab, agents
    finally:
        for agent in agents.values():
            agent.close()
        labmod.down(name)


def reflexive(lab, agents: dict[str, Agent], host: str, observer: str = "h1") -> tuple[str, int]:
    """`host`'s endpoint as `observer` sees it (asked from WireGuard's port)."""
    tag = uuid.uuid4().hex[:8]
    target = lab.state.host(observer).address

    def answers() -> list[dict]:
        return [g for g in agents[host].received(tag) if g["data"].startswith("you ")]

    def answered() -> bool:
        if not answers():
            agents[host].send(target, PORT, f"whoami {tag}")  # again: a lost datagram is no failure here
            return False
        return True
    until(answered, 10, f"{observer} answers {host}'s whoami", interval=0.2)
    _, address, port, _ = answers()[0]["data"].split(" ")
    return address, int(port)


def punch(lab, agents: dict[str, Agent], a: str, b: str, rounds: int = 10) -> bool:
    """Both send to the other's reflexive endpoint, `rounds` times 0.25 s apart or until each
    has heard from the other (a punch or its ack)."""
    ea, eb = reflexive(lab, agents, a), reflexive(lab, agents, b)
    tag = f"{a}{b}{uuid.uuid4().hex[:6]}"

    def both_heard() -> bool:
        return bool(agents[a].received(tag)) and bool(agents[b].received(tag))
    for _ in range(rounds):
        agents[a].send(*eb, f"punch {tag}")
        agents[b].send(*ea, f"punch {tag}")
        try:
            until(both_heard, 0.25, "")
            return True
        except AssertionError:
            continue
    return False


def sim(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SIM, *args, "--name", name], capture_output=True, text=True, timeout=60)


def test_the_direct_matrix_is_what_theory_says(nat_lab):
    lab, agents = nat_lab
    got, want = {}, {}
    for a, b in itertools.combinations(sorted(CLASSES), 2):
        got[(a, b)] = punch(lab, agents, a, b)
        want[(a, b)] = frozenset((CLASSES[a], CLASSES[b])) not in NOT_DIRECT
    table = "\n".join(f"{a} {CLASSES[a]:>8} - {b} {CLASSES[b]:<8} {'direct' if d else 'relay'}"
                      for (a, b), d in got.items())
    print(f"\n{table}")
    assert got == want, table


def test_status_shows_each_hosts_nat(nat_lab):
    lab, _ = nat_lab
    proc = sim(lab.state.name, "status", "--json")
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    rows = {h["host"]: h for h in status["hosts"]}
    assert {h: r["nat"] for h, r in rows.items()} == CLASSES
    assert rows["h1"]["router"] is None and rows["h1"]["private_address"] is None
    assert rows["h4"]["router"] == f"sl-{lab.state.name}-r4" and rows["h4"]["private_address"] == "192.168.1.2"
    assert rows["h7"]["router"] == f"sl-{lab.state.name}-r7" and rows["h7"]["private_address"] is None
    assert status["nat_udp_timeout"] == UDP_TIMEOUT
    assert sim(lab.state.name, "nat", "h1", "rebind").returncode == 2  # public: nothing to rebind
    assert sim(lab.state.name, "nat", "h7", "rebind").returncode == 2  # a firewall translates nothing


def test_rebind_gives_a_full_cone_host_a_new_external_port(nat_lab):
    lab, agents = nat_lab
    before = reflexive(lab, agents, "h2")
    assert before == (lab.state.host("h2").address, PORT)  # the inner port kept until a rebind
    seen = [before[1]]
    for rebinds in (1, 2):
        # the second while h2 sends all the time, as a daemon's WireGuard does: a datagram riding
        # the old conntrack entry must not carry the old port into the new mapping table
        stop = threading.Event()

        def send_steadily() -> None:
            while not stop.wait(0.002):
                agents["h2"].send(lab.state.host("h8").address, PORT, "tick")
        steady = threading.Thread(target=send_steadily)
        if rebinds == 2:
            steady.start()
        try:
            proc = sim(lab.state.name, "nat", "h2", "rebind")
        finally:
            stop.set()
            if steady.is_alive():
                steady.join()
        assert proc.returncode == 0, proc.stderr
        after = reflexive(lab, agents, "h2")
        low, high = natmod.port_range(rebinds)
        assert after[0] == before[0] and low <= after[1] <= high and after[1] not in seen, (seen, after)
        assert reflexive(lab, agents, "h2", observer="h8") == after  # still endpoint-independent
        seen.append(after[1])
    status = json.loads(sim(lab.state.name, "status", "--json").stdout)
    assert {h["host"]: h["nat_rebinds"] for h in status["hosts"]}["h2"] == 2


def test_an_unrefreshed_mapping_is_forgotten_after_the_udp_timeout(nat_lab):
    lab, agents = nat_lab
    lab.rebind("h2")  # no flow of h2's left: the one made now is answered once, never assured (no stream timeout)
    external = reflexive(lab, agents, "h2")  # h2's last outbound datagram: nothing refreshes the mapping now
    probes = iter(range(1_000_000))

    def stranger_gets_through() -> bool:
        """h8, which h2 never wrote to, sends from a new port each time (a new flow, no conntrack to reuse)."""
        tag = f"stranger{next(probes)}"
        agents["h8"].send(*external, f"hello {tag}", new_flow=True)
        try:
            until(lambda: agents["h2"].received(tag), 1.0, "")
            return True
        except AssertionError:
            return False
    assert stranger_gets_through(), "a full cone admits anyone to a fresh mapping"
    took = until(lambda: not stranger_gets_through() and not stranger_gets_through(), UDP_TIMEOUT + 20,
                 f"h2's mapping forgotten {UDP_TIMEOUT} s after its last datagram", interval=0.2)
    print(f"\nmapping forgotten within {took:.1f} s (udp timeout {UDP_TIMEOUT} s)")


def test_a_crash_cuts_the_host_behind_its_router_and_spares_the_router(nat_lab):
    lab, agents = nat_lab
    h4 = lab.state.host("h4")
    router_pids = sorted(labmod.netns_pids(f"/run/netns/{h4.router}"))
    assert router_pids and sorted(lab._taps_of("h4")) == router_pids  # the router holds the host's taps, only them
    reflexive(lab, agents, "h4")

    killed = lab.crash("h4")
    assert agents["h4"].proc.pid in killed
    assert agents["h4"].proc.wait(10) == -9
    assert sorted(labmod.netns_pids(f"/run/netns/{h4.router}")) == router_pids
    ping = ["ip", "netns", "exec", lab.state.host("h1").netns, "ping", "-n", "-q", "-c", "2", "-i", "0.2", "-W", "1",
            h4.address]
    assert subprocess.run(ping, capture_output=True).returncode != 0  # the router's links are cut with the host

    lab.revive("h4")
    assert subprocess.run(ping, capture_output=True).returncode == 0
    agents["h4"] = Agent(lab, "h4")
    assert reflexive(lab, agents, "h4") == (h4.address, PORT)
