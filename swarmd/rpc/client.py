"""Blocking client for the control socket, used by swarmctl and by tests.

Import-light by design (socket, msgpack): `swarmctl --help` must answer in < 300 ms.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
from collections.abc import Iterator
from typing import Any

from .framing import NOT_YET, FrameDecoder, encode_frame
from .protocol import ErrorCode


class DaemonUnreachable(Exception):
    """Nothing answers on the socket; the message says which socket was tried."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot reach swarmd at {path}: {reason}")
        self.path = path
        self.reason = reason


class RemoteError(Exception):
    """The daemon answered with an error reply."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def failed(self) -> bool:
        """The operation ran and failed, as opposed to a refused or malformed call."""
        return self.code == ErrorCode.OPERATION_FAILED


class Client:
    def __init__(self, path: str, *, timeout: float | None = 10.0) -> None:
        self.path = str(path)
        self._timeout = timeout
        self._sock: socket.socket | None = None
        self._decoder = FrameDecoder(bounded=False)  # our daemon's replies: a log reply is a line per few bytes
        self._ids = itertools.count(1)

    def set_timeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        if self._sock is not None:
            self._sock.settimeout(timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def shutdown(self) -> None:
        """End, from another thread, a stream this client is reading: its read returns at once
        (closing alone would not wake it) and the stream raises DaemonUnreachable."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._timeout)
            try:
                sock.connect(self.path)
            except FileNotFoundError:
                sock.close()
                raise DaemonUnreachable(self.path, "no such socket") from None
            except ConnectionRefusedError:
                sock.close()
                raise DaemonUnreachable(self.path, "connection refused (stale socket?)") from None
            except PermissionError:
                sock.close()
                raise DaemonUnreachable(self.path, "permission denied (are you in the swarm group?)") from None
            except OSError as exc:
                sock.close()
                raise DaemonUnreachable(self.path, exc.strerror or str(exc)) from None
            self._sock = sock
        return self._sock

    def call(self, method: str, **params: Any) -> Any:
        """Call a unary method and return its result; raises RemoteError on an error reply."""
        for result in self.stream(method, **params):
            return result
        raise RemoteError(int(ErrorCode.INTERNAL_ERROR), f"{method}: empty reply")

    def take_over(self, method: str, **params: Any) -> tuple[Any, socket.socket, bytes]:
        """Call a method that turns the connection into a byte pipe once it answers
        (`jobs.forward`): its result, the socket (the caller's now: this client lets go of it)
        and the bytes already read past the answer. RemoteError when refused."""
        result = self.call(method, **params)
        sock, rest = self._sock, self._decoder.rest()
        assert sock is not None
        self._sock = None
        return result, sock, rest

    def stream(self, method: str, **params: Any) -> Iterator[Any]:
        """Yield each result of a (possibly streaming) call until the final reply."""
        sock = self._connect()
        request_id = next(self._ids)
        try:
            sock.sendall(encode_frame({"id": request_id, "method": method, "params": params}))
        except OSError as exc:
            # the daemon may have refused the connection before reading (too many connections):
            # its reason is there to read
            with contextlib.suppress(DaemonUnreachable):
                if "error" in (message := self._receive()) and message.get("id") is None:
                    raise _remote_error(message)
            self.close()
            raise DaemonUnreachable(self.path, f"send failed: {exc}") from None
        while True:
            message = self._receive()
            if message.get("id") != request_id and not (message.get("id") is None and "error" in message):
                continue  # an error of no request is the connection's own (too many connections): ours
            if "error" in message:
                raise _remote_error(message)
            if "result" in message:
                yield message["result"]
            if message.get("final", True):
                return

    def _receive(self) -> dict[str, Any]:
        sock = self._connect()
        while (message := self._decoder.next_message()) is NOT_YET:
            try:
                data = sock.recv(1 << 16)
            except TimeoutError:
                self.close()
                raise DaemonUnreachable(self.path, f"no reply within {self._timeout} s") from None
            except OSError as exc:
                self.close()
                raise DaemonUnreachable(self.path, f"receive failed: {exc}") from None
            if not data:
                self.close()
                raise DaemonUnreachable(self.path, "the daemon closed the connection")
            self._decoder.feed(data)
        if not isinstance(message, dict):
            raise RemoteError(int(ErrorCode.INVALID_REQUEST), "reply is not a map")
        return message


def _remote_error(message: dict[str, Any]) -> RemoteError:
    err = message["error"]
    return RemoteError(int(err.get("code", ErrorCode.INTERNAL_ERROR)), str(err.get("message")))
