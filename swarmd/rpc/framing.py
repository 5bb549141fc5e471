"""Length-prefixed msgpack frames: the wire format of the control socket.

Rules:
- A frame is a 4-byte big-endian length followed by that many bytes of msgpack.
- A frame longer than ``MAX_FRAME`` is refused as soon as its header is read: the body is
  never buffered, so a hostile length costs nothing.
- The decoder is sans-IO: ``feed(bytes)`` then ``next_message()`` until it returns
  ``NOT_YET``. It never touches a socket; the trio server and the blocking client both
  drive it. ``next_body()`` hands out the undecoded body instead, for a caller that
  decodes a large one off its event loop.
- A body is decoded within a budget (``decode``): at most ``max_objects(len(body))``
  objects, 64 Ki plus one per 16 bytes of frame, so a frame costs at most a few MB or a few
  times its size in memory (a Python object is 16-64 bytes; a msgpack one can be a single
  byte, and 16 MiB of empty arrays was 1.2 GB and 6 s). The blocking client decodes the
  daemon's replies without it (``bounded=False``): it trusts its daemon, whose log replies
  carry a line per few bytes. msgpack's own limits are per container, so
  the total is counted twice: each finished array and map adds its length (hooks), and the
  body is fed to the decoder in slices with the interpreter's allocated-block count read
  between them, which also sees the scalars of containers still open (a deep chain of
  large arrays finishes none of them until its end). A refusal is ``FrameTooComplex``.
"""

from __future__ import annotations

import struct
import sys
from typing import Any, Final

import msgpack

MAX_FRAME: Final = 16 * 1024 * 1024
HEADER = struct.Struct(">I")
BYTES_PER_OBJECT: Final = 16  # a 16 MiB frame may hold a million objects (a sync's 20,000 records are 20,000)
MIN_OBJECTS: Final = 64 * 1024  # a few MB and tens of ms whatever the frame; a job's output batch (4096 lines) is 12 Ki
DECODE_SLICE: Final = 64 * 1024  # bytes fed to msgpack per call: a few ms of C, then the budget is checked


class FramingError(Exception):
    """The byte stream cannot be read as frames; the connection must be closed."""


class FrameTooLarge(FramingError):
    pass


class MalformedFrame(FramingError):
    pass


class FrameTooComplex(MalformedFrame):
    """More objects than the frame's size allows (``max_objects``)."""


class _NotYet:
    def __repr__(self) -> str:
        return "NOT_YET"


NOT_YET: Final = _NotYet()


def encode_frame(message: Any, *, max_frame: int = MAX_FRAME) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > max_frame:
        raise FrameTooLarge(f"frame of {len(body)} bytes exceeds the {max_frame}-byte limit")
    return HEADER.pack(len(body)) + body


def max_objects(length: int) -> int:
    return MIN_OBJECTS + length // BYTES_PER_OBJECT


def decode(body: bytes, *, strict_map_key: bool = False, bounded: bool = True) -> Any:
    """One msgpack object from ``body`` (all of it), within ``max_objects(len(body))``.

    Raises ``FrameTooComplex`` over the budget, ``MalformedFrame`` for anything that is not
    exactly one msgpack object. ``bounded=False`` is for bytes from a trusted source only."""
    if not bounded:
        try:
            return msgpack.unpackb(body, raw=False, strict_map_key=strict_map_key)
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            raise MalformedFrame(f"frame is not valid msgpack ({type(exc).__name__}: {exc})") from None
    budget = max_objects(len(body))
    count = 0

    def counted(n: int) -> None:
        nonlocal count
        count += n
        if count > budget:
            raise FrameTooComplex(f"a {len(body)}-byte frame with more than {budget} objects")

    def on_list(items: list[Any]) -> list[Any]:
        counted(len(items) + 1)
        return items

    def on_map(items: dict[Any, Any]) -> dict[Any, Any]:
        counted(2 * len(items) + 1)
        return items

    unpacker = msgpack.Unpacker(raw=False, strict_map_key=strict_map_key, list_hook=on_list, object_hook=on_map,
                                max_buffer_size=max(len(body), 1), max_str_len=len(body), max_bin_len=len(body),
                                max_ext_len=len(body), max_array_len=budget, max_map_len=budget // 2)
    view = memoryview(body)
    start = sys.getallocatedblocks()
    result: Any = NOT_YET
    try:
        for at in range(0, len(body), DECODE_SLICE):
            unpacker.feed(view[at:at + DECODE_SLICE])
            if sys.getallocatedblocks() - start > budget:
                raise FrameTooComplex(f"a {len(body)}-byte frame with more than {budget} objects")
            try:
                result = unpacker.unpack()
            except msgpack.OutOfData:
                continue
            break
        if result is NOT_YET:
            raise MalformedFrame("frame is not valid msgpack (truncated)")
        if unpacker.tell() != len(body):
            raise MalformedFrame(f"frame is not valid msgpack ({len(body) - unpacker.tell()} bytes after the message)")
    except FramingError:
        raise
    except ValueError as exc:
        if "exceeds max_" in str(exc):  # one container or string longer than the whole budget
            raise FrameTooComplex(f"a {len(body)}-byte frame over its object budget ({exc})") from None
        raise MalformedFrame(f"frame is not valid msgpack ({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise MalformedFrame(f"frame is not valid msgpack ({type(exc).__name__}: {exc})") from None
    return result


class FrameDecoder:
    def __init__(self, *, max_frame: int = MAX_FRAME, bounded: bool = True) -> None:
        self._max = max_frame
        self._bounded = bounded  # False only where the other end is trusted (the client, of its daemon)
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held; non-zero at EOF means a truncated frame."""
        return len(self._buf)

    def rest(self) -> bytes:
        """Every byte buffered and not yet a frame, handed out and forgotten (a connection
        that stops being frames: what its peer sent past the last one)."""
        rest, self._buf = bytes(self._buf), bytearray()
        return rest

    def next_message(self) -> Any:
        """The next decoded message, or ``NOT_YET`` when a whole frame is not buffered."""
        body = self.next_body()
        return body if body is NOT_YET else decode(body, bounded=self._bounded)

    def next_body(self) -> Any:
        """The next frame's body, undecoded (``decode`` it), or ``NOT_YET``."""
        if len(self._buf) < HEADER.size:
            return NOT_YET
        (length,) = HEADER.unpack_from(self._buf)
        if length > self._max:
            raise FrameTooLarge(f"frame of {length} bytes exceeds the {self._max}-byte limit")
        end = HEADER.size + length
        if len(self._buf) < end:
            return NOT_YET
        body = bytes(self._buf[HEADER.size : end])
        del self._buf[:end]
        return body
