"""What gossip's helpers share: state, never another helper.

``Shared`` is what this node is and holds while it gossips: its host, key and peer id, the
swarm it is in (replaced by a renewal), the membership core and the verifier once it is in
one, the peers it excludes, the nursery and pubsub of the running swarm, gossip's side of
the refusal counter (p2p/rejects.py) and the topic's traffic (``Traffic``). Every helper
(loop.py, inbound.py, probes.py, sync.py, gate.py, peers.py, admission.py, records.py)
reads this, and is given the few callables it needs of the others when service.py builds
it: a helper holds no other helper, and what one causes in another (a probe answered: the
core acts; a connection lost: the gate forgets it) goes through the core's actions or one
callback wired in service.py.

Everything here is set from the swarm task; nothing is read before ``Gossip.run``.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.abc import IHost

from ..p2p.rejects import Refusals
from ..p2p.signed import Signer
from .membership import Membership, View
from .protocols import KINDS
from .swarmstate import SwarmMembership
from .wire import Verifier


class Traffic:
    """The swarm topic's messages and bytes each way, and what pubsub dropped for a slow peer:
    in ``swarmd_gossip_{messages,bytes,dropped}_total`` and in ``counts`` (`swarmctl status`).
    Also the bytes the membership received by kind (protocols.KINDS, as the simulator counts
    them): ``recv_KIND`` in ``counts``, ``swarmd_gossip_received_bytes_total{kind}``."""

    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics
        self.counts: collections.Counter[str] = collections.Counter()

    def carried(self, direction: str, size: int) -> None:
        self.counts[f"messages_{direction}"] += 1
        self.counts[f"bytes_{direction}"] += size
        self.metrics.gossip_messages.labels(direction).inc()
        self.metrics.gossip_bytes.labels(direction).inc(size)

    def received(self, kind: str, size: int) -> None:
        self.counts[f"recv_{kind}"] += size
        self.metrics.gossip_received_bytes.labels(kind).inc(size)

    def by_kind(self) -> dict[str, int]:
        """Bytes received so far, by kind (every kind, zero or not)."""
        return {kind: self.counts[f"recv_{kind}"] for kind in KINDS}

    def dropped(self, peer: Any) -> None:
        self.counts["dropped"] += 1
        self.metrics.gossip_dropped.inc()


class Shared:
    def __init__(self, *, host: IHost, sign: Signer, me: str, swarm: SwarmMembership | None, rng: Any,
                 rejects: Refusals, traffic: Traffic) -> None:
        self.host = host
        self.sign = sign
        self.me = me
        self.swarm = swarm  # None until `swarm init` or a join; a renewal replaces it
        self.rng = rng
        self.rejects = rejects
        self.traffic = traffic
        self.core: Membership | None = None  # made when this node is in a swarm
        self.verifier: Verifier | None = None  # made with the core
        self.excluded: dict[str, str] = {}  # peer -> why; applied to the core once it exists
        self.nursery: trio.Nursery | None = None  # gossip's, while it runs
        self.pubsub: Any = None  # pubsub.GatedPubsub, while in a swarm
        self.topic = ""
        self.view_changed = trio.Event()  # set, and replaced, whenever a member or its record changes

    def view(self) -> View:
        """The membership as an immutable snapshot (the same object until something changes)."""
        return self.core.view() if self.core is not None else View.empty(self.me)

    def reject(self, reason: str, peer: str, detail: str) -> None:
        self.rejects.reject(reason, peer, detail)

    def changed(self) -> None:
        """Wake whoever waits on ``view_changed``."""
        self.view_changed.set()
        self.view_changed = trio.Event()

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in gossip's nursery; nothing before gossip runs."""
        if self.nursery is not None:
            self.nursery.start_soon(fn, *args)
