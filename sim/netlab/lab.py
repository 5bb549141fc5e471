"""Bring a lab up and down, and act on it: exec, link changes, kill and start.

Each host is a network namespace ``sl-NAME-hI`` with its own swarmd, state directory and
control socket. Each host pair is a vde2 segment: a vde_switch per end, a wirefilter
between them (delay = RTT/2 each way, loss, bandwidth; changed at run time through its
management socket), and a vde_plug2tap in each namespace. A host behind NAT (`nat.py`)
has a router namespace ``sl-NAME-rI`` in front of it that holds its taps, its underlay
address and its routes; the host reaches it over a veth. Helpers are started detached and
recorded by pidfile, so they outlive `lab up`; `lab down` kills by pidfile and by the lab
directory in a process's command line, so a crashed `up` is cleaned too.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from ipaddress import IPv4Network
from pathlib import Path

from swarmd.compute.host.sandbox import box
from swarmd.gossip import swarmstate
from swarmd.gossip.cert import DEFAULT_CERT_TTL
from swarmd.p2p.signed import peer_bytes
from swarmd.identity import load_or_create
from swarmd.rpc.client import Client, DaemonUnreachable, RemoteError
from swarmd.wg import address

from . import nat as natmod
from .state import ROOT, HostState, LabState
from .topology import Host, Link

READY_TIMEOUT = 90.0  # N daemons importing libp2p on 2 cores
FORM_TIMEOUT = 60.0  # from every daemon answering to every one seeing (and meshed with) the others
SWARMD_PORT = 4001
JOB_USER = "nobody"  # who runs job ranks in the lab, as the daemon default (and with the sandbox off)
# the daemons' default job uid range; the lab's daemons share one machine, so each host draws from its own slice
JOB_UIDS = (61184, 65519)
JOB_UIDS_PER_HOST = 200
TOOLS = {"vde_switch": "vde2", "wirefilter": "vde2", "vde_plug2tap": "vde2", "ip": "iproute2", "nsenter": "util-linux"}
NAT_TOOLS = {"nft": "nftables", "conntrack": "conntrack"}  # only a lab with NAT routers needs them


class LabError(Exception):
    """Shown as one line; exit status 2 for what the user must fix, 1 otherwise."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def preflight(*, nat: bool = False) -> None:
    if os.geteuid() != 0:
        raise LabError("swarm-sim lab needs root (it creates network namespaces): run it as root", 2)
    if not Path("/proc/self/ns/net").exists():
        raise LabError("this kernel has no network namespaces (CONFIG_NET_NS): swarm-sim lab cannot run", 2)
    for tool, package in (TOOLS | NAT_TOOLS if nat else TOOLS).items():
        if shutil.which(tool) is None:
            raise LabError(f"{tool} not found: install the Debian package {package}", 2)


def run(*args: str, input: str | None = None) -> None:
    proc = subprocess.run(args, input=input, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LabError(f"{' '.join(args)}: {proc.stderr.strip()}")


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise LabError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


def _pidfile_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def process_state(pid: int | None) -> str:
    if not _alive(pid):
        return "dead"
    with open(f"/proc/{pid}/stat") as f:
        code = f.read().rsplit(")", 1)[1].split()[0]
    return {"T": "stopped", "t": "stopped"}.get(code, "running")


class Lab:
    def __init__(self, state: LabState) -> None:
        self.state = state
        self.dir = Path(state.dir)

    # --- up ----------------------------------------------------------------------------

    @classmethod
    def up(cls, name: str, hosts: list[Host], links: list[Link], *, daemons: bool = True, mesh: bool = True,
           daemon_args: Sequence[str] = (), nat: Mapping[str, str] | None = None,
           nat_timeouts: natmod.Timeouts = natmod.Timeouts()) -> Lab:
        """`daemon_args`: extra swarmd flags for every host, kept in the lab's state (a restart keeps them).
        `nat`: {host: class} (nat.CLASSES) for the hosts behind a router; the rest are public.
        `nat_timeouts`: the routers' conntrack UDP timeouts."""
        try:
            classes = natmod.check(nat or {}, [h.name for h in hosts])
        except ValueError as exc:
            raise LabError(str(exc), 2) from None
        preflight(nat=any(c != natmod.PUBLIC for c in classes.values()))
        if LabState.load(name) is not None or any(_netns_of(name)):
            raise LabError(f"lab {name!r} exists: `swarm-sim lab down --name {name}` first", 2)
        directory = ROOT / name
        directory.mkdir(parents=True, exist_ok=True)
        state = LabState(name=name, dir=str(directory), daemons=daemons, links=links, mesh=mesh,
                         daemon_args=list(daemon_args), nat_udp_timeout=nat_timeouts.udp,
                         nat_udp_stream_timeout=nat_timeouts.udp_stream)
        for h in hosts:
            hdir = directory / h.name
            ident, _ = load_or_create(hdir / "state")  # the peer id is known before the daemon starts
            kind = classes[h.name]
            state.hosts.append(HostState(
                name=h.name, index=h.index, address=h.address, netns=f"sl-{name}-{h.name}",
                state_dir=str(hdir / "state"), socket=str(hdir / "swarmd.sock"), log=str(hdir / "swarmd.log"),
                peer_id=str(ident.peer_id), country=h.country, nat=kind,
                router=None if kind == natmod.PUBLIC else router_netns(name, h.index),
                private_address=natmod.HOST_PRIVATE if kind in natmod.TRANSLATING else None))
        _make_swarm([Path(h.state_dir) for h in state.hosts], [h.peer_id for h in state.hosts])
        state.save()
        lab = cls(state)
        try:
            lab._build_network()
            if daemons:
                for h in state.hosts:
                    lab._spawn(h)
                state.save()
                lab.wait_ready(list(state.hosts))
        except BaseException:
            lab.down_quietly()
            raise
        return lab

    def _build_network(self) -> None:
        for h in self.state.hosts:
            run("ip", "netns", "add", h.netns)
            lo = ["link set lo up"]
            if h.nat not in natmod.TRANSLATING:  # a translated host's underlay address is its router's
                lo.append(f"addr add {h.address}/32 dev lo")
            run("ip", "-n", h.netns, "-batch", "-", input="\n".join(lo) + "\n")
            if h.router:
                self._build_router(h)
        (self.dir / "links").mkdir(exist_ok=True)
        for link in self.state.links:
            self._build_link(link)
        for h in self.state.hosts:  # addresses and host routes, one batch per namespace
            lines = []
            # a firewall's router forwards the host's own address and has none of its own to send from
            src = "" if h.nat == "firewall" else f" src {h.address}"
            for link in self.state.links:
                if h.name not in (link.a, link.b):
                    continue
                mine, theirs = (link.a_addr, link.b_addr) if h.name == link.a else (link.b_addr, link.a_addr)
                peer = self.state.host(link.b if h.name == link.a else link.a)
                tap = f"to-{peer.name}"
                wait_for(lambda: _link_exists(h.edge, tap), 10, f"tap {tap} in {h.edge}")
                lines += [f"addr add {mine}/30 dev {tap}", f"link set {tap} up",
                          f"route add {peer.address}/32 via {theirs}{src}"]
            if lines:
                run("ip", "-n", h.edge, "-batch", "-", input="\n".join(lines) + "\n")
        for h in self.state.hosts:
            if h.router:
                self._apply_nat(h)

    def _build_router(self, h: HostState) -> None:
        """The router namespace in front of `h` and the veth between them; the taps come later."""
        assert h.router
        run("ip", "netns", "add", h.router)
        router = ["link set lo up", f"addr add {natmod.ROUTER_PRIVATE}/24 dev {natmod.LAN_IF}",
                  f"link set {natmod.LAN_IF} up"]
        host = [f"link set {natmod.HOST_IF} up"]
        if h.nat in natmod.TRANSLATING:
            router.insert(1, f"addr add {h.address}/32 dev lo")
            host += [f"addr add {natmod.HOST_PRIVATE}/24 dev {natmod.HOST_IF}",
                     f"route add default via {natmod.ROUTER_PRIVATE}"]
        else:  # firewall: the host keeps its public address; the veth's private pair only carries it
            router.append(f"route add {h.address}/32 via {natmod.HOST_PRIVATE} dev {natmod.LAN_IF}")
            host += [f"addr add {natmod.HOST_PRIVATE}/24 dev {natmod.HOST_IF}",
                     f"route add default via {natmod.ROUTER_PRIVATE} src {h.address}"]
        run("ip", "link", "add", natmod.LAN_IF, "netns", h.router, "type", "veth",
            "peer", "name", natmod.HOST_IF, "netns", h.netns)
        run("ip", "-n", h.router, "-batch", "-", input="\n".join(router) + "\n")
        run("ip", "-n", h.netns, "-batch", "-", input="\n".join(host) + "\n")

    def _timeouts(self) -> natmod.Timeouts:
        return natmod.Timeouts(udp=self.state.nat_udp_timeout, udp_stream=self.state.nat_udp_stream_timeout)

    def _apply_nat(self, h: HostState) -> None:
        """The router's ruleset (replacing what it had, maps included) and its conntrack timeouts."""
        assert h.router
        timeouts = self._timeouts()
        run("ip", "netns", "exec", h.router, "nft", "-f", "-",
            input=natmod.ruleset(h.nat, external=h.address, generation=h.nat_generation, timeouts=timeouts))
        # after nft: the ruleset's ct expressions load conntrack, whose sysctls appear with it
        sysctls = {"net.ipv4.ip_forward": "1", **timeouts.sysctls()}
        run("ip", "netns", "exec", h.router, "sysctl", "-q", "-w", *(f"{k}={v}" for k, v in sysctls.items()))

    def rebind(self, host: str) -> tuple[int, int] | None:
        """`host`'s router forgets its mappings (its conntrack entries and maps) and draws
        external ports from a new range from now on, as a NAT that reboots or a carrier that
        reassigns ports does; every flow gets a new external port. The new range."""
        h = self.state.host(host)
        if h.nat not in natmod.TRANSLATING:
            raise LabError(f"{host} is {h.nat}: only a host behind a translating NAT "
                           f"({', '.join(natmod.TRANSLATING)}) can be rebound", 2)
        h.nat_generation += 1
        # As a NAT that reboots: it forwards nothing while its state goes (a packet let through
        # between the new rules and the conntrack flush rode its old entry, and its translation
        # refilled the new @eim map with the old port: the host kept its mapping), then maps anew.
        run("ip", "netns", "exec", h.router, "nft", "-f", "-", input=natmod.HOLD)
        run("ip", "netns", "exec", h.router, "conntrack", "-F")
        self._apply_nat(h)
        self.state.save()
        return natmod.port_range(h.nat_generation)

    def _build_link(self, link: Link) -> None:
        base = self.dir / "links" / f"p{link.pair}"
        for end in ("a", "b"):
            run("vde_switch", "-s", f"{base}{end}.sw", "-d", "-p", f"{base}{end}.sw.pid")
        args = ["wirefilter", "-v", f"{base}a.sw:{base}b.sw", "-M", f"{base}.mgmt", "--daemon",
                "--pidfile", f"{base}.wf.pid", "-d", f"{link.rtt_ms / 2:g}", "-l", f"{link.loss_pct:g}"]
        if link.bandwidth_mbit:
            args += ["-b", str(int(link.bandwidth_mbit * 125_000))]
        run(*args)
        for end, host, peer in (("a", link.a, link.b), ("b", link.b, link.a)):
            run("ip", "netns", "exec", self.state.host(host).edge, "vde_plug2tap", "-s", f"{base}{end}.sw",
                "-d", "-P", f"{base}{end}.tap.pid", f"to-{peer}")

    # --- daemons -----------------------------------------------------------------------

    def _spawn(self, h: HostState) -> None:
        (Path(h.state_dir).parent / "swarmd.toml").touch()
        with open(h.log, "ab") as log:
            proc = subprocess.Popen(self.daemon_argv(h), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True, env={**os.environ, "PYTHONPATH": _source_root()})
        h.pid = proc.pid  # nsenter execs: this is swarmd's pid

    def daemon_argv(self, h: HostState) -> list[str]:
        """How `h`'s swarmd is started: in its namespace, bootstrapping through the public hosts."""
        hdir = Path(h.state_dir).parent
        bootstrap = []
        for other in self.state.hosts:  # only public hosts can be dialled
            if other.name != h.name and other.nat == natmod.PUBLIC:
                bootstrap += ["--bootstrap", f"/ip4/{other.address}/tcp/{SWARMD_PORT}/p2p/{other.peer_id}"]
        # behind a router the daemon sees only its private (or, behind a firewall, undialable)
        # address: it must find out itself what others can reach, so it is told nothing
        announce = ["--announce", f"/ip4/{h.address}/tcp/{SWARMD_PORT}"] if h.nat == natmod.PUBLIC else []
        # nsenter, not `ip netns exec`: that one also gives its command a mount namespace with a
        # fresh /sys, where the host's cgroup filesystems are not mounted (no job cgroups then)
        return ["nsenter", f"--net=/run/netns/{h.netns}", "--", sys.executable, "-m", "swarmd.main",
                "--config", str(hdir / "swarmd.toml"), "--state-dir", h.state_dir, "--socket", h.socket,
                "--listen", f"/ip4/0.0.0.0/tcp/{SWARMD_PORT}", "--metrics-addr", "off", "--log-format", "json",
                *announce, "--mdns", "off",
                "--log-level", os.environ.get("SWARMD_LAB_LOG_LEVEL", "info"),
                "--mesh", "userspace" if self.state.mesh else "off",
                "--mesh-interface", mesh_interface(self.state.name, h.name), "--job-user", job_user(),
                "--job-slots", "2", "--job-uids", job_uids(h.index, len(self.state.hosts)), *bootstrap,
                # no service gateway unless a lab asks for one (daemon_args): a process per host
                "--gateway-listen", "off", *self.state.daemon_args]

    def formed(self) -> bool:
        """Every daemon sees every other alive and, with the mesh, has a handshake with each."""
        n = len(self.state.hosts)
        for h in self.state.hosts:
            try:
                with Client(h.socket, timeout=5) as c:
                    alive = [p for p in c.call("peers")["peers"] if p["state"] == "alive"]
                    if len(alive) != n - 1:
                        return False
                    if self.state.mesh:
                        peers = c.call("mesh")["peers"]
                        if len(peers) != n - 1 or any(p["handshake_age_s"] is None for p in peers):
                            return False
            except (DaemonUnreachable, RemoteError):
                return False
        return True

    def wait_formed(self, timeout: float = FORM_TIMEOUT) -> float:
        started = time.monotonic()
        while not self.formed():
            if time.monotonic() - started > timeout:
                raise LabError(f"the swarm did not form within {timeout:g} s (see the hosts' logs)")
            time.sleep(0.1)
        return time.monotonic() - started

    def wait_ready(self, hosts: list[HostState], timeout: float = READY_TIMEOUT) -> None:
        pending = list(hosts)
        deadline = time.monotonic() + timeout
        while pending:
            for h in list(pending):
                if not _alive(h.pid):
                    raise LabError(f"swarmd on {h.name} exited; its log: {h.log}")
                try:
                    with Client(h.socket, timeout=2) as c:
                        c.call("status")
                    pending.remove(h)
                except DaemonUnreachable:
                    pass
            if pending and time.monotonic() > deadline:
                raise LabError(f"swarmd not ready after {timeout:g} s on {', '.join(h.name for h in pending)}")
            time.sleep(0.05)

    def kill(self, host: str, sig: signal.Signals = signal.SIGTERM, timeout: float = 10.0) -> float:
        """Signal ``host``'s daemon; for SIGTERM and SIGKILL, wait ``timeout`` seconds for it to
        exit. The seconds it took (0 for other signals)."""
        h = self.state.host(host)
        if not _alive(h.pid):
            raise LabError(f"swarmd on {host} is not running")
        started = time.monotonic()
        os.kill(h.pid, sig)
        if sig not in (signal.SIGTERM, signal.SIGKILL):
            return 0.0
        wait_for(lambda: not _alive(h.pid), timeout, f"swarmd on {host} to exit")
        _reap(h.pid)
        return time.monotonic() - started

    def start(self, host: str) -> None:
        h = self.state.host(host)
        if h.crashed:
            raise LabError(f"{host} is crashed: `swarm-sim lab revive {host}` brings it back", 2)
        if _alive(h.pid):
            raise LabError(f"swarmd on {host} is already running (pid {h.pid})", 2)
        self._spawn(h)
        self.state.save()
        self.wait_ready([h])

    # --- crash and revive --------------------------------------------------------------

    def crash(self, host: str) -> list[int]:
        """Power the host off silently: its links lose every packet first (no FIN, no RST
        reaches a peer), then every process in its namespace but the lab's own taps is
        SIGKILLed: the daemon, its ranks, wireguard-go, whatever `lab exec` left running.
        The links' own settings stay as they were, for `revive`. The pids killed."""
        h = self.state.host(host)
        if h.crashed:
            raise LabError(f"{host} is already crashed: `swarm-sim lab revive {host}` brings it back", 2)
        h.crashed = True
        self.state.save()  # recorded before anything changes: a crash cut short is still known and revivable
        for link in self._links_of(host):
            self._apply(link)
        spared = {os.getpid(), *self._taps_of(host)}
        killed: list[int] = []
        deadline = time.monotonic() + 10
        while victims := [p for p in netns_pids(f"/run/netns/{h.netns}") if p not in spared]:
            if time.monotonic() > deadline:  # SIGKILL cannot be refused: only a process stuck in the kernel stays
                raise LabError(f"processes in {h.netns} survived SIGKILL for 10 s: {victims}")
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                if pid not in killed:
                    killed.append(pid)
            time.sleep(0.02)  # delivery is asynchronous; what they forked meanwhile is found next round
        _reap(h.pid)
        h.pid = None
        self.state.save()
        return killed

    def revive(self, host: str) -> None:
        """Power a crashed host on: its links as they were, its daemon started again with
        the same identity and state directory (as `lab start`)."""
        h = self.state.host(host)
        if not h.crashed:
            raise LabError(f"{host} is not crashed: `swarm-sim lab crash {host}` first", 2)
        h.crashed = False
        for link in self._links_of(host):
            self._apply(link)
        self.state.save()
        if self.state.daemons:
            self._spawn(h)
            self.state.save()
            self.wait_ready([h])

    def _links_of(self, host: str) -> list[Link]:
        return [link for link in self.state.links if host in (link.a, link.b)]

    def _taps_of(self, host: str) -> list[int]:
        """The host's ends of its links (vde_plug2tap, by pidfile): plumbing, not the host."""
        pids = []
        for link in self._links_of(host):
            end = "a" if link.a == host else "b"
            pid = _pidfile_pid(self.dir / "links" / f"p{link.pair}{end}.tap.pid")
            if pid:
                pids.append(pid)
        return pids

    def _cut(self, link: Link) -> bool:
        return any(self.state.host(end).crashed for end in (link.a, link.b))

    def _apply(self, link: Link) -> None:
        _wirefilter(self.dir / "links" / f"p{link.pair}.mgmt", wirefilter_commands(link, cut=self._cut(link)))

    # --- links -------------------------------------------------------------------------

    def set_link(self, a: str, b: str, *, rtt_ms: float | None = None, loss_pct: float | None = None,
                 bandwidth_mbit: float | None = None, up: bool | None = None) -> Link:
        link = self.state.link(a, b)
        if rtt_ms is not None:
            link.rtt_ms = rtt_ms
        if loss_pct is not None:
            link.loss_pct = loss_pct
        if bandwidth_mbit is not None:
            link.bandwidth_mbit = bandwidth_mbit
        if up is not None:
            link.up = up
        self._apply(link)  # a crashed end keeps the link cut; the settings apply at its revive
        self.state.save()
        return link

    # --- exec, status, down ------------------------------------------------------------

    def exec(self, host: str, argv: list[str]) -> int:
        h = self.state.host(host)
        env = {**os.environ, "SWARMD_SOCKET": h.socket,
               "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
        return subprocess.call(["ip", "netns", "exec", h.netns, *argv], env=env)

    def status(self) -> dict:
        hosts = []
        for h in self.state.hosts:
            ports = natmod.describe_ports(h.nat, h.nat_generation)
            hosts.append({"host": h.name, "netns": h.netns, "address": h.address, "country": h.country,
                          "pid": h.pid, "crashed": h.crashed,
                          "daemon": "crashed" if h.crashed else process_state(h.pid) if self.state.daemons else "none",
                          "socket": h.socket, "peer_id": h.peer_id, "nat": h.nat, "router": h.router,
                          "private_address": h.private_address, "nat_rebinds": h.nat_generation,
                          "external_ports": ports})
        return {"name": self.state.name, "dir": self.state.dir, "hosts": hosts,
                "nat_udp_timeout": self.state.nat_udp_timeout,
                "nat_udp_stream_timeout": self.state.nat_udp_stream_timeout,
                "links": [link.to_dict() | {"cut": self._cut(link)} for link in self.state.links]}

    def down_quietly(self) -> None:
        down(self.state.name)


def wirefilter_commands(link: Link, *, cut: bool = False) -> list[str]:
    """What a link's wirefilter is told: its settings, or every packet lost while it is down
    or `cut` (an end crashed); the settings themselves are kept either way."""
    return [f"delay {link.rtt_ms / 2:g}", f"loss {100 if cut or not link.up else link.loss_pct:g}",
            f"bandwidth {int((link.bandwidth_mbit or 0) * 125_000)}"]


def netns_pids(netns_path: str, proc: Path = Path("/proc")) -> list[int]:
    """Pids of the processes whose network namespace is the one bound at `netns_path`
    (`/run/netns/NAME`): same nsfs inode as their /proc/PID/ns/net. Zombies and processes
    gone meanwhile have no namespace left and are not listed."""
    want = os.stat(netns_path)
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            st = os.stat(entry / "ns" / "net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            pids.append(int(entry.name))
    return pids


def _make_swarm(state_dirs: list[Path], peers: list[str], network: IPv4Network = address.DEFAULT_NETWORK) -> None:
    """The first host owns a new swarm; the others hold certificates from it, as after a join:
    each names an overlay address in ``network`` (the hosts' ``mesh_network``) that the owner
    allocated and recorded, as its join handler does."""
    owner = swarmstate.create(state_dirs[0], peer_bytes(peers[0]), network=network)
    assert owner.owner_key is not None
    for state_dir, peer in zip(state_dirs[1:], peers[1:]):
        cert = swarmstate.certify(state_dirs[0], owner.owner_key, peer_bytes(peer), now=time.time(),
                                  network=network, ttl=DEFAULT_CERT_TTL)
        swarmstate.save_joined(state_dir, owner.owner_public, cert, ())


def down(name: str) -> bool:
    """Remove everything lab ``name`` made; True if there was anything. Safe to repeat."""
    directory = ROOT / name
    state = LabState.load(name)
    found = state is not None or directory.exists()
    daemons = [h.pid for h in state.hosts if _alive(h.pid)] if state else []
    for pid in daemons:  # a clean stop first, so daemons remove what they made
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in daemons) and time.monotonic() < deadline:
        time.sleep(0.05)
    marker = str(directory) + "/"
    leftovers = _pids_mentioning(marker) + _pids_mentioning(f"-f {mesh_prefix(name)}")  # wireguard-go of a killed daemon
    for pid in leftovers + [p for p in (_pidfile_pid(f) for f in directory.glob("links/*.pid")) if p]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in daemons:
        _reap(pid)
    for host in state.hosts if state else []:  # a daemon that had to be killed left its jobs' trees
        if host.peer_id:
            box.remove_left_shm(box.name_for(host.peer_id))
    for ns in _netns_of(name):
        found = True
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    if keep := os.environ.get("SWARMD_LAB_KEEP_LOGS"):  # a test's lab, for the post-mortem
        for log in directory.glob("*/swarmd.log"):
            dest = Path(keep) / name / f"{log.parent.name}.log"
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, dest)
    shutil.rmtree(directory, ignore_errors=True)
    for sock in Path("/var/run/wireguard").glob(f"{mesh_prefix(name)}*.sock"):
        sock.unlink(missing_ok=True)
    return found


@functools.cache
def job_user() -> str:
    """`nobody` runs the lab's job ranks, as on a real host, when it can run this Python;
    a checkout under a private home (/root/…) is out of its reach, and ranks then run as
    root, with a warning."""
    probe = subprocess.run(["runuser", "-u", JOB_USER, "--", sys.executable, "-c", "import torch"],
                           capture_output=True, text=True, cwd="/")
    if probe.returncode == 0:
        return JOB_USER
    print(f"swarm-sim: job ranks run as root: {JOB_USER} cannot run {sys.executable} "
          f"({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else probe.returncode})", file=sys.stderr)
    return ""


def job_uids(index: int, hosts: int) -> str:
    """Host `index`'s (1-based) slice of the job uid range, disjoint from every other host's
    of a lab of `hosts`: two daemons handing out the same uid would share a job's identity."""
    size = min(JOB_UIDS_PER_HOST, (JOB_UIDS[1] - JOB_UIDS[0] + 1) // max(hosts, index))
    low = JOB_UIDS[0] + (index - 1) * size
    return f"{low}-{low + size - 1}"


def router_netns(lab: str, index: int) -> str:
    """Under the lab's `sl-NAME-` prefix, so `down` removes it with the hosts."""
    return f"sl-{lab}-r{index}"


def mesh_prefix(lab: str) -> str:
    return f"w{lab}"[:11]


def mesh_interface(lab: str, host: str) -> str:
    """Distinct per host: wireguard-go's UAPI sockets share one directory across namespaces."""
    return f"{mesh_prefix(lab)}{host}"[:15]


def _reap(pid: int | None) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)  # our child when started by this process (tests)
    except (ChildProcessError, TypeError):
        pass


def _pids_mentioning(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _netns_of(name: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    prefix = f"sl-{name}-"
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def _link_exists(netns: str, dev: str) -> bool:
    return subprocess.run(["ip", "-n", netns, "link", "show", dev], capture_output=True).returncode == 0


def _wirefilter(mgmt: Path, commands: list[str]) -> None:
    """Send commands to a wirefilter's management socket; each must answer '1000 Success'."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(mgmt))
        buf = b""
        while not buf.endswith(b"$ "):
            buf += s.recv(4096)  # the banner and prompt
        for command in commands:
            s.sendall(command.encode() + b"\n")
            buf = b""
            while not buf.endswith(b"$ "):
                chunk = s.recv(4096)
                if not chunk:
                    break
                buf += chunk
            if b"1000 Success" not in buf:
                raise LabError(f"wirefilter refused {command!r}: {buf.decode(errors='replace').strip()}")


def _source_root() -> str:
    return str(Path(__file__).resolve().parent.parent.parent)
