"""A job-protocol stream in memory, for handler tests: frames in, the handler's replies out."""

from __future__ import annotations

from types import SimpleNamespace

import msgpack
import trio
from libp2p.network.stream.exceptions import StreamEOF

from swarmd.rpc.framing import HEADER, encode_frame


class FakeStream:
    """A job stream from `peer` that has `frames` to read, then ends (or hangs, if asked)."""

    def __init__(self, peer: str, frames: list, *, raw: bytes = b"", hang: bool = False) -> None:
        self.inbound = bytearray(b"".join(encode_frame(f) for f in frames) + raw)
        self.out = bytearray()
        self.hang = hang
        self.muxed_conn = SimpleNamespace(peer_id=peer)

    async def read(self, n: int) -> bytes:
        if not self.inbound:
            if self.hang:
                await trio.sleep_forever()
            raise StreamEOF("stream closed")  # what a yamux stream raises at the peer's end (an EOFError)
        chunk = bytes(self.inbound[:n])
        del self.inbound[:n]
        return chunk

    async def write(self, data: bytes) -> None:
        self.out += data

    async def close(self) -> None:
        pass

    def replies(self) -> list:
        out, data = [], bytes(self.out)
        while data:
            (n,) = HEADER.unpack(data[:HEADER.size])
            out.append(msgpack.unpackb(data[HEADER.size:HEADER.size + n], raw=False))
            data = data[HEADER.size + n:]
        return out
