"""Who owns a TCP socket of this host, asked of the kernel (sock_diag netlink, through pyroute2).

Users: a forward's head host (compute/forward.py: which uid listens on a port, and which uid
accepted the daemon's connection) and `swarmctl jobs forward` (which uid connected to its
local listener).

Rules:
- Never the whole socket table, not even a dump: a host whose jobs hold 200,000 sockets
  made one parse of /proc/net/tcp cost 1.2 s and ~157 MB (issue 23, finding 3). Each call
  asks for one socket by its ends (SOCK_DIAG_BY_FAMILY without NLM_F_DUMP: the kernel's
  `inet_diag_find_one_icsk`, the same hash lookup that delivers a packet), so what it
  costs does not grow with the sockets anyone holds.
- That lookup finds a connection by its four ends, and when none has them, the listener a
  connection to the local end would reach (`__inet_lookup_listener`: that address, else the
  wildcard). `listener` uses that on purpose, with a remote port no connection has (0);
  `connection` takes a reply only if its four ends are the ones asked for.
- Blocking (one netlink socket per call, opened and closed in the calling thread): call
  these from a worker thread (`trio.to_thread.run_sync`), from as many at once as need be.
- pyroute2 is imported on first use (swarmctl starts without it), once, under a lock: its
  package imports itself in a circle, and two threads importing it at once got a partially
  initialized module (an ImportError in `swarmctl jobs forward`'s first connections).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import struct
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from dataclasses import dataclass
from typing import Any

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Endpoint = tuple[Address, int]

TCP_LISTEN = 10  # the kernel's TCP states (include/net/tcp_states.h)
TCP_TIME_WAIT, TCP_CLOSE = 6, 7
ALL_STATES = (1 << 12) - 1
_NLMSG_ERROR = 2
_NO_COOKIE = 0xFFFFFFFFFFFFFFFF  # INET_DIAG_NOCOOKIE: match by the four-tuple alone


class DiagError(OSError):
    """sock_diag could not answer (its module is missing, the kernel refused the request)."""


@dataclass(frozen=True, slots=True)
class TcpSocket:
    """One TCP socket as the kernel reports it (an IPv4-mapped IPv6 address as its IPv4)."""

    local: Endpoint
    remote: Endpoint
    state: int
    uid: int
    inode: int


def address(text: str) -> Address:
    """An address as this module compares them: no scope, an IPv4-mapped one as IPv4 (a
    dual-stack socket's IPv4 peer is the same peer)."""
    a = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        return a.ipv4_mapped
    return a


_import_lock = threading.Lock()
_netlink: SimpleNamespace | None = None


def _pyroute2() -> SimpleNamespace:
    """What this module uses of pyroute2, imported by the first caller of any thread."""
    global _netlink
    with _import_lock:
        if _netlink is None:
            import logging

            from pyroute2 import DiagSocket
            from pyroute2.netlink import NLM_F_REQUEST
            from pyroute2.netlink.diag import SOCK_DIAG_BY_FAMILY, inet_diag_req

            logging.getLogger("pyroute2").setLevel(logging.WARNING)  # importing it resets its logger to NOTSET
            _netlink = SimpleNamespace(DiagSocket=DiagSocket, NLM_F_REQUEST=NLM_F_REQUEST,
                                       SOCK_DIAG_BY_FAMILY=SOCK_DIAG_BY_FAMILY, inet_diag_req=inet_diag_req)
        return _netlink


def _request(family: int, local: tuple[str, int], remote: tuple[str, int]) -> Any:
    """An inet_diag_req_v2 for the one TCP socket with these ends, in any state."""

    def words(addr: str) -> tuple[int, ...]:
        return struct.unpack(">4I", ipaddress.ip_address(addr).packed.ljust(16, b"\0"))

    req = _pyroute2().inet_diag_req()
    req["sdiag_family"] = family
    req["sdiag_protocol"] = socket.IPPROTO_TCP
    req["idiag_states"] = ALL_STATES
    req["idiag_sport"], req["idiag_dport"] = local[1], remote[1]
    req["idiag_src"], req["idiag_dst"] = words(local[0]), words(remote[0])
    req["idiag_cookie"] = _NO_COOKIE
    return req


@contextlib.contextmanager
def _diag() -> Iterator[Any]:
    """A sock_diag netlink socket, for this thread's calls only."""
    with _pyroute2().DiagSocket() as ds:
        ds.bind()
        yield ds


def _lookup(local: tuple[str, int], remote: tuple[str, int]) -> TcpSocket | None:
    """What the kernel's one-socket lookup answers for these ends (unchecked), or None."""
    nl = _pyroute2()
    v4 = isinstance(address(local[0]), ipaddress.IPv4Address) and isinstance(address(remote[0]), ipaddress.IPv4Address)
    req = _request(socket.AF_INET if v4 else socket.AF_INET6, local, remote)
    with _diag() as ds:
        for msg in ds.nlm_request(req, nl.SOCK_DIAG_BY_FAMILY, nl.NLM_F_REQUEST):
            if msg["header"]["type"] == _NLMSG_ERROR:
                # struct nlmsgerr follows the 16-byte header; its first field is -errno
                (code,) = struct.unpack_from("i", msg.data, msg.offset + 16)
                if code == 0:
                    continue
                if -code == errno.ENOENT:  # no such socket
                    return None
                raise DiagError(-code, f"sock_diag refused the request: {os.strerror(-code)}")
            return TcpSocket(local=(address(msg["idiag_src"]), msg["idiag_sport"]),
                             remote=(address(msg["idiag_dst"]), msg["idiag_dport"]),
                             state=msg["idiag_state"], uid=msg["idiag_uid"], inode=msg["idiag_inode"])
    return None


_WILDCARDS = (ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::"))


def listener(addr: str, port: int) -> TcpSocket | None:
    """The socket listening that a TCP connection to `addr`:`port` of this host would reach
    now (one bound to that address, else to the wildcard), or None when none would (blocking)."""
    want = address(addr)
    plain = str(want)  # an IPv4-mapped address asked as IPv4, like the kernel delivers it
    s = _lookup((plain, port), (plain, 0))
    if s is None or s.state != TCP_LISTEN or s.local[1] != port or s.local[0] not in (want, *_WILDCARDS):
        return None
    return s


def connection(local: tuple[str, int], remote: tuple[str, int]) -> TcpSocket | None:
    """The TCP socket of this host whose local end is `local` and remote end `remote`, if
    one is open (not TIME_WAIT or closed); else None (blocking)."""
    want = ((address(local[0]), local[1]), (address(remote[0]), remote[1]))
    s = _lookup((str(want[0][0]), want[0][1]), (str(want[1][0]), want[1][1]))
    if s is None or (s.local, s.remote) != want or s.state in (TCP_TIME_WAIT, TCP_CLOSE):
        return None
    return s
