"""The control socket's mesh methods, and the check every mesh-backed method makes first.

``up`` answers the mesh driver while its WireGuard interface is up, else an error naming
why not (the mesh is off by configuration, or waiting for a swarm, or failed to start);
``mesh`` itself (this node's interface and its peers with their paths) joins routing's
columns and lives in swarmd/api.py.
"""

from __future__ import annotations

from typing import Any

from ..rpc.protocol import Access, Caller, ErrorCode, Method, RpcError
from .driver import Mesh


def up(mesh: Mesh | None, off: str | None, method: str) -> Mesh:
    """``mesh`` if its interface is up; else the error ``method`` answers with."""
    if mesh is None:
        raise RpcError(ErrorCode.OPERATION_FAILED, f"{method}: the WireGuard mesh is off on this node ({off})")
    if not mesh.started:
        why = f": {mesh.error}" if mesh.error else " (waiting to join a swarm)"
        raise RpcError(ErrorCode.OPERATION_FAILED, f"{method}: the WireGuard mesh is not up yet{why}")
    return mesh


def methods(mesh: Mesh | None, off: str | None, *, log: Any) -> list[Method]:
    """The mesh's own methods (``off``: why ``mesh`` is None, if it is), logging to ``log``."""

    async def rotate_key(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        result = await up(mesh, off, "mesh.rotate-key").rotate_key()
        log.info("mesh key rotated", by_uid=caller.uid)
        return result

    return [
        Method(name="mesh.rotate-key", handler=rotate_key, access=Access.ADMIN,
               doc="a new WireGuard key for this node, re-advertised at once"),
    ]
