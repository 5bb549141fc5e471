"""Prometheus metrics of one daemon, on its own registry, served by prometheus-client.

Cores return counts; the drivers that own them record them here. Each later subsystem
adds its metrics to ``Metrics.registry``.
"""

from __future__ import annotations

import time
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, start_http_server

from .rpc.protocol import ErrorCode


class Metrics:
    def __init__(self, *, version: str, peer_id: str, started: float | None = None) -> None:
        self.registry = CollectorRegistry()
        started = time.monotonic() if started is None else started
        Info("swarmd", "This daemon", registry=self.registry).info(
            {"version": version, "peer_id": peer_id})
        Gauge("swarmd_uptime_seconds", "Seconds since the daemon started",
              registry=self.registry).set_function(lambda: time.monotonic() - started)
        self.rpc_requests = Counter("swarmd_rpc_requests", "Control-socket requests by method",
                                    ["method"], registry=self.registry)
        self.rpc_errors = Counter("swarmd_rpc_errors", "Control-socket error replies by method and code",
                                  ["method", "code"], registry=self.registry)
        self.peers_connected = Gauge("swarmd_libp2p_connected_peers", "Peers with an open libp2p connection",
                                     registry=self.registry)
        self.members = Gauge("swarmd_members", "Swarm members in this node's view, by state", ["state"],
                             registry=self.registry)
        self.gossip_messages = Counter("swarmd_gossip_messages", "Records and rumors on the swarm topic",
                                       ["direction"], registry=self.registry)
        self.gossip_bytes = Counter("swarmd_gossip_bytes", "Bytes of records and rumors on the swarm topic",
                                    ["direction"], registry=self.registry)
        self.gossip_received_bytes = Counter(
            "swarmd_gossip_received_bytes", "Bytes the membership received, by kind: probes, gossip (a record's or "
            "rumor's first copy), duplicates (its further copies), ihave (lazy gossip), syncs", ["kind"],
            registry=self.registry)
        self.rejected = Counter("swarmd_rejected", "Peer input refused, by subsystem and reason",
                                ["subsystem", "reason"], registry=self.registry)
        self.gossip_dropped = Counter("swarmd_gossip_dropped", "Outbound gossip RPCs dropped by a full queue",
                                      registry=self.registry)
        self._server: WSGIServer | None = None
        self._thread: Thread | None = None

    def observe_rpc(self, method: str, code: ErrorCode | None) -> None:
        self.rpc_requests.labels(method).inc()
        if code is not None:
            self.rpc_errors.labels(method, code.name.lower()).inc()

    def set_members(self, counts: dict[str, int]) -> None:
        for state, n in counts.items():
            self.members.labels(state).set(n)

    def serve(self, host: str, port: int) -> tuple[str, int]:
        """Start the HTTP endpoint (a daemon thread of prometheus-client); the bound address."""
        self._server, self._thread = start_http_server(port, host, registry=self.registry)
        bound = self._server.server_address
        return str(bound[0]), int(bound[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
