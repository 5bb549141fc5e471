"""The console's HTTP side (asyncio, aiohttp: DESIGN's "asyncio belongs only in processes that
are asyncio by nature", as the gateway): the page, the JSON API it reads, live updates.

Theory of operation. `swarmctl console` runs this as the calling user, on loopback. Every
answer comes from the member's control socket through `swarmd.client.Swarm`, called off the
event loop (a thread per call, at most MAX_CALLS at once), as that user: the console can do
nothing its user could not do with swarmctl, and the daemon's access rules (read for anyone
who opens the socket; jobs, and only one's own, for its group) stay the only ones.

The API, ``/api/v1`` (openapi.py describes it; ``GET /api/v1/openapi.json``):
- ``GET swarm``: this member and every member it sees (state, capacity, labels, NAT class,
  record age, network coordinate) and the mesh's paths (direct, or via a relay);
- ``GET jobs``, ``GET jobs/{id}``: the caller's jobs and one job's detail (attempts,
  hand-overs, checkpoints); ``GET jobs/{id}/logs?tail=N``: its last N output lines;
  ``POST jobs/{id}/cancel``: cancel it (the daemon refuses another user's job);
- ``GET services``, ``GET services/{name}``: the registry and one service's replicas,
  traffic and scaling; ``POST services/{name}/scale`` ``{"replicas": N}``: a fixed count for
  one of the caller's services;
- ``GET node``: this daemon's status (sandbox, relay, gossip and routing counters);
- ``GET events``: server-sent events, one ``snapshot`` (swarm, jobs, services, node) every
  ``interval`` seconds when something changed, a comment every KEEPALIVE_S else;
- ``GET jobs/{id}/logs/follow``: server-sent events, one ``lines`` event per batch of
  output as the ranks write it, ``end`` when the job ended.
A part the caller may not read (jobs, for a user outside the daemon's group) is
``{"error": …}`` in a snapshot and a 403 on its own; a daemon that does not answer, a 502.

Rules (every client of the page's port is hostile until it shows the token):
- Authentication. The console's token (a random 256-bit string `swarmctl console` prints in
  its URL) is asked of every request but the page's login: ``GET /login?token=T`` sets it
  as an HttpOnly, SameSite=Strict cookie and redirects to the page; a script may send
  ``Authorization: Bearer T`` instead. Compared in constant time; a wrong or missing one is
  a 401 that says where the URL comes from. Another local user, who cannot read the
  terminal or the 0600 file the URL is in, cannot use the console.
- The Host header must name the console's own address (127.0.0.1, localhost or ::1 and its
  port): a page elsewhere that rebinds its DNS name to 127.0.0.1 gets a 421, not the API.
- A POST needs an Origin header naming the console (or none, with a bearer token): no other
  page can make a browser cancel a job (the SameSite cookie is the first fence, this the
  second).
- Every response says ``Content-Security-Policy: default-src 'none'`` with only the
  console's own script, style and connections allowed (nothing from elsewhere, no inline
  script), ``X-Content-Type-Options: nosniff``, ``Referrer-Policy: no-referrer`` and
  ``X-Frame-Options: DENY``; API answers are ``no-store``. The page writes what members and
  jobs say as text (`textContent`), never as markup: a label ``<img onerror=…>`` shows as
  those characters (the browser test sends one).
- Bounds. At most MAX_CALLS daemon calls at once (the rest wait their turn) and MAX_STREAMS
  event streams (beyond, a 503 with Retry-After); a request body over 64 KiB is a 413.
- Input. A job id is its alphabet, 1-12 characters (a unique prefix, as swarmctl takes); a
  service name a DNS label; ``tail`` 1-LOG_TAIL_MAX. Anything else is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import re
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

from aiohttp import web

from ..client import DaemonUnreachable, RemoteError, Swarm
from ..compute.ids import ALPHABET, LENGTH
from ..rpc.client import Client
from ..rpc.protocol import ErrorCode
from . import openapi

API: Final = "/api/v1"
COOKIE: Final = "swarmd_console"
STATIC: Final = Path(__file__).parent / "static"
FILES: Final = {"/": ("index.html", "text/html"), "/static/app.js": ("app.js", "text/javascript"),
                "/static/app.css": ("app.css", "text/css")}
MAX_CALLS: Final = 8  # daemon calls in flight at once (threads)
MAX_STREAMS: Final = 16  # event streams open at once (a page holds two: the snapshots, a job's output)
KEEPALIVE_S: Final = 15.0  # an idle event stream's comment: proxies and browsers keep it open
LOG_TAIL_MAX: Final = 2000
LOG_TAIL_DEFAULT: Final = 200
MAX_SCALE: Final = 256  # replicas a scale may ask for (the daemon bounds it again)
JOB_ID: Final = re.compile(f"[{ALPHABET}]{{1,{LENGTH}}}", re.ASCII)
SERVICE: Final = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", re.ASCII)
CSP: Final = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
              "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
# the control API has no "not found" code: its words for an unknown job or service say it
_NOT_FOUND: Final = re.compile(r"^[a-z.]+: no (job|service) '")
_STATUS = {ErrorCode.PERMISSION_DENIED: 403, ErrorCode.INVALID_PARAMS: 400, ErrorCode.METHOD_NOT_FOUND: 404,
           ErrorCode.BUSY: 503, ErrorCode.OPERATION_FAILED: 409}

TOKEN_KEY: Final = web.AppKey("token", str)
DAEMON_KEY: Final = web.AppKey("daemon", "Daemon")
ORIGINS_KEY: Final = web.AppKey("origins", set)
PORT_KEY: Final = web.AppKey("port", int)
INTERVAL_KEY: Final = web.AppKey("interval", float)


class Daemon:
    """The member's control socket, for the event loop: each call in a thread (the client is
    blocking and import-light), at most MAX_CALLS at once."""

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm
        self._calls = asyncio.Semaphore(MAX_CALLS)
        self.streams = 0  # open now (MAX_STREAMS)

    async def call(self, method: str, **params: Any) -> Any:
        async with self._calls:
            return await asyncio.to_thread(self.swarm.call, method, **params)

    async def tail(self, job: str, n: int) -> tuple[list[list[Any]], bool]:
        """The last ``n`` lines of the job's output, and whether there were more."""
        def read() -> tuple[list[list[Any]], bool]:
            kept: deque[list[Any]] = deque(maxlen=n)
            seen = 0
            for line in self.swarm.logs(job):
                kept.append([line.rank, line.text])
                seen += 1
            return list(kept), seen > n

        async with self._calls:
            return await asyncio.to_thread(read)

    def follow(self, job: str) -> Follow:
        return Follow(self.swarm.socket, job)


class Follow:
    """A job's output as it is written, read by a thread from its own connection, handed to
    the event loop in batches; ``close`` ends it from the loop's side (it shuts the socket the
    thread waits on)."""

    def __init__(self, socket: str, job: str) -> None:
        self._client = Client(socket, timeout=None)
        self._job = job
        self._queue: asyncio.Queue[list[list[Any]] | BaseException | None] = asyncio.Queue(maxsize=64)
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=f"console-follow-{job}", daemon=True)
        self._closed = False
        self._thread.start()

    def _put(self, item: list[list[Any]] | BaseException | None) -> None:
        if not self._closed:
            asyncio.run_coroutine_threadsafe(self._queue.put(item), self._loop).result()

    def _run(self) -> None:
        try:
            for event in self._client.stream("jobs.logs", id=self._job, follow=True):
                if event.get("out"):
                    self._put([[int(r), t] for r, t in event["out"]])
            self._put(None)
        except BaseException as exc:  # noqa: BLE001 - told to the loop, which decides
            if not self._closed:
                self._put(exc)

    async def next(self) -> list[list[Any]] | None:
        """The next batch; None when the job ended. Raises what the stream raised."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._closed = True
        self._client.shutdown()
        while not self._queue.empty():  # a thread blocked on a full queue goes on, and ends
            self._queue.get_nowait()


def make_app(swarm: Swarm, token: str, *, port: int, interval: float = 1.0) -> web.Application:
    """The console for ``swarm``, served on 127.0.0.1/localhost/::1 at ``port``."""
    if len(token) < 16:
        raise ValueError("the console's token must be at least 16 characters")
    app = web.Application(middlewares=[_guard], client_max_size=64 * 1024)
    app[TOKEN_KEY] = token
    app[DAEMON_KEY] = Daemon(swarm)
    app[ORIGINS_KEY] = {f"http://{host}:{port}" for host in ("127.0.0.1", "localhost", "[::1]")}
    app[PORT_KEY] = port
    app[INTERVAL_KEY] = interval
    app.router.add_get("/login", _login)
    for path in FILES:
        app.router.add_get(path, _file)
    app.router.add_get(f"{API}/openapi.json", _openapi)
    app.router.add_get(f"{API}/swarm", _json(_swarm))
    app.router.add_get(f"{API}/jobs", _json(_jobs))
    app.router.add_get(f"{API}/jobs/{{id}}", _json(_job))
    app.router.add_get(f"{API}/jobs/{{id}}/logs", _json(_logs))
    app.router.add_get(f"{API}/jobs/{{id}}/logs/follow", _follow)
    app.router.add_post(f"{API}/jobs/{{id}}/cancel", _json(_cancel))
    app.router.add_get(f"{API}/services", _json(_services))
    app.router.add_get(f"{API}/services/{{name}}", _json(_service))
    app.router.add_post(f"{API}/services/{{name}}/scale", _json(_scale))
    app.router.add_get(f"{API}/node", _json(_node))
    app.router.add_get(f"{API}/events", _events)
    return app


# --- the guard: host, token, origin, headers -----------------------------------------------

def _host_ok(request: web.Request, port: int) -> bool:
    host, sep, got = (request.host or "").rpartition(":")
    if not sep or got != str(port):
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _token_of(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return auth[len("Bearer "):].strip()
    return request.cookies.get(COOKIE)


@web.middleware
async def _guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                 ) -> web.StreamResponse:
    app = request.app
    port = app[PORT_KEY]
    if not _host_ok(request, port):
        response: web.StreamResponse = _error(421, "this console answers only on its own loopback address "
                                                   f"(127.0.0.1:{port}, localhost:{port})")
    elif request.path != "/login" and not _valid(app[TOKEN_KEY], _token_of(request)):
        response = _error(401, "no console token: open the URL `swarmctl console --url` prints")
    elif request.method not in ("GET", "HEAD") and not _same_origin(request):
        response = _error(403, "a change needs a request from the console's own page (its Origin header)")
    else:
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            response = exc
    response.headers.setdefault("Content-Security-Policy", CSP)
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("Referrer-Policy", "no-referrer")
    response.headers.setdefault("X-Frame-Options", "DENY")
    if request.path.startswith(API):
        response.headers.setdefault("Cache-Control", "no-store")
    return response


def _valid(token: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(token.encode(), given.encode(errors="replace"))


def _same_origin(request: web.Request) -> bool:
    origin = request.headers.get("Origin")
    if origin is None:  # not a browser's page: a script with the bearer token
        return request.headers.get("Authorization", "").startswith("Bearer ")
    return origin in request.app[ORIGINS_KEY]


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _login(request: web.Request) -> web.StreamResponse:
    if not _valid(request.app[TOKEN_KEY], request.query.get("token")):
        return _error(401, "a wrong or missing token: open the URL `swarmctl console --url` prints")
    response = web.HTTPSeeOther("/")
    response.set_cookie(COOKIE, request.app[TOKEN_KEY], httponly=True, samesite="Strict", path="/")
    return response


async def _file(request: web.Request) -> web.StreamResponse:
    name, kind = FILES[request.path]
    return web.Response(body=(STATIC / name).read_bytes(), content_type=kind, charset="utf-8")


async def _openapi(request: web.Request) -> web.StreamResponse:
    return web.json_response(openapi.SPEC)


# --- the API ----------------------------------------------------------------------------

Handler = Callable[[web.Request, Daemon], Awaitable[Any]]


def _json(handler: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A handler's result as JSON; the daemon's refusals as their HTTP statuses."""
    async def answer(request: web.Request) -> web.StreamResponse:
        try:
            return web.json_response(await handler(request, request.app[DAEMON_KEY]))
        except RemoteError as exc:
            return _refused(exc)
        except DaemonUnreachable as exc:
            return _error(502, str(exc))
    return answer


def _refused(exc: RemoteError) -> web.Response:
    status = 404 if _NOT_FOUND.search(exc.message) else _STATUS.get(exc.code, 502)
    return _error(status, exc.message)


def _job_id(request: web.Request) -> str:
    job = request.match_info["id"]
    if not JOB_ID.fullmatch(job):
        raise _bad(f"a job id is 1-{LENGTH} characters of {ALPHABET}")
    return job


async def _swarm(request: web.Request, daemon: Daemon) -> dict[str, Any]:
    return await swarm_part(daemon)


async def swarm_part(daemon: Daemon) -> dict[str, Any]:
    peers = await daemon.call("peers")
    try:
        mesh = await daemon.call("mesh")
        paths = {row["peer"]: {"path": row.get("path"), "relay": row.get("relay"), "rtt_ms": row.get("path_rtt_ms")}
                 for row in mesh.get("peers", []) if row.get("peer")}
    except RemoteError:  # the mesh is off: no paths to draw
        paths = {}
    return {"swarm": peers.get("swarm"), "me": peers.get("me"), "members": peers["peers"], "paths": paths}


async def _jobs(request: web.Request, daemon: Daemon) -> dict[str, Any]:
    return await daemon.call("jobs.ls", limit=100)


async def _job(request: web.Request, daemon: Daemon) -> dict[str, Any]:
    return await daemon.call("jobs.show", id=_job_id(request))


async def _logs(request: web.Request, daemon: Daemon) -> dict[str, Any]:
    job = _job_id(request)
    raw = request.query.get("tail", str(LOG_TAIL_DEFAULT))
    if not raw.isdigit() or not 1 <= int(raw) <= LOG_TAIL_MAX:
        raise _bad(f"tail must be 1-{LOG_TAIL_MAX}")
    lines, more = await daemon.tail(job, int(raw))
    return {"id": job, "lines": lines, "truncated": more}


async def _cancel(request: web.Request, daemon: Daemon) -> dict[str, Any]:
    return await daemon.call("jobs.cancel", id=_job_id(request))


async def _services(request: web.Request, daemon: Daemon) -> dict[str, Any]:
    return await daemon.call("serve.ls")


def _service_name(request: web.Request) -> str:
    name = request.match_info["name"]
    if not SERVICE.fullmatch(name):
        raise _bad("a service name is a DNS label: a-z, 0-9 and -")
    return name


async def _service(request: web.Request, daemon: Daemon) -> dict[str, Any]:
    return await daemon.call("serve.show", name=_service_name(request))


async def _scale(request: web.Request, daemon: Daemon) -> dict[str, Any]:
    """``{"replicas": N}``: a fixed count for one of the caller's services (autoscaling off)."""
    name = _service_name(request)
    try:
        body = await request.json()
    except ValueError:
        raise _bad("the body must be JSON: {\"replicas\": N}") from None
    replicas = body.get("replicas") if isinstance(body, dict) else None
    if isinstance(replicas, float) and replicas.is_integer():  # 3.0 is JSON Schema's integer too
        replicas = int(replicas)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 0 <= replicas <= MAX_SCALE:
        raise _bad(f"replicas must be a whole number 0-{MAX_SCALE}")
    return await daemon.call("serve.scale", name=name, replicas=replicas)


def _bad(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps({"error": message}), content_type="application/json")


async def _node(request: web.Request, daemon: Daemon) -> dict[str, Any]:
    return await daemon.call("status")


# --- live updates -----------------------------------------------------------------------

async def snapshot(daemon: Daemon) -> dict[str, Any]:
    """Everything the page shows but a job's output; a part the daemon refused or could not
    give is ``{"error": …}`` (a user outside the jobs group still sees the swarm)."""
    async def part(make: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await make()
        except (RemoteError, DaemonUnreachable) as exc:
            return {"error": getattr(exc, "message", None) or str(exc)}

    swarm, jobs, services, node = await asyncio.gather(
        part(lambda: swarm_part(daemon)), part(lambda: daemon.call("jobs.ls", limit=100)),
        part(lambda: daemon.call("serve.ls")), part(lambda: daemon.call("status")))
    return {"swarm": swarm, "jobs": jobs, "services": services, "node": node}


def _sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _streams_full(daemon: Daemon) -> web.Response | None:
    if daemon.streams < MAX_STREAMS:
        return None
    response = _error(503, f"{MAX_STREAMS} event streams are open already: close a page")
    response.headers["Retry-After"] = "5"
    return response


async def _open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                           "Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff"})
    await response.prepare(request)
    return response


async def _events(request: web.Request) -> web.StreamResponse:
    """A snapshot at once, then one whenever it changed (checked every `interval` seconds).
    `node` changes every time (uptime, counters): the page draws it over time."""
    daemon, interval = request.app[DAEMON_KEY], request.app[INTERVAL_KEY]
    if (full := _streams_full(daemon)) is not None:
        return full
    daemon.streams += 1
    try:
        response = await _open_stream(request)
        last, quiet_since = b"", time.monotonic()
        while True:
            data = _sse("snapshot", await snapshot(daemon))
            if data != last:
                await response.write(data)
                last, quiet_since = data, time.monotonic()
            elif time.monotonic() - quiet_since > KEEPALIVE_S:
                await response.write(b": still here\n\n")
                quiet_since = time.monotonic()
            await asyncio.sleep(interval)
    finally:
        daemon.streams -= 1


async def _follow(request: web.Request) -> web.StreamResponse:
    job = _job_id(request)
    daemon = request.app[DAEMON_KEY]
    try:
        await daemon.call("jobs.show", id=job)  # refused here, as a status, not inside the stream
    except RemoteError as exc:
        return _refused(exc)
    if (full := _streams_full(daemon)) is not None:
        return full
    daemon.streams += 1
    follow = None
    try:
        response = await _open_stream(request)
        follow = daemon.follow(job)
        while (batch := await follow.next()) is not None:
            await response.write(_sse("lines", batch))
        await response.write(_sse("end", {"id": job}))
    except (RemoteError, DaemonUnreachable) as exc:
        await response.write(_sse("error", {"error": getattr(exc, "message", None) or str(exc)}))
    finally:
        daemon.streams -= 1
        if follow is not None:
            follow.close()
    return response
