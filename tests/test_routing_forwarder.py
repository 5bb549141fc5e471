"""forwarder.py with the kernel: nft.py's rules relaying UDP between two namespaces through a third.

Three throwaway network namespaces, no daemons: A (10.9.1.1, and 10.9.1.3 as a stranger on
the same link) — veth — R (10.9.1.2 | 10.9.2.2) — veth — B (10.9.2.1). A and B have a route
to each other's network through R, so anything R forwards beyond the relayed pairs would
arrive. In A and B a small stdlib agent (one process per namespace, JSON lines on stdin)
binds UDP sockets, sends and receives; the relay's rules are applied in R by a real
Forwarder through `ip netns exec R nft` and `... sysctl` (its ip_forward is R's).
What a user of the relay would notice is checked: A reaches B only through R's port and
sees R's port answer, either side may start, nobody else is forwarded, the cap drops what
is above it, a removed pair stops at once, and close() leaves R as it was.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import structlog.testing
import trio

from swarmd.routing import nft
from swarmd.nft import NftError
from swarmd.routing.forwarder import Forwarder
from swarmd.routing.relay import End, Pair

real = pytest.mark.skipif(os.geteuid() != 0 or not all(map(shutil.which, ("nft", "ip", "sysctl"))),
                                reason="needs root (network namespaces), nft, ip and sysctl")

A_IP, STRANGER_IP, RA, RB, B_IP = "10.9.1.1", "10.9.1.3", "10.9.1.2", "10.9.2.2", "10.9.2.1"
PUBLIC = "203.0.113.2"  # R's address as a 1:1 NAT in front of it shows it to A (no interface of R holds it)
TABLE = "swarmd_relay_test"
NO = 1.0  # seconds a datagram that must not arrive is waited for (one that must takes well under a millisecond)
YES = 5.0

AGENT = r"""
import json, socket, sys, time
socks = {}
for line in sys.stdin:
    cmd = json.loads(line)
    op, key = cmd["op"], cmd.get("sock")
    if op == "bind":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), 8 << 20)  # root: past rmem_max
        s.bind((cmd["ip"], cmd["port"]))
        socks[key] = s
        out = {}
    elif op == "close":
        socks.pop(key).close()
        out = {}
    elif op == "send":
        s, data = socks[key], cmd["data"].encode().ljust(cmd.get("size", 0), b".")
        start = time.monotonic()
        for i in range(cmd.get("count", 1)):
            s.sendto(data, tuple(cmd["to"]))
            if cmd.get("rate"):  # bytes/s: pace, so that only the relay's cap can drop
                ahead = start + (i + 1) * len(data) / cmd["rate"] - time.monotonic()
                if ahead > 0.001:
                    time.sleep(ahead)
        out = {"seconds": time.monotonic() - start}
    elif op == "recv":  # until `count` came, none came within `first` s, or `quiet` s passed without one
        s, got, n, size = socks[key], [], 0, 0
        s.settimeout(cmd["first"])
        try:
            while n < cmd.get("count", 1):
                data, src = s.recvfrom(65536)
                n, size = n + 1, size + len(data)
                if len(got) < 5:
                    got.append([data[:40].decode(errors="replace").rstrip("."), src[0], src[1]])
                s.settimeout(cmd.get("quiet", cmd["first"]))
        except socket.timeout:
            pass
        out = {"n": n, "bytes": size, "got": got}
    print(json.dumps(out), flush=True)
"""


class Agent:
    def __init__(self, ns: str) -> None:
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-I", "-S", "-c", AGENT],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def post(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"agent died: {self.proc.poll()}"
        return json.loads(line)

    def __call__(self, **cmd) -> dict:
        self.post(**cmd)
        return self.answer()


@dataclass
class Lab:
    a: str
    r: str
    b: str
    agent_a: Agent
    agent_b: Agent

    def forwarder(self, cap: int = 1 << 30) -> Forwarder:
        exec_r = ("ip", "netns", "exec", self.r)
        return Forwarder(TABLE, cap_bytes_per_s=cap, ports=(40000, 40099), nft=(*exec_r, "nft"),
                         sysctl=(*exec_r, "sysctl"), netns=f"/run/netns/{self.r}", local_ips=lambda: (RA, RB))

    def ip_forward(self, value: int | None = None) -> int:
        if value is not None:
            _sh("ip", "netns", "exec", self.r, "sysctl", "-qw", f"net.ipv4.ip_forward={value}")
        return int(_sh("ip", "netns", "exec", self.r, "sysctl", "-n", "net.ipv4.ip_forward"))

    def conntrack(self, mark: int) -> bool | None:
        """Whether R has a conntrack entry with `mark` (None: this kernel has no /proc/net/nf_conntrack)."""
        if not os.path.exists("/proc/net/nf_conntrack"):
            return None
        return f"mark={mark} " in _sh("ip", "netns", "exec", self.r, "cat", "/proc/net/nf_conntrack")

    def tables(self) -> str:
        return _sh("ip", "netns", "exec", self.r, "nft", "list", "tables")

    def relayed(self, sender: Agent, sock: str, to: tuple[str, int], receiver: Agent, rsock: str,
                data: str, wait: float = YES) -> list:
        """`data` from `sender`'s socket to `to`: what `receiver`'s socket got [[data, ip, port]]."""
        receiver.post(op="recv", sock=rsock, first=wait)
        sender(op="send", sock=sock, to=list(to), data=data)
        return receiver.answer()["got"]


# --- without root: a fake nft, ip_forward in a file --------------------------------------------

FAKE_NFT = """\
import pathlib, sys
here = pathlib.Path(sys.argv[0]).parent
log, table = here / "log", here / "table"
with log.open("a") as f:
    f.write(" ".join(sys.argv[1:]) + " | ip_forward=" + (here / "ip_forward").read_text().strip() + "\\n")
if (here / "fail").exists():
    sys.exit("Error: no")
if sys.argv[1:] == ["-f", "-"]:
    script = sys.stdin.read()
    if " {" in script:
        table.write_text(script)
    else:
        table.unlink(missing_ok=True)
elif sys.argv[1] == "list":
    if not table.exists():
        sys.exit("Error: No such file or directory")
    print(table.read_text())
"""


@pytest.fixture
def fake(tmp_path):
    (tmp_path / "nft.py").write_text(FAKE_NFT)
    (tmp_path / "ip_forward").write_text("0\n")
    (tmp_path / "log").write_text("")
    return tmp_path


def fake_forwarder(fake) -> Forwarder:
    return Forwarder(TABLE, cap_bytes_per_s=1000, ports=(40000, 40099), nft=(sys.executable, str(fake / "nft.py")),
                     ip_forward=fake / "ip_forward", flush_conntrack=False)


def test_forwarding_goes_on_only_after_the_table_and_off_before_it_goes(fake):
    fw = fake_forwarder(fake)
    p = pair(40000, 5001, 5000)
    assert trio.run(fw.apply, [p]) is True
    assert (fake / "ip_forward").read_text() == "1\n" and fw.forwarding_was_off is True
    assert trio.run(fw.apply, [p]) is False and fw.applied == 1  # the same rules are not applied again
    assert trio.run(fw.apply, []) is True and fw.applied == 2
    trio.run(fw.close)
    assert (fake / "ip_forward").read_text() == "0\n" and not (fake / "table").exists()
    log = (fake / "log").read_text().splitlines()
    assert log == ["-f - | ip_forward=0",  # the table, with its drop of other forwarding...
                   "-f - | ip_forward=1",  # ...before forwarding; the pair removed
                   "-f - | ip_forward=0"]  # forwarding off, then the table deleted


def test_no_forwarding_when_nft_fails_and_close_runs_even_when_cancelled(fake):
    (fake / "fail").write_text("")
    fw = fake_forwarder(fake)
    with pytest.raises(NftError, match="no"):
        trio.run(fw.start)
    assert (fake / "ip_forward").read_text() == "0\n" and not fw.started
    (fake / "fail").unlink()
    trio.run(fw.start)
    assert fw.started and (fake / "ip_forward").read_text() == "1\n"

    async def cancelled_close():
        with trio.CancelScope() as scope:
            scope.cancel()
            await fw.close()

    trio.run(cancelled_close)
    assert (fake / "ip_forward").read_text() == "0\n" and not (fake / "table").exists()


def test_ip_forward_someone_changed_is_left_alone_at_close(fake):
    """This daemon wrote 1; someone set it back to 0 meanwhile (another tool owns it now): close
    writes nothing and says so."""
    fw = fake_forwarder(fake)
    trio.run(fw.start)
    assert (fake / "ip_forward").read_text() == "1\n"
    (fake / "ip_forward").write_text("0\n")
    os.utime(fake / "ip_forward", (1_000_000, 1_000_000))
    with structlog.testing.capture_logs() as logs:
        trio.run(fw.close)
    assert (fake / "ip_forward").stat().st_mtime == 1_000_000  # not written
    assert any("no longer the 1 this daemon wrote" in entry["event"] for entry in logs)
    assert not (fake / "table").exists()


def test_bad_settings_are_refused_before_anything_runs():
    for table, cap in (("bad name", 1000), (TABLE, 0)):
        with pytest.raises(ValueError):
            Forwarder(table, cap_bytes_per_s=cap)


# --- with root: three namespaces ---------------------------------------------------------------


def _sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30).stdout


def _nft(ns: str, script: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=script, check=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    tag = secrets.token_hex(3)
    a, r, b = (f"swrl-{tag}-{x}" for x in "arb")
    made, agents = [], []
    try:
        for ns in (a, r, b):
            _sh("ip", "netns", "add", ns)
            made.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", r, "link", "add", "vra", "type", "veth", "peer", "name", "va", "netns", a)
        _sh("ip", "-n", r, "link", "add", "vrb", "type", "veth", "peer", "name", "vb", "netns", b)
        links = ((a, "va", (A_IP, STRANGER_IP)), (r, "vra", (RA,)), (r, "vrb", (RB,)), (b, "vb", (B_IP,)))
        for ns, dev, addrs in links:
            for addr in addrs:
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
        _sh("ip", "-n", a, "route", "add", "10.9.2.0/24", "via", RA)  # what R must not forward unasked
        _sh("ip", "-n", b, "route", "add", "10.9.1.0/24", "via", RB)
        the = Lab(a, r, b, Agent(a), Agent(b))
        agents += [the.agent_a, the.agent_b]
        assert the.ip_forward() == 0  # a new namespace's default: the relay turns it on
        yield the
    finally:
        for agent in agents:
            agent.proc.kill()
            agent.proc.wait()
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def forwarder(lab) -> Iterator[Forwarder]:
    fw = lab.forwarder()
    try:
        yield fw
    finally:
        trio.run(fw.close)
        lab.ip_forward(0)


def pair(port: int, a_port: int, b_port: int, *, a_pinned: bool = True, a_via: str = RA) -> Pair:
    """A and B not NATed (pinned: their packets come from their WireGuard ports) unless said."""
    return Pair(port, End(peer="A", ip=A_IP, wg_port=a_port, via_ip=a_via, pinned=a_pinned),
                End(peer="B", ip=B_IP, wg_port=b_port, via_ip=RB, pinned=True))


@pytest.fixture
def sockets(lab) -> Iterator[None]:
    """Fresh sockets per test, so that one test's conntrack flows are not another's."""
    binds = [(lab.agent_a, "a", A_IP), (lab.agent_a, "stranger", STRANGER_IP), (lab.agent_b, "b", B_IP)]
    port = 6000 + secrets.randbelow(2000) * 2
    for agent, name, ip in binds:
        agent(op="bind", sock=name, ip=ip, port=port if name != "b" else port + 1)
    yield port, port + 1  # A's and the stranger's port, B's
    for agent, name, _ in binds:
        agent(op="close", sock=name)


@real
def test_a_and_b_talk_both_ways_through_the_relays_port(lab, forwarder, sockets):
    a_port, b_port = sockets
    trio.run(forwarder.apply, [pair(40000, a_port, b_port)])
    assert lab.ip_forward() == 1
    # A sends to R:P; B receives it from R:P (its side's address), answers there; A hears R:P
    assert lab.relayed(lab.agent_a, "a", (RA, 40000), lab.agent_b, "b", "hello") == [["hello", RB, 40000]]
    assert lab.relayed(lab.agent_b, "b", (RB, 40000), lab.agent_a, "a", "hi") == [["hi", RA, 40000]]
    assert lab.relayed(lab.agent_a, "a", (RA, 40000), lab.agent_b, "b", "again") == [["again", RB, 40000]]


@real
def test_b_may_speak_first(lab, forwarder, sockets):
    a_port, b_port = sockets
    trio.run(forwarder.apply, [pair(40001, a_port, b_port)])
    assert lab.relayed(lab.agent_b, "b", (RB, 40001), lab.agent_a, "a", "first") == [["first", RA, 40001]]
    assert lab.relayed(lab.agent_a, "a", (RA, 40001), lab.agent_b, "b", "reply") == [["reply", RB, 40001]]


@real
def test_nobody_outside_the_pair_is_forwarded(lab, forwarder, sockets):
    a_port, b_port = sockets
    trio.run(forwarder.apply, [pair(40002, a_port, b_port)])
    # another address on A's link, to the pair's port: not relayed
    assert lab.relayed(lab.agent_a, "stranger", (RA, 40002), lab.agent_b, "b", "let me in", wait=NO) == []
    # the pair's own end, to another port of the relay, or to B's address routed through R: nothing
    assert lab.relayed(lab.agent_a, "a", (RA, 40003), lab.agent_b, "b", "other port", wait=NO) == []
    assert lab.relayed(lab.agent_a, "a", (B_IP, b_port), lab.agent_b, "b", "routed", wait=NO) == []
    # while the pair itself goes through
    assert lab.relayed(lab.agent_a, "a", (RA, 40002), lab.agent_b, "b", "member") == [["member", RB, 40002]]


@real
def test_a_removed_pair_stops_at_once_though_its_flow_lives_on(lab, forwarder, sockets):
    a_port, b_port = sockets
    p = pair(40004, a_port, b_port)
    trio.run(forwarder.apply, [p])
    assert lab.relayed(lab.agent_a, "a", (RA, 40004), lab.agent_b, "b", "before") == [["before", RB, 40004]]
    trio.run(forwarder.apply, [])  # lease expired / member revoked: the conntrack entry is still there
    assert lab.relayed(lab.agent_a, "a", (RA, 40004), lab.agent_b, "b", "after", wait=NO) == []
    assert lab.relayed(lab.agent_b, "b", (RB, 40004), lab.agent_a, "a", "after", wait=NO) == []
    trio.run(forwarder.apply, [p])
    assert lab.relayed(lab.agent_a, "a", (RA, 40004), lab.agent_b, "b", "back") == [["back", RB, 40004]]


@real
def test_an_end_at_a_new_address_gets_through_at_once(lab, forwarder, sockets):
    """The old flow's entry holds B's side (B:port -> R:P) while B keeps sending: A's flow from its
    new address could not be NATed until it timed out, had the forwarder not deleted it."""
    a_port, b_port = sockets
    p = pair(40007, a_port, b_port)
    trio.run(forwarder.apply, [p])
    assert lab.relayed(lab.agent_a, "a", (RA, 40007), lab.agent_b, "b", "old") == [["old", RB, 40007]]
    assert lab.relayed(lab.agent_b, "b", (RB, 40007), lab.agent_a, "a", "old") == [["old", RA, 40007]]
    moved = Pair(40007, End(peer="A", ip=STRANGER_IP, wg_port=a_port, via_ip=RA), p.b)
    trio.run(forwarder.apply, [moved])  # A asked again from its new address
    assert lab.relayed(lab.agent_a, "stranger", (RA, 40007), lab.agent_b, "b", "new") == [["new", RB, 40007]]
    assert lab.relayed(lab.agent_b, "b", (RB, 40007), lab.agent_a, "stranger", "new") == [["new", RA, 40007]]
    assert lab.relayed(lab.agent_a, "a", (RA, 40007), lab.agent_b, "b", "old", wait=NO) == []


@real
def test_a_rebound_source_port_recovers_when_the_pair_is_released_and_asked_again(lab, forwarder, sockets):
    """An end's NAT gives it a new source port (same address): the relay cannot see it, and the old
    flow, kept alive by B, blocks the new one. Releasing and asking again clears it."""
    a_port, b_port = sockets
    p = pair(40009, a_port, b_port, a_pinned=False)  # behind a NAT
    trio.run(forwarder.apply, [p])
    assert lab.relayed(lab.agent_a, "a", (RA, 40009), lab.agent_b, "b", "old") == [["old", RB, 40009]]
    lab.agent_a(op="bind", sock="rebound", ip=A_IP, port=a_port + 4000)
    try:
        assert lab.relayed(lab.agent_b, "b", (RB, 40009), lab.agent_a, "a", "keep") == [["keep", RA, 40009]]
        assert lab.relayed(lab.agent_a, "rebound", (RA, 40009), lab.agent_b, "b", "new", wait=NO) == []
        trio.run(forwarder.apply, [])  # A released...
        trio.run(forwarder.apply, [p])  # ...and asked again
        assert lab.relayed(lab.agent_a, "rebound", (RA, 40009), lab.agent_b, "b", "new") == [["new", RB, 40009]]
        assert lab.relayed(lab.agent_b, "b", (RB, 40009), lab.agent_a, "rebound", "back") == [["back", RA, 40009]]
    finally:
        lab.agent_a(op="close", sock="rebound")


@real
def test_after_close_a_live_flow_is_not_relayed_even_where_the_host_forwards(lab, sockets):
    """A host with NAT of its own (docker's, say) and forwarding on: after close a live flow of a pair
    is not relayed, and none of the relay's conntrack entries is left."""
    a_port, b_port = sockets
    lab.ip_forward(1)  # a router already: forwarding stays on after close
    _sh("ip", "netns", "exec", lab.r, "nft", "add table ip hosts_own; add chain ip hosts_own pre "
        "{ type nat hook prerouting priority dstnat; }")
    try:
        fw = lab.forwarder()
        trio.run(fw.apply, [pair(40008, a_port, b_port)])
        assert lab.relayed(lab.agent_a, "a", (RA, 40008), lab.agent_b, "b", "on") == [["on", RB, 40008]]
        assert lab.conntrack(nft.mark(40008)) in (True, None)
        trio.run(fw.close)
        assert lab.relayed(lab.agent_a, "a", (RA, 40008), lab.agent_b, "b", "off", wait=NO) == []
        assert fw.conntrack_errors == 0
        assert lab.conntrack(nft.mark(40008)) in (False, None)
    finally:
        _sh("ip", "netns", "exec", lab.r, "nft", "delete table ip hosts_own")
        lab.ip_forward(0)


@real
def test_a_relay_behind_1_to_1_nat_forwards(lab, forwarder, sockets):
    """R announces PUBLIC, which none of its interfaces holds (a cloud VM): A sends to PUBLIC:P, a
    1:1 NAT in front of R (modelled in A's namespace) hands it to R as RA:P and maps R's answers from
    RA back to PUBLIC; what leaves R from PUBLIC is dropped (the cloud's anti-spoofing)."""
    a_port, b_port = sockets
    _nft(lab.a, f"""table ip cloud_nat {{
      chain out {{ type nat hook output priority -100; ip daddr {PUBLIC} udp dport 40000-40099 dnat to {RA}; }}
      chain in {{ type nat hook input priority 100; ip saddr {RA} udp sport 40000-40099 snat to {PUBLIC}; }}
    }}""")
    _sh("ip", "-n", lab.a, "route", "add", PUBLIC, "via", RA)
    _nft(lab.r, f"table ip cloud_egress {{ chain post {{ type filter hook postrouting priority 200; "
                f"ip saddr {PUBLIC} drop; }}; }}")
    try:
        trio.run(forwarder.apply, [pair(40010, a_port, b_port, a_via=PUBLIC), pair(40011, a_port, b_port, a_via=PUBLIC)])
        assert lab.relayed(lab.agent_a, "a", (PUBLIC, 40010), lab.agent_b, "b", "up") == [["up", RB, 40010]]
        assert lab.relayed(lab.agent_b, "b", (RB, 40010), lab.agent_a, "a", "down") == [["down", PUBLIC, 40010]]
        # B first (a flow towards A made at R): it leaves R from RA, A sees PUBLIC
        assert lab.relayed(lab.agent_b, "b", (RB, 40011), lab.agent_a, "a", "b first") == [["b first", PUBLIC, 40011]]
        assert lab.relayed(lab.agent_a, "a", (PUBLIC, 40011), lab.agent_b, "b", "reply") == [["reply", RB, 40011]]
    finally:
        _sh("ip", "netns", "exec", lab.a, "nft", "delete table ip cloud_nat")
        _sh("ip", "-n", lab.a, "route", "del", PUBLIC)
        _sh("ip", "netns", "exec", lab.r, "nft", "delete table ip cloud_egress")


@real
def test_nobody_else_at_a_pinned_ends_address_can_take_the_pair(lab, forwarder, sockets):
    """Another port of A's address (a job on A, a host behind A's NAT, a spoofer) speaks first: it
    makes no flow, and A's WireGuard port still gets the pair, both ways."""
    a_port, b_port = sockets
    lab.agent_a(op="bind", sock="squat", ip=A_IP, port=a_port + 4000)
    try:
        trio.run(forwarder.apply, [pair(40012, a_port, b_port)])
        assert lab.relayed(lab.agent_a, "squat", (RA, 40012), lab.agent_b, "b", "mine now", wait=NO) == []
        assert lab.relayed(lab.agent_a, "a", (RA, 40012), lab.agent_b, "b", "real") == [["real", RB, 40012]]
        assert lab.relayed(lab.agent_b, "b", (RB, 40012), lab.agent_a, "a", "back") == [["back", RA, 40012]]
    finally:
        lab.agent_a(op="close", sock="squat")


@real
def test_b_first_to_a_natted_a_waits_for_a_and_then_works(lab, forwarder, sockets):
    """A is behind a port-translating NAT: its record's port (here a_port + 3000) is not where its
    packets come from. B speaking first must not make a flow to that port (it would hold the pair's
    mapping against A's real flow for as long as B keeps sending): B's datagrams wait for A's."""
    a_port, b_port = sockets
    trio.run(forwarder.apply, [pair(40013, a_port + 3000, b_port, a_pinned=False)])
    lab.agent_b(op="send", sock="b", to=[RB, 40013], data="too early")
    assert lab.relayed(lab.agent_a, "a", (RA, 40013), lab.agent_b, "b", "a speaks") == [["a speaks", RB, 40013]]
    assert lab.relayed(lab.agent_b, "b", (RB, 40013), lab.agent_a, "a", "b answers") == [["b answers", RA, 40013]]


SIZE, COUNT, RATE = 1000, 1500, 1_000_000  # 1.5 MB at 1 MB/s


def burst(lab, port: int) -> tuple[int, float]:
    """COUNT datagrams A -> R:port at RATE; (how many B got, seconds the sending took)."""
    lab.agent_b.post(op="recv", sock="b", count=COUNT, first=YES, quiet=0.5)
    seconds = lab.agent_a(op="send", sock="a", to=[RA, port], data="x", size=SIZE, count=COUNT, rate=RATE)["seconds"]
    return lab.agent_b.answer()["n"], seconds


@real
def test_the_bandwidth_cap_drops_what_is_above_it(lab, forwarder, sockets):
    a_port, b_port = sockets
    trio.run(forwarder.apply, [pair(40005, a_port, b_port)])
    got, _ = burst(lab, 40005)
    assert got >= 0.95 * COUNT  # without a (low) cap nearly everything arrives: the path itself drops nothing
    cap = 100_000  # bytes/s, a tenth of the rate sent
    forwarder.cap_bytes_per_s = cap
    assert trio.run(forwarder.apply, [pair(40005, a_port, b_port)]) is True
    got, seconds = burst(lab, 40005)
    wire = SIZE + 28  # the limit counts IP packets: UDP and IP headers
    allowed = cap * (seconds + 1.0) / wire  # the rate for the whole burst, plus a bucket of up to 1 s
    assert 0.5 * cap * seconds / wire <= got <= 1.2 * allowed, (got, seconds)
    assert got < 0.3 * COUNT


@real
def test_pairs_coming_and_going_do_not_lift_the_cap(lab, forwarder, sockets):
    """Two members toggle their own pair every 50 ms while a third pair streams at 10 x the cap: every
    change of the rules must leave the cap's bucket as it was (the table is not made anew)."""
    a_port, b_port = sockets
    cap, count, rate = 50_000, 1000, 500_000  # bytes/s; 1 MB at 500 kB/s: 2 s
    forwarder.cap_bytes_per_s = cap
    streaming, toggled = pair(40014, a_port, b_port), pair(40015, a_port + 1, b_port + 1)
    trio.run(forwarder.apply, [streaming])
    applied = forwarder.applied

    async def toggle() -> None:
        for i in range(40):
            await forwarder.apply([streaming, toggled] if i % 2 == 0 else [streaming])
            await trio.sleep(0.05)

    lab.agent_b.post(op="recv", sock="b", count=count, first=YES, quiet=0.5)
    lab.agent_a.post(op="send", sock="a", to=[RA, 40014], data="x", size=SIZE, count=count, rate=rate)
    trio.run(toggle)
    seconds = lab.agent_a.answer()["seconds"]
    got = lab.agent_b.answer()["n"]
    assert forwarder.applied >= applied + 30  # the rules did change all along
    allowed = cap * (seconds + 1.0) / (SIZE + 28)  # the cap for the whole burst, plus its bucket of 1 s
    assert 0.5 * cap * seconds / (SIZE + 28) <= got <= 1.2 * allowed, (got, allowed, seconds)  # and it streamed on


@real
def test_a_table_someone_deleted_is_made_again_at_the_next_change(lab, forwarder, sockets):
    a_port, b_port = sockets
    trio.run(forwarder.apply, [pair(40016, a_port, b_port)])
    _sh("ip", "netns", "exec", lab.r, "nft", "delete", "table", "ip", TABLE)  # an operator's `nft flush ruleset`
    trio.run(forwarder.apply, [pair(40017, a_port, b_port)])  # the update fails: the whole table again
    assert lab.relayed(lab.agent_a, "a", (RA, 40017), lab.agent_b, "b", "again") == [["again", RB, 40017]]


@real
def test_close_leaves_no_table_and_forwarding_as_it_was(lab):
    fw = lab.forwarder()
    trio.run(fw.start)
    assert fw.forwarding_was_off is True and lab.ip_forward() == 1
    assert TABLE in lab.tables()
    trio.run(fw.close)
    assert lab.ip_forward() == 0 and TABLE not in lab.tables()
    trio.run(fw.close)  # twice: nothing left to do, no error

    # forwarding already on (the host is a router): left on, nothing else dropped
    lab.ip_forward(1)
    try:
        fw = lab.forwarder()
        trio.run(fw.start)
        assert fw.forwarding_was_off is False
        assert nft.FORWARDING_WAS_OFF not in _sh("ip", "netns", "exec", lab.r, "nft", "list", "table", "ip", TABLE)
        trio.run(fw.close)
        assert lab.ip_forward() == 1 and TABLE not in lab.tables()
    finally:
        lab.ip_forward(0)


@real
def test_a_crashed_relays_leftovers_are_undone(lab):
    crashed = lab.forwarder()
    trio.run(crashed.apply, [pair(40006, 5001, 5000)])  # then the daemon is killed: no close()
    assert lab.ip_forward() == 1
    # the next run, relaying still on: it knows forwarding was off, and turns it off when it closes
    again = lab.forwarder()
    trio.run(again.start)
    assert again.forwarding_was_off is True
    trio.run(again.close)
    assert lab.ip_forward() == 0 and TABLE not in lab.tables()
    # the next run with relaying off: close() alone cleans up
    trio.run(crashed.apply, [])  # its table again, and a crash with forwarding on
    lab.ip_forward(1)
    trio.run(lab.forwarder().close)
    assert lab.ip_forward() == 0 and TABLE not in lab.tables()
