"""firewall.py: the script text for a few policies (unit), then the rules in real nftables.

The real tests build two throwaway network namespaces: `host`, where the daemon's table is
and the job uids' sockets run (`ip netns exec` + `setpriv`), and `peer`, one veth away,
holding the addresses a job may or may not reach: a node of the job's (10.77.0.2,
fd77::2), another private address (10.77.0.3, fd77::3), a resolver (10.77.0.53), the cloud
metadata address and a public-looking 8.8.8.8 (outside the never-sets; the namespaces reach
nothing real). The host's end of the veth is named like the mesh interface. Each attempt is
a small stdlib program printing `ok <uid of the answering socket>`, `error <errno>` or
`timeout`: a refused connect() fails at once with ECONNREFUSED (the rules answer its SYN
with a RST; every address tried here has a listener, so it is the firewall that answered),
a refused datagram's send() with EPERM; a connection to a local listener of another uid
is refused when the SYN is retransmitted (1 s); one from a remote address that may not be
answered times out.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import trio

from swarmd.compute.host.sandbox import firewall
from swarmd.compute.host.sandbox.firewall import Policy

ip = ipaddress.ip_address
net = ipaddress.ip_network

RANGE = (61184, 61199)
A, B, C = 61184, 61185, 61190  # two jobs, and a uid of the range with no chain
MESH = "swmesh0"
NODE, NODE6, OTHER, OTHER6, RESOLVER = "10.77.0.2", "fd77::2", "10.77.0.3", "fd77::3", "10.77.0.53"
METADATA, PUBLIC = "169.254.169.254", "8.8.8.8"
PORT, BLOCKED_PORT = 7000, 7001  # root's servers in peer
REFUSED = "error ECONNREFUSED"
RETRY = 3.0  # TCP's first SYN retransmission comes after 1 s (RFC 6298 initial RTO)
NO = 1.0  # seconds a connection that must not complete is given (a local one takes microseconds)
YES = 10.0  # a generous bound for one that must

real = pytest.mark.skipif(os.geteuid() != 0 or not all(map(shutil.which, ("nft", "ip", "setpriv"))),
                          reason="needs root, nft, ip and setpriv")

# --- unit: the script text ------------------------------------------------------------------


def policy(**kw) -> Policy:
    return Policy(**{"uids": RANGE, "egress": "mesh", **kw})


def test_base_recreates_the_table_and_leaves_uids_without_a_chain_alone():
    script = firewall.base(policy())
    lines = script.splitlines()
    # idempotent: a table that is there is deleted, in the same transaction that recreates it
    assert lines.index("add table inet swarmd_jobs") < lines.index("delete table inet swarmd_jobs") < lines.index(
        "table inet swarmd_jobs {")
    assert "    type filter hook output priority filter; policy accept;" in lines
    # no rule for the range as such: a uid of it without a chain is no job's
    assert not any("61184" in line for line in lines if not line.lstrip().startswith("#"))
    assert "  set job_uids { typeof meta skuid; }" in lines
    assert lines[lines.index("    meta skuid vmap @jobs") + 1] == "  }"  # nothing after a job's own chain
    assert lines.index("    ct direction reply ct mark vmap @opened") < lines.index("    meta skuid vmap @jobs")
    assert "169.254.0.0/16" in script and "10.0.0.0/8" in script and "fc00::/7" in script
    assert "oifname" not in script  # no mesh interface named


def test_base_sets_allow_resolvers_mesh_and_table_name():
    script = firewall.base(policy(allow=(net("10.1.0.0/16"), net("10.1.2.0/24"), net("fd00::/64")),
                                  resolvers=(ip("10.0.0.53"), ip("fd00::53")), mesh_ifname="wg-swarm",
                                  table="lab_b"))
    assert "table inet lab_b {" in script
    assert "set allow4 { type ipv4_addr; flags interval; elements = { 10.1.0.0/16 }; }" in script  # collapsed
    assert "set allow6 { type ipv6_addr; flags interval; elements = { fd00::/64 }; }" in script
    assert "set resolvers4 { type ipv4_addr; flags interval; elements = { 10.0.0.53 }; }" in script
    assert "set resolvers6 { type ipv6_addr; flags interval; elements = { fd00::53 }; }" in script
    assert 'oifname "wg-swarm" ct direction reply meta skuid != @job_uids drop' in script
    assert "tcp sport" not in script
    script = firewall.base(policy(mesh_ifname="wg-swarm", daemon=(0, 4001)))
    assert 'oifname "wg-swarm" ct direction reply meta skuid 0 tcp sport 4001 accept' in script
    for bad in ((0, 0), (0, 70000), (-1, 4001), (True, 4001), "0:4001"):
        with pytest.raises(ValueError, match="daemon"):
            policy(mesh_ifname="wg-swarm", daemon=bad)


def job_rules(script: str, chain: str) -> list[str]:
    prefix = f"add rule inet swarmd_jobs {chain} "
    return [line.removeprefix(prefix) for line in script.splitlines() if line.startswith(prefix)]


def test_add_job_mesh_egress():
    script = firewall.add_job(policy(), A, [ip(NODE), ip(NODE6), ip(NODE)], [(ip(NODE), 4001)])
    rules = job_rules(script, f"job_{A}")
    assert f"ct state new ct mark set {A}" in rules
    assert "ct direction reply ct original ip saddr { 10.77.0.2 } accept" in rules
    assert "ct direction reply ct original ip6 saddr { fd77::2 } accept" in rules
    assert "ip daddr { 10.77.0.2 } meta l4proto tcp accept" in rules
    assert "ip6 daddr { fd77::2 } meta l4proto tcp accept" in rules
    # TCP only to its nodes: anything else to them is dropped before allow and internet
    assert rules.index("ip daddr { 10.77.0.2 } drop") < rules.index("ip daddr @allow4 accept")
    assert rules.index("ip6 daddr { fd77::2 } drop") < rules.index("ip6 daddr @allow6 accept")
    # the blocked port before the node that holds it; this host's addresses before the nodes
    to_node = rules.index("ip daddr { 10.77.0.2 } meta l4proto tcp accept")
    assert rules.index("ip daddr . tcp dport { 10.77.0.2 . 4001 } reject with tcp reset") < to_node
    assert rules.index("fib daddr type local drop") < to_node
    assert not any("@never" in r for r in rules)  # mesh: no public addresses
    assert rules[-2:] == ["meta l4proto tcp reject with tcp reset", "drop"]
    assert job_rules(script, f"opened_{A}")[-1] == f"meta skuid != {A} drop"
    assert f"add element inet swarmd_jobs job_uids {{ {A} }}" in script
    assert f"add element inet swarmd_jobs jobs {{ {A} : jump job_{A} }}" in script
    assert f"add element inet swarmd_jobs opened {{ {A} : jump opened_{A} }}" in script


def test_add_job_internet_egress_after_allow_and_without_nodes():
    rules = job_rules(firewall.add_job(policy(egress="internet"), B, []), f"job_{B}")
    assert rules.index("ip daddr @allow4 accept") < rules.index("ip daddr != @never4 accept") < len(rules) - 1
    assert "ip6 daddr != @never6 accept" in rules
    assert not any("original ip saddr" in r for r in rules)  # no nodes: replies only to this host
    assert rules[:2] == ['ct direction reply oifname "lo" accept', "ct direction reply drop"]


def test_remove_job_deletes_map_entries_before_chains():
    lines = firewall.remove_job(policy(), A).splitlines()[1:]
    assert lines == [f"delete element inet swarmd_jobs jobs {{ {A} }}",
                     f"delete element inet swarmd_jobs opened {{ {A} }}",
                     f"delete element inet swarmd_jobs job_uids {{ {A} }}",
                     f"flush chain inet swarmd_jobs job_{A}", f"delete chain inet swarmd_jobs job_{A}",
                     f"flush chain inet swarmd_jobs opened_{A}", f"delete chain inet swarmd_jobs opened_{A}"]


@pytest.mark.parametrize("kw", [{"uids": (0, 10)}, {"uids": (10, 5)}, {"egress": "everything"},
                                {"table": "x; flush ruleset"}, {"mesh_ifname": 'wg0" accept'},
                                {"mesh_ifname": "a" * 16}, {"allow": ("10.0.0.0/8",)},
                                {"resolvers": ("1.1.1.1",)}])
def test_policy_refuses_what_could_not_be_written_safely(kw):
    with pytest.raises(ValueError):
        policy(**kw)


@pytest.mark.parametrize("args", [(A - 1, []), (RANGE[1] + 1, []), (A, ["10.0.0.1"]),
                                  (A, [], [(ip(NODE), 0)]), (A, [], [(ip(NODE), 65536)]),
                                  (A, [], [("10.0.0.1", 80)])])
def test_add_job_refuses_bad_values(args):
    with pytest.raises(ValueError):
        firewall.add_job(policy(), *args)


def test_never_sets_are_disjoint_and_leave_public_addresses_out():
    for ranges in (firewall.NEVER_V4, firewall.NEVER_V6):
        nets = [net(r) for r in ranges]
        assert not any(a.overlaps(b) for i, a in enumerate(nets) for b in nets[i + 1:])  # nft interval sets
    never = [net(r) for r in firewall.NEVER_V4 + firewall.NEVER_V6]
    for a in ("8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"):
        assert not any(ip(a) in n for n in never)
    for a in (METADATA, "10.1.2.3", "172.20.0.1", "192.168.1.1", "100.100.0.1", "127.0.0.1", "::1",
              "fe80::1", "fd00:ec2::254", "::ffff:10.0.0.1", "64:ff9b::a00:1"):
        assert any(ip(a) in n for n in never), a


# --- real nftables in throwaway namespaces --------------------------------------------------

PROGRAM = r"""
import errno, os, socket, sys
mode, proto, host, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
family = socket.AF_INET6 if ":" in host else socket.AF_INET
kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
s = socket.socket(family, kind)
if mode == "serve":
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    if proto == "tcp":
        s.listen(64)
    print("ready", flush=True)
    while True:
        if proto == "tcp":
            c, _ = s.accept()
            c.sendall(b"%d\n" % os.getuid())
            c.close()
        else:
            _, peer = s.recvfrom(512)
            s.sendto(b"%d\n" % os.getuid(), peer)
else:
    if len(sys.argv) > 6:
        s.bind((sys.argv[6], 0))
    s.settimeout(float(sys.argv[5]))
    try:
        s.connect((host, port))
        if proto == "udp":
            s.send(b"?")
        print("ok", s.recv(64).decode().strip())
    except socket.timeout:
        print("timeout")
    except OSError as exc:
        print("error", errno.errorcode.get(exc.errno, exc.errno))
"""


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def _prefix(ns: str, uid: int) -> list[str]:
    drop = ["setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups"] if uid else []
    return ["ip", "netns", "exec", ns, *drop, sys.executable, "-I", "-S", "-c", PROGRAM]


@dataclass
class Lab:
    host: str
    peer: str
    servers: list[subprocess.Popen]

    def apply(self, script: str, ns: str | None = None) -> None:
        trio.run(functools.partial(firewall.apply, script, nft=("ip", "netns", "exec", ns or self.host, "nft")))

    def setup(self, pol: Policy, jobs: dict[int, list[str]], blocked=()) -> None:
        """The daemon's start (`base`) and one `add_job` per job uid -> its node addresses."""
        self.apply(firewall.base(pol))
        for uid, nodes in jobs.items():
            self.apply(firewall.add_job(pol, uid, [ip(n) for n in nodes], blocked))

    def connect(self, uid: int, host: str, port: int, *, proto: str = "tcp", timeout: float = YES,
                source: str | None = None, ns: str | None = None) -> str:
        argv = [*_prefix(ns or self.host, uid), "connect", proto, host, str(port), str(timeout)]
        done = subprocess.run(argv + ([source] if source else []), capture_output=True, text=True,
                              timeout=timeout + 30)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def serve(self, uid: int, host: str, port: int, *, proto: str = "tcp", ns: str | None = None) -> None:
        proc = subprocess.Popen([*_prefix(ns or self.host, uid), "serve", proto, host, str(port)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.servers.append(proc)
        line = proc.stdout.readline()  # the condition: it listens
        if line != "ready\n":
            proc.kill()
            raise AssertionError(f"server {host}:{port} did not start: {line}{proc.stderr.read()}")

    def tables(self, ns: str) -> str:
        return subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "ruleset"], capture_output=True,
                              text=True, check=True).stdout


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    tag = secrets.token_hex(3)
    the = Lab(host=f"swfw-{tag}-h", peer=f"swfw-{tag}-p", servers=[])
    made = []
    try:
        for ns in (the.host, the.peer):
            _sh("ip", "netns", "add", ns)
            made.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", the.host, "link", "add", MESH, "type", "veth", "peer", "name", "eth0", "netns", the.peer)
        _sh("ip", "-n", the.host, "addr", "add", "10.77.0.1/24", "dev", MESH)
        _sh("ip", "-n", the.host, "addr", "add", "fd77::1/64", "dev", MESH, "nodad")
        for a in ("10.77.0.2/24", f"{OTHER}/32", f"{RESOLVER}/32", f"{PUBLIC}/32", f"{METADATA}/32"):
            _sh("ip", "-n", the.peer, "addr", "add", a, "dev", "eth0")
        for a in (f"{NODE6}/64", f"{OTHER6}/128"):
            _sh("ip", "-n", the.peer, "addr", "add", a, "dev", "eth0", "nodad")
        for ns in (the.host, the.peer):
            _sh("ip", "-n", ns, "link", "set", MESH if ns == the.host else "eth0", "up")
        _sh("ip", "-n", the.host, "route", "add", "default", "via", NODE)  # metadata, 8.8.8.8: in peer
        _sh("ip", "-n", the.peer, "route", "add", "default", "via", "10.77.0.1")
        # root's services in peer, on every address it holds
        the.serve(0, "::", PORT, ns=the.peer)  # IPv4 too (dual stack)
        the.serve(0, "0.0.0.0", BLOCKED_PORT, ns=the.peer)
        the.serve(0, RESOLVER, 53, proto="udp", ns=the.peer)  # bound: it answers from that address
        the.serve(0, "0.0.0.0", 54, proto="udp", ns=the.peer)
        yield the
    finally:
        for proc in the.servers:
            proc.kill()
            proc.wait()
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@contextmanager
def listening(lab: Lab, *servers: tuple[int, str, int]) -> Iterator[None]:
    """(uid, address, port) listeners in the host namespace while the block runs."""
    first = len(lab.servers)
    try:
        for uid, host, port in servers:
            lab.serve(uid, host, port)
        yield
    finally:
        for proc in lab.servers[first:]:
            proc.kill()
            proc.wait()
        del lab.servers[first:]


@real
def test_a_job_reaches_its_own_local_listener_and_no_other(lab):
    lab.setup(policy(), {A: [NODE], B: [NODE]})
    with listening(lab, (A, "127.0.0.1", 7101), (B, "127.0.0.1", 7102), (0, "127.0.0.1", 7103),
                   (A, "10.77.0.1", 7104), (A, "::1", 7105), (0, "::1", 7106)):
        assert lab.connect(A, "127.0.0.1", 7101) == f"ok {A}"
        assert lab.connect(A, "10.77.0.1", 7104) == f"ok {A}"  # its own, on this host's mesh address
        # another job's, root's (the daemon's ports): refused at the SYN's retransmission
        assert lab.connect(A, "127.0.0.1", 7102, timeout=RETRY) == REFUSED
        assert lab.connect(A, "127.0.0.1", 7103, timeout=RETRY) == REFUSED
        assert lab.connect(B, "127.0.0.1", 7102) == f"ok {B}"
        assert lab.connect(B, "10.77.0.1", 7104, timeout=RETRY) == REFUSED
        assert lab.connect(A, "::1", 7105) == f"ok {A}"  # the same over IPv6
        assert lab.connect(B, "::1", 7105, timeout=RETRY) == REFUSED
        assert lab.connect(A, "::1", 7106, timeout=RETRY) == REFUSED
        assert lab.connect(0, "127.0.0.1", 7101) == f"ok {A}"  # this host reaches a job's listener
        # the kernel's RST for a closed port has no socket: left alone, refused at once
        assert lab.connect(A, "127.0.0.1", 7199) == "error ECONNREFUSED"
        # UDP to a local address (not a resolver) would reach the service before any reply check
        assert lab.connect(A, "127.0.0.1", 7101, proto="udp") == "error EPERM"


@real
def test_metadata_private_and_public_addresses_fail_at_once_in_mesh_mode(lab):
    lab.setup(policy(resolvers=(ip(RESOLVER),)), {A: [NODE, NODE6]})
    for host in (METADATA, OTHER, OTHER6, PUBLIC):
        assert lab.connect(A, host, PORT, timeout=NO) == REFUSED, host
    assert lab.connect(A, OTHER, 54, proto="udp") == "error EPERM"
    # a uid of the range with no chain is no job's (maybe a DynamicUser service's): left alone
    assert lab.connect(C, METADATA, PORT) == "ok 0"
    assert lab.connect(0, METADATA, PORT) == "ok 0"  # other uids are not this firewall's business


@real
def test_a_job_reaches_its_nodes_and_resolvers_but_not_blocked_ports(lab):
    lab.setup(policy(resolvers=(ip(RESOLVER),)), {A: [NODE, NODE6]}, blocked=[(ip(NODE), BLOCKED_PORT)])
    assert lab.connect(A, NODE, PORT) == "ok 0"
    assert lab.connect(A, NODE6, PORT) == "ok 0"
    assert lab.connect(A, NODE, BLOCKED_PORT, timeout=NO) == REFUSED  # a member's libp2p port
    # UDP to its nodes: it would reach any service there before a reply could be checked
    # (issue 23 finding 8: a job's datagrams reached its other hosts' WireGuard, other jobs)
    assert lab.connect(A, NODE, 54, proto="udp") == "error EPERM"
    assert lab.connect(A, NODE6, 54, proto="udp") == "error EPERM"
    assert lab.connect(A, RESOLVER, 53, proto="udp") == "ok 0"  # DNS
    assert lab.connect(A, RESOLVER, 54, proto="udp") == "error EPERM"  # and nothing else there


@real
def test_a_job_listener_answers_its_nodes_only(lab):
    lab.setup(policy(), {A: [NODE], B: [OTHER]})
    with listening(lab, (A, "0.0.0.0", 7201)):
        assert lab.connect(0, "10.77.0.1", 7201, source=NODE, ns=lab.peer) == f"ok {A}"
        assert lab.connect(0, "10.77.0.1", 7201, source=OTHER, ns=lab.peer, timeout=NO) == "timeout"


@real
def test_nothing_but_a_job_answers_over_the_mesh_interface(lab):
    lab.setup(policy(mesh_ifname=MESH), {A: [NODE]})
    with listening(lab, (0, "0.0.0.0", 7301), (A, "0.0.0.0", 7302), (C, "0.0.0.0", 7303)):
        assert lab.connect(0, "10.77.0.1", 7301, source=NODE, ns=lab.peer, timeout=NO) == "timeout"
        assert lab.connect(0, "127.0.0.1", 7301) == "ok 0"  # still served on this host
        assert lab.connect(0, "10.77.0.1", 7302, source=NODE, ns=lab.peer) == f"ok {A}"
        # a uid of the range with no chain is no job's: like any other service, not over the mesh
        assert lab.connect(0, "10.77.0.1", 7303, source=NODE, ns=lab.peer, timeout=NO) == "timeout"
        assert lab.connect(0, "127.0.0.1", 7303) == f"ok {C}"
        lab.setup(policy(), {A: [NODE]})  # without mesh_ifname: served over it again
        assert lab.connect(0, "10.77.0.1", 7301, source=NODE, ns=lab.peer) == "ok 0"


def test_the_daemon_answers_over_the_mesh_on_its_libp2p_port_only(lab):
    # members behind a NAT are dialled at their overlay address (issue 25): the daemon's own
    # socket on its libp2p port answers there; its other ports, and root's, still do not
    lab.setup(policy(mesh_ifname=MESH, daemon=(0, 7301)), {A: [NODE]})
    with listening(lab, (0, "0.0.0.0", 7301), (0, "0.0.0.0", 7304)):
        assert lab.connect(0, "10.77.0.1", 7301, source=NODE, ns=lab.peer) == "ok 0"
        assert lab.connect(0, "10.77.0.1", 7304, source=NODE, ns=lab.peer, timeout=NO) == "timeout"


@real
def test_a_service_replica_answers_members_over_the_mesh_on_its_port_and_no_job_reaches_one(lab):
    pol = policy(mesh_ifname=MESH, serve_ports=(30000, 30099))
    lab.apply(firewall.base(pol))
    lab.apply(firewall.add_job(pol, A, [], serves=30005))  # a replica: one node, this host
    lab.apply(firewall.add_job(pol, B, [ip(NODE)]))  # a job whose nodes include the peer
    first = len(lab.servers)
    lab.serve(0, "0.0.0.0", 30007, ns=lab.peer)  # a replica's port on another member
    try:
        with listening(lab, (A, "0.0.0.0", 30005), (A, "0.0.0.0", 7401), (B, "0.0.0.0", 30006)):
            # any member's gateway (not only the job's nodes) reaches the replica's port, and only it
            assert lab.connect(0, "10.77.0.1", 30005, source=OTHER, ns=lab.peer) == f"ok {A}"
            assert lab.connect(0, "10.77.0.1", 7401, source=OTHER, ns=lab.peer, timeout=NO) == "timeout"
            # a port of the range held by a job that is no replica answers only its nodes, as any port
            assert lab.connect(0, "10.77.0.1", 30006, source=OTHER, ns=lab.peer, timeout=NO) == "timeout"
            # no job reaches a replica elsewhere, not even on its own nodes; the rest of a node still
            assert lab.connect(B, NODE, 30007, timeout=NO) == REFUSED
            assert lab.connect(B, NODE, PORT) == "ok 0"
            # nor one here: a job's connection is answered by its own sockets only
            assert lab.connect(B, "127.0.0.1", 30005, timeout=RETRY) == REFUSED
            assert lab.connect(0, "127.0.0.1", 30005) == f"ok {A}"  # the host's health check
    finally:
        for proc in lab.servers[first:first + 1]:
            proc.kill()
            proc.wait()
        del lab.servers[first:first + 1]


def test_a_replica_port_outside_the_serve_ports_or_without_a_mesh_is_refused():
    with pytest.raises(ValueError, match="serve ports"):
        firewall.add_job(policy(mesh_ifname=MESH, serve_ports=(30000, 30099)), A, [], serves=31000)
    assert "sport 30001" not in firewall.add_job(policy(serve_ports=(30000, 30099)), A, [], serves=30001), \
        "no mesh: no member's gateway to answer, this host's is answered over lo"
    with pytest.raises(ValueError, match="serve ports"):
        policy(serve_ports=(30099, 30000))
    rules = firewall.add_job(policy(mesh_ifname=MESH, serve_ports=(30000, 30099)), A, [])
    assert f'oifname "{MESH}" tcp dport 30000-30099' in rules, "every job, replica or not, is kept off them"


@real
def test_internet_mode_reaches_public_addresses_but_never_the_never_sets(lab):
    lab.setup(policy(egress="internet"), {A: []})
    assert lab.connect(A, PUBLIC, PORT) == "ok 0"
    for host in (METADATA, OTHER, OTHER6, NODE):
        assert lab.connect(A, host, PORT, timeout=NO) == REFUSED, host
    lab.setup(policy(egress="internet", allow=(net(f"{OTHER}/32"),)), {A: []})
    assert lab.connect(A, OTHER, PORT) == "ok 0"  # unless listed in job_egress_allow
    assert lab.connect(A, NODE, PORT, timeout=NO) == REFUSED


@real
def test_internet_mode_keeps_a_public_nodes_udp_and_every_blocked_port_closed(lab):
    # a node at a public address (no mesh): internet egress must not reopen UDP to it, and the
    # members' daemon ports stay closed wherever they are (issue 23 findings 8 and 11)
    if not any(PUBLIC in p.args for p in lab.servers):
        lab.serve(0, PUBLIC, 55, proto="udp", ns=lab.peer)  # bound: it answers from that address
    lab.setup(policy(egress="internet"), {A: [PUBLIC]}, blocked=[(ip(PUBLIC), BLOCKED_PORT)])
    assert lab.connect(A, PUBLIC, PORT) == "ok 0"
    assert lab.connect(A, PUBLIC, 55, proto="udp") == "error EPERM"
    assert lab.connect(A, PUBLIC, BLOCKED_PORT, timeout=NO) == REFUSED
    lab.setup(policy(egress="internet"), {A: []}, blocked=[(ip(PUBLIC), BLOCKED_PORT)])
    assert lab.connect(A, PUBLIC, 55, proto="udp") == "ok 0", "UDP to the internet is still open"
    assert lab.connect(A, PUBLIC, BLOCKED_PORT, timeout=NO) == REFUSED, "not a node: still a daemon's port"


@real
def test_remove_job_leaves_the_uid_alone_and_add_job_confines_it_again(lab):
    """After remove_job the uid is no job's: box.py removes the chain only once the job's
    cgroup is killed, and uids.py then gives the uid's lock back, so systemd may hand it to
    a DynamicUser service (the default range is systemd's). A chain-less uid of the range
    is therefore left alone, as every other uid is: it reaches another uid's listener on
    this host and a private address. Only add_job confines it again."""
    pol = policy()
    lab.setup(pol, {A: [NODE]})
    with listening(lab, (0, "127.0.0.1", 7401)):
        assert lab.connect(A, NODE, PORT) == "ok 0"
        assert lab.connect(A, OTHER, PORT, timeout=NO) == REFUSED
        assert lab.connect(A, "127.0.0.1", 7401, timeout=RETRY) == REFUSED
        lab.apply(firewall.remove_job(pol, A))
        assert f"job_{A}" not in lab.tables(lab.host)
        assert lab.connect(A, "127.0.0.1", 7401) == "ok 0"
        assert lab.connect(A, OTHER, PORT) == "ok 0"
        lab.apply(firewall.add_job(pol, A, [ip(NODE)]))
        assert lab.connect(A, OTHER, PORT, timeout=NO) == REFUSED
        assert lab.connect(A, "127.0.0.1", 7401, timeout=RETRY) == REFUSED


@real
def test_base_twice_is_a_clean_restart_and_each_namespace_has_its_own_table(lab):
    pol = policy()
    lab.setup(pol, {A: [NODE]})
    lab.apply(firewall.base(pol))  # a daemon restart
    lab.apply(firewall.base(pol))
    assert f"job_{A}" not in lab.tables(lab.host)
    # the previous run's job uid has no chain: no job's now (its cgroup was killed at start)
    assert lab.connect(A, OTHER, PORT) == "ok 0"
    other = policy(egress="internet", table="swarmd_other")
    lab.apply(firewall.base(other), ns=lab.peer)  # another daemon, in its own namespace
    lab.apply(firewall.add_job(pol, A, [ip(NODE)]))
    host, peer = lab.tables(lab.host), lab.tables(lab.peer)
    assert "table inet swarmd_jobs" in host and "swarmd_other" not in host
    assert "table inet swarmd_other" in peer and "swarmd_jobs" not in peer and f"job_{A}" not in peer
    lab.apply("delete table inet swarmd_other\n", ns=lab.peer)


@real
def test_apply_reports_nfts_complaint_and_changes_nothing(lab):
    pol = policy()
    lab.setup(pol, {})
    before = lab.tables(lab.host)
    with pytest.raises(firewall.FirewallError, match="job_61185|No such file"):
        lab.apply(firewall.add_job(pol, A, [ip(NODE)]) + firewall.remove_job(pol, B))
    assert lab.tables(lab.host) == before  # one transaction: A's chain was not added either


@real
def test_detect_says_nft_can_be_used_here():
    assert firewall.detect() is None
    assert firewall.detect("/nonexistent/nft").startswith("nft fails")
