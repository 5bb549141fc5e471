"""The daemon's control-socket methods: what swarmctl can ask of a node.

Each handler reads the node's state and returns plain data (msgpack-able); the method table
says which handlers change something (refused to callers outside the swarm group).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import trio

from . import __version__, log
from .config import LOG_LEVELS
from .rpc.protocol import Caller, Method, Param, RpcError, ErrorCode

if TYPE_CHECKING:
    from .node import Node

MIN_WATCH_INTERVAL = 0.1


def methods(node: Node) -> list[Method]:
    async def status(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return node.status()

    async def version(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        from importlib.metadata import version as dist_version

        return {"version": __version__, "python": platform.python_version(),
                "libp2p": dist_version("libp2p"), "pid": os.getpid()}

    async def watch(params: dict[str, Any], caller: Caller) -> AsyncIterator[dict[str, Any]]:
        interval = float(params.get("interval", 1.0))
        if interval < MIN_WATCH_INTERVAL:
            raise RpcError(ErrorCode.INVALID_PARAMS,
                           f"status.watch: 'interval' must be at least {MIN_WATCH_INTERVAL} s")
        count = params.get("count")
        sent = 0
        while count is None or sent < count:
            if sent:
                await trio.sleep(interval)
            yield node.status()
            sent += 1

    async def set_log_level(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        level = params["level"].lower()
        if level not in LOG_LEVELS:
            raise RpcError(ErrorCode.INVALID_PARAMS,
                           f"log.level: 'level' must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
        previous, node.log_level = node.log_level, level
        log.set_level(level)
        node.log.info("log level changed", level=level, previous=previous, by_uid=caller.uid)
        return {"level": level, "previous": previous}

    return [
        Method(name="status", handler=status, doc="this node: identity, addresses, uptime"),
        Method(name="version", handler=version, doc="daemon and library versions"),
        Method(name="status.watch", handler=watch, streams=True,
               doc="status every `interval` seconds, `count` times (forever when absent)",
               params={"interval": Param(type=float, doc="seconds between snapshots"),
                       "count": Param(type=int, doc="snapshots to send")}),
        Method(name="log.level", handler=set_log_level, mutates=True,
               doc="change the daemon's log level at run time",
               params={"level": Param(type=str, required=True, doc=" | ".join(LOG_LEVELS))}),
    ]


def uptime(started: float) -> float:
    return round(time.monotonic() - started, 3)
