"""The control socket's service methods: deploy, list, show, logs, scale, take down; and the
gateway's poll.

A service belongs to the uid that deployed it (as a job does): members of the daemon's group
deploy and change their own; root and the daemon's user act on every one. `serve ls` and
`serve show` read the registry, which every member shares. `serve.gateway` is the gateway
process's alone (it runs as the daemon's user): its statistics in, the routes out.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from ..rpc.protocol import Access, Caller, ErrorCode, Method, Param, RpcError
from .service import ServeError

if TYPE_CHECKING:
    from .service import Services


def methods(get: Callable[[], Services | None], jobs: Callable[[], Any]) -> list[Method]:
    def services(method: str) -> Services:
        s = get()
        if s is None:
            raise RpcError(ErrorCode.OPERATION_FAILED, f"{method}: this node is in no swarm (swarmctl swarm init or join)")
        return s

    def wrapped(method: str, call: Callable[[Services], Any]) -> Any:
        try:
            return call(services(method))
        except ServeError as exc:
            raise RpcError(ErrorCode.INVALID_PARAMS, f"{method}: {exc}") from None

    async def up(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        workdir = params.get("workdir")
        if workdir is not None and not (jobs().archives / f"{workdir}.tar.gz").exists():
            raise RpcError(ErrorCode.INVALID_PARAMS, "serve.up: the workdir was not uploaded (jobs.upload)")
        return wrapped("serve.up", lambda s: s.up(params, caller.uid, caller.access >= Access.ADMIN))

    async def ls(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return {"services": services("serve.ls").ls()}

    async def show(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return wrapped("serve.show", lambda s: s.show(params["name"]))

    async def scale(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        if params.get("replicas") is None and params.get("autoscale") is None:
            raise RpcError(ErrorCode.INVALID_PARAMS, "serve.scale: replicas (a count) or autoscale (a range) is needed")
        return wrapped("serve.scale", lambda s: s.scale(params["name"], params.get("replicas"), caller.uid,
                                                         caller.access >= Access.ADMIN, params.get("autoscale")))

    async def down(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return wrapped("serve.down", lambda s: s.down(params["name"], caller.uid, caller.access >= Access.ADMIN))

    async def logs(params: dict[str, Any], caller: Caller) -> AsyncIterator[dict[str, Any]]:
        index = params.get("replica", 0)
        job = wrapped("serve.logs", lambda s: s.replica_job(params["name"], index, caller.uid,
                                                             caller.access >= Access.ADMIN))
        async for event in jobs().watch(job, progress=False, output=True, follow=bool(params.get("follow"))):
            yield event

    async def gateway(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return services("serve.gateway").routes(params.get("stats"))

    name = Param(type=str, required=True, doc="the service's name")
    return [
        Method(name="serve.up", handler=up, access=Access.JOBS,
               doc="deploy a service, or change one (a new workdir or command rolls out replica by replica)",
               params={"name": name, "replicas": Param(type=int, doc="how many (default 1)"),
                       "template": Param(type=dict, required=True, doc="each replica's job fields: cmd, env, cpus, "
                                                                        "mem, gpus_per_node, labels, hosts, python"),
                       "workdir": Param(type=str, doc="digest of an uploaded workdir"),
                       "health": Param(type=str, doc="the path its hosts GET to check a replica (default /)"),
                       "access": Param(type=str, doc="members (default), token or public"),
                       "token_sha256": Param(type=str, doc="with access token: the token's SHA-256, hex"),
                       "autoscale": Param(type=dict, doc="a replica range and its scaler's settings: min, max, "
                                                         "target_inflight, slo_p99_ms, predictive, season_s, …")}),
        Method(name="serve.ls", handler=ls, access=Access.READ, doc="the services in the registry"),
        Method(name="serve.show", handler=show, access=Access.READ,
               doc="one service: its replicas, their hosts, paths, health, and this node's gateway's figures",
               params={"name": name}),
        Method(name="serve.scale", handler=scale, access=Access.JOBS,
               doc="change how many replicas a service has: a fixed count, or a range to autoscale in",
               params={"name": name, "replicas": Param(type=int, doc="how many (autoscaling off)"),
                       "autoscale": Param(type=dict, doc="min and max, and any scaler setting to change")}),
        Method(name="serve.down", handler=down, access=Access.JOBS, doc="drain and stop every replica, then forget it",
               params={"name": name}),
        Method(name="serve.logs", handler=logs, access=Access.JOBS, streams=True, doc="one replica's output",
               params={"name": name, "replica": Param(type=int, doc="its index (default 0)"),
                       "follow": Param(type=bool, doc="keep streaming until it ends")}),
        Method(name="serve.gateway", handler=gateway, access=Access.ADMIN,
               doc="the gateway's poll: its statistics in, the routing table out",
               params={"stats": Param(type=dict, doc="the gateway's figures")}),
    ]
