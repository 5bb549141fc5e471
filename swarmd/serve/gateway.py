"""The inference gateway: ``curl http://127.0.0.1:8080/NAME/...`` on any member reaches service NAME.

Theory of operation. Beside each daemon runs one gateway process (asyncio + uvloop, aiohttp's
server and client: DESIGN's one event loop per process, and a proxy is asyncio by nature). It
asks its daemon for the routing table every ``--interval`` seconds (``DaemonRoutes``: RPC
``serve.gateway`` on the control socket, sending the balancer's statistics along) and feeds
it to the balancer (``balance.py``). A request for ``/NAME/rest?q`` is checked (name, access,
size), admitted (a slot of the gateway's concurrency), given a replica by the balancer and
forwarded as ``/rest?q`` over the mesh (plain HTTP to the replica's overlay address: the
WireGuard mesh is the encryption); the response streams back as it arrives. While the daemon
is unreachable the last table stands.

Rules:
- Names. NAME is a DNS label (``NAME_RE``); anything else is a 404 naming the problem. An
  unknown service is a 404, a known one without a replica to take the request a 503 with
  ``Retry-After``.
- Access, per service, from the table: ``public`` serves anyone; ``members`` serves only
  clients on loopback (the listener may face the Internet when a provider opens it, and the
  members of the swarm reach it on their own loopback); ``token`` needs ``Authorization:
  Bearer T`` with sha256(T) equal to the table's ``token_sha256`` (compared in constant time),
  else 401 without a token and 403 with a wrong one. The bearer token is the gateway's, so it
  is not passed on to the replica (its host is any member, not the service's owner).
- Forwarding. Hop-by-hop headers (RFC 9110 7.6.1: Connection and the ones it names,
  Keep-Alive, Transfer-Encoding, Upgrade, Proxy-*, TE, Trailer) are dropped both ways;
  ``Host`` is the replica's; ``X-Forwarded-For`` gets the client appended,
  ``X-Forwarded-Proto``/``-Prefix``/``-Host`` say how the client called. Bodies are passed
  as they are, compressed or not (no decompression either way). Upgrades (WebSocket) are not
  proxied.
- Streaming. The response's headers go to the client when the replica's arrive, and each
  chunk of its body as it is read (an LLM's tokens one by one, server-sent events); a
  request body is streamed to the replica unless it is buffered for a retry.
- Retries (on a replica not tried yet, at most ``retries`` more). A connection that fails
  before the request was sent (connect refused, unreachable, connect timeout) is always
  retried. An idempotent request (GET, HEAD, OPTIONS, PUT, DELETE) that fails before the
  response headers arrived (reset, timeout, an answer that is not HTTP) is retried too,
  when its body was buffered: bodies up to ``retry_body`` are, larger ones are streamed and
  such a request is retried only on a connect failure (its body not yet read). A response,
  even a 5xx, is never retried: the replica may have acted on the request. Pooled
  connections to replicas are dropped after ``pool_idle_s``, below the common servers'
  keep-alive (uvicorn: 5 s), so a request rarely meets a connection its replica just closed.
- The balancer's outcome per attempt: a failure for a connect error, a timeout, a reset, an
  answer that is not HTTP, a 5xx, a stream that broke or stalled; a success otherwise (also
  when the client left). Its latency is the time to the response headers. An ejected replica
  is checked every ``health_interval_s`` (GET of its health path, ``health_timeout_s``) and
  readmitted after a 2xx.
- Bounds (hostile clients and replicas). A request head larger than aiohttp's line and
  field limits is a 400. A client's request head must arrive within ``client_header_s`` of
  its connection opening or its previous response ending: aiohttp's keep-alive timer does
  this, as the bytes of a head still incomplete do not re-arm it (a test pins that), so a
  client sending a byte a second is cut off. At most ``max_connections`` client connections
  (beyond, closed at once), ``max_concurrent`` requests in progress, and per service
  ``max_queued`` waiting for a slot, each at most ``queue_timeout_s``: beyond, 503 with
  ``Retry-After: 1``; slots free up to the waiting services in turn. A body over
  ``max_body`` is a 413 (told by Content-Length before reading, or when the count passes it),
  one that stalls ``idle_read_s`` a 408. A replica has ``connect_s`` to accept,
  ``response_header_s`` to answer (from the request's start, its body's upload included;
  then 504), and ``idle_read_s`` between two reads of its body (then the client's response is
  cut short: its connection closed before the end). Each refusal is counted by its reason
  (``stats()['refused']``) and sent to the daemon with the balancer's statistics.
- Error bodies are plain text, with whatever came from a client or replica stripped of
  control characters and cut to ``MAX_ECHO`` characters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import itertools
import math
import os
import re
import signal
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from ..rpc.framing import NOT_YET, FrameDecoder, FrameTooLarge, decode, encode_frame
from .balance import MAX_SERVICES, Balancer, Replica

log = structlog.get_logger()

MiB: Final = 1024 * 1024
NAME_RE: Final = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
ACCESS: Final = frozenset({"public", "token", "members"})
SHA256_HEX: Final = re.compile(r"[0-9a-f]{64}")
HEALTH_PATH: Final = re.compile(r"/[!-~]{0,255}")  # printable ASCII, no space: it goes into a request line
DEFAULT_HEALTH: Final = "/healthz"
MAX_KEY: Final = 256  # characters of a replica key or host id
MAX_ECHO: Final = 200  # characters of client or replica text in an error body
IDEMPOTENT: Final = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
HOP_BY_HOP: Final = frozenset({"connection", "keep-alive", "transfer-encoding", "upgrade", "te", "trailer"})
# Set by the gateway, or the gateway's business: never passed from the client.
NOT_FORWARDED: Final = frozenset({"host", "content-length", "expect", "x-forwarded-proto", "x-forwarded-prefix",
                                  "x-forwarded-host"})


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Every bound and timer of the gateway. The defaults are production's; ``local()`` has the
    short timers the tests use."""

    max_body: int = 16 * MiB  # a request body beyond it: 413
    retry_body: int = 1 * MiB  # a body up to it is buffered, so that its request can be retried
    max_concurrent: int = 256  # requests in progress in the whole gateway
    max_queued: int = 128  # per service, waiting for one of those; beyond: 503
    queue_timeout_s: float = 10.0  # the longest wait there (503)
    max_connections: int = 4096  # client connections open at once; beyond, closed at accept
    client_header_s: float = 15.0  # a request head must arrive within it; also the idle keep-alive
    max_line_size: int = 8190  # request line and each header line (aiohttp's defaults)
    max_field_size: int = 8190
    max_headers: int = 100
    lingering_s: float = 2.0  # reading the rest of a refused body so the client can see the refusal
    connect_s: float = 3.0  # to open a connection to a replica (the mesh adds a relay hop at most)
    response_header_s: float = 30.0  # a replica's response headers, from the request's start
    idle_read_s: float = 60.0  # between two reads of a body, the replica's or the client's
    retries: int = 2  # attempts on other replicas after the first
    pool_per_replica: int = 64  # pooled connections per replica (the balancer's in-flight cap)
    pool_idle_s: float = 4.0  # an idle pooled connection is closed after it: below uvicorn's 5 s keep-alive
    health_interval_s: float = 2.0  # active checks of ejected replicas
    health_timeout_s: float = 1.0
    max_health_checks: int = 16  # at once
    shutdown_s: float = 10.0  # requests in progress may finish this long at close

    @classmethod
    def local(cls, **overrides: Any) -> Limits:
        """Short timers for tests on one machine."""
        return replace(cls(queue_timeout_s=1.0, client_header_s=1.0, connect_s=1.0, response_header_s=1.0,
                           idle_read_s=1.0, health_interval_s=0.2, health_timeout_s=0.5, shutdown_s=1.0,
                           lingering_s=0.5), **overrides)


# -- the table -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Route:
    access: str  # one of ACCESS
    token_sha256: str | None  # lower-case hex; set exactly when access is "token"


@dataclass(frozen=True, slots=True)
class Table:
    routes: dict[str, Route]
    replicas: tuple[Replica, ...]
    health: dict[str, str]  # replica key -> its health path
    invalid: int  # services and replicas dropped as malformed


class TableError(Exception):
    """The route source's answer is not a table at all."""


def parse_table(raw: Any) -> Table:
    """The daemon's ``serve.gateway`` answer as a ``Table``: a malformed service or replica is
    dropped and counted; an answer without a ``services`` map raises ``TableError``."""
    if not isinstance(raw, Mapping) or not isinstance(services := raw.get("services"), Mapping):
        raise TableError("the answer has no 'services' map")
    routes: dict[str, Route] = {}
    replicas: list[Replica] = []
    health: dict[str, str] = {}
    invalid = 0
    for name, entry in services.items():
        if not (isinstance(name, str) and NAME_RE.fullmatch(name) and isinstance(entry, Mapping)):
            invalid += 1
            continue
        access, token = entry.get("access"), entry.get("token_sha256")
        if access not in ACCESS or (access == "token") != (token is not None) or (
                token is not None and not (isinstance(token, str) and SHA256_HEX.fullmatch(token))):
            invalid += 1
            continue
        listed = entry.get("replicas", ())
        if not isinstance(listed, list | tuple):
            invalid += 1
            continue
        routes[name] = Route(access=access, token_sha256=token)
        for item in listed:
            replica = _replica(name, item)
            if replica is None:
                invalid += 1
                continue
            replicas.append(replica)
            path = item.get("health")
            health[replica.key] = path if isinstance(path, str) and HEALTH_PATH.fullmatch(path) else DEFAULT_HEALTH
    return Table(routes=routes, replicas=tuple(replicas), health=health, invalid=invalid)


def _replica(service: str, item: Any) -> Replica | None:
    if not isinstance(item, Mapping):
        return None
    key, host, address, port = item.get("key"), item.get("host"), item.get("address"), item.get("port")
    rtt, healthy = item.get("rtt_ms"), item.get("healthy")
    if not (isinstance(key, str) and 0 < len(key) <= MAX_KEY and key.isprintable()
            and isinstance(host, str) and 0 < len(host) <= MAX_KEY and host.isprintable()):
        return None
    if not (isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 and isinstance(healthy, bool)):
        return None
    try:
        ip = ipaddress.ip_address(address) if isinstance(address, str) else None
    except ValueError:
        ip = None
    if ip is None or ip.is_unspecified or ip.is_multicast:
        return None
    if rtt is not None and not (isinstance(rtt, int | float) and not isinstance(rtt, bool)
                                and math.isfinite(rtt) and rtt >= 0):
        return None
    return Replica(key=key, service=service, host=host, address=str(ip), port=port,
                   rtt_ms=None if rtt is None else float(rtt), healthy=healthy)


RouteSource = Callable[[dict[str, Any]], Awaitable[Any]]
"""Called with the gateway's statistics, returns the daemon's answer (see ``parse_table``)."""


def static_routes(table: Mapping[str, Any]) -> RouteSource:
    """A route source that always answers ``table`` (tests; a gateway without a daemon)."""

    async def source(stats: dict[str, Any]) -> Any:
        del stats
        return table

    return source


class RouteSourceError(Exception):
    pass


class DaemonRoutes:
    """The production route source: RPC ``serve.gateway`` on the daemon's control socket
    (length-prefixed msgpack frames, ``swarmd.rpc.framing``; request and reply shapes as in
    ``swarmd.rpc.protocol``). One connection, reopened after any failure."""

    METHOD: Final = "serve.gateway"
    DECODE_INLINE: Final = 256 * 1024  # a larger reply is decoded in a thread, off the event loop

    def __init__(self, path: str, *, timeout_s: float = 5.0) -> None:
        self.path = str(path)
        self._timeout = timeout_s
        self._ids = itertools.count(1)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._decoder = FrameDecoder(bounded=False)

    async def __call__(self, stats: dict[str, Any]) -> Any:
        try:
            async with asyncio.timeout(self._timeout):
                return await self._call(stats)
        except RouteSourceError:
            self.close()
            raise
        except Exception as exc:  # unreachable, timed out, a broken frame: start afresh next time
            self.close()
            raise RouteSourceError(f"{self.path}: {type(exc).__name__}: {exc}") from None

    async def _call(self, stats: dict[str, Any]) -> Any:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_unix_connection(self.path)
            self._decoder = FrameDecoder(bounded=False)
        request_id = next(self._ids)
        try:
            frame = encode_frame({"id": request_id, "method": self.METHOD, "params": {"stats": stats}})
        except FrameTooLarge:
            frame = encode_frame({"id": request_id, "method": self.METHOD,
                                  "params": {"stats": {"truncated": True}}})
        self._writer.write(frame)
        await self._writer.drain()
        while True:
            message = await self._receive()
            if not isinstance(message, Mapping):
                raise RouteSourceError(f"{self.path}: a reply that is not a map")
            if message.get("id") != request_id and not (message.get("id") is None and "error" in message):
                continue
            if "error" in message:
                error = message["error"]
                text = error.get("message") if isinstance(error, Mapping) else error
                raise RouteSourceError(f"{self.path}: {self.METHOD} refused: {_plain(str(text))}")
            return message.get("result")

    async def _receive(self) -> Any:
        assert self._reader is not None
        while (body := self._decoder.next_body()) is NOT_YET:
            data = await self._reader.read(1 << 16)
            if not data:
                raise EOFError("the daemon closed the connection")
            self._decoder.feed(data)
        if len(body) > self.DECODE_INLINE:
            return await asyncio.to_thread(decode, body, bounded=False)
        return decode(body, bounded=False)  # our daemon: trusted, as the blocking client trusts it

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


# -- access and admission --------------------------------------------------------------------------


def is_loopback(remote: str | None) -> bool:
    if not remote:
        return False
    try:
        ip = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def check_access(route: Route, remote: str | None, authorization: str | None) -> tuple[int, str, str] | None:
    """None when the client may use the service, else (status, counter reason, text)."""
    if route.access == "public":
        return None
    if route.access == "members":
        return None if is_loopback(remote) else (403, "members_only", "this service is for members of the swarm")
    if route.access == "token" and route.token_sha256 is not None:
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return 401, "no_token", "this service needs a bearer token (Authorization: Bearer ...)"
        digest = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).hexdigest()
        if hmac.compare_digest(digest, route.token_sha256):
            return None
        return 403, "bad_token", "the bearer token is not this service's"
    return 403, "forbidden", "this service cannot be reached here"  # fails closed


class _Admission:
    """``limit`` requests in progress; per service at most ``queued`` waiting for a slot. A freed
    slot goes to the services with waiters in turn (one waiter each), so that a busy service
    cannot starve a quiet one."""

    def __init__(self, limit: int, queued: int) -> None:
        self.limit = limit
        self.queued = queued
        self.in_flight = 0
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    async def acquire(self, service: str, timeout_s: float) -> str | None:
        """None with a slot held (``release`` it), else the reason of the refusal."""
        if self.in_flight < self.limit and not self._waiting:
            self.in_flight += 1
            return None
        queue = self._waiting.get(service)
        if self.queued <= 0 or (queue is not None and len(queue) >= self.queued):
            return "overloaded"
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(service, deque()).append(future)
        try:
            async with asyncio.timeout(timeout_s):
                await future
        except BaseException as exc:
            if future.done() and not future.cancelled():
                self.release()  # handed a slot as the wait ended: pass it on
            else:
                future.cancel()
                self._discard(service, future)
            if isinstance(exc, TimeoutError):
                return "queue_timeout"
            raise
        return None

    def release(self) -> None:
        while self._waiting:
            service = next(iter(self._waiting))
            queue = self._waiting.pop(service)
            while queue:
                future = queue.popleft()
                if not future.done():
                    future.set_result(None)  # the slot changes hands: in_flight stays
                    if queue:
                        self._waiting[service] = queue  # to the back of the turn
                    return
        self.in_flight -= 1

    def _discard(self, service: str, future: asyncio.Future[None]) -> None:
        queue = self._waiting.get(service)
        if queue is None:
            return
        with contextlib.suppress(ValueError):
            queue.remove(future)
        if not queue:
            del self._waiting[service]


class _Server(web.Server):
    """aiohttp's low-level server, with a cap on the client connections open at once."""

    def __init__(self, handler: Any, *, max_connections: int, on_refused: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._max_connections = max_connections
        self._on_refused = on_refused
        self.open_connections = 0

    def connection_made(self, handler: Any, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self.open_connections += 1
        if self.open_connections > self._max_connections:
            self._on_refused()
            transport.close()

    def connection_lost(self, handler: Any, exc: BaseException | None = None) -> None:
        self.open_connections -= 1
        super().connection_lost(handler, exc)


# -- the gateway -----------------------------------------------------------------------------------


class _Body:
    """A request body streamed to a replica: what was read ahead, then the rest of the client's,
    counted against ``max_body`` and read with an idle timeout."""

    def __init__(self, content: aiohttp.StreamReader, prefix: bytes, limits: Limits) -> None:
        self._content = content
        self._prefix = prefix
        self._limits = limits
        self.started = False  # its first byte was asked for: it cannot be sent again
        self.too_large = False
        self.stalled = False

    async def chunks(self) -> AsyncIterator[bytes]:
        self.started = True
        sent = len(self._prefix)
        if self._prefix:
            yield self._prefix
        while True:
            try:
                async with asyncio.timeout(self._limits.idle_read_s):
                    chunk = await self._content.readany()
            except TimeoutError:
                self.stalled = True
                raise
            if not chunk:
                return
            sent += len(chunk)
            if sent > self._limits.max_body:
                self.too_large = True
                raise aiohttp.ClientPayloadError("request body over the limit")
            yield chunk


class _Refusal(Exception):
    def __init__(self, status: int, reason: str, text: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(text)
        self.status, self.reason, self.text, self.headers = status, reason, text, dict(headers or {})


class Gateway:
    """The gateway of one member: ``await start(host, port)``, then ``close()`` (or ``async with``)."""

    def __init__(self, routes: RouteSource, *, limits: Limits | None = None, balancer: Balancer | None = None,
                 interval_s: float = 1.0) -> None:
        self.limits = limits or Limits()
        self.balancer = balancer or Balancer(max_in_flight_per_replica=self.limits.pool_per_replica)
        self._source = routes
        self._interval = interval_s
        self._routes: dict[str, Route] = {}
        self._health: dict[str, str] = {}
        self._admission = _Admission(self.limits.max_concurrent, self.limits.max_queued)
        self.refused: Counter[str] = Counter()  # by reason: what the client got instead of an answer
        self.upstream: Counter[str] = Counter()  # failed attempts on replicas by kind, retries, health checks
        self._table = {"updates": 0, "errors": 0, "invalid": 0, "failing": False}
        self._session: aiohttp.ClientSession | None = None
        self._health_session: aiohttp.ClientSession | None = None
        self._server: _Server | None = None
        self._runner: web.ServerRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.address: tuple[str, int] | None = None

    async def __aenter__(self) -> Gateway:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    async def start(self, host: str = "127.0.0.1", port: int = 8080) -> tuple[str, int]:
        """Listen on host:port (0: any free port); returns the address bound. The first table is
        asked for before it returns; without one the gateway answers 404 until the next."""
        lim = self.limits
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=lim.connect_s, sock_read=lim.idle_read_s)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=lim.pool_per_replica,
                                           keepalive_timeout=lim.pool_idle_s),
            timeout=timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(), trust_env=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            max_line_size=lim.max_line_size, max_field_size=lim.max_field_size, max_headers=lim.max_headers)
        self._health_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=lim.max_health_checks, force_close=True),
            timeout=aiohttp.ClientTimeout(total=lim.health_timeout_s), cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False)
        self._server = _Server(
            self._handle, max_connections=lim.max_connections, on_refused=lambda: self._count("too_many_connections"),
            handler_cancellation=True, keepalive_timeout=lim.client_header_s, access_log=None,
            max_line_size=lim.max_line_size, max_field_size=lim.max_field_size, max_headers=lim.max_headers,
            lingering_time=lim.lingering_s, auto_decompress=False)
        self._runner = web.ServerRunner(self._server, shutdown_timeout=lim.shutdown_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        bound = self._runner.addresses[0]
        self.address = (bound[0], bound[1])
        await self.refresh()
        self._tasks = [asyncio.create_task(self._poll_loop()), asyncio.create_task(self._health_loop())]
        return self.address

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for session in (self._session, self._health_session):
            if session is not None:
                await session.close()
        self._session = self._health_session = None

    # -- the table ------------------------------------------------------------------------------

    async def refresh(self) -> bool:
        """Ask the route source for the table once; False (the last table stays) when it failed."""
        try:
            raw = await self._source(self.stats())
            table = parse_table(raw)
        except Exception as exc:  # any source failure leaves the last table standing
            self._table["errors"] += 1
            if not self._table["failing"]:
                log.warning("gateway.routes_unavailable", error=_plain(str(exc)), kept=len(self._routes))
            self._table["failing"] = True
            return False
        if self._table["failing"]:
            log.info("gateway.routes_back", services=len(table.routes))
        self._table.update(updates=self._table["updates"] + 1, invalid=table.invalid, failing=False)
        self.balancer.update(self._now(), table.replicas)
        # the services the balancer kept, then those without replicas (503, not 404) up to its bound
        routes = {name: route for name, route in table.routes.items() if self.balancer.known(name)}
        for name in sorted(table.routes):
            if len(routes) >= MAX_SERVICES:
                break
            routes.setdefault(name, table.routes[name])
        self._routes = routes
        self._health = table.health
        return True

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.refresh()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.limits.health_interval_s)
            keys = sorted(self.balancer.ejected(self._now()))
            for at in range(0, len(keys), self.limits.max_health_checks):
                await asyncio.gather(*(self._check(key) for key in keys[at:at + self.limits.max_health_checks]))

    async def _check(self, key: str) -> None:
        replica = self.balancer.replica(key)
        if replica is None or self._health_session is None:
            return
        url = URL(f"http://{_hostport(replica)}{self._health.get(key, DEFAULT_HEALTH)}", encoded=True)
        try:
            async with self._health_session.get(url, allow_redirects=False) as response:
                passed = 200 <= response.status < 300
        except (aiohttp.ClientError, OSError, TimeoutError):
            passed = False
        self.upstream["health_passed" if passed else "health_failed"] += 1
        if passed:
            self.balancer.readmit(key)

    def stats(self) -> dict[str, Any]:
        """The balancer's statistics, plus the gateway's own counters (sent to the daemon)."""
        stats = self.balancer.stats(self._now())
        stats["refused"] = dict(self.refused)
        stats["upstream"] = dict(self.upstream)
        stats["table"] = dict(self._table)
        stats["gateway"] = {"in_flight": self._admission.in_flight, "queued": self._admission.waiting,
                            "connections": self._server.open_connections if self._server else 0,
                            # where it listens as bound (a port of 0 in its flags: any free one)
                            "listen": None if self.address is None else "%s:%d" % self.address[:2]}
        return stats

    def _count(self, reason: str) -> None:
        self.refused[reason] += 1

    # -- requests -------------------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        try:
            return await self._serve(request)
        except _Refusal as refusal:
            self._count(refusal.reason)
            return _text_response(refusal.status, refusal.text, refusal.headers)
        except Exception:
            if request.writer.output_size > 0:
                raise  # the response has begun: aiohttp closes the connection
            log.exception("gateway.request_failed")  # a bug: aiohttp's own 500 would be HTML to browsers
            self._count("internal_error")
            return _text_response(500, "internal error in the gateway")

    async def _serve(self, request: web.BaseRequest) -> web.StreamResponse:
        raw = request.raw_path
        if not raw.startswith("/"):
            raise _Refusal(400, "bad_target", "the request target must be a path: /SERVICE/...")
        path, has_query, query = raw.partition("?")
        name, _, rest = path[1:].partition("/")
        if not NAME_RE.fullmatch(name):
            raise _Refusal(404, "bad_name", f"not a service name: {name!r} (lower-case letters, digits, '-')")
        route = self._routes.get(name)
        if route is None:
            raise _Refusal(404, "unknown_service", f"no service named {name}")
        denied = check_access(route, request.remote, request.headers.get("Authorization"))
        if denied is not None:
            status, reason, text = denied
            raise _Refusal(status, reason, text, {"WWW-Authenticate": "Bearer"} if status == 401 else None)
        length = request.content_length
        if length is not None and length > self.limits.max_body:
            raise _Refusal(413, "too_large", f"the request body is over {self.limits.max_body} bytes")
        refused = await self._admission.acquire(name, self.limits.queue_timeout_s)
        if refused is not None:
            raise _Refusal(503, refused, "the gateway is busy, try again", {"Retry-After": "1"})
        try:
            target = "/" + rest + ("?" + query if has_query else "")
            return await self._proxy(request, name, route, target)
        finally:
            self._admission.release()

    async def _proxy(self, request: web.BaseRequest, name: str, route: Route, target: str) -> web.StreamResponse:
        assert self._session is not None
        lim = self.limits
        if request.headers.get("Expect", "").lower() == "100-continue" and request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        buffered, body = await self._read_ahead(request)
        headers = _upstream_headers(request, name, route)
        if body is not None and request.content_length is not None:
            headers["Content-Length"] = str(request.content_length)
        idempotent = request.method in IDEMPOTENT
        tried: set[str] = set()
        failed: str | None = None
        for _attempt in range(1 + lim.retries):
            replica = self.balancer.pick(name, self._now(), exclude=tried)
            if replica is None:
                break
            if tried:
                self.upstream["retries"] += 1
            tried.add(replica.key)
            self.balancer.started(replica.key)
            began = time.perf_counter()  # uvloop's clock moves in whole milliseconds: a fast answer read 0
            url = URL(f"http://{_hostport(replica)}{target}", encoded=True)
            data = body.chunks() if body is not None else buffered or None
            try:
                async with asyncio.timeout(lim.response_header_s):
                    upstream = await self._session.request(request.method, url, headers=headers, data=data,
                                                           allow_redirects=False)
            except BaseException as exc:
                if body is not None and (body.too_large or body.stalled):
                    self.balancer.finished(replica.key, self._now(), ok=True, latency_s=None)
                    if body.too_large:
                        raise _Refusal(413, "too_large", f"the request body is over {lim.max_body} bytes") from None
                    raise _Refusal(408, "body_timeout", "the request body stalled") from None
                if not isinstance(exc, Exception):  # cancelled: the client left, not the replica's fault
                    self.balancer.finished(replica.key, self._now(), ok=True, latency_s=None)
                    raise
                kind, sent = _classify(exc)
                self.balancer.finished(replica.key, self._now(), ok=False, latency_s=None)
                self.upstream[kind] += 1
                failed = kind
                log.debug("gateway.attempt_failed", service=name, replica=replica.key, kind=kind,
                          error=_plain(str(exc)))
                if not sent and (body is None or not body.started):
                    continue
                if sent and idempotent and body is None:
                    continue
                break
            return await self._relay(request, upstream, replica, began)
        if failed is None:
            raise _Refusal(503, "no_replica", f"no replica of {name} can take the request now",
                           {"Retry-After": "1"})
        if failed == "timeout":
            raise _Refusal(504, "upstream_timeout", "the service did not answer in time")
        raise _Refusal(502, f"upstream_{failed}", _FAILURE_TEXT[failed])

    async def _read_ahead(self, request: web.BaseRequest) -> tuple[bytes, _Body | None]:
        """(the whole body, None) when it fits ``retry_body``; else (b"", a ``_Body`` to stream)."""
        if not request.body_exists:
            return b"", None
        lim = self.limits
        length = request.content_length
        want = lim.retry_body + 1 if length is None or length > lim.retry_body else length
        parts: list[bytes] = []
        got = 0
        while got < want:
            try:
                async with asyncio.timeout(lim.idle_read_s):
                    chunk = await request.content.readany()
            except TimeoutError:
                raise _Refusal(408, "body_timeout", "the request body stalled") from None
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
            if got > lim.max_body:
                raise _Refusal(413, "too_large", f"the request body is over {lim.max_body} bytes")
        data = b"".join(parts)
        if got <= lim.retry_body and request.content.at_eof():
            return data, None
        return b"", _Body(request.content, data, lim)

    async def _relay(self, request: web.BaseRequest, upstream: aiohttp.ClientResponse, replica: Replica,
                     began: float) -> web.StreamResponse:
        """Stream ``upstream`` to the client; the balancer hears how it ended."""
        latency = time.perf_counter() - began
        ok = upstream.status < 500
        complete = False
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                      headers=_strip_hop_by_hop(upstream.headers))
        try:
            await response.prepare(request)
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    ok = False
                    kind = "stalled" if isinstance(exc, TimeoutError) else "broken"
                    self.upstream[kind] += 1
                    self._count(f"upstream_{kind}")
                    log.debug("gateway.stream_failed", replica=replica.key, kind=kind, error=_plain(str(exc)))
                    if request.transport is not None:
                        request.transport.close()  # cut short: the client sees an incomplete response
                    return response
                if not chunk:
                    break
                await response.write(chunk)
            await response.write_eof()
            complete = True
        except ConnectionError:
            pass  # the client left; the replica did nothing wrong
        finally:
            if complete:
                upstream.release()
            else:
                upstream.close()
            self.balancer.finished(replica.key, self._now(), ok=ok, latency_s=latency)
        return response


_FAILURE_TEXT: Final = {
    "connect": "no replica of the service could be reached",
    "reset": "the service closed the connection before answering",
    "garbage": "the service's answer was not HTTP",
    "timeout": "the service did not answer in time",
}


def _classify(exc: BaseException) -> tuple[str, bool]:
    """(kind of failure, whether the request may have been sent) for a failed attempt."""
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return "connect", False
    if isinstance(exc, TimeoutError):
        return "timeout", True
    if isinstance(exc, aiohttp.ClientResponseError):
        return "garbage", True
    return "reset", True


def _hostport(replica: Replica) -> str:
    return f"[{replica.address}]:{replica.port}" if ":" in replica.address else f"{replica.address}:{replica.port}"


def _connection_tokens(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> set[str]:
    return {token.strip().lower() for value in headers.getall("Connection", ()) for token in value.split(",")}


def _strip_hop_by_hop(headers: CIMultiDictProxy[str] | CIMultiDict[str],
                      also: frozenset[str] = frozenset()) -> CIMultiDict[str]:
    named = _connection_tokens(headers)
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in headers.items():
        low = key.lower()
        if low in HOP_BY_HOP or low.startswith("proxy-") or low in named or low in also:
            continue
        out.add(key, value)
    return out


def _upstream_headers(request: web.BaseRequest, name: str, route: Route) -> CIMultiDict[str]:
    headers = _strip_hop_by_hop(request.headers, NOT_FORWARDED | (
        frozenset({"authorization"}) if route.access == "token" else frozenset()))
    client = request.remote or "unknown"
    forwarded = request.headers.getall("X-Forwarded-For", ())
    headers.popall("X-Forwarded-For", None)
    headers["X-Forwarded-For"] = ", ".join([*forwarded, client])
    headers["X-Forwarded-Proto"] = request.scheme
    headers["X-Forwarded-Prefix"] = f"/{name}"
    if (host := request.headers.get("Host")) is not None:
        headers["X-Forwarded-Host"] = host
    return headers


def _plain(text: str, limit: int = MAX_ECHO) -> str:
    """``text`` fit for a plain-text error body or a log line: no control characters, bounded."""
    cleaned = "".join(ch for ch in text if ch.isprintable())
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 3] + "..."


def _text_response(status: int, text: str, headers: Mapping[str, str] | None = None) -> web.Response:
    response = web.Response(status=status, text=_plain(text) + "\n", content_type="text/plain", charset="utf-8",
                            headers=headers)
    return response


# -- the process -----------------------------------------------------------------------------------


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536 or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            raise argparse.ArgumentTypeError(f"{host!r} is not an IP address") from None
    return host, int(port)


PARENT_CHECK_S: Final = 1.0  # how often the gateway looks whether the daemon that started it is still there


async def _run(listen: tuple[str, int], socket_path: str, interval_s: float, parent: int | None = None) -> None:
    source = DaemonRoutes(socket_path)
    gateway = Gateway(source, interval_s=interval_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    parent = os.getppid() if parent is None else parent  # given: a daemon killed while we started is seen too

    async def orphaned() -> None:
        """A daemon killed outright (SIGKILL, a crash) sends no SIGTERM: the gateway then belongs
        to init, and goes, so that the daemon started again can bind the port anew."""
        while os.getppid() == parent:
            await asyncio.sleep(PARENT_CHECK_S)
        log.info("gateway.orphaned", parent=parent)
        stop.set()

    watch = asyncio.ensure_future(orphaned())
    try:
        address = await gateway.start(*listen)
        log.info("gateway.listening", address=f"{address[0]}:{address[1]}", daemon=socket_path)
        await stop.wait()
    finally:
        watch.cancel()
        await gateway.close()
        source.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swarmd.serve.gateway",
                                     description="Route http://LISTEN/NAME/... to the replicas of service NAME.")
    parser.add_argument("--listen", type=_listen, default=("127.0.0.1", 8080), metavar="HOST:PORT",
                        help="address to listen on (default 127.0.0.1:8080)")
    parser.add_argument("--daemon-socket", required=True, metavar="PATH", help="the daemon's control socket")
    parser.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                        help="how often to ask the daemon for the routes (default 1.0)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--parent", type=int, metavar="PID",
                        help="the daemon's pid: the gateway exits once it is no longer its parent")
    args = parser.parse_args(argv)
    if not 0.05 <= args.interval <= 3600:
        parser.error("--interval must be between 0.05 and 3600 seconds")
    import uvloop

    from .. import log as logs

    logs.configure(args.log_level)
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(_run(args.listen, args.daemon_socket, args.interval, args.parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
