"""A libp2p host whose peers are far away, on trio's clock, for tests of what a long round
trip does to the drivers (a dial or a stream opening outliving the probe that wanted it).

Nothing flows through it: `connect` and `new_stream` only take the time the real handshakes
would, and a stream is libp2p's ping protocol (what is written comes back one round trip
later). Run it under trio.testing.MockClock (autojump) and the waiting is free and exact.
For streams with content between handlers, use FakeNet (net.py).

The counts a test asserts on: `dials` (connects begun), `cancelled` (connects cut off before
they ended), `opened` (every stream, each counting its own `resets`), `connected` (the peers
a connect reached; a test may add to it, as a peer that dialled us would)."""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import trio

# Round trips a dial takes: TCP, multistream-select of the security protocol, Noise, then
# multistream-select of the muxer (about 1.2 s to a member 243 ms away).
DIAL_RTTS = 5
# Round trips opening a stream takes on a connection: multistream-select of its protocol.
OPEN_RTTS = 2


class EchoStream:
    """libp2p's ping protocol: what is written comes back `rtt` seconds later."""

    def __init__(self, rtt: float) -> None:
        self.rtt = rtt
        self.pending = bytearray()
        self.resets = 0

    async def write(self, data: bytes) -> None:
        self.pending += data

    async def read(self, n: int) -> bytes:
        await trio.sleep(self.rtt)
        out, self.pending = bytes(self.pending[:n]), self.pending[n:]
        return out

    async def reset(self) -> None:
        self.resets += 1


class SlowHost:
    """Every peer is `rtt` seconds away: `connect` takes `dial_s` (DIAL_RTTS round trips unless
    given), `new_stream` `open_s` (OPEN_RTTS). `refuse`: a connect fails at its end with
    ConnectionRefusedError; `hang`: a connect never answers (the caller's timeout ends it)."""

    def __init__(self, rtt: float, *, dial_s: float | None = None, open_s: float | None = None,
                 refuse: bool = False, hang: bool = False) -> None:
        self.rtt = rtt
        self.dial_s = DIAL_RTTS * rtt if dial_s is None else dial_s
        self.open_s = OPEN_RTTS * rtt if open_s is None else open_s
        self.refuse, self.hang = refuse, hang
        self.connected: set = set()
        self.dials = 0
        self.cancelled = 0
        self.opened: list[EchoStream] = []

    def get_connected_peers(self) -> list:
        return list(self.connected)

    def get_peerstore(self) -> Any:
        return SimpleNamespace(clear_addrs=lambda peer: None)

    async def connect(self, info: Any) -> None:
        self.dials += 1
        try:
            await trio.sleep(float("inf") if self.hang else self.dial_s)
        except trio.Cancelled:
            self.cancelled += 1
            raise
        if self.refuse:
            raise ConnectionRefusedError("refused")
        self.connected.add(info.peer_id)

    async def disconnect(self, peer: Any) -> None:
        self.connected.discard(peer)

    async def new_stream(self, peer: Any, protocols: Iterable[str]) -> EchoStream:
        await trio.sleep(self.open_s)
        self.opened.append(EchoStream(self.rtt))
        return self.opened[-1]
