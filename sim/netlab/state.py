"""The lab's state file: which hosts, namespaces, routers, pids and links a lab has.

One JSON file per lab under /run/swarm-sim/NAME/, written atomically, so any later
`swarm-sim lab …` command (and `lab down` after a crash) finds everything.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from swarmd.atomic import write_atomically

from .topology import Link

ROOT = Path("/run/swarm-sim")


@dataclass(slots=True, kw_only=True)
class HostState:
    name: str
    index: int
    address: str
    netns: str
    state_dir: str
    socket: str
    log: str
    peer_id: str
    country: str | None = None
    pid: int | None = None
    crashed: bool = False  # `lab crash`: its processes killed, its links cut (their own settings kept) until `lab revive`
    nat: str = "public"  # its NAT class (nat.CLASSES)
    router: str | None = None  # the router's namespace, for every class but public; it holds the host's taps
    private_address: str | None = None  # what the host sees as its own address behind a translating router
    nat_generation: int = 0  # `lab nat HOST rebind`s so far: selects the router's external port range

    @property
    def edge(self) -> str:
        """The namespace that holds the host's ends of its links and its underlay routes."""
        return self.router or self.netns


@dataclass(slots=True, kw_only=True)
class LabState:
    name: str
    dir: str
    hosts: list[HostState] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    daemons: bool = True
    mesh: bool = True  # each daemon runs the WireGuard mesh (wireguard-go)
    daemon_args: list[str] = field(default_factory=list)  # extra swarmd flags for every host (a test's settings)
    nat_udp_timeout: int = 30  # the routers' conntrack timeouts, seconds (nat.Timeouts)
    nat_udp_stream_timeout: int = 120

    @staticmethod
    def path_for(name: str) -> Path:
        return ROOT / name / "lab.json"

    def save(self) -> None:
        data = asdict(self)
        write_atomically(self.path_for(self.name), json.dumps(data, indent=2).encode(), mode=0o644)

    @classmethod
    def load(cls, name: str) -> LabState | None:
        path = cls.path_for(name)
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return cls(name=data["name"], dir=data["dir"], daemons=data.get("daemons", True), mesh=data.get("mesh", True),
                   daemon_args=list(data.get("daemon_args", [])), nat_udp_timeout=data.get("nat_udp_timeout", 30),
                   nat_udp_stream_timeout=data.get("nat_udp_stream_timeout", 120),
                   hosts=[HostState(**h) for h in data["hosts"]], links=[Link(**l) for l in data["links"]])

    def host(self, name: str) -> HostState:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r} in lab {self.name!r} (hosts: {', '.join(h.name for h in self.hosts)})")

    def link(self, a: str, b: str) -> Link:
        for link in self.links:
            if {link.a, link.b} == {a, b}:
                return link
        raise KeyError(f"no link between {a} and {b} in lab {self.name!r}")
