"""Jobs as the daemon configures them: slots, the job user, the sandbox, directories, the
protocol handler. The package's composition (like gossip's and routing's service.py): the
one place compute's parts are built and wired, called once by node.py."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable
from typing import Any

from ..config import Config
from ..p2p import multiaddrs
from ..p2p.transport import Transport
from .coordinator.coordinator import Jobs
from .coordinator.placement import Rtt
from .coordinator.replication import PROTOCOL as REPLICA_PROTOCOL
from .coordinator.replication import Handler as ReplicaHandler
from .coordinator.replication import Store, Writer
from .coordinator.store import JobStore
from .host.sandbox.box import Settings, name_for
from .host.service import JOB_PROTOCOL, JobHandler
from .host.worker import JobNodes, Worker
from .ledger import Ledger
from .ports import Overlay, Swarm
from .workdir import Cache

DEFAULT_SLOTS_WITHOUT_GPU = 2


def job_user(config: Config) -> str | None:
    """The user ranks run as: the configured one when root ('' means root itself), else
    the daemon's own user (None)."""
    if os.geteuid() != 0:
        return None
    return config.job_user or "root"


def from_config(config: Config, gossip: Swarm, mesh: Overlay | None, *, transport: Transport,
                reject: Callable[[str, str, str], None], path_rtt: Callable[[], Rtt] | None = None) -> Jobs:
    """The job service of this node: its protocol served on `transport`, the refusals of
    peers counted with `reject` (the node's counter, labelled "jobs"). `path_rtt`: routing's
    measure of a pair by the path its traffic takes (Jobs' header); without it placement
    reads the probes in the view."""
    gpus = tuple(g.index for g in gossip.resources.gpus)
    ledger = Ledger(config.job_slots or len(gpus) or DEFAULT_SLOTS_WITHOUT_GPU, gpus)
    state = config.state_dir
    for d in (state / "archives", config.jobs_path):
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    config.jobs_path.chmod(0o711)  # ranks of another user reach their own directory inside
    worker = Worker(ledger=ledger, cache=Cache(state / "workdirs"), jobs_dir=config.jobs_path,
                    user=job_user(config), ifname=lambda: mesh.interface if mesh and mesh.started else None,
                    changed=gossip.readvertise,
                    job_nodes=lambda ips: job_nodes(gossip, ips, mesh_up=bool(mesh and mesh.started),
                                                    connected=transport.remote_ips),
                    sandbox_later=True, checkpoint_max=config.checkpoint_max, checkpoint_keep=config.checkpoint_keep,
                    serve_ports=config.serve_ports,
                    coordinator_gone=lambda peer: coordinator_gone(gossip, peer))
    handler = JobHandler(worker, check_member=gossip.check_member, submitters=config.job_submitters,
                         rejected=reject)
    transport.serve(JOB_PROTOCOL, handler.handle, reject=reject)
    store = Store(gossip.me, state / "replicas")
    replicas = ReplicaHandler(store, check_member=gossip.check_member, reject=reject)
    transport.serve(REPLICA_PROTOCOL, replicas.handle, reject=reject)
    writer = Writer(store, me=gossip.me, sign=gossip.sign, request=transport.request,
                    cert=lambda: gossip.swarm.cert.blob if gossip.swarm is not None else None)
    sandbox = Settings(mode=config.sandbox, uids=config.job_uids, egress=config.job_egress,
                       egress_allow=config.job_egress_allow, paths=config.job_paths, pids=config.job_pids,
                       state_dir=state, jobs_dir=config.jobs_path, socket=config.socket_path,
                       name=name_for(gossip.me), mesh_ifname=config.mesh_interface if mesh else None,
                       serve_ports=config.serve_ports)
    jobs = Jobs(store=JobStore(state), worker=worker, gossip=gossip, archives=state / "archives",
                retention=config.job_retention, sandbox=sandbox, path_rtt=path_rtt, reject=reject,
                transport=transport, replication=writer, handed=JobStore(state / "handed"),
                grow_every=config.job_grow_every)
    replicas.jobs = jobs  # an origin's log and cancel of a job this node took over
    return jobs


def job_nodes(gossip: Swarm, ips: tuple[str, ...], *, mesh_up: bool,
              connected: Callable[[str], list[str]]) -> JobNodes:
    """What a job whose nodes are at `ips` (a coordinator's word) may reach. With the mesh
    up: only those that are a member's overlay address (the owner certified it). Without:
    only those a member is connected from right now (its record's addresses are its own
    claim: it could name the provider's LAN). Either way every member's advertised daemon
    port (its record's libp2p addresses) is closed to it: with `job_egress = internet` a job
    would otherwise speak libp2p to any member from this host's address (and ask a relay to
    forward towards this host, routing/relay.py). A member's claim only closes that
    (address, TCP port) to the jobs here, which a member may do. `connected(peer)`: where
    our live connections to a member come from (Transport.remote_ips)."""
    records = [m.record for m in gossip.view().in_service()]
    if gossip.own_record is not None:
        records.append(gossip.own_record)
    wanted = {str(ipaddress.ip_address(ip)) for ip in ips}
    ports = {pair for r in records for pair in _daemon_ports(r.addrs) | _overlay_daemon_ports(r)}
    if mesh_up:
        overlay = {r.wg.addr4 for r in records if r.wg is not None}
        return JobNodes(addresses=tuple(sorted(wanted & overlay)), daemon_ports=tuple(sorted(ports)))
    known = {ip for r in records if r.peer != gossip.me for ip in connected(r.peer)}
    if gossip.own_record is not None:
        known |= {ip for ip, _ in _daemon_ports(gossip.own_record.addrs)}
    allowed = wanted & known
    return JobNodes(addresses=tuple(sorted(allowed)), daemon_ports=tuple(sorted(ports)))


def _overlay_daemon_ports(record: Any) -> set[tuple[str, int]]:
    """(overlay address, TCP port) where a member's daemon answers over the mesh: its libp2p
    ports (a member behind a NAT names its own in ``wg.tcp``, announcing no address)."""
    wg = record.wg
    if wg is None:
        return set()
    tcp = getattr(wg, "tcp", None)
    ports = {port for _, port in _daemon_ports(record.addrs)} | ({tcp} if tcp is not None else set())
    return {(wg.addr4, port) for port in ports}


def _daemon_ports(addrs: tuple[str, ...]) -> set[tuple[str, int]]:
    """(ip, TCP port) of each of a record's libp2p multiaddrs (/ip4/A/tcp/P[/p2p/...]), in
    canonical form; what does not parse is no address of a daemon and is left out."""
    return {endpoint for addr in addrs if (endpoint := multiaddrs.tcp_endpoint(addr)) is not None}


def coordinator_gone(gossip: Swarm, peer: str) -> str | None:
    """"dead" or "left" when membership says so of `peer`, else None. A coordinator missing
    from the view is not gone: a member that just joined may start a job before its record
    reached this host."""
    view = gossip.view()
    member = view.get(peer) if peer != view.me else None
    if member is not None and member.state.value in ("dead", "left"):
        return member.state.value
    return None
