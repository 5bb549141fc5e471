"""Requests, replies, errors and the method table of the control socket (sans-IO).

Theory of operation: the transport hands every decoded message to ``Dispatcher.prepare``
together with who is calling. ``prepare`` either returns a ``Call`` (a known method, typed
parameters, a caller allowed to make it) or raises ``RpcError`` carrying the reply to send.
Replies are built by ``reply`` and ``error_reply``. Nothing here reads a socket or a clock.

Access: every method names the lowest ``Access`` level that may call it, and every caller
holds one level, decided from its kernel credentials (``access_of``):
- ``READ``: anyone who can open the socket: status, peers, the mesh, versions;
- ``JOBS``: members of the daemon's group: run jobs, and list, read and cancel their own
  (a job belongs to the uid that submitted it; handlers check with ``check_owner``);
- ``ADMIN``: root and the daemon's own user: administer the swarm and the node (init, join,
  invite, revoke, labels, log level, mesh keys), and every user's jobs.
A method that does not say is ``ADMIN``: a forgotten entry fails closed.

Wire shapes (msgpack maps):
- request  ``{id: int|str, method: str, params: map}`` (params optional)
- reply    ``{id, result, final: true}``
- stream   ``{id, result, final: false}`` per item, then ``{id, final: true}`` (no result)
- error    ``{id, error: {code: int, message: str}, final: true}``
- takeover a method marked ``takeover`` (``jobs.forward``) must be its connection's only call;
  its handler returns a ``Takeover``: after its reply the connection is a raw byte pipe both
  ways, handed to ``Takeover.run``, until either side closes (an error reply, or a plain
  result, leaves the connection a frame connection).

Error codes follow JSON-RPC 2.0 where it has one, so they mean something to anyone who has
seen it; the -320xx range is ours.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


class ErrorCode(enum.IntEnum):
    PARSE_ERROR = -32700  # not msgpack, truncated
    INVALID_REQUEST = -32600  # not a request-shaped map
    METHOD_NOT_FOUND = -32601
    INVALID_PARAMS = -32602
    INTERNAL_ERROR = -32603  # a bug in the daemon; logged with its traceback
    OPERATION_FAILED = -32000  # the method ran and reports failure (swarmctl exits 1)
    FRAME_TOO_LARGE = -32001
    PERMISSION_DENIED = -32003
    BUSY = -32004  # too many connections or calls in flight


class Access(enum.IntEnum):
    """Who may call a method, lowest first; a caller may call every method at or below its level."""

    READ = 0
    JOBS = 1
    ADMIN = 2


# What each level may do, and who holds it: the words of a refusal.
_MAY = {Access.READ: "only read this node's status", Access.JOBS: "run jobs and manage only its own",
        Access.ADMIN: "administer the swarm and manage every job"}
_HELD_BY = {Access.READ: "anyone who can open the socket",
            Access.JOBS: "root, the daemon's user, or a member of the daemon's group",
            Access.ADMIN: "root or the daemon's user"}


class RpcError(Exception):
    def __init__(self, code: ErrorCode, message: str, *, request_id: Any = None,
                 method: str | None = None) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
        self.request_id = request_id
        self.method = method  # set once the request named a known method (a metrics label)

    def reply(self) -> dict[str, Any]:
        return error_reply(self.request_id, self.code, self.message)


def failed(message: str) -> RpcError:
    """The error a handler raises when the operation itself failed."""
    return RpcError(ErrorCode.OPERATION_FAILED, message)


@dataclass(frozen=True, slots=True, kw_only=True)
class Param:
    type: type | tuple[type, ...]
    required: bool = False
    doc: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Method:
    """One entry of the method table.

    ``handler(params, caller)`` is awaited for a unary method; for a streaming method it
    is an async generator whose items become non-final replies.
    """

    name: str
    handler: Callable[..., Any]
    doc: str
    params: Mapping[str, Param] = field(default_factory=dict)
    access: Access = Access.ADMIN
    streams: bool = False
    takeover: bool = False  # its handler may return a Takeover: the connection becomes a byte pipe


@dataclass(frozen=True, slots=True, kw_only=True)
class Takeover:
    """A handler's answer that takes the connection over: ``result`` is sent as the reply,
    then ``run(stream, leftover)`` has the connection (``leftover``: bytes the client sent past
    its request), and ``close()`` is awaited whatever happens, the reply not sent included."""

    result: Any
    run: Callable[[Any, bytes], Any]
    close: Callable[[], Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class Caller:
    """Who is on the other end of a connection, as the kernel says (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int
    access: Access

    def owns(self, owner_uid: int) -> bool:
        """Whether this caller may act on something that belongs to ``owner_uid`` (a job)."""
        return self.access >= Access.ADMIN or self.uid == owner_uid


@dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    id: int | str
    method: Method
    params: dict[str, Any]
    caller: Caller


def access_of(uid: int, gids: Iterable[int], *, daemon_uid: int, group_gid: int | None) -> Access:
    """Root and the daemon's own user administer; members of the daemon's group run jobs."""
    if uid == 0 or uid == daemon_uid:
        return Access.ADMIN
    if group_gid is not None and group_gid in set(gids):
        return Access.JOBS
    return Access.READ


def check_owner(caller: Caller, method: str, what: str, owner_uid: int) -> None:
    """Refuse ``caller`` acting on ``what`` (e.g. "job X") unless it owns it or administers."""
    if not caller.owns(owner_uid):
        raise RpcError(ErrorCode.PERMISSION_DENIED,
                       f"{method}: {what} belongs to uid {owner_uid}; uid {caller.uid} may act only on its "
                       f"own jobs ({_HELD_BY[Access.ADMIN]} may act on any)", method=method)


def reply(request_id: Any, result: Any, *, final: bool = True) -> dict[str, Any]:
    return {"id": request_id, "result": result, "final": final}


def end_of_stream(request_id: Any) -> dict[str, Any]:
    return {"id": request_id, "final": True}


def error_reply(request_id: Any, code: ErrorCode, message: str) -> dict[str, Any]:
    return {"id": request_id, "error": {"code": int(code), "message": message}, "final": True}


def _type_name(t: type | tuple[type, ...]) -> str:
    names = {int: "integer", float: "number", str: "string", bool: "boolean", list: "list",
             dict: "map", bytes: "bytes", type(None): "nil"}
    ts = t if isinstance(t, tuple) else (t,)
    return " or ".join(names.get(x, x.__name__) for x in ts)


def _is_instance(value: Any, t: type | tuple[type, ...]) -> bool:
    ts = t if isinstance(t, tuple) else (t,)
    if isinstance(value, bool) and bool not in ts:
        return False  # True is an int to Python, not to a caller
    if isinstance(value, int) and float in ts:
        return True
    return isinstance(value, ts)


class Dispatcher:
    def __init__(self, methods: Iterable[Method]) -> None:
        self._methods: dict[str, Method] = {}
        for m in methods:
            if m.name in self._methods:
                raise ValueError(f"method {m.name!r} registered twice")
            self._methods[m.name] = m

    @property
    def methods(self) -> Mapping[str, Method]:
        return self._methods

    def prepare(self, message: Any, caller: Caller) -> Call:
        if not isinstance(message, dict):
            raise RpcError(ErrorCode.INVALID_REQUEST,
                           f"a request must be a map, got {type(message).__name__}")
        request_id = message.get("id")
        if isinstance(request_id, bool) or not isinstance(request_id, (int, str)):
            raise RpcError(ErrorCode.INVALID_REQUEST,
                           "request 'id' must be an integer or a string")
        name = message.get("method")
        if not isinstance(name, str):
            raise RpcError(ErrorCode.INVALID_REQUEST, "request 'method' must be a string",
                           request_id=request_id)
        method = self._methods.get(name)
        if method is None:
            raise RpcError(ErrorCode.METHOD_NOT_FOUND,
                           f"unknown method {name!r} (known: {', '.join(sorted(self._methods))})",
                           request_id=request_id)
        if caller.access < method.access:  # before its params: a refused caller learns nothing more
            raise RpcError(ErrorCode.PERMISSION_DENIED,
                           f"{name}: refused: it needs {_HELD_BY[method.access]}; uid {caller.uid} may "
                           f"{_MAY[caller.access]}", request_id=request_id, method=name)
        params = message.get("params", {})
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise RpcError(ErrorCode.INVALID_PARAMS,
                           f"{name}: 'params' must be a map, got {type(params).__name__}",
                           request_id=request_id)
        params = self._check_params(method, params, request_id)
        return Call(id=request_id, method=method, params=params, caller=caller)

    @staticmethod
    def _check_params(method: Method, params: dict[Any, Any], request_id: Any) -> dict[str, Any]:
        for key in params:
            if key not in method.params:
                known = ", ".join(sorted(method.params)) or "none"
                raise RpcError(ErrorCode.INVALID_PARAMS,
                               f"{method.name}: unknown parameter {key!r} (known: {known})",
                               request_id=request_id, method=method.name)
        for key, spec in method.params.items():
            if key not in params:
                if spec.required:
                    raise RpcError(ErrorCode.INVALID_PARAMS,
                                   f"{method.name}: missing parameter {key!r}",
                                   request_id=request_id, method=method.name)
                continue
            if not _is_instance(params[key], spec.type):
                raise RpcError(ErrorCode.INVALID_PARAMS,
                               f"{method.name}: parameter {key!r} must be {_type_name(spec.type)}, "
                               f"got {type(params[key]).__name__}", request_id=request_id,
                               method=method.name)
        return params
