"""Request/response over libp2p streams, and the libp2p ping used as SWIM's direct probe.

Frames are the control socket's (4-byte length + msgpack, checked from the header before
anything is read), so a 10 MB frame from a peer costs four bytes of reading. Each request
carries the requester's membership certificate in its first frame, read with a small limit
(``MAX_SMALL_FRAME``); the handler checks it against the peer id Noise authenticated before
reading or sending anything more. Only then may a frame be large (a sync's views:
``gossip.protocols.MAX_SYNC_FRAME``).
A body is decoded within the object budget of ``rpc.framing.decode``; one larger than
``THREAD_DECODE`` is decoded in a worker thread, one at a time (``_big_decodes``), so a
peer's frame neither holds the event loop nor multiplies its memory cost by concurrency.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import trio
from libp2p.abc import IHost, INetStream
from libp2p.host.ping import ID as PING_PROTOCOL
from libp2p.peer.id import ID

from ..rpc.framing import HEADER, FrameTooLarge, MalformedFrame, decode, encode_frame

MAX_SMALL_FRAME = 64 * 1024
PING_SIZE = 32
THREAD_DECODE = 256 * 1024  # measured: a 256 KiB frame at its object budget decodes in about 10 ms
_big_decodes: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("big_decodes")


def _big_decode_limiter() -> trio.CapacityLimiter:
    try:
        return _big_decodes.get()
    except LookupError:
        _big_decodes.set(limiter := trio.CapacityLimiter(1))
        return limiter


class PeerError(Exception):
    """The peer closed, reset, sent garbage or something too large."""


async def _read_exactly(stream: INetStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = await stream.read(n - len(buf))
        except Exception as exc:  # StreamEOF, StreamReset, StreamError…
            raise PeerError(f"stream closed ({exc.__class__.__name__})") from None
        if not chunk:
            raise PeerError("stream closed")
        buf += chunk
    return bytes(buf)


async def read_frame(stream: INetStream, limit: int, counted: Callable[[int], None] | None = None) -> Any:
    """One frame, decoded; ``counted`` is told its size in bytes, header included, once read."""
    (length,) = HEADER.unpack(await _read_exactly(stream, HEADER.size))
    if length > limit:
        raise FrameTooLarge(f"a {length}-byte frame; the limit is {limit}")
    body = await _read_exactly(stream, length)
    if counted is not None:
        counted(HEADER.size + length)
    try:
        if length <= THREAD_DECODE:
            return decode(body, strict_map_key=True)
        return await trio.to_thread.run_sync(lambda: decode(body, strict_map_key=True), limiter=_big_decode_limiter())
    except MalformedFrame as exc:
        raise PeerError(str(exc)) from None


async def write_frame(stream: INetStream, obj: Any) -> None:
    try:
        await stream.write(encode_frame(obj))
    except Exception as exc:
        raise PeerError(f"write failed ({exc.__class__.__name__})") from None


async def open_stream(host: IHost, peer: ID, protocol: str) -> INetStream:
    """A new stream to ``peer``; whatever py-libp2p raises (no address, dial failure, protocol
    refused) becomes one PeerError naming the protocol."""
    try:
        return await host.new_stream(peer, [protocol])
    except Exception as exc:
        raise PeerError(f"cannot open {protocol} ({exc.__class__.__name__}: {exc})") from None


async def request(host: IHost, peer: ID, protocol: str, obj: Any, limit: int = MAX_SMALL_FRAME,
                  counted: Callable[[int], None] | None = None) -> Any:
    """Open a stream, send one frame, read one frame, close. Callers bound it with a timeout."""
    stream = await open_stream(host, peer, protocol)
    try:
        await write_frame(stream, obj)
        return await read_frame(stream, limit, counted)
    finally:
        await close_quietly(stream)


async def close_quietly(stream: INetStream) -> None:
    """Close a stream, even from a cancelled task, giving it a second at most."""
    with trio.CancelScope(shield=True), trio.move_on_after(1):
        try:
            await stream.close()
        except Exception:
            pass


async def reset_quietly(stream: INetStream) -> None:
    """Refuse a stream at once: a reset, not a goodbye (nothing of ours is read or written)."""
    with trio.CancelScope(shield=True), trio.move_on_after(1):
        try:
            await stream.reset()
        except Exception:
            pass


class Pinger:
    """One reusable ping stream per peer (the ping protocol echoes 32 bytes for as long as the
    stream lives), so a probe's RTT is one round trip, not a stream negotiation.

    Opening the stream takes a few round trips (multistream-select) on top of the echo: with
    the probe's 0.5 s timeout around both, a member more than ~170 ms away was never pinged
    successfully (every probe cancelled the opening, and the next one started over), so its
    RTT stayed unknown and it lived on indirect probes alone. With a nursery (``start``), the
    opening runs on its own, up to ``OPEN_TIMEOUT``: a probe that times out during it fails,
    and the next one finds the stream ready. A probe whose wait for the opening left it less
    time than the wait took does not start the echo: cut off by its deadline, the echo would
    reset the new stream (seen: a 243 ms pair whose stream opened in 0.49 s of a 0.5 s probe,
    reset 10 ms later, every probe)."""

    OPEN_TIMEOUT = 10.0

    def __init__(self, host: IHost) -> None:
        self.host = host
        self.received: Callable[[int], None] = lambda size: None  # the bytes of each echo read
        self._streams: dict[ID, INetStream] = {}
        self._locks: dict[ID, trio.Lock] = {}
        self._opening: dict[ID, trio.Event] = {}
        self._nursery: trio.Nursery | None = None

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    async def _open(self, peer: ID) -> INetStream:
        try:
            return await self.host.new_stream(peer, [PING_PROTOCOL])
        except Exception as exc:
            raise PeerError(f"cannot reach ({exc.__class__.__name__})") from None

    async def _open_apart(self, peer: ID, done: trio.Event) -> None:
        try:
            with trio.move_on_after(self.OPEN_TIMEOUT):
                stream = await self._open(peer)
                if self._opening.get(peer) is done:  # not forgotten meanwhile
                    self._streams[peer] = stream
                else:
                    await reset_quietly(stream)
        except PeerError:
            pass
        finally:
            if self._opening.get(peer) is done:
                del self._opening[peer]
            done.set()

    async def ping(self, peer: ID) -> float:
        """Seconds for one echo; raises PeerError. Callers bound it with a timeout."""
        lock = self._locks.setdefault(peer, trio.Lock())
        async with lock:
            stream = self._streams.get(peer)
            if stream is None and self._nursery is not None:
                done = self._opening.get(peer)
                if done is None:
                    done = self._opening[peer] = trio.Event()
                    self._nursery.start_soon(self._open_apart, peer, done)
                waited = trio.current_time()
                await done.wait()
                stream = self._streams.get(peer)
                if stream is None:
                    raise PeerError("cannot reach (no ping stream)")
                waited = trio.current_time() - waited
                if trio.current_effective_deadline() - trio.current_time() < waited:
                    # the opening took about two round trips: an echo now would be cut off by the
                    # caller's deadline and the new stream thrown away with it, again at every probe
                    raise PeerError("the ping stream just opened; too little time left for an echo")
            elif stream is None:
                stream = await self._open(peer)
                self._streams[peer] = stream
            payload = os.urandom(PING_SIZE)
            ok = False
            try:
                started = time.monotonic()
                await write_frame_raw(stream, payload)
                echo = await _read_exactly(stream, PING_SIZE)
                ok = echo == payload
                if not ok:
                    raise PeerError("ping echo mismatch")
                self.received(PING_SIZE)
                return time.monotonic() - started
            finally:
                if not ok:  # also on cancellation: a half-read stream is useless
                    await self.forget(peer)

    async def forget(self, peer: ID) -> None:
        self._opening.pop(peer, None)
        stream = self._streams.pop(peer, None)
        if stream is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(0.5):
                try:
                    await stream.reset()
                except Exception:
                    pass


class _CountedReads:
    """A stream whose reads are counted (``received(size)``); everything else is the stream's."""

    def __init__(self, stream: INetStream, received: Callable[[int], None]) -> None:
        self._stream, self._received = stream, received

    async def read(self, n: int | None = None) -> bytes:
        data = await self._stream.read(n)
        self._received(len(data))
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def count_pings(host: IHost, received: Callable[[int], None]) -> None:
    """Tell ``received`` the bytes of every ping a peer sends us: libp2p's own handler still
    answers them, reading through a stream that counts (``_CountedReads``)."""
    answer = host.get_mux().handlers.get(PING_PROTOCOL)
    if answer is None:
        return

    async def counted(stream: INetStream) -> None:
        await answer(_CountedReads(stream, received))  # type: ignore[arg-type]

    host.set_stream_handler(PING_PROTOCOL, counted)


async def write_frame_raw(stream: INetStream, data: bytes) -> None:
    try:
        await stream.write(data)
    except Exception as exc:
        raise PeerError(f"write failed ({exc.__class__.__name__})") from None
