"""Deleting conntrack entries by mark, over ctnetlink (the relay's flows; Linux only, needs CAP_NET_ADMIN).

Why: the relay's NAT lives in conntrack entries, and an entry outlives the rules that made
it as long as packets keep coming (a WireGuard keepalive every 25 s is enough). The
forward chain already drops a flow of a pair that is gone (nft.py), but an entry also
holds its reply tuple (B:port -> R:P): when A comes back from a new address or port, its
new flow would need that same reply tuple and is dropped until the old entry times out,
which B's own packets never let happen. And after the table is removed, entries go on
NATing (and, where the host forwards anyway, relaying). So the forwarder deletes the
entries of a pair that changed or went, and all of ours when it starts and closes.

The request is one netlink message, IPCTNL_MSG_CT_DELETE without a tuple but with
CTA_MARK and CTA_MARK_MASK: the kernel flushes every entry whose mark matches
(net/netfilter/nf_conntrack_netlink.c, ctnetlink_flush_conntrack). No conntrack-tools needed.
`netns` (a path such as /run/netns/NAME) makes the socket in another network namespace
(tests); it is entered in a thread of its own that ends right after.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import threading

NETLINK_NETFILTER = 12
NFNL_SUBSYS_CTNETLINK = 1
IPCTNL_MSG_CT_DELETE = 2
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NLMSG_ERROR = 2
CTA_MARK, CTA_MARK_MASK = 8, 21
CLONE_NEWNET = 0x40000000


def delete_by_mark(mark: int, mask: int = 0xFFFFFFFF, *, netns: str | None = None) -> None:
    """Delete every conntrack entry with `entry.mark & mask == mark`; OSError if the kernel refuses."""
    if netns is None:
        _delete(mark, mask)
        return
    failure: list[BaseException] = []

    def run() -> None:
        try:
            fd = os.open(netns, os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns {netns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            _delete(mark, mask)
        except BaseException as exc:  # reported to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="conntrack-netns")  # never reused: it dies in that namespace
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def _delete(mark: int, mask: int) -> None:
    attrs = _attr(CTA_MARK, struct.pack("!I", mark)) + _attr(CTA_MARK_MASK, struct.pack("!I", mask))
    body = struct.pack("!BBH", socket.AF_INET, 0, 0) + attrs  # nfgenmsg: family, version, res_id
    header = struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE,
                         NLM_F_REQUEST | NLM_F_ACK, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER) as sock:
        sock.settimeout(5.0)
        sock.sendto(header + body, (0, 0))
        answer = sock.recv(65536)
    if len(answer) < 20:
        raise OSError(errno.EIO, "conntrack: short netlink answer")
    _, kind, _, _, _ = struct.unpack_from("=IHHII", answer)
    if kind == NLMSG_ERROR:
        (code,) = struct.unpack_from("=i", answer, 16)
        if code not in (0, -errno.ENOENT):  # ENOENT: nothing had that mark
            raise OSError(-code, f"conntrack delete: {os.strerror(-code)}")


def _attr(kind: int, payload: bytes) -> bytes:
    data = struct.pack("=HH", 4 + len(payload), kind) + payload
    return data + b"\0" * (-len(data) % 4)
