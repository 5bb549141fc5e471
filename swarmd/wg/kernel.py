"""The kernel backend: a ``wireguard`` link configured over generic netlink (pyroute2).

Untested on the development machine (its kernel has no WireGuard module): kept to the
minimum the Backend protocol needs. pyroute2 is blocking; every call goes through
trio.to_thread.run_sync. A kernel device does not die with a process, so ``supervise`` only
waits for cancellation.
"""

from __future__ import annotations

import base64
import errno
import os
import secrets
from collections.abc import Awaitable, Callable, Iterable, Sequence

import trio
from pyroute2 import IPRoute, WireGuard
from pyroute2.netlink.exceptions import NetlinkError

from .backend import (
    NO_KERNEL_MODULE,
    BackendError,
    BackendUnavailable,
    check_addresses,
    check_ifname,
    check_link_settings,
    configure_link,
    delete_link,
    set_link_addresses,
)
from .endpoint import split_endpoint
from .uapi import KEY_LEN, DeviceState, PeerConfig, PeerState


def available() -> bool:
    """Whether this kernel can make a WireGuard link: the module is loaded, or creating a
    probe link works (which also loads a module that is built but not yet loaded)."""
    if os.path.exists("/sys/module/wireguard"):
        return True
    probe = f"wgprobe{secrets.token_hex(3)}"
    try:
        with IPRoute() as ipr:
            ipr.link("add", ifname=probe, kind="wireguard")
            ipr.link("del", index=ipr.link_lookup(ifname=probe)[0])
    except (NetlinkError, OSError, IndexError):
        return False
    return True


class KernelBackend:
    name = "kernel"

    def __init__(self, iface: str) -> None:
        self.iface = check_ifname(iface)

    async def start(self, *, private_key: bytes, listen_port: int, addresses: Sequence[str],
                    mtu: int) -> None:
        if not isinstance(private_key, bytes) or len(private_key) != KEY_LEN:
            raise ValueError(f"private key must be {KEY_LEN} bytes")
        check_link_settings(listen_port, addresses, mtu)
        try:
            await trio.to_thread.run_sync(self._create, private_key, listen_port)
            await trio.to_thread.run_sync(configure_link, self.iface, list(addresses), mtu)
        except BaseException:
            await self.close()
            raise

    async def set_peers(self, peers: Iterable[PeerConfig]) -> None:
        await trio.to_thread.run_sync(self._set_peers, list(peers))

    async def set_addresses(self, addresses: Sequence[str]) -> None:
        check_addresses(addresses)
        await trio.to_thread.run_sync(set_link_addresses, self.iface, list(addresses))

    async def set_private_key(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) != KEY_LEN:
            raise ValueError(f"private key must be {KEY_LEN} bytes")
        await trio.to_thread.run_sync(self._wg, "set", {"private_key": _b64(key)})

    async def state(self) -> DeviceState:
        return _device_state(await trio.to_thread.run_sync(self._wg, "info", {}))

    async def supervise(self, on_restart: Callable[[], Awaitable[object]]) -> None:
        await trio.sleep_forever()

    async def close(self) -> None:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(delete_link, self.iface)

    def _create(self, private_key: bytes, listen_port: int) -> None:
        delete_link(self.iface)  # a crashed earlier run's
        try:
            with IPRoute() as ipr:
                ipr.link("add", ifname=self.iface, kind="wireguard")
        except NetlinkError as e:
            if e.code in (errno.EOPNOTSUPP, errno.EINVAL):
                raise BackendUnavailable(f"cannot create WireGuard interface {self.iface}: {NO_KERNEL_MODULE}") from e
            raise BackendError(f"cannot create WireGuard interface {self.iface}: {e}") from e
        self._wg("set", {"private_key": _b64(private_key), "listen_port": listen_port})

    def _set_peers(self, peers: list[PeerConfig]) -> None:
        for p in peers:
            peer: dict[str, object] = {"public_key": _b64(p.public)}
            if p.remove:
                peer["remove"] = True
            else:
                if p.endpoint is not None:
                    peer["endpoint_addr"], peer["endpoint_port"] = split_endpoint(p.endpoint)
                if p.keepalive is not None:
                    peer["persistent_keepalive"] = p.keepalive
                peer["replace_allowed_ips"] = True
                peer["allowed_ips"] = list(p.allowed_ips)
            self._wg("set", {"peer": peer})

    def _wg(self, op: str, kwargs: dict[str, object]):
        try:
            with WireGuard() as wg:
                if op == "info":
                    return list(wg.info(self.iface))
                return wg.set(self.iface, **kwargs)
        except (NetlinkError, OSError) as e:
            raise BackendError(f"{self.iface}: WireGuard netlink {op} failed: {e}") from e


def _b64(key: bytes) -> str:
    return base64.b64encode(key).decode()


def _device_state(messages: list) -> DeviceState:
    """Fold the (possibly several, for many peers) WG_CMD_GET_DEVICE replies into a DeviceState."""
    private_key, port, fwmark = None, None, 0
    peers: dict[bytes, PeerState] = {}
    for msg in messages:
        if (key := msg.get_attr("WGDEVICE_A_PRIVATE_KEY")) is not None and any(base64.b64decode(key)):
            private_key = base64.b64decode(key)
        port = msg.get_attr("WGDEVICE_A_LISTEN_PORT") or port
        fwmark = msg.get_attr("WGDEVICE_A_FWMARK") or fwmark
        for p in msg.get_attr("WGDEVICE_A_PEERS") or ():
            public = base64.b64decode(p.get_attr("WGPEER_A_PUBLIC_KEY"))
            ep = p.get_attr("WGPEER_A_ENDPOINT")
            endpoint = None
            if ep is not None and ep.get("port"):
                endpoint = f"[{ep['addr']}]:{ep['port']}" if ":" in ep["addr"] else f"{ep['addr']}:{ep['port']}"
            hs = p.get_attr("WGPEER_A_LAST_HANDSHAKE_TIME")
            handshake = hs["tv_sec"] + hs["tv_nsec"] / 1e9 if hs is not None and (hs["tv_sec"] or hs["tv_nsec"]) else None
            ips = tuple(a["addr"] for a in p.get_attr("WGPEER_A_ALLOWEDIPS") or ()
                        if isinstance(a, dict) and a.get("addr"))
            old = peers.get(public)  # a peer's allowed ips may continue in the next message
            peers[public] = PeerState(
                public=public, endpoint=endpoint, allowed_ips=(old.allowed_ips if old else ()) + ips,
                last_handshake=handshake, rx_bytes=p.get_attr("WGPEER_A_RX_BYTES") or 0,
                tx_bytes=p.get_attr("WGPEER_A_TX_BYTES") or 0,
                keepalive=p.get_attr("WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL") or 0)
    return DeviceState(private_key=private_key, listen_port=port, fwmark=fwmark, peers=peers)
