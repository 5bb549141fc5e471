"""`swarmctl jobs forward ID LOCAL_PORT[:REMOTE_PORT]`: a port on this machine forwarded to
a running job's first host (like `kubectl port-forward`).

It listens on 127.0.0.1 (and ::1 where there is one) and, for each connection accepted,
opens a control connection of its own (`jobs.forward`): once the daemon answers, that
connection is a byte pipe to the job's listener, relayed here by a thread. A refused
connection is closed and the reason printed; the forward keeps serving until Ctrl-C (exit 0).

Rules: the port serves only its user. Any local user can connect to a loopback port, so
each connection is first asked of the kernel whose it is (`peer_refusal`: the uid of the
connecting socket, sockdiag.py) and one of another uid is closed before a byte is read or
the daemon is asked: another user never reaches the job, nor acts as this user toward it.
An address that is taken is an error, not a warning: with [::1]:PORT another program's, a
client of localhost:PORT could reach it instead of the job.
"""

from __future__ import annotations

import argparse
import errno
import os
import select
import socket
import sys
import threading
from typing import Any

from swarmd import sockdiag
from swarmd.rpc.client import Client, DaemonUnreachable, RemoteError

from .render import plain

CHUNK = 64 * 1024


class UsageError(Exception):
    pass


def ports(text: str) -> tuple[int, int]:
    """LOCAL[:REMOTE], each 1-65535; REMOTE defaults to LOCAL."""
    local, sep, remote = text.partition(":")
    out = []
    for part, name in ((local, "LOCAL_PORT"), (remote if sep else local, "REMOTE_PORT")):
        if not part.isdigit() or not 1 <= int(part) <= 65535:
            raise UsageError(f"{name} must be a port number from 1 to 65535, got {part!r} (in {text!r})")
        out.append(int(part))
    return out[0], out[1]


def _listen(local: int) -> list[socket.socket]:
    """Listeners on 127.0.0.1:local and, where this machine has IPv6, [::1]:local."""
    out = []
    for family, addr in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind((addr, local))
            s.listen(64)
        except OSError as exc:
            s.close()
            if family == socket.AF_INET6 and exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                continue  # no ::1 on this machine: 127.0.0.1 alone is localhost
            for other in out:
                other.close()
            shown = f"[{addr}]" if family == socket.AF_INET6 else addr
            raise UsageError(f"cannot listen on {shown}:{local}: {exc.strerror or exc}"
                             + (" (another program has it: pick another LOCAL_PORT)"
                                if exc.errno == errno.EADDRINUSE else "")) from None
        out.append(s)
    return out


def _one_way(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(CHUNK):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)  # its end, passed on
    except OSError:
        for s in (src, dst):  # one side failed: both go
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def relay(a: socket.socket, b: socket.socket, leftover: bytes = b"") -> None:
    """Bytes both ways (a thread each) until both sides ended, each end passed on as a
    half-close, or either failed; then both are closed."""
    try:
        if leftover:
            a.sendall(leftover)
        back = threading.Thread(target=_one_way, args=(b, a), daemon=True)
        back.start()
        _one_way(a, b)
        back.join()
    except OSError:
        pass
    finally:
        a.close()
        b.close()


# connections relayed at once: the job's host takes 16 forwards of a job; more wait in the
# listen backlog instead of each costing a thread and a control connection of the daemon's
MAX_RELAYS = 16
_relays = threading.BoundedSemaphore(MAX_RELAYS)


def _serve_one(conn: socket.socket, peer: Any, socket_path: str, timeout: float, job: str, port: int) -> None:
    try:
        _relay_one(conn, peer, socket_path, timeout, job, port)
    finally:
        _relays.release()


def peer_refusal(conn: socket.socket) -> str | None:
    """None when the connection accepted as `conn` comes from this user's uid, else why it
    is refused (the kernel's word on the connecting socket; blocking)."""
    try:
        theirs = sockdiag.connection(conn.getpeername()[:2], conn.getsockname()[:2])
    except OSError as exc:  # the client is gone already (ENOTCONN), or sock_diag cannot answer
        return f"cannot tell which user connected: {exc.strerror or exc}"
    if theirs is None:
        return "cannot tell which user connected (the connection is gone)"
    me = os.geteuid()  # what the kernel records as a socket's owner
    if theirs.uid != me:
        return f"it comes from uid {theirs.uid}, and this forward serves only uid {me}"
    return None


def _relay_one(conn: socket.socket, peer: Any, socket_path: str, timeout: float, job: str, port: int) -> None:
    if (why := peer_refusal(conn)) is not None:
        print(f"swarmctl: connection from {peer[0]}:{peer[1]} refused: {why}", file=sys.stderr, flush=True)
        conn.close()
        return
    try:
        with Client(socket_path, timeout=max(timeout, 30.0)) as client:  # the daemon asks the host (10 s at most)
            _, daemon, leftover = client.take_over("jobs.forward", id=job, port=port)
    except (RemoteError, DaemonUnreachable) as exc:
        why = plain(getattr(exc, "message", exc))  # the daemon's answer may quote a host
        print(f"swarmctl: connection from {peer[0]}:{peer[1]} refused: {why}", file=sys.stderr, flush=True)
        conn.close()
        return
    daemon.settimeout(None)
    relay(conn, daemon, leftover)


def command(client: Client, args: argparse.Namespace) -> int:
    try:
        local, remote = ports(args.ports)
    except UsageError as exc:
        print(f"swarmctl: {exc}", file=sys.stderr)
        return 2
    where = client.call("jobs.forward", id=args.id, port=remote, check=True)  # not running, not ours: exits here
    try:
        listeners = _listen(local)
    except UsageError as exc:
        print(f"swarmctl: {exc}", file=sys.stderr)
        return 1
    if args.json:
        from . import render

        render.as_json({**where, "local": local})
    else:
        print(f"forwarding 127.0.0.1:{local} -> job {where['id']} on host {where['address']} "
              f"({where['peer'][-8:]}) port {remote}; Ctrl-C to stop", flush=True)
    try:
        while True:
            readable, _, _ = select.select(listeners, [], [])
            for listener in readable:
                _relays.acquire()  # at most MAX_RELAYS at once; the rest wait in the backlog
                try:
                    conn, peer = listener.accept()
                except OSError:
                    _relays.release()
                    continue
                threading.Thread(target=_serve_one, args=(conn, peer, client.path, args.timeout, where["id"], remote),
                                 daemon=True).start()
    except KeyboardInterrupt:
        return 0
    finally:
        for listener in listeners:
            listener.close()
