"""A node: wires identity, the libp2p host, the control socket and metrics together.

Start order matters to systemd: READY=1 is sent only once the control socket accepts, so
`systemctl start swarmd && swarmctl status` never races. Stop order: stop accepting, close
libp2p, remove the socket.
"""

from __future__ import annotations

import dataclasses
import grp
import os
import random
import time
from typing import Any

import structlog
import trio
from multiaddr import Multiaddr

from . import __version__, api
from .compute import service as jobs_service
from .config import Config
from .gossip import swarmstate
from .gossip.cert import parse_token
from .p2p.host import announce_addrs, keep_connected, local_ipv4, make_host, mdns_connector
from .p2p import multiaddrs
from .p2p.rejects import Rejects
from .p2p.transport import Transport
from .gossip.membership import Timing
from .gossip.service import Above, Gossip, JoinError
from .identity import Identity
from .mesh import driver as mesh_driver
from .mesh.reach import Reachability
from .metrics import Metrics
from .routing.service import Routing
from .serve.service import Services
from .rpc.protocol import Dispatcher
from .rpc.server import AccessPolicy, RpcServer, bind_unix
from .sdnotify import Notifier
from .wg.backend import BackendError

SHUTDOWN_GRACE = 3.0  # seconds libp2p gets to close; systemd's stop timeout is longer
MESH_RETRY_MAX = 60.0  # seconds between attempts to bring a failed WireGuard backend back


def group_id(name: str) -> int | None:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


class Node:
    def __init__(self, config: Config, identity: Identity, *, notifier: Notifier | None = None,
                 started: float | None = None) -> None:
        self.config = config
        self.identity = identity
        self.notifier = notifier or Notifier()
        self.started = time.monotonic() if started is None else started
        self.log_level = config.log_level
        self.log = structlog.get_logger("swarmd")
        self.metrics = Metrics(version=__version__, peer_id=str(identity.peer_id), started=self.started)
        self.metrics_bound: tuple[str, int] | None = None
        self.host = make_host(identity, config.listen)
        self.rng = random.Random()
        peer = identity.peer_id.to_bytes()
        self.swarm = swarmstate.load(config.state_dir, peer)  # SwarmStateError: exit 2
        labels = swarmstate.effective_labels(config.state_dir, dict(config.labels))
        seq = swarmstate.first_seq(swarmstate.next_epoch(config.state_dir))
        timing = {"wan": Timing.wan, "lan": Timing.lan, "local": Timing.local}[config.gossip_timing]()
        # what the floors above put into our record and take from our probes: read only once
        # gossip runs, when mesh, routing and jobs below exist
        above = Above(mesh_info=lambda: self.mesh.advertised() if self.mesh is not None else None,
                      job_slots=lambda: self.jobs.job_slots(), route_info=lambda: self.routing.record_fields(),
                      recent_rtts=lambda: self.routing.recent_rtts(),
                      rtt_observed=lambda peer, rtt: self.routing.rtt_observed(peer, rtt),
                      serve_info=lambda: self.services.serve_info())
        self.transport = Transport(self.host)  # what every subsystem's protocol runs on
        self.rejects = Rejects(self.metrics)  # what every subsystem refuses of its peers, by its label
        self.gossip = Gossip(host=self.host, sign=identity.sign, peer=str(identity.peer_id), swarm=self.swarm,
                             timing=timing, labels=labels, seq=seq, metrics=self.metrics, rng=self.rng,
                             addrs=self._announced,
                             above=above, refusals=self.rejects.of("gossip"))
        self.gossip.admission.configure(config.state_dir, config.mesh_network)  # invites, revocations on disk
        # BackendUnavailable here (a backend forced in config that cannot run): exit 2
        self.mesh, self.mesh_off = mesh_driver.from_config(config, self.gossip)
        # how members reach us (needs WireGuard: what a member's device sees of ours is the measure)
        self.reach = None if self.mesh is None else Reachability(
            transport=self.transport, gossip=self.gossip, mesh=self.mesh, sign=identity.sign,
            reject=self.rejects.of("reach").reject, network=config.mesh_network, rng=self.rng)
        if self.mesh is not None and self.reach is not None:
            self.mesh.reach = self.reach.current
            self.mesh.reject = self.reach.reject
        self.routing = Routing(gossip=self.gossip, mesh=self.mesh, config=config, metrics=self.metrics,
                               refusals=self.rejects.of("routing"), transport=self.transport)
        # placement ranks by the paths jobs will use
        self.jobs = jobs_service.from_config(config, self.gossip, self.mesh, transport=self.transport,
                                           reject=self.rejects.of("jobs").reject, path_rtt=self.routing.rtt_function)
        me = str(identity.peer_id)
        self.services = Services(jobs=self.jobs, gossip=self.gossip, state_dir=config.state_dir,
                                 rtt=lambda host: self.routing.rtt_function()(me, host),
                                 path=lambda host: self.routing.path_row(host)["path"],
                                 pair_rtt=lambda a, b: self.routing.rtt_function()(a, b),
                                 gateway_listen=config.gateway_listen, socket_path=config.socket_path)

    def _announced(self) -> list[str]:
        """Our record's addresses: none once members found nobody can dial them (behind a NAT or
        a firewall: we are dialled at our overlay address then, mesh/reach.py)."""
        if self.reach is not None and not self.reach.public():
            return []
        return announce_addrs(self.host, self.config.announce, self.config.mesh_network)

    def status(self) -> dict[str, Any]:
        peers = self.host.get_connected_peers()
        self.metrics.peers_connected.set(len(peers))
        return {
            "peer_id": str(self.identity.peer_id),
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": api.uptime(self.started),
            "state_dir": str(self.config.state_dir),
            "socket": str(self.config.socket_path),
            "listen_addrs": [str(a) for a in self.host.get_addrs()],
            "connected_peers": len(peers),
            "metrics_addr": "off" if self.metrics_bound is None else "%s:%d" % self.metrics_bound,
            "log_level": self.log_level,
            **api.swarm_status(self),
            "mesh": self.mesh.status() if self.mesh else {"up": False, "off": self.mesh_off},
            "reach": self.reach.status() if self.reach else {"reach": "unknown (no mesh: it is measured over WireGuard)"},
            "routing": self.routing.status(),
            "jobs": self.jobs.status(),
            "sandbox": self.jobs.sandbox_status(),
            "serve": self.services.status(),
        }

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        config = self.config
        group = group_id(config.socket_group)
        dispatcher = Dispatcher(api.methods(self))
        server = RpcServer(dispatcher, AccessPolicy(daemon_uid=os.geteuid(), group_gid=group),
                           observer=self.metrics.observe_rpc)
        listener = await bind_unix(config.socket_path, group_gid=group)
        try:
            if (hostport := config.metrics_hostport) is not None:
                self.metrics_bound = self.metrics.serve(*hostport)
            async with self.host.run([Multiaddr(a) for a in config.listen]), trio.open_nursery() as nursery:
                # the libp2p port as bound (a listen port of 0 is any free one): members dial a NATed
                # node there at its overlay address, and the job firewall lets the daemon answer on it
                port = multiaddrs.tcp_port([str(a) for a in self.host.get_addrs()], 0) or None
                if self.mesh is not None:
                    self.mesh.tcp_port = port
                if self.jobs.sandbox is not None:
                    self.jobs.sandbox = dataclasses.replace(self.jobs.sandbox, daemon_port=port)
                await nursery.start(server.serve, listener)
                await nursery.start(self.gossip.run)
                await nursery.start(self.jobs.run)
                await nursery.start(self.services.run)
                nursery.start_soon(self.routing.run)
                if self.mesh is not None:
                    nursery.start_soon(self._run_mesh)
                if self.reach is not None:
                    nursery.start_soon(self.reach.run, lambda: local_ipv4(config.mesh_network), port)
                if config.join and self.gossip.swarm is None:
                    nursery.start_soon(self._join, config.join)
                if config.mdns:
                    nursery.start_soon(mdns_connector, self.host,
                                       announce_addrs(self.host, config.announce, config.mesh_network))
                for addr in config.bootstrap:
                    nursery.start_soon(keep_connected, self.host, addr, self.rng)
                if self.notifier.watchdog_interval:
                    nursery.start_soon(self._watchdog, self.notifier.watchdog_interval)
                self.notifier.notify("READY=1", f"STATUS=serving {config.socket_path}")
                self.log.info("ready", socket=str(config.socket_path),
                              listen=[str(a) for a in self.host.get_addrs()],
                              metrics=self.status()["metrics_addr"],
                              startup_s=round(time.monotonic() - self.started, 3))
                task_status.started()
                await trio.sleep_forever()
        finally:
            self.notifier.notify("STOPPING=1")
            if self.mesh is not None:
                await self.mesh.close()
            config.socket_path.unlink(missing_ok=True)
            self.metrics.close()

    async def leave(self) -> None:
        """A graceful stop: tell the swarm this node is leaving, then let the caller cancel."""
        await self.gossip.leave()

    async def _run_mesh(self) -> None:
        """The mesh, brought back with backoff if its backend fails; the daemon keeps serving."""
        assert self.mesh is not None
        delay = 1.0
        while True:
            try:
                await self.mesh.run()
                return
            except BackendError as exc:
                self.mesh.error = str(exc)
                self.log.error("WireGuard mesh failed", error=str(exc), retry_in=delay)
                await self.mesh.close()
            await trio.sleep(delay)
            delay = min(MESH_RETRY_MAX, delay * 2)

    async def _join(self, text: str) -> None:
        token = parse_token(text)  # checked when the config was loaded
        delay = 1.0
        while self.gossip.swarm is None:
            try:
                await self.gossip.join(token, self.config.state_dir)
                return
            except JoinError as exc:
                self.log.warning("cannot join the swarm yet", error=str(exc), retry_in=round(delay, 1))
            await trio.sleep(delay)
            delay = min(30.0, delay * 2)

    async def _watchdog(self, interval: float) -> None:
        while True:
            self.notifier.notify("WATCHDOG=1")
            await trio.sleep(interval)
