"""WireGuard's cross-platform userspace API (UAPI): encode "set", parse "get", talk to the socket.

Spec: https://www.wireguard.com/xplatform/#configuration-protocol. Implementations (wireguard-go
here) listen on ``/var/run/wireguard/IFACE.sock``. A request is ``get=1\\n\\n`` or ``set=1\\n``
followed by ``key=value`` lines and a blank line; every reply ends with ``errno=N\\n\\n``, N
being 0 or a negated errno (wireguard-go: -EIO, -EPROTO, -EINVAL, -EADDRINUSE, -ENOANO).

Rules:
- Keys travel as 64 lowercase hex digits. Lines before the first ``public_key`` are about the
  device; each ``public_key`` opens a peer and the lines after it are about that peer.
- ``encode_set`` and ``parse_get`` are pure: no sockets, no clock. Bad arguments raise
  ``ValueError`` naming the field; a malformed or failed reply raises ``UapiError``.
- Unknown keys in a reply are ignored (a newer wireguard-go may add some); a known key with a
  bad value is an error.
- ``uapi_get`` / ``uapi_set`` open one connection per request and are bounded by a timeout.
"""

from __future__ import annotations

import errno as _errno
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import trio
from nacl.bindings import crypto_scalarmult_base

from .endpoint import split_endpoint

KEY_LEN = 32
DEFAULT_TIMEOUT = 5.0  # seconds; a healthy wireguard-go answers in well under a millisecond
MAX_REPLY = 64 << 20  # a get with ~100k peers is ~30 MB; anything past this is not a reply
_GET_REQUEST = b"get=1\n\n"


class UapiError(Exception):
    """A UAPI exchange failed: no socket, no reply, a malformed reply or a non-zero errno."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """The desired state of one peer, as a ``set`` applies it.

    ``allowed_ips`` replaces the peer's list (``replace_allowed_ips=true``); ``endpoint`` and
    ``keepalive`` are left as they are when None (0 turns keepalive off); ``remove`` deletes
    the peer and ignores the other fields.
    """

    public: bytes
    endpoint: str | None = None
    allowed_ips: tuple[str, ...] = ()
    keepalive: int | None = None
    remove: bool = False

    def __post_init__(self) -> None:
        _check_key("peer public key", self.public)
        object.__setattr__(self, "allowed_ips", tuple(self.allowed_ips))
        for ip in self.allowed_ips:
            _check_prefix(ip)
        if self.endpoint is not None:
            split_endpoint(self.endpoint)
        if self.keepalive is not None and not 0 <= self.keepalive <= 0xFFFF:
            raise ValueError(f"keepalive must be 0..65535 seconds, got {self.keepalive}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerState:
    """One peer as the device reports it. ``last_handshake`` is unix seconds, None if never."""

    public: bytes
    endpoint: str | None
    allowed_ips: tuple[str, ...]
    last_handshake: float | None
    rx_bytes: int
    tx_bytes: int
    keepalive: int  # seconds, 0 = off


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceState:
    """The device as ``get`` reports it. The private key comes back clamped (X25519)."""

    private_key: bytes | None
    listen_port: int | None
    fwmark: int = 0
    peers: dict[bytes, PeerState] = field(default_factory=dict)

    @property
    def public_key(self) -> bytes | None:
        return None if self.private_key is None else crypto_scalarmult_base(self.private_key)


def encode_set(*, private_key: bytes | None = None, listen_port: int | None = None,
               replace_peers: bool = False, peers: Iterable[PeerConfig] = ()) -> bytes:
    """A complete ``set=1`` request, blank line included."""
    lines = ["set=1"]
    if private_key is not None:
        _check_key("private key", private_key)
        lines.append(f"private_key={private_key.hex()}")
    if listen_port is not None:
        if not 0 <= listen_port <= 0xFFFF:
            raise ValueError(f"listen port must be 0..65535, got {listen_port}")
        lines.append(f"listen_port={listen_port}")
    if replace_peers:
        lines.append("replace_peers=true")
    for peer in peers:
        if not isinstance(peer, PeerConfig):
            raise ValueError(f"peers must be PeerConfig, got {type(peer).__name__}")
        lines.append(f"public_key={peer.public.hex()}")
        if peer.remove:
            lines.append("remove=true")
            continue
        if peer.endpoint is not None:
            lines.append(f"endpoint={peer.endpoint}")
        if peer.keepalive is not None:
            lines.append(f"persistent_keepalive_interval={peer.keepalive}")
        lines.append("replace_allowed_ips=true")
        lines.extend(f"allowed_ip={ip}" for ip in peer.allowed_ips)
    return ("\n".join(lines) + "\n\n").encode()


def parse_set(text: str) -> None:
    """Check the reply to a ``set``: exactly ``errno=N``; raise UapiError unless N is 0."""
    lines = _reply_lines(text)
    if len(lines) != 1:
        raise UapiError(f"malformed UAPI set reply: expected one errno= line, got {text[:200]!r}")
    _check_errno(lines[0])


def parse_get(text: str) -> DeviceState:
    """Parse the reply to ``get=1`` (the lines, then ``errno=N``)."""
    lines = _reply_lines(text)
    _check_errno(lines[-1])
    device: dict[str, object] = {"private_key": None, "listen_port": None, "fwmark": 0}
    peers: dict[bytes, PeerState] = {}
    peer: dict[str, object] | None = None

    def close_peer() -> None:
        if peer is None:
            return
        sec, nsec = peer.pop("sec"), peer.pop("nsec")
        peer["last_handshake"] = None if sec == nsec == 0 else sec + nsec / 1e9
        peer["allowed_ips"] = tuple(peer["allowed_ips"])
        peers[peer["public"]] = PeerState(**peer)

    for n, line in enumerate(lines[:-1], 1):
        key, sep, value = line.partition("=")
        if not sep:
            raise UapiError(f"malformed UAPI reply, line {n}: expected key=value, got {line!r}")
        try:
            if key == "public_key":
                close_peer()
                public = _hex_key(value)
                if public in peers:
                    raise ValueError(f"peer {value} listed twice")
                peer = {"public": public, "endpoint": None, "allowed_ips": [], "sec": 0, "nsec": 0,
                        "rx_bytes": 0, "tx_bytes": 0, "keepalive": 0}
            elif peer is None:
                if key in _PEER_KEYS:
                    raise ValueError(f"peer key {key} before any public_key")
                if key == "private_key":
                    device["private_key"] = _hex_key(value)
                elif key == "listen_port":
                    device["listen_port"] = _uint(value, 0xFFFF) or None
                elif key == "fwmark":
                    device["fwmark"] = _uint(value, 0xFFFFFFFF)
            elif key == "endpoint":
                split_endpoint(value)
                peer["endpoint"] = value
            elif key == "allowed_ip":
                peer["allowed_ips"].append(_check_prefix(value))
            elif key == "protocol_version":
                if value != "1":
                    raise ValueError(f"unsupported protocol_version {value}")
            elif key in _PEER_INTS:
                name, limit = _PEER_INTS[key]
                peer[name] = _uint(value, limit)
            elif key in _DEVICE_KEYS:
                raise ValueError(f"device key {key} after a public_key")
        except ValueError as e:
            raise UapiError(f"malformed UAPI reply, line {n} ({line[:100]!r}): {e}") from None
    close_peer()
    return DeviceState(private_key=device["private_key"], listen_port=device["listen_port"],
                       fwmark=device["fwmark"], peers=peers)


async def uapi_get(path: str | os.PathLike[str], *, timeout: float = DEFAULT_TIMEOUT) -> DeviceState:
    return parse_get(await _exchange(os.fspath(path), _GET_REQUEST, timeout))


async def uapi_set(path: str | os.PathLike[str], data: bytes, *, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Send a request made by ``encode_set``; raise UapiError unless the device accepted it."""
    # Without the blank line wireguard-go would wait for more lines until our timeout.
    if not data.startswith(b"set=1\n") or not data.endswith(b"\n\n") or b"\n\n" in data[:-2]:
        raise ValueError("data must be one set=1 request ending in a blank line (use encode_set)")
    parse_set(await _exchange(os.fspath(path), data, timeout))


# Peer integer fields: UAPI key -> (PeerState field, largest value).
_PEER_INTS = {
    "last_handshake_time_sec": ("sec", 2**63 - 1),
    "last_handshake_time_nsec": ("nsec", 999_999_999),
    "rx_bytes": ("rx_bytes", 2**64 - 1),
    "tx_bytes": ("tx_bytes", 2**64 - 1),
    "persistent_keepalive_interval": ("keepalive", 0xFFFF),
}
_PEER_KEYS = {"endpoint", "allowed_ip", "protocol_version", "preshared_key", *_PEER_INTS}
_DEVICE_KEYS = {"private_key", "listen_port", "fwmark"}
_HEX = set("0123456789abcdefABCDEF")


def _check_key(what: str, key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_LEN:
        got = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
        raise ValueError(f"{what} must be {KEY_LEN} bytes, got {got}")


def _check_prefix(prefix: str) -> str:
    try:
        if "/" not in prefix:
            raise ValueError
        return str(ipaddress.ip_network(prefix, strict=False))
    except ValueError:
        raise ValueError(f"allowed ip must be a CIDR prefix such as 10.0.0.1/32, got {prefix!r}") from None


def _hex_key(value: str) -> bytes:
    if len(value) != 2 * KEY_LEN or not set(value) <= _HEX:
        raise ValueError(f"a key must be {2 * KEY_LEN} hex digits, got {value[:80]!r}")
    return bytes.fromhex(value)


def _uint(value: str, limit: int) -> int:
    if not value.isascii() or not value.isdigit() or int(value) > limit:
        raise ValueError(f"expected an integer 0..{limit}, got {value!r}")
    return int(value)


def _reply_lines(text: str) -> list[str]:
    """The reply's lines without the terminating blank line; they must end with errno=."""
    body = text[:-1] if text.endswith("\n\n") else text
    lines = body.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines or not lines[-1].startswith("errno="):
        raise UapiError(f"malformed UAPI reply: no errno= line at the end (truncated?): {text[-200:]!r}")
    if "" in lines:
        raise UapiError("malformed UAPI reply: blank line before errno=")
    return lines


def _check_errno(line: str) -> None:
    value = line.removeprefix("errno=")
    try:
        code = int(value)
    except ValueError:
        raise UapiError(f"malformed UAPI reply: errno={value!r} is not an integer") from None
    if code == 0:
        return
    name = _errno.errorcode.get(abs(code), "unknown errno")
    hint = " (the listen port is in use)" if -code == _errno.EADDRINUSE else ""
    raise UapiError(f"WireGuard device refused the request: errno={code} ({name}: "
                    f"{os.strerror(abs(code))}){hint}", errno=code)


async def _exchange(path: str, request: bytes, timeout: float) -> str:
    try:
        with trio.fail_after(timeout):
            stream = await trio.open_unix_socket(path)
            async with stream:
                await stream.send_all(request)
                buf = bytearray()
                while True:
                    chunk = await stream.receive_some(1 << 16)
                    if not chunk:
                        raise UapiError(f"{path} closed the connection before the reply ended "
                                        f"({len(buf)} bytes received)")
                    start = max(0, len(buf) - 1)
                    buf += chunk
                    # The blank line that ends a reply is the first one in it.
                    if buf.find(b"\n\n", start) >= 0:
                        break
                    if len(buf) > MAX_REPLY:
                        raise UapiError(f"{path} sent more than {MAX_REPLY} bytes without ending its reply")
    except trio.TooSlowError:
        raise UapiError(f"no reply from the WireGuard UAPI socket {path} within {timeout:g} s") from None
    except FileNotFoundError:
        raise UapiError(f"no WireGuard UAPI socket at {path}: is wireguard-go running?") from None
    except ConnectionRefusedError:
        raise UapiError(f"nothing listens on the WireGuard UAPI socket {path} (stale socket?)") from None
    except OSError as e:
        raise UapiError(f"cannot talk to the WireGuard UAPI socket {path}: {e.strerror or e}") from None
    try:
        return buf.decode("ascii")
    except UnicodeDecodeError:
        raise UapiError(f"malformed UAPI reply from {path}: not ASCII") from None
