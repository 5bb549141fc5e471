"""What the job side needs of the floors below it, as protocols: node.py hands it the real
gossip driver and mesh; a test hands it whatever has these. compute never imports another
package's driver class, only these shapes and the data types they carry."""

from __future__ import annotations

from typing import Any, Protocol

from libp2p.abc import INetStream
from libp2p.peer.id import ID

from ..gossip.capacity import Resources
from ..gossip.membership import View
from ..gossip.swarmstate import SwarmMembership
from ..gossip.wire import Record
from ..p2p.signed import Signer


class Swarm(Protocol):
    """The membership as the job side reads it (the streams go over p2p.transport.Transport)."""

    me: str  # this node's peer id
    swarm: SwarmMembership | None  # None until this node is in a swarm (its certificate then)

    @property
    def own_record(self) -> Record | None: ...

    @property
    def sign(self) -> Signer: ...  # this node's identity key (a job's charter and records)

    @property
    def resources(self) -> Resources: ...

    def view(self) -> View: ...

    def reject(self, reason: str, peer: str, detail: str) -> None: ...

    def readvertise(self) -> None: ...

    async def check_member(self, req: Any, peer: ID, stream: INetStream) -> bool: ...


class Overlay(Protocol):
    """The WireGuard mesh, as far as a job's ranks care: its interface, while it is up."""

    interface: str
    started: bool
