"""Chunked transfer over a stream: bytes too large for one frame, sent and received with
their limits. The job protocol uses it both ways (a workdir upload, a checkpoint put and get:
compute/host/service.py has the requests around it).

Wire: once a request and its answer have agreed on the size, the sender writes
``{data: bytes}`` frames of at most `CHUNK` bytes each, then ``{end: true}``; frames are
p2p/streams' (4-byte length, msgpack). The receiver knew the size beforehand and takes:
- a frame of at most `MAX_CHUNK_FRAME` (a chunk and its framing), so a peer's 4 GiB header
  costs four bytes of reading (streams.read_frame);
- each frame within `chunk_timeout` (`CHUNK_TIMEOUT`): a peer that stalls holds a transfer
  slot and a spool file, and must let go of them;
- all of them within `within`: a peer that trickles one byte per pause is given up too;
- a map; ``{end: true}`` ends, anything else must be ``{data: bytes}`` with at least one
  byte (an empty chunk would let a peer send for ever without moving);
- exactly the agreed size: the chunk that goes past it is refused before it is taken, and an
  ``{end}`` short of it is refused.
Each refusal is one `TransferError` (a reason, a message naming `what`); each protocol maps
it to its own error. A frame too large or unreadable, or a stream that breaks, is the
reader's `FrameTooLarge` / `PeerError` as on any read; only the caller knows what answer,
if any, follows the transfer.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable
from typing import Any, Literal

import trio
from libp2p.abc import INetStream

from .streams import read_frame, write_frame

CHUNK = 1024 * 1024  # bytes a {data} frame carries at most: one read, one write, one frame
MAX_CHUNK_FRAME = CHUNK + 1024  # a chunk and its framing
CHUNK_TIMEOUT = 30.0  # seconds a transfer may pause between chunks

Reason = Literal["stalled", "late", "malformed", "over", "short"]


class TransferError(Exception):
    """A transfer the peer broke: `reason` is ``stalled`` (no chunk for `chunk_timeout`),
    ``late`` (not all within `within`), ``malformed`` (a frame not a map, or neither a
    non-empty ``{data}`` nor ``{end: true}``), ``over`` (more bytes than agreed) or ``short``
    (``{end}`` before them all); the message says it naming what was sent."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


async def send_chunks(stream: INetStream, source: bytes | int, *, chunk: int = CHUNK,
                      progress: Callable[[int], None] | None = None) -> None:
    """`source` as ``{data}`` frames of at most `chunk` bytes, then ``{end: true}``: a byte
    string, or an open file descriptor read (in a worker thread) from where it stands to its
    end. `progress` is told the bytes sent so far after each chunk. Raises PeerError."""
    sent = 0
    while piece := await _piece(source, sent, chunk):
        await write_frame(stream, {"data": piece})
        sent += len(piece)
        if progress is not None:
            progress(sent)
    await write_frame(stream, {"end": True})


async def _piece(source: bytes | int, sent: int, chunk: int) -> bytes:
    if isinstance(source, int):
        return await trio.to_thread.run_sync(os.read, source, chunk)
    return source[sent:sent + chunk]


async def receive_chunks(stream: INetStream, size: int, take: Callable[[bytes], Any], *, what: str,
                         within: float = math.inf, chunk_timeout: float = CHUNK_TIMEOUT,
                         check: Callable[[Any], Any] | None = None) -> None:
    """Exactly `size` bytes of ``{data}`` frames until ``{end}``, each chunk handed to `take`
    (sync or async) in order. Each frame read is first given to `check` when there is one
    (it may raise: a protocol's own ``{error}`` frame). Raises TransferError naming `what`,
    or the reader's PeerError / FrameTooLarge."""
    received = 0
    with trio.move_on_after(within) as whole:
        while True:
            with trio.move_on_after(chunk_timeout) as pause:
                frame = await read_frame(stream, MAX_CHUNK_FRAME)
            if pause.cancelled_caught:
                raise TransferError("stalled", f"no {what} chunk for {chunk_timeout:g} s")
            if check is not None:
                check(frame)
            if not isinstance(frame, dict):
                raise TransferError("malformed", f"a {what} chunk must be a map")
            if frame.get("end") is True:
                break
            data = frame.get("data")
            if not isinstance(data, bytes) or not data:
                raise TransferError("malformed", f"a {what} chunk must be {{data: bytes}} or {{end: true}}")
            if received + len(data) > size:
                raise TransferError("over", f"the {what}'s chunks are more than its {size} bytes")
            if inspect.isawaitable(taken := take(data)):
                await taken
            received += len(data)
    if whole.cancelled_caught:
        raise TransferError("late", f"the {what} took more than {within:g} s to arrive")
    if received != size:
        raise TransferError("short", f"the {what} ended after {received} of its {size} bytes")
