"""Length-prefixed msgpack frames: the wire format of the control socket.

Rules:
- A frame is a 4-byte big-endian length followed by that many bytes of msgpack.
- A frame longer than ``MAX_FRAME`` is refused as soon as its header is read: the body is
  never buffered, so a hostile length costs nothing.
- The decoder is sans-IO: ``feed(bytes)`` then ``next_message()`` until it returns
  ``NOT_YET``. It never touches a socket; the trio server and the blocking client both
  drive it.
"""

from __future__ import annotations

import struct
from typing import Any, Final

import msgpack

MAX_FRAME: Final = 16 * 1024 * 1024
HEADER = struct.Struct(">I")


class FramingError(Exception):
    """The byte stream cannot be read as frames; the connection must be closed."""


class FrameTooLarge(FramingError):
    pass


class MalformedFrame(FramingError):
    pass


class _NotYet:
    def __repr__(self) -> str:
        return "NOT_YET"


NOT_YET: Final = _NotYet()


def encode_frame(message: Any, *, max_frame: int = MAX_FRAME) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > max_frame:
        raise FrameTooLarge(f"frame of {len(body)} bytes exceeds the {max_frame}-byte limit")
    return HEADER.pack(len(body)) + body


class FrameDecoder:
    def __init__(self, *, max_frame: int = MAX_FRAME) -> None:
        self._max = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held; non-zero at EOF means a truncated frame."""
        return len(self._buf)

    def next_message(self) -> Any:
        """The next decoded message, or ``NOT_YET`` when a whole frame is not buffered."""
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
        try:
            return msgpack.unpackb(body, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            raise MalformedFrame(f"frame is not valid msgpack ({type(exc).__name__}: {exc})") from None
