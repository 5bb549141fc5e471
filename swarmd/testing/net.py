"""An in-memory libp2p network for driver tests, in the shape of trio.testing's fakes.

`FakeNet(nursery)` makes hosts by peer id; a host's `new_stream(peer, protocols)` runs the
other host's handler for the first protocol it serves in the nursery, with the far end of
an in-memory duplex stream, and returns this end. A stream is shaped like py-libp2p's
yamux stream, as the drivers use it: `read(n)` (at most n bytes; `StreamEOF` once the other
side closed its writing half, `StreamReset` once either side reset), `write`, `close_write`,
`close` and `reset`, and `muxed_conn.peer_id`, the other end's peer id, as Noise would have
authenticated it. `Faults`, seeded, makes the network misbehave on each write: reset the
stream, hold the write back a while, or deliver it twice (a peer's duplicate).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import trio
import trio.testing
from libp2p.network.stream.exceptions import StreamEOF, StreamReset

Handler = Callable[["NetStream"], Awaitable[Any]]


@dataclass(frozen=True)
class Faults:
    """Per write, with these probabilities (drawn from `seed`): `reset` the stream, `delay`
    it by up to `max_delay` seconds (trio's clock: a MockClock makes it free), `duplicate` it."""

    seed: int = 0
    reset: float = 0.0
    delay: float = 0.0
    max_delay: float = 1.0
    duplicate: float = 0.0


class _Pair:
    """What the two ends of one stream share: whether it was reset."""

    def __init__(self) -> None:
        self.reset = False


class NetStream:
    """One end of an in-memory stream; `muxed_conn.peer_id` is the other end's peer id."""

    def __init__(self, stream: trio.testing.StapledStream, peer: str, protocol: str, pair: _Pair,
                 faults: Faults | None, rng: random.Random) -> None:
        self._stream = stream
        self._pair = pair
        self._faults = faults
        self._rng = rng
        self.protocol = protocol
        self.muxed_conn = SimpleNamespace(peer_id=peer)

    async def read(self, n: int = 65536) -> bytes:
        if self._pair.reset:
            raise StreamReset("stream reset")
        try:
            data = await self._stream.receive_some(n)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise StreamReset("stream reset") from None
        if self._pair.reset:
            raise StreamReset("stream reset")
        if not data:
            raise StreamEOF("stream closed")
        return data

    async def write(self, data: bytes) -> None:
        if self._pair.reset:
            raise StreamReset("stream reset")
        copies = 1
        if (f := self._faults) is not None:
            if self._rng.random() < f.reset:
                await self.reset()
                raise StreamReset("stream reset (a fault)")
            if self._rng.random() < f.delay:
                await trio.sleep(self._rng.uniform(0, f.max_delay))
            copies += self._rng.random() < f.duplicate
        try:
            for _ in range(copies):
                await self._stream.send_all(data)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise StreamReset("stream reset") from None

    async def close_write(self) -> None:
        try:
            await self._stream.send_eof()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    async def close(self) -> None:
        await self._stream.aclose()

    async def reset(self) -> None:
        self._pair.reset = True
        await self._stream.aclose()


class FakeHost:
    """A libp2p host on a FakeNet: `set_stream_handler`, `new_stream`, `get_id`."""

    def __init__(self, net: FakeNet, peer: str) -> None:
        self.net = net
        self.peer = peer
        self.handlers: dict[str, Handler] = {}

    def get_id(self) -> str:
        return self.peer

    def set_stream_handler(self, protocol: str, handler: Handler) -> None:
        self.handlers[protocol] = handler

    async def new_stream(self, peer_id: Any, protocols: Iterable[str]) -> NetStream:
        """A stream to `peer_id`'s handler of the first of `protocols` it serves; OSError
        when it is no host of this network or serves none (a dial that fails)."""
        other = self.net.hosts.get(str(peer_id))
        protocol = next((p for p in protocols if other is not None and p in other.handlers), None)
        if other is None or protocol is None:
            raise OSError(f"{str(peer_id)[-8:]} serves none of {list(protocols)}")
        ours, theirs = trio.testing.memory_stream_pair()
        pair = _Pair()
        rng = self.net.rng
        far = NetStream(theirs, self.peer, protocol, pair, self.net.faults, rng)
        self.net.nursery.start_soon(other.handlers[protocol], far)
        return NetStream(ours, other.peer, protocol, pair, self.net.faults, rng)


class FakeNet:
    """Hosts that reach each other's handlers in memory; handlers run in `nursery`."""

    def __init__(self, nursery: trio.Nursery, faults: Faults | None = None) -> None:
        self.nursery = nursery
        self.faults = faults
        self.rng = random.Random(faults.seed if faults is not None else 0)
        self.hosts: dict[str, FakeHost] = {}

    def host(self, peer: str) -> FakeHost:
        """The host of `peer` on this network (made at the first call)."""
        if peer not in self.hosts:
            self.hosts[peer] = FakeHost(self, peer)
        return self.hosts[peer]
