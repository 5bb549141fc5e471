"""swarmd's configuration: one documented dataclass, loaded from layered sources.

Precedence, lowest first: defaults, the TOML file (/etc/swarmd/swarmd.toml or --config),
SWARMD_* environment variables, command-line flags. Every value is checked where it
enters; a bad one raises ConfigError naming the source, the key and what was expected, and
swarmd exits 2 with that line.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from . import paths

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")


class ConfigError(Exception):
    """Exit status 2: the configuration is wrong and restarting will not fix it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    state_dir: Path = field(default_factory=paths.default_state_dir, metadata={
        "doc": "identity key and everything that must survive a restart (created 0700)"})
    socket: Path | None = field(default=None, metadata={
        "doc": "control socket; default /run/swarmd/swarmd.sock as root, else STATE_DIR/swarmd.sock"})
    socket_group: str = field(default="swarm", metadata={
        "doc": "group owning the socket (mode 0660): its members run jobs and manage their own; "
               "administering the swarm needs root or the daemon's user. Ignored if absent"})
    listen: tuple[str, ...] = field(default=("/ip4/0.0.0.0/tcp/4001",), metadata={
        "doc": "libp2p listen multiaddrs (TCP; Noise + yamux)"})
    bootstrap: tuple[str, ...] = field(default=(), metadata={
        "doc": "peers to dial at start: multiaddrs ending in /p2p/PEER_ID"})
    announce: tuple[str, ...] = field(default=(), metadata={
        "doc": "addresses put in this node's record; default: the listen addresses, 0.0.0.0 "
               "expanded to this host's non-loopback addresses"})
    join: str | None = field(default=None, metadata={
        "doc": "invite token (swarmctl swarm invite) to join a swarm at start; ignored once joined"})
    labels: tuple[tuple[str, str], ...] = field(default=(), metadata={
        "doc": "labels advertised in this node's record, e.g. region=eu (K=V, comma-separated in env)"})
    mdns: bool = field(default=True, metadata={"doc": "find peers on the local network with mDNS"})
    gossip_timing: str = field(default="wan", metadata={
        "doc": "failure-detector timers: wan (internet), lan, or local (tests)"})
    mesh: str = field(default="auto", metadata={
        "doc": "WireGuard backend: auto (kernel if the module is there, else wireguard-go), kernel, "
               "userspace, or off"})
    mesh_interface: str = field(default="swarm0", metadata={
        "doc": "WireGuard interface name (distinct per host when several share a machine)"})
    mesh_network: str = field(default="10.211.0.0/16", metadata={
        "doc": "private IPv4 range overlay addresses are drawn from (the same on every member)"})
    mesh_port: int = field(default=51820, metadata={"doc": "WireGuard UDP listen port"})
    mesh_mtu: int = field(default=1420, metadata={"doc": "MTU of the WireGuard interface"})
    relay: str = field(default="auto", metadata={
        "doc": "forward other members' WireGuard packets when a path through this node is faster than "
               "their direct one: auto (when root, nftables and the mesh are there) or off. Relaying costs "
               "this host bandwidth (capped by relay_max_mbit); the packets stay end-to-end encrypted"})
    relay_max_mbit: int = field(default=1000, metadata={
        "doc": "the most bandwidth all relayed pairs together may use here, both directions, Mbit/s (above it "
               "packets are dropped: a relayed pair's throughput is bounded by it, so keep it above what one "
               "all-reduce needs; measured: 100 Mbit held a relayed 16 MB all-reduce to 0.45 of direct)"})
    relay_ports: tuple[int, int] = field(default=(51821, 52820), metadata={
        "doc": "UDP ports relayed pairs are given, one per pair: LOW-HIGH within 1024-65535 (open them in the "
               "host's firewall)"})
    serve_ports: tuple[int, int] = field(default=(30000, 30999), metadata={
        "doc": "TCP ports service replicas on this host listen on ($PORT), one each: LOW-HIGH within "
               "1024-65535, below the kernel's ephemeral range; only members' gateways reach them (over the mesh)"})
    gateway_listen: str | None = field(default="127.0.0.1:8080", metadata={
        "doc": "where this node's service gateway listens, HOST:PORT, or 'off'; off the loopback only when "
               "asked: a service then serves the outside as its access says (public, or with its token)"})
    metrics_addr: str | None = field(default="127.0.0.1:9464", metadata={
        "doc": "Prometheus endpoint HOST:PORT (port 0: any free port), or 'off'"})
    job_user: str | None = field(default="nobody", metadata={
        "doc": "user that job ranks run as when swarmd is root; '' runs them as root (not advised)"})
    job_slots: int = field(default=0, metadata={
        "doc": "jobs this host runs at once; 0: one per GPU, or 2 without GPUs"})
    job_submitters: tuple[str, ...] = field(default=(), metadata={
        "doc": "peer ids allowed to place jobs here (empty: every member of the swarm)"})
    job_retention: float = field(default=7 * 86400.0, metadata={
        "doc": "how long a finished job's directory, record and log are kept: seconds, or e.g. 12h, 7d"})
    jobs_dir: Path | None = field(default=None, metadata={
        "doc": "where ranks run (a copy of the workdir, checkpoints); default STATE_DIR-jobs beside the state"})
    sandbox: str = field(default="auto", metadata={
        "doc": "confine each job (own uid, cgroup, mount and pid namespace, egress firewall): auto (every part "
               "this host can do, saying why a part is missing), required (refuse jobs unless all can), or off"})
    job_uids: tuple[int, int] = field(default=(61184, 65519), metadata={
        "doc": "uids (and gids) jobs run as, one per job while it has a process or a file here: LOW-HIGH, "
               "systemd's DynamicUser range by default"})
    job_egress: str = field(default="mesh", metadata={
        "doc": "what a job may connect to: mesh (its own nodes over the overlay, and DNS) or internet (also "
               "public addresses); private, link-local and metadata addresses only if in job_egress_allow"})
    job_egress_allow: tuple[str, ...] = field(default=(), metadata={
        "doc": "networks jobs may also reach, e.g. 192.168.1.20/32 for a dataset server (CIDRs, comma-separated)"})
    job_paths: tuple[Path, ...] = field(default=(), metadata={
        "doc": "extra read-only paths jobs see where the sandbox hides the host (e.g. a dataset under /srv)"})
    job_pids: int = field(default=4096, metadata={
        "doc": "processes and threads one job may have on this host (a fork bomb stops there)"})
    checkpoint_max: int = field(default=8 * 1024**3, metadata={
        "doc": "largest checkpoint this host copies out of a job or takes from a coordinator: bytes, or e.g. "
               "512M, 8G"})
    checkpoint_keep: int = field(default=2, metadata={
        "doc": "checkpoints of a job this host keeps (the newest; those its latest start used are kept too)"})
    job_grow_every: float = field(default=300.0, metadata={
        "doc": "the least time between two growths of an elastic job this node coordinates (each costs the job "
               "one restart from its newest checkpoint): seconds, or e.g. 5m"})
    log_level: str = field(default="info", metadata={"doc": "one of " + ", ".join(LOG_LEVELS)})
    log_format: str = field(default="auto", metadata={
        "doc": "json (journald), console, or auto: console on a TTY, json otherwise"})

    @property
    def socket_path(self) -> Path:
        return self.socket or paths.default_socket(self.state_dir)

    @property
    def jobs_path(self) -> Path:
        return self.jobs_dir or self.state_dir.with_name(self.state_dir.name + "-jobs")

    @property
    def metrics_hostport(self) -> tuple[str, int] | None:
        if self.metrics_addr is None:
            return None
        host, _, port = self.metrics_addr.rpartition(":")
        return host.strip("[]"), int(port)


# --- checking values -------------------------------------------------------------------

Check = Callable[[Any], Any]


class _Bad(Exception):
    def __init__(self, expected: str) -> None:
        self.expected = expected


def _path(v: Any) -> Path:
    if not isinstance(v, str) or not v:
        raise _Bad("a non-empty path string")
    return Path(v).expanduser()


def _choice(options: tuple[str, ...]) -> Check:
    def check(v: Any) -> str:
        if not isinstance(v, str) or v.lower() not in options:
            raise _Bad("one of " + ", ".join(options))
        return v.lower()
    return check


def _group(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise _Bad("a group name")
    return v


def _multiaddrs(need: str, what: str) -> Check:
    def check(v: Any) -> tuple[str, ...]:
        if isinstance(v, str):
            v = [x for x in (p.strip() for p in v.split(",")) if x]
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
            raise _Bad(f"a list of multiaddr strings ({what})")
        from multiaddr import Multiaddr  # the daemon pays for it; swarmctl never loads config

        for addr in v:
            try:
                protocols = {p.name for p in Multiaddr(addr).protocols()}
            except Exception as exc:
                raise _Bad(f"multiaddrs ({what}); {addr!r} does not parse: {exc}") from None
            if need not in protocols:
                raise _Bad(f"multiaddrs with /{need}/ ({what}); {addr!r} has none")
        return tuple(v)
    return check


def _labels(v: Any) -> tuple[tuple[str, str], ...]:
    from .gossip.wire import LABEL_KEY, MAX_LABEL_VALUE

    if isinstance(v, str):
        v = [x for x in (p.strip() for p in v.split(",")) if x]
    if isinstance(v, (list, tuple)):
        pairs = {}
        for item in v:
            key, sep, value = str(item).partition("=")
            if not sep:
                raise _Bad(f"K=V labels; {item!r} has no '='")
            pairs[key.strip()] = value.strip()
        v = pairs
    if not isinstance(v, dict):
        raise _Bad("a table of labels, or K=V strings")
    for key, value in v.items():
        if not isinstance(key, str) or not LABEL_KEY.match(key):
            raise _Bad(f"label keys of 1-63 characters a-z 0-9 . _ / - ({key!r} is not)")
        if not isinstance(value, str) or len(value) > MAX_LABEL_VALUE or not value.isprintable():
            raise _Bad(f"label values as printable text of at most {MAX_LABEL_VALUE} characters "
                       f"({key}={value!r} is not)")
    return tuple(sorted(v.items()))


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return v.lower() in ("1", "true", "yes", "on")
    raise _Bad("true or false (on/off)")


def _token(v: Any) -> str | None:
    if v is None or v == "":
        return None
    from .gossip.cert import parse_token

    try:
        parse_token(str(v))
    except ValueError as exc:
        raise _Bad(f"an invite token ({exc})") from None
    return str(v).strip()


def _interface(v: Any) -> str:
    if not isinstance(v, str) or not 1 <= len(v) <= 15 or not all(c.isalnum() or c in "-_." for c in v):
        raise _Bad("an interface name of 1-15 characters a-z 0-9 - _ .")
    return v


def _private_network(v: Any) -> str:
    import ipaddress

    try:
        net = ipaddress.IPv4Network(str(v))
    except ValueError as exc:
        raise _Bad(f"an IPv4 network such as 10.211.0.0/16 ({exc})") from None
    if not net.is_private or net.prefixlen > 24:
        raise _Bad(f"a private IPv4 network of /24 or larger, got {v!r}")
    return str(net)


def _int_range(low: int, high: int) -> Check:
    def check(v: Any) -> int:
        if isinstance(v, str) and v.isdigit():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            raise _Bad(f"an integer from {low} to {high}")
        return v
    return check


def _bytes(low: int, high: int) -> Check:
    units = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}

    def check(v: Any) -> int:
        if isinstance(v, str) and v[-1:].upper() in units and v[:-1].isdigit():
            v = int(v[:-1]) * units[v[-1].upper()]
        elif isinstance(v, str) and v.isdigit():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            raise _Bad(f"a size of {low} bytes to {high // 1024**4} TiB (bytes, or e.g. 512M, 8G)")
        return v
    return check


def _duration(low: float, high: float) -> Check:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}

    def check(v: Any) -> float:
        if isinstance(v, str) and v and v[-1] in units and v[:-1].replace(".", "", 1).isdigit():
            v = float(v[:-1]) * units[v[-1]]
        elif isinstance(v, str) and v.replace(".", "", 1).isdigit():
            v = float(v)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high:
            raise _Bad(f"a duration of {low:g} s to {high / 86400:g} days (seconds, or e.g. 12h, 7d)")
        return float(v)
    return check


def _hostport_or_off(v: Any) -> str | None:
    if v is False or (isinstance(v, str) and v.lower() in ("off", "none", "")):
        return None
    if isinstance(v, str):
        host, sep, port = v.rpartition(":")
        if sep and host and port.isdigit() and int(port) <= 65535:
            return v
    raise _Bad("HOST:PORT with a port 0-65535, or 'off'")


def _user(v: Any) -> str | None:
    if v is None or v == "":
        return None
    if not isinstance(v, str) or not all(c.isalnum() or c in "-_." for c in v):
        raise _Bad("a user name, or '' for the daemon's own user")
    return v


def _uid_range(v: Any) -> tuple[int, int]:
    if isinstance(v, str) and "-" in v:
        v = v.split("-", 1)
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(str(x).strip().isdigit() for x in v):
        low, high = (int(str(x).strip()) for x in v)
        if 1000 <= low <= high < 2**31 - 1 and high != 65534:
            return low, high
    raise _Bad("a uid range LOW-HIGH of ordinary uids (≥ 1000, not 65534 'nobody'), e.g. 61184-65519")


def _port_range(v: Any, kind: str = "UDP", example: str = "51821-52820") -> tuple[int, int]:
    if isinstance(v, str) and "-" in v:
        v = v.split("-", 1)
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(str(x).strip().isdigit() for x in v):
        low, high = (int(str(x).strip()) for x in v)
        if 1024 <= low <= high <= 65535:  # members refuse a relay's grant below 1024 (routing/sessions.py)
            return low, high
    raise _Bad(f"a {kind} port range LOW-HIGH within 1024-65535, e.g. {example}")


def _networks(v: Any) -> tuple[str, ...]:
    import ipaddress

    if isinstance(v, str):
        v = [x for x in (p.strip() for p in v.split(",")) if x]
    if not isinstance(v, (list, tuple)):
        raise _Bad("a list of networks (CIDR)")
    out = []
    for net in v:
        try:
            out.append(str(ipaddress.ip_network(str(net), strict=False)))
        except ValueError as exc:
            raise _Bad(f"networks such as 192.168.1.20/32 ({exc})") from None
    return tuple(out)


def _abs_paths(v: Any) -> tuple[Path, ...]:
    if isinstance(v, str):
        v = [x for x in (p.strip() for p in v.split(",")) if x]
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x.startswith("/") for x in v):
        raise _Bad("a list of absolute paths")
    return tuple(Path(x) for x in v)


def _peer_ids(v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [x for x in (p.strip() for p in v.split(",")) if x]
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
        raise _Bad("a list of peer ids")
    from libp2p.peer.id import ID

    for peer in v:
        try:
            ID.from_base58(peer)
        except Exception:
            raise _Bad(f"peer ids such as 12D3KooW...; {peer!r} is not one") from None
    return tuple(v)


_CHECKS: dict[str, Check] = {
    "state_dir": _path,
    "socket": _path,
    "socket_group": _group,
    "listen": _multiaddrs("tcp", "e.g. /ip4/0.0.0.0/tcp/4001"),
    "bootstrap": _multiaddrs("p2p", "e.g. /ip4/10.0.0.2/tcp/4001/p2p/12D3KooW..."),
    "announce": _multiaddrs("tcp", "e.g. /ip4/203.0.113.7/tcp/4001"),
    "join": _token,
    "labels": _labels,
    "mdns": _bool,
    "gossip_timing": _choice(("wan", "lan", "local")),
    "mesh": _choice(("auto", "kernel", "userspace", "off")),
    "mesh_interface": _interface,
    "mesh_network": _private_network,
    "mesh_port": _int_range(1, 65535),
    "mesh_mtu": _int_range(1280, 9000),
    "relay": _choice(("auto", "off")),
    "relay_max_mbit": _int_range(1, 100_000),
    "relay_ports": _port_range,
    "serve_ports": lambda v: _port_range(v, "TCP", "30000-30999"),
    "gateway_listen": _hostport_or_off,
    "metrics_addr": _hostport_or_off,
    "job_user": _user,
    "job_slots": _int_range(0, 1024),
    "job_submitters": _peer_ids,
    "job_retention": _duration(60, 10 * 365 * 86400),
    "jobs_dir": _path,
    "sandbox": _choice(("auto", "required", "off")),
    "job_uids": _uid_range,
    "job_egress": _choice(("mesh", "internet")),
    "job_egress_allow": _networks,
    "job_paths": _abs_paths,
    "job_pids": _int_range(16, 1 << 22),
    "checkpoint_max": _bytes(1024**2, 1024**4),
    "checkpoint_keep": _int_range(1, 100),
    "job_grow_every": _duration(0, 30 * 86400),
    "log_level": _choice(LOG_LEVELS),
    "log_format": _choice(LOG_FORMATS),
}
assert set(_CHECKS) == {f.name for f in fields(Config)}


def env_name(key: str) -> str:
    return "SWARMD_" + key.upper()


def _apply(config: Config, values: Mapping[str, Any], where: Callable[[str], str]) -> Config:
    changes: dict[str, Any] = {}
    for key, value in values.items():
        check = _CHECKS.get(key)
        if check is None:
            known = ", ".join(sorted(_CHECKS))
            raise ConfigError(f"{where(key)}: unknown key (known keys: {known})")
        try:
            changes[key] = check(value)
        except _Bad as bad:
            raise ConfigError(f"{where(key)}: expected {bad.expected}, got {value!r}") from None
    return replace(config, **changes)


def read_file(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such configuration file") from None
    except PermissionError:
        raise ConfigError(f"{path}: permission denied") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def load(*, config_file: Path | None, env: Mapping[str, str] = os.environ,
         flags: Mapping[str, Any] | None = None) -> Config:
    """Build the configuration; ``config_file=None`` means the system file if it exists."""
    config = Config()
    path = config_file
    if path is None and env.get("SWARMD_CONFIG"):
        path = Path(env["SWARMD_CONFIG"])
    if path is None and paths.SYSTEM_CONFIG.exists():
        path = paths.SYSTEM_CONFIG
    if path is not None:
        config = _apply(config, read_file(path), lambda k: f"{path}: key '{k}'")
    from_env = {k: env[env_name(k)] for k in _CHECKS if env.get(env_name(k)) is not None}
    config = _apply(config, from_env, lambda k: f"environment {env_name(k)}")
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    config = _apply(config, given, lambda k: f"flag --{k.replace('_', '-')}")
    low, high = config.relay_ports
    if low <= config.mesh_port <= high:
        raise ConfigError(f"relay_ports {low}-{high} includes mesh_port {config.mesh_port}: a relay port is "
                          "forwarded to other members, so WireGuard's own port cannot be one; move either")
    return config
