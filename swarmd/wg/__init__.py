"""The WireGuard floor: keys, overlay addresses (address), this node's proof of its key
(proof), the sans-IO reconciler, wireguard-go's protocol (uapi) and the two backends (kernel
netlink, wireguard-go) behind one `backend.Backend`, chosen by `choose`. It knows nothing of
gossip: the mesh driver above it (swarmd/mesh/) feeds it the membership view."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .backend import Backend

__all__ = ["choose"]


def choose(preference: str, iface: str) -> Backend:
    """The backend for ``preference`` ("auto" | "kernel" | "userspace"), bound to ``iface``.

    auto: the kernel module when present, else wireguard-go when on PATH. A forced choice that
    cannot run raises BackendUnavailable saying why rather than falling back silently.
    """
    # here, not at the top: a record's check reads wg.address alone, without pyroute2
    from . import backend, kernel, userspace

    if preference not in backend.PREFERENCES:
        raise ValueError(f"WireGuard backend must be one of {', '.join(backend.PREFERENCES)}, got {preference!r}")
    has_kernel = preference != "userspace" and kernel.available()
    if preference == "kernel" and not has_kernel:
        raise backend.BackendUnavailable(f"WireGuard backend 'kernel' is unavailable: {backend.NO_KERNEL_MODULE}; "
                                         "or choose the 'userspace' backend (wireguard-go)")
    if has_kernel:
        return kernel.KernelBackend(iface)
    if shutil.which(userspace.BINARY) is None:
        if preference == "userspace":
            raise backend.BackendUnavailable(f"wireguard-go not found: {backend.INSTALL_WG_GO}")
        raise backend.BackendUnavailable(f"no WireGuard backend: {backend.NO_KERNEL_MODULE}, and wireguard-go is "
                                         f"not on PATH ({backend.INSTALL_WG_GO})")
    return userspace.UserspaceBackend(iface)
