"""The job egress firewall: nftables rules keyed on the job's uid (issue 12).

Every job runs as a uid of its own from the `job_uids` range (uids.py). This module writes
the nftables script that limits what sockets of that uid may reach, and applies it. The
script builders (`base`, `add_job`, `remove_job`) are pure functions of a `Policy`;
`apply` (swarmd/nft.py, shared with the relay's rules) feeds a script to `nft -f -`, where it is
one atomic transaction.

Theory of operation. One `table inet <policy.table>` with one base chain on the output
hook. Only packets that leave a socket are judged: a packet the kernel sends with no user
socket (an ICMP error, the RST for a closed port, neighbour discovery) matches no
`meta skuid` expression and passes. Conntrack tells the two directions of a connection
apart, and the conntrack mark records which job uid opened it.
- A job uid U's new connection: `ct mark` is set to U, then it is accepted when it goes to
  * a resolver (`policy.resolvers`, port 53, UDP or TCP);
  * a local address of this host, TCP only: which socket answers is decided at its reply
    (below). Other protocols to a local address are dropped: a UDP datagram reaches a
    local service before any reply could be checked (so a job's ranks on one host talk
    TCP to each other, as torch.distributed does);
  * one of the job's nodes (its hosts' overlay addresses), TCP only, for the same reason
    (issue 23 finding 8): a datagram to another host's overlay address reaches whatever
    listens there (its WireGuard, a resolver, another job's socket) before anything could
    check who answers; a TCP connection is answered there only by a job's socket (the mesh
    rule below, on that host) that may answer this host (its chain there). Other
    protocols to a node are dropped, `allow` and "internet" notwithstanding. Gloo, NCCL's
    sockets, torch.distributed's store and Ray talk TCP between hosts;
  * never the `blocked` (address, TCP port) pairs, wherever they are (every member's
    advertised libp2p port: a job is no libp2p peer, whatever its egress);
  * `policy.allow`; with egress "internet" also any address outside NEVER_V4/NEVER_V6.
  Anything else is refused at once, never left to time out: a TCP SYN is answered with a
  RST made here, so connect() fails with ECONNREFUSED; any other packet is dropped, which
  fails its send() with EPERM. (A dropped SYN would leave TCP retransmitting it until
  connect() times out; an ICMP "administratively prohibited" reaches an IPv6 socket while
  connect() holds it and only aborts it at the retransmission, 1 s later.)
- A reply to a connection a job uid U opened (`ct mark` U) must come from a socket of U
  itself (or be DNS from a resolver): U reaches its own listeners on this host and no
  other local service (the daemon's libp2p and metrics ports, sshd, another job, root).
  The other side's SYN-ACK is dropped; U's SYN, retransmitted after 1 s (the initial
  RTO), then meets a connection whose reply conntrack has seen and is answered with a
  RST: connect() fails with ECONNREFUSED after about a second instead of retrying for
  two minutes.
- A reply from U's socket to a connection someone else opened is allowed only towards
  this host (over `lo`; connections from another job were already checked by their mark)
  or one of U's nodes: a job's listener answers its own ranks, not the world.
- With `policy.mesh_ifname`, no socket but a job's (a uid in the `job_uids` set: one with
  a chain here) answers a connection that came in over the mesh interface, except the
  daemon's own on its libp2p port (`policy.daemon`): a member behind a NAT or a firewall is
  dialled at its overlay address (issue 25), so daemons talk libp2p over the overlay. A
  job on another member does not reach that port: every member's daemon port at its
  overlay address is in every job's `blocked` (compute/service.py job_nodes).
- Service replicas (issue 27; `policy.serve_ports`, with `mesh_ifname`): a replica's job
  uid answers, on its one port, a connection from anyone that came in over the mesh (the
  members' gateways: WireGuard admits members only), and no job reaches any port of the
  range over the mesh (its own gateway's the way in). A job on this host reaching a replica
  here is refused as any other job's listener is (its reply is not the opener's socket).
- What is left open between hosts: another host sees a job's packets come from this host's
  address, not from the job, so on a host two jobs both run on, a job's TCP reaches the
  other's listeners when that job's nodes include this host (its chain there lets it answer
  this host). Without `mesh_ifname` (no mesh: nodes are underlay addresses) nothing keeps
  the other host's own services from answering a job's TCP but `blocked` and that host's
  own firewall.
- A uid of the range with no chain here is no job's, and this firewall leaves it alone as
  it leaves every other uid. The range is by default systemd's DynamicUser range, and
  systemd may hand any uid of it that uids.py does not hold (its lock) to a service: a
  catch-all "a uid of the range without a chain sends nothing" would cut such a service off
  the network. What a job uid may do is decided by its own chain, from `add_job`, before
  any rank starts, to `remove_job`, after the job's cgroup is killed (box.py); a daemon
  restart kills the previous run's leftover job cgroups before `base`. Consequence: a job
  process that outlives `remove_job` (possible only on a host without the cgroup part) is
  no longer confined.

Rules of this module:
- `meta skuid` cannot be assigned to `ct mark` (different datatypes), so each job has its
  own chains with its uid written out: `job_<U>` (what U's sockets send) and `opened_<U>`
  (replies to what U opened), reached through the verdict maps `jobs` and `opened`.
  The set `job_uids` names the uids that have chains (for the mesh rule). `remove_job`
  deletes the map and set entries and both chains in one transaction.
- Each daemon has a table of its own, named by its pid (`table_for`): nftables state is per
  network namespace, and several daemons may share one (a test suite's, two swarms on one
  host). With one shared name, a daemon that stopped deleted the table another one's jobs
  were confined by: they ran unconfined from then on, and its next job failed to start
  (seen: "add chain inet swarmd_jobs job_61223: No such file or directory"). Their job
  uids never overlap (uids.py's locks hand a uid to one daemon at a time), so the tables
  judge disjoint uids; a packet passes only if every table accepts it, and a table leaves
  the uids it has no chain for alone.
- `base` deletes the table if present and creates it again; before it, a daemon deletes
  the job tables no running swarmd owns (`stale`: a killed daemon's, whose pid is gone or
  is no swarmd's now, and the shared `swarmd_jobs` of versions before): a chain left there
  for a uid would judge the next job handed that uid.
- Everything written into a script is validated first (addresses through `ipaddress`,
  names against a strict pattern): no value can add a statement.
- The `conntrack mark` is ours: nothing else on a swarmd host should set it on connections
  of job uids.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ....nft import NftError, apply, tables  # noqa: F401 (apply, tables: this module's interface to box.py)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# Never reachable by a job (unless listed in `allow` or as one of its nodes): the ranges
# IANA's special-purpose registries (RFC 6890 and updates) mark not globally reachable, and
# the IPv6 prefixes that carry an IPv4 address (a private one could hide in them). So
# "internet" means the public internet, never the provider's LAN, the cloud metadata
# address or the overlay. Cost: a job on an IPv6-only host behind NAT64 reaches no IPv4.
NEVER_V4 = (
    "0.0.0.0/8",  # "this network"
    "10.0.0.0/8",  # private (RFC 1918)
    "100.64.0.0/10",  # shared address space, carrier-grade NAT (RFC 6598)
    "127.0.0.0/8",  # loopback
    "169.254.0.0/16",  # link-local; cloud metadata at 169.254.169.254
    "172.16.0.0/12",  # private (RFC 1918)
    "192.0.0.0/24",  # IETF protocol assignments
    "192.0.2.0/24",  # TEST-NET-1 (documentation)
    "192.168.0.0/16",  # private (RFC 1918)
    "198.18.0.0/15",  # benchmarking (RFC 2544)
    "198.51.100.0/24",  # TEST-NET-2
    "203.0.113.0/24",  # TEST-NET-3
    "224.0.0.0/4",  # multicast
    "240.0.0.0/4",  # reserved, and the limited broadcast 255.255.255.255
)
NEVER_V6 = (
    "::/127",  # unspecified and loopback
    "::ffff:0:0/96",  # IPv4-mapped: the IPv4 ranges above in disguise
    "64:ff9b::/96",  # NAT64 well-known prefix: reaches any IPv4 address, private ones too
    "64:ff9b:1::/48",  # NAT64 local use (RFC 8215)
    "100::/64",  # discard-only (RFC 6666)
    "2001::/32",  # Teredo: embeds an IPv4 address
    "2001:db8::/32",  # documentation
    "2002::/16",  # 6to4: embeds an IPv4 address
    "3fff::/20",  # documentation (RFC 9637)
    "fc00::/7",  # unique local; AWS metadata at fd00:ec2::254
    "fe80::/10",  # link-local
    "fec0::/10",  # site-local (deprecated)
    "ff00::/8",  # multicast
)
EGRESS = ("mesh", "internet")
REFUSE = "reject with tcp reset"  # connect() fails now (ECONNREFUSED), not after its SYN retries
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")
TABLE = "swarmd_jobs"  # the shared name of versions before: always stale now
_OWNED = re.compile(r"swarmd_jobs_([1-9][0-9]{0,9})")  # table_for's names: the owner's pid
_IFNAME = re.compile(r"[A-Za-z0-9_.-]{1,15}")  # IFNAMSIZ - 1


FirewallError = NftError  # nft refused a script or cannot run here (the message is nft's)


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    uids: tuple[int, int]  # the job uid range, inclusive
    egress: str  # "mesh": the job's nodes, resolvers and `allow`; "internet": also public addresses
    allow: tuple[Network, ...] = ()  # job_egress_allow: reachable whatever NEVER_* says
    resolvers: tuple[Address, ...] = ()  # DNS servers (port 53) every job may ask
    mesh_ifname: str | None = None  # the overlay interface: only job sockets answer over it ...
    # ... and the daemon itself on its libp2p port (uid, TCP port): members behind a NAT are
    # dialled at their overlay address (mesh/reach.py); every job's chain closes that port to it
    daemon: tuple[int, int] | None = None
    # the TCP ports service replicas listen on (serve/): no job reaches them over the mesh, a
    # replica's own port answers any member there (its gateway); with `mesh_ifname` only
    serve_ports: tuple[int, int] | None = None
    table: str = TABLE  # the daemon's is table_for(its pid)

    def __post_init__(self) -> None:
        low, high = self.uids
        if not (isinstance(low, int) and isinstance(high, int) and 0 < low <= high < 2**32 - 1):
            raise ValueError(f"bad job uid range {self.uids!r}")
        if self.egress not in EGRESS:
            raise ValueError(f"egress must be one of {EGRESS}, not {self.egress!r}")
        if not _NAME.fullmatch(self.table):
            raise ValueError(f"bad nftables table name {self.table!r}")
        if self.mesh_ifname is not None and not _IFNAME.fullmatch(self.mesh_ifname):
            raise ValueError(f"bad interface name {self.mesh_ifname!r}")
        if self.daemon is not None and not (
                isinstance(self.daemon, tuple) and len(self.daemon) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in self.daemon)
                and 0 <= self.daemon[0] < 2**32 - 1 and 1 <= self.daemon[1] <= 65535):
            raise ValueError(f"bad daemon (uid, port) {self.daemon!r}")
        if self.serve_ports is not None and not (
                isinstance(self.serve_ports, tuple) and len(self.serve_ports) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in self.serve_ports)
                and 1 <= self.serve_ports[0] <= self.serve_ports[1] <= 65535):
            raise ValueError(f"bad serve ports {self.serve_ports!r}")
        for n in self.allow:
            if not isinstance(n, ipaddress.IPv4Network | ipaddress.IPv6Network):
                raise ValueError(f"allow holds networks, not {n!r}")
        for a in self.resolvers:
            if not isinstance(a, ipaddress.IPv4Address | ipaddress.IPv6Address):
                raise ValueError(f"resolvers holds addresses, not {a!r}")

    @property
    def range(self) -> str:
        return f"{self.uids[0]}-{self.uids[1]}"


def table_for(pid: int) -> str:
    """The job table of the daemon with process id `pid` (module header)."""
    return f"{TABLE}_{pid}"


def stale(tables: Iterable[str], is_swarmd: Callable[[int], bool]) -> list[str]:
    """Of the inet tables `tables`, the job tables no running daemon owns: the shared name of
    versions before, and those of pids that `is_swarmd` says are no swarmd now."""
    out = []
    for name in tables:
        owner = _OWNED.fullmatch(name)
        if name == TABLE or (owner is not None and not is_swarmd(int(owner.group(1)))):
            out.append(name)
    return out


def sweep(tables: Iterable[str]) -> str:
    """The script that deletes `tables` (from `stale`), present or not: a daemon starting
    beside this one may be deleting the same ones."""
    lines = []
    for name in tables:
        if not _NAME.fullmatch(name):
            raise ValueError(f"bad nftables table name {name!r}")
        lines += [f"add table inet {name}", f"delete table inet {name}"]
    return "\n".join(lines) + "\n" if lines else ""


def is_swarmd(pid: int) -> bool:
    """Whether process `pid` runs swarmd (`swarmd ...`, `python /usr/bin/swarmd ...` or
    `python -m swarmd.main ...`) as root (only root has a job firewall): a job table's owner
    is alive. A pid reused by another program is not, nor a local user's process that names
    itself swarmd to keep a dead daemon's chains in place."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != 0:
            return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read(4096).split(b"\0")[:3]
    except OSError:
        return False
    return any(a == b"swarmd.main" or os.path.basename(a) == b"swarmd" for a in args)


def base(policy: Policy) -> str:
    """The script that (re)creates the table with its sets, maps and the output chain."""
    allow4 = ipaddress.collapse_addresses(n for n in policy.allow if n.version == 4)
    allow6 = ipaddress.collapse_addresses(n for n in policy.allow if n.version == 6)
    t = policy.table
    lines = [
        f"# swarmd job firewall: job uids {policy.range}, egress {policy.egress}",
        f"add table inet {t}",  # so that the delete below finds it on a first start
        f"delete table inet {t}",
        f"table inet {t} {{",
        _set("never4", "ipv4_addr", NEVER_V4, "never reachable unless allowed: private, link-local, reserved"),
        _set("never6", "ipv6_addr", NEVER_V6, None),
        _set("allow4", "ipv4_addr", map(str, allow4), "job_egress_allow"),
        _set("allow6", "ipv6_addr", map(str, allow6), None),
        _set("resolvers4", "ipv4_addr", [str(a) for a in policy.resolvers if a.version == 4], "DNS servers"),
        _set("resolvers6", "ipv6_addr", [str(a) for a in policy.resolvers if a.version == 6], None),
        "  # job uid -> its chain (add_job)",
        "  map jobs { typeof meta skuid : verdict; }",
        "  # conntrack mark (the job uid that opened a connection) -> the check of its replies",
        "  map opened { typeof ct mark : verdict; }",
        "  # the job uids with a chain here (add_job)",
        "  set job_uids { typeof meta skuid; }",
        "  chain output {",
        "    type filter hook output priority filter; policy accept;",
    ]
    if policy.mesh_ifname is not None:
        if policy.daemon is not None:
            uid, port = policy.daemon
            lines += ["    # the daemon answers members on its libp2p port over the mesh (NATed ones are dialled there)",
                      f'    oifname "{policy.mesh_ifname}" ct direction reply meta skuid {uid} tcp sport {port} accept']
        lines += ["    # nothing else but a job answers a connection that came in over the mesh",
                  f'    oifname "{policy.mesh_ifname}" ct direction reply meta skuid != @job_uids drop']
    lines += [
        "    # a reply to a connection a job opened: only from that job's own sockets",
        "    ct direction reply ct mark vmap @opened",
        "    # a job's sockets: its own chain decides; any other uid (one of the range with no chain",
        "    # here included: no job's, maybe a DynamicUser service's) is left alone",
        "    meta skuid vmap @jobs",
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def add_job(policy: Policy, uid: int, nodes: Iterable[Address],
            blocked: Iterable[tuple[Address, int]] = (), serves: int | None = None) -> str:
    """The script that lets job uid `uid` reach what `policy` allows plus its `nodes` (its
    hosts' overlay addresses, checked by the caller), never the `blocked` (address, TCP
    port) pairs; a service replica's `serves` port (within `policy.serve_ports`) answers any
    member over the mesh."""
    _check_uid(policy, uid)
    if serves is not None and policy.mesh_ifname is None:
        serves = None  # no mesh: nothing comes from another member; this host's gateway is answered over lo
    if serves is not None and (policy.serve_ports is None or not policy.serve_ports[0] <= serves <= policy.serve_ports[1]):
        raise ValueError(f"a replica's port {serves!r} is not one of the serve ports {policy.serve_ports!r}")
    nodes, blocked = list(nodes), list(blocked)
    for a in nodes:
        if not isinstance(a, ipaddress.IPv4Address | ipaddress.IPv6Address):
            raise ValueError(f"a node is an address, not {a!r}")
    for pair in blocked:
        if not (isinstance(pair, tuple) and len(pair) == 2
                and isinstance(pair[0], ipaddress.IPv4Address | ipaddress.IPv6Address)
                and isinstance(pair[1], int) and 0 < pair[1] < 65536):
            raise ValueError(f"bad blocked pair {pair!r}")
    nodes = sorted(set(nodes), key=lambda a: (a.version, a))
    blocked = sorted(set(blocked), key=lambda p: (p[0].version, p))
    nodes4 = _elements(str(a) for a in nodes if a.version == 4)
    nodes6 = _elements(str(a) for a in nodes if a.version == 6)
    blocked4 = _elements(f"{a} . {p}" for a, p in blocked if a.version == 4)
    blocked6 = _elements(f"{a} . {p}" for a, p in blocked if a.version == 6)
    t, job, opened = policy.table, f"job_{uid}", f"opened_{uid}"
    rules = ["# replies from its sockets: to this host (other jobs' connections are checked by their mark) "
             "or its nodes",
             'ct direction reply oifname "lo" accept']
    rules += [f"ct direction reply ct original ip saddr {nodes4} accept"] if nodes4 else []
    rules += [f"ct direction reply ct original ip6 saddr {nodes6} accept"] if nodes6 else []
    if serves is not None:
        rules += ["# a service replica: its port answers members (their gateways) over the mesh",
                  f'ct direction reply oifname "{policy.mesh_ifname}" tcp sport {serves} accept']
    rules += ["ct direction reply drop",
              "# its SYN again to this host after a reply was seen: that reply was dropped (not its own",
              "# listener); refuse now rather than leave connect() retrying for two minutes",
              "ct direction original ct state established fib daddr type local"
              f" tcp flags & (syn | ack) == syn {REFUSE}",
              "# only a connection it opened itself: an entry another socket left (same ports) is not its",
              f"ct state established,related ct mark {uid} accept",
              "# a new connection: remember who opened it, for the check of its replies",
              f"ct state new ct mark set {uid}",
              "meta l4proto { tcp, udp } th dport 53 ip daddr @resolvers4 accept",
              "meta l4proto { tcp, udp } th dport 53 ip6 daddr @resolvers6 accept"]
    if policy.serve_ports is not None and policy.mesh_ifname is not None:
        low, high = policy.serve_ports
        rules += ["# service replicas elsewhere: through a gateway only",
                  f'oifname "{policy.mesh_ifname}" tcp dport {low}-{high} {REFUSE}']
    rules += [f"ip daddr . tcp dport {blocked4} {REFUSE}"] if blocked4 else []
    rules += [f"ip6 daddr . tcp dport {blocked6} {REFUSE}"] if blocked6 else []
    rules += ["# this host: TCP only, the listener's uid is checked at its reply (opened map)",
              "fib daddr type local meta l4proto tcp accept",
              "fib daddr type local drop",
              "# its nodes: TCP only, answered there by a job's socket alone; a datagram would reach",
              "# any service there first"]
    rules += [f"ip daddr {nodes4} meta l4proto tcp accept", f"ip daddr {nodes4} drop"] if nodes4 else []
    rules += [f"ip6 daddr {nodes6} meta l4proto tcp accept", f"ip6 daddr {nodes6} drop"] if nodes6 else []
    rules += ["ip daddr @allow4 accept", "ip6 daddr @allow6 accept"]
    if policy.egress == "internet":
        rules += ["ip daddr != @never4 accept", "ip6 daddr != @never6 accept"]
    rules += [f"meta l4proto tcp {REFUSE}", "drop"]
    lines = [f"# job uid {uid}: egress {policy.egress}",
             f"add chain inet {t} {job}",
             f"flush chain inet {t} {job}",
             *(r if r.startswith("#") else f"add rule inet {t} {job} {r}" for r in rules),
             f"add chain inet {t} {opened}",
             f"flush chain inet {t} {opened}",
             "# replies to its connections: from its own sockets, or DNS answers",
             f"add rule inet {t} {opened} meta l4proto {{ tcp, udp }} th sport 53 ip saddr @resolvers4 return",
             f"add rule inet {t} {opened} meta l4proto {{ tcp, udp }} th sport 53 ip6 saddr @resolvers6 return",
             f"add rule inet {t} {opened} meta skuid != {uid} drop",
             f"add element inet {t} job_uids {{ {uid} }}",
             f"add element inet {t} jobs {{ {uid} : jump {job} }}",
             f"add element inet {t} opened {{ {uid} : jump {opened} }}"]
    return "\n".join(lines) + "\n"


def remove_job(policy: Policy, uid: int) -> str:
    """The script that takes job uid `uid`'s chains away once its job's processes are gone:
    from then on the uid is no job's, and this firewall leaves it alone."""
    _check_uid(policy, uid)
    t = policy.table
    return "\n".join([
        f"# job uid {uid} ended",
        f"delete element inet {t} jobs {{ {uid} }}",
        f"delete element inet {t} opened {{ {uid} }}",
        f"delete element inet {t} job_uids {{ {uid} }}",
        *(f"{verb} chain inet {t} {c}_{uid}" for c in ("job", "opened") for verb in ("flush", "delete")),
    ]) + "\n"


def detect(nft: str | None = None) -> str | None:
    """Why this host cannot use the firewall (not root, no nft, the kernel lacks a feature
    the rules use), or None when it can: a base table and one job are checked (`nft -c`)."""
    if os.geteuid() != 0:
        return "swarmd is not root"
    nft = nft or shutil.which("nft")
    if nft is None:
        return "nft (Debian package nftables) is not installed"
    probe = Policy(uids=(1, 1), egress="internet", table="swarmd_probe", mesh_ifname="probe0")
    script = base(probe) + add_job(probe, 1, [ipaddress.ip_address("10.0.0.1")])
    try:
        done = subprocess.run([nft, "-c", "-f", "-"], input=script.encode(), capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nft fails: {exc}"
    if done.returncode != 0:
        first = done.stderr.decode(errors="replace").strip().splitlines()
        return f"nft fails: {first[0] if first else f'exit {done.returncode}'}"
    return None


def _check_uid(policy: Policy, uid: int) -> None:
    if not (isinstance(uid, int) and policy.uids[0] <= uid <= policy.uids[1]):
        raise ValueError(f"uid {uid!r} is outside the job range {policy.range}")


def _elements(items: Iterable[str]) -> str:
    items = list(items)
    return "{ " + ", ".join(items) + " }" if items else ""


def _set(name: str, kind: str, elements: Iterable[str], comment: str | None) -> str:
    head = f"  # {comment}\n" if comment else ""
    body = _elements(elements)
    return f"{head}  set {name} {{ type {kind}; flags interval;" + (f" elements = {body};" if body else "") + " }"
