"""The gateway (swarmd/serve/gateway.py) against real HTTP servers on loopback: routing, streaming,
retries, ejection, the bounds a hostile client or replica meets, access, and the daemon's socket.

Each test is an asyncio program run by ``asyncio.run`` (the suite's plugin is pytest-trio)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import random
import socket
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from swarmd.rpc.framing import NOT_YET, FrameDecoder, encode_frame
from swarmd.serve.balance import Balancer
from swarmd.serve.gateway import (DaemonRoutes, Gateway, Limits, Route, TableError, check_access, is_loopback,
                                  parse_table)

TEST_TIMEOUT = 20.0


def aio(fn):
    """Run the async test body in a fresh asyncio loop, bounded in time."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        async def bounded():
            async with asyncio.timeout(TEST_TIMEOUT):
                return await fn(*args, **kwargs)

        return asyncio.run(bounded())

    return run


async def until(predicate, timeout: float, what: str, interval: float = 0.01):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := predicate()):
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)
    return value


# -- replicas ------------------------------------------------------------------------------------


class Upstream:
    """A real aiohttp server standing in for a replica. Paths: ``/slow`` waits for ``release``,
    ``/sse`` sends 5 events 200 ms apart, ``/fail`` is a 500, ``/stall`` sends a chunk and stalls,
    ``/healthz`` is ``health_status``; anything else echoes the request as JSON. ``hang``: never
    answers anything."""

    def __init__(self, name: str, rtt: float | None = 1.0, *, hang: bool = False) -> None:
        self.name, self.rtt, self.hang = name, rtt, hang
        self.port = 0
        self.seen: list[dict[str, Any]] = []
        self.release = asyncio.Event()
        self.waiting = 0
        self.sent: list[float] = []
        self.health_status = 200
        self._runner: web.ServerRunner | None = None

    @property
    def key(self) -> str:
        return f"{self.name}/llm/0"

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        self.seen.append({"path": request.raw_path, "headers": dict(request.headers), "body": body,
                          "method": request.method})
        if self.hang:
            await asyncio.Event().wait()
        if request.path == "/healthz":
            return web.Response(status=self.health_status, text="health")
        if request.path == "/slow":
            self.waiting += 1
            await self.release.wait()
        if request.path == "/fail":
            return web.Response(status=500, text="boom")
        if request.path in ("/sse", "/stall"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for i in range(5 if request.path == "/sse" else 1):
                if i:
                    await asyncio.sleep(0.2)  # the replica's pace: what the test measures
                await response.write(f"data: {i}\n\n".encode())
                self.sent.append(asyncio.get_running_loop().time())
            if request.path == "/stall":
                await asyncio.Event().wait()
            await response.write_eof()
            return response
        return web.json_response(
            {"replica": self.name, "path": request.raw_path, "headers": dict(request.headers), "length": len(body),
             "sha256": hashlib.sha256(body).hexdigest()},
            headers={"X-Replica": self.name, "Proxy-Foo": "hop", "Keep-Alive": "timeout=99"})

    async def start(self) -> None:
        self._runner = web.ServerRunner(web.Server(self.handle, access_log=None, handler_cancellation=True),
                                       shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def close(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()


class Garbage(Upstream):
    """Answers every request with bytes that are not HTTP."""

    def __init__(self, name: str, rtt: float | None = 1.0) -> None:
        super().__init__(name, rtt)
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            await reader.read(65536)
            writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\x00\x01garbage\r\n\r\n")
            await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()
            self._writers.discard(writer)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class Dead(Upstream):
    """A port nothing listens on."""

    async def start(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]

    async def close(self) -> None:
        pass


def service_table(upstreams, *, name: str = "llm", access: str = "public", token_sha256: str | None = None):
    return {"services": {name: {"access": access, "token_sha256": token_sha256, "replicas": [
        {"key": u.key, "host": u.name, "address": "127.0.0.1", "port": u.port, "rtt_ms": u.rtt, "healthy": True,
         "health": "/healthz"} for u in upstreams]}}}


class Routes:
    """A route source whose table a test can change; it records the stats it was sent."""

    def __init__(self, table) -> None:
        self.table = table
        self.stats: list[dict[str, Any]] = []

    async def __call__(self, stats):
        self.stats.append(stats)
        return self.table


@contextlib.asynccontextmanager
async def lab(*upstreams: Upstream, limits: Limits | None = None, balancer: Balancer | None = None,
              table_kw: dict[str, Any] | None = None):
    for u in upstreams:
        await u.start()
    routes = Routes(service_table(upstreams, **(table_kw or {})))
    gateway = Gateway(routes, limits=limits or Limits.local(), balancer=balancer or Balancer(random.Random(1)),
                      interval_s=0.1)
    try:
        address = await gateway.start("127.0.0.1", 0)
        async with aiohttp.ClientSession(f"http://127.0.0.1:{address[1]}") as client:
            yield SimpleNamespace(gateway=gateway, client=client, routes=routes, address=address)
    finally:
        await gateway.close()
        for u in upstreams:
            await u.close()


async def get(client: aiohttp.ClientSession, path: str, **kw) -> tuple[int, Any, Any]:
    async with client.get(path, **kw) as response:
        text = await response.text()
        try:
            body = json.loads(text)
        except ValueError:
            body = text
        return response.status, body, response.headers


# -- routing -------------------------------------------------------------------------------------


@aio
async def test_a_get_reaches_a_replica_without_the_prefix_and_hop_by_hop_headers():
    a = Upstream("a")
    async with lab(a) as t:
        status, body, headers = await get(t.client, "/llm/v1/models?x=1&y=%20", headers={
            "Connection": "keep-alive, X-Secret", "X-Secret": "s", "Keep-Alive": "timeout=5",
            "Proxy-Authorization": "Basic eA==", "TE": "trailers", "X-Forwarded-For": "192.0.2.7",
            "X-Forwarded-Prefix": "/evil", "Authorization": "Bearer app-level"})
        assert status == 200 and body["replica"] == "a"
        assert body["path"] == "/v1/models?x=1&y=%20"
        seen = {k.lower(): v for k, v in body["headers"].items()}
        assert seen["x-forwarded-prefix"] == "/llm"
        assert seen["x-forwarded-for"] == "192.0.2.7, 127.0.0.1"
        assert seen["x-forwarded-proto"] == "http"
        assert seen["host"] == f"127.0.0.1:{a.port}"
        assert seen["authorization"] == "Bearer app-level"  # public: the replica's own business
        assert not {"x-secret", "keep-alive", "proxy-authorization", "te"} & set(seen)
        assert headers["X-Replica"] == "a" and "Proxy-Foo" not in headers and "Keep-Alive" not in headers
        status, body, _ = await get(t.client, "/llm")
        assert (status, body["path"]) == (200, "/")


@aio
async def test_unknown_services_and_bad_names_are_404():
    async with lab(Upstream("a")) as t:
        status, body, _ = await get(t.client, "/nope/x")
        assert status == 404 and "no service named nope" in body
        for path in ("/LLM/x", "/-llm/x", "/l_m/x", "/%6c%6c%6d/x", "/" + "a" * 64 + "/"):
            status, body, headers = await get(t.client, URL(path, encoded=True))  # sent as written
            assert status == 404 and "not a service name" in body and headers["Content-Type"].startswith("text/plain")
        status, body, headers = await get(t.client, "/llm/x", headers={"X-Big": "b" * 9000})
        assert status == 400 and headers["Content-Type"].startswith("text/plain")  # aiohttp's line limit
        assert t.gateway.stats()["refused"] == {"unknown_service": 1, "bad_name": 5}
        t.routes.table = {"services": {"llm": {"access": "public", "token_sha256": None, "replicas": []},
                                       "sick": service_table([Upstream("s")])["services"]["llm"]}}
        t.routes.table["services"]["sick"]["replicas"][0]["healthy"] = False
        await t.gateway.refresh()
        for path in ("/llm/x", "/sick/x"):
            status, body, headers = await get(t.client, path)
            assert (status, headers["Retry-After"]) == (503, "1") and "no replica" in body


@aio
async def test_requests_spread_over_two_equally_near_replicas():
    a, b = Upstream("a", 1.0), Upstream("b", 1.1)
    async with lab(a, b) as t:
        tasks = [asyncio.create_task(get(t.client, "/llm/slow")) for _ in range(20)]
        await until(lambda: a.waiting + b.waiting == 20, 5, "20 requests at the replicas")
        assert (a.waiting, b.waiting) == (10, 10)  # two choices on in-flight between two: level
        a.release.set()
        b.release.set()
        assert [s for s, _, _ in await asyncio.gather(*tasks)] == [200] * 20


@aio
async def test_the_nearer_replica_gets_the_traffic_when_both_are_idle():
    near, far = Upstream("near", 1.0), Upstream("far", 40.0)
    async with lab(near, far) as t:
        replicas = [(await get(t.client, "/llm/x"))[1]["replica"] for _ in range(10)]
        assert replicas == ["near"] * 10


@aio
async def test_server_sent_events_arrive_one_by_one():
    a = Upstream("a")
    async with lab(a) as t:
        loop = asyncio.get_running_loop()
        arrivals, buffer = [], b""
        async with t.client.get("/llm/sse") as response:
            assert response.headers["Content-Type"] == "text/event-stream"
            async for chunk in response.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    arrivals.append((loop.time(), event))
        assert [e for _, e in arrivals] == [f"data: {i}".encode() for i in range(5)]
        assert arrivals[0][0] < a.sent[-1] - 0.5  # the first event came 0.8 s before the last was sent
        assert all(abs(t_arrived - t_sent) < 0.15 for (t_arrived, _), t_sent in zip(arrivals, a.sent, strict=True))


# -- failures and retries ------------------------------------------------------------------------


@aio
async def test_a_dead_replica_is_retried_on_the_other_with_no_failed_request():
    dead, live = Dead("dead", 1.0), Upstream("live", 30.0)
    async with lab(dead, live, limits=Limits.local(retry_body=1000),
                   balancer=Balancer(random.Random(1), consecutive_failures=3)) as t:
        async with t.client.post("/llm/x", data=b"y" * 5000) as response:  # streamed, but not read yet
            assert (response.status, (await response.json())["length"]) == (200, 5000)
        statuses = [(await get(t.client, "/llm/x"))[0] for _ in range(5)]
        async with t.client.post("/llm/x", data=b"not idempotent, but never sent") as response:
            statuses.append(response.status)
        assert statuses == [200] * 6
        stats = t.gateway.stats()
        assert stats["upstream"]["connect"] == 3 and stats["upstream"]["retries"] == 3
        assert t.gateway.balancer.ejected(asyncio.get_running_loop().time()) == {dead.key}


@aio
async def test_a_replica_that_hangs_is_a_504_in_time_and_gets_are_retried_elsewhere():
    hung = Upstream("hung", 1.0, hang=True)
    async with lab(hung) as t:
        loop = asyncio.get_running_loop()
        began = loop.time()
        status, body, _ = await get(t.client, "/llm/x")
        assert status == 504 and "did not answer in time" in body
        assert 0.9 < loop.time() - began < 2.0  # response_header_s is 1 s in Limits.local()
    hung, live = Upstream("hung", 1.0, hang=True), Upstream("live", 30.0)
    async with lab(hung, live, balancer=Balancer(random.Random(1), consecutive_failures=10)) as t:
        status, body, _ = await get(t.client, "/llm/x")
        assert (status, body["replica"]) == (200, "live")
        async with t.client.post("/llm/x", data=b"{}") as response:
            assert response.status == 504  # it may have been acted on: not retried
        assert t.gateway.stats()["refused"] == {"upstream_timeout": 1}


@aio
async def test_a_replica_speaking_garbage_is_a_502_and_gets_ejected():
    junk = Garbage("junk")
    async with lab(junk, balancer=Balancer(random.Random(1), consecutive_failures=3)) as t:
        now = asyncio.get_running_loop().time
        for i in range(3):
            status, body, _ = await get(t.client, "/llm/x")
            assert status == 502 and "not HTTP" in body
            assert t.gateway.balancer.ejected(now()) == (set() if i < 2 else {junk.key})
        assert (await get(t.client, "/llm/x"))[0] == 502  # panic mode: still tried rather than 503
        stats = t.gateway.stats()
        assert stats["services"]["llm"]["panics"] == 1 and stats["upstream"]["garbage"] == 4
        await until(lambda: t.gateway.upstream["health_failed"], 3, "a failed health check")  # garbage again
        assert junk.key in t.gateway.balancer.ejected(now())


@aio
async def test_an_ejected_replica_is_readmitted_by_its_health_check():
    a = Upstream("a")
    a.health_status = 503
    async with lab(a, balancer=Balancer(random.Random(1), consecutive_failures=2)) as t:
        now = asyncio.get_running_loop().time
        assert [(await get(t.client, "/llm/fail"))[0] for _ in range(2)] == [500, 500]  # passed on, counted
        assert t.gateway.balancer.ejected(now()) == {a.key}
        await until(lambda: t.gateway.upstream["health_failed"] >= 2, 3, "health checks failing")
        assert t.gateway.balancer.ejected(now()) == {a.key}
        a.health_status = 200
        await until(lambda: not t.gateway.balancer.ejected(now()), 3, "the readmission")
        assert [s["path"] for s in a.seen].count("/healthz") >= 3


@aio
async def test_a_replica_that_stalls_mid_stream_cuts_the_client_response_short():
    a = Upstream("a")
    async with lab(a, balancer=Balancer(random.Random(1), consecutive_failures=1)) as t:
        got = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async with t.client.get("/llm/stall") as response:
                assert response.status == 200
                async for chunk in response.content.iter_any():
                    got += chunk
        assert got == b"data: 0\n\n"
        assert t.gateway.stats()["refused"] == {"upstream_stalled": 1}
        assert t.gateway.balancer.ejected(asyncio.get_running_loop().time()) == {a.key}


# -- bounds --------------------------------------------------------------------------------------


@aio
async def test_bodies_buffered_streamed_and_too_large():
    a = Upstream("a")
    async with lab(a, limits=Limits.local(max_body=100_000, retry_body=10_000)) as t:
        small, large = random.Random(3).randbytes(5000), random.Random(4).randbytes(60_000)
        for data in (small, large):
            async with t.client.put("/llm/up", data=data) as response:
                body = await response.json()
            assert (body["length"], body["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())

        async def chunks(n: int, size: int = 8000):
            for _ in range(n):
                yield b"x" * size

        async with t.client.post("/llm/up", data=chunks(5)) as response:  # chunked, streamed
            assert (await response.json())["length"] == 40_000
        async with t.client.post("/llm/up", data=b"x" * 50_000, expect100=True) as response:
            assert (await response.json())["length"] == 50_000
        async with t.client.post("/llm/up", data=b"x" * 100_001) as response:
            assert response.status == 413  # told by Content-Length, refused before reading
        async with t.client.post("/llm/up", data=chunks(20)) as response:
            assert response.status == 413  # counted while streaming
        assert t.gateway.stats()["refused"] == {"too_large": 2}


@aio
async def test_the_concurrency_bound_is_a_503_with_retry_after():
    a = Upstream("a")
    async with lab(a, limits=Limits.local(max_concurrent=1, max_queued=1)) as t:
        first = asyncio.create_task(get(t.client, "/llm/slow"))
        await until(lambda: a.waiting == 1, 5, "the first request at the replica")
        second = asyncio.create_task(get(t.client, "/llm/x"))  # waits in the service's queue
        await until(lambda: t.gateway.stats()["gateway"]["queued"] == 1, 5, "the second request queued")
        status, body, headers = await get(t.client, "/llm/x")
        assert (status, headers["Retry-After"]) == (503, "1") and "busy" in body
        a.release.set()
        assert (await first)[0] == 200 and (await second)[0] == 200
        assert t.gateway.stats()["refused"] == {"overloaded": 1}
        gateway = t.gateway.stats()["gateway"]
        assert (gateway["in_flight"], gateway["queued"], gateway["connections"]) == (0, 0, 3)  # 3 kept alive


@aio
async def test_a_slow_header_client_is_cut_off_while_others_are_served():
    a = Upstream("a")
    async with lab(a) as t:  # client_header_s is 1 s in Limits.local()
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_connection(*t.address)
        head = b"GET /llm/x HTTP/1.1\r\nHost: gateway\r\nUser-Agent: slowloris\r\n\r\n"
        began, sent, closed_at, other = loop.time(), 0, None, None
        try:
            for byte in head:
                writer.write(bytes([byte]))
                sent += 1
                if other is None:
                    other = asyncio.create_task(get(t.client, "/llm/x"))
                try:
                    data = await asyncio.wait_for(reader.read(1024), 1.0)  # a byte a second
                except TimeoutError:
                    continue
                if not data:
                    closed_at = loop.time()
                    break
        except ConnectionError:
            closed_at = loop.time()
        finally:
            writer.close()
        assert closed_at is not None and closed_at - began < 2.5 and sent < len(head)
        assert (await other)[0] == 200


@aio
async def test_client_connections_beyond_the_cap_are_closed():
    async with lab(Upstream("a"), limits=Limits.local(max_connections=2)) as t:
        held = [await asyncio.open_connection(*t.address) for _ in range(2)]
        reader, writer = await asyncio.open_connection(*t.address)
        assert await asyncio.wait_for(reader.read(), 2) == b""
        writer.close()
        assert t.gateway.stats()["refused"] == {"too_many_connections": 1}
        for _, w in held:
            w.close()


# -- access --------------------------------------------------------------------------------------


@aio
async def test_token_access():
    token = "s3cret-token"
    a = Upstream("a")
    async with lab(a, table_kw={"access": "token", "token_sha256": hashlib.sha256(token.encode()).hexdigest()}) as t:
        status, body, headers = await get(t.client, "/llm/x")
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
        assert (await get(t.client, "/llm/x", headers={"Authorization": "Bearer wrong"}))[0] == 403
        assert (await get(t.client, "/llm/x", headers={"Authorization": "Basic czNjcmV0"}))[0] == 401
        status, body, _ = await get(t.client, "/llm/x", headers={"Authorization": f"Bearer {token}"})
        assert status == 200
        assert "authorization" not in {k.lower() for k in body["headers"]}  # the gateway's token stays here
        assert t.gateway.stats()["refused"] == {"no_token": 2, "bad_token": 1}


@aio
async def test_members_only_is_served_on_loopback_only():
    async with lab(Upstream("a"), table_kw={"access": "members"}) as t:
        assert (await get(t.client, "/llm/x"))[0] == 200  # from 127.0.0.1
    members = Route(access="members", token_sha256=None)
    for remote in ("127.0.0.1", "127.3.4.5", "::1", "::ffff:127.0.0.1"):
        assert is_loopback(remote) and check_access(members, remote, None) is None
    for remote in ("10.0.0.2", "192.0.2.1", "::ffff:10.0.0.2", "fe80::1%eth0", "", None, "nonsense"):
        assert check_access(members, remote, None) == (403, "members_only", "this service is for members of the swarm")
    assert check_access(Route(access="public", token_sha256=None), "203.0.113.9", None) is None
    assert check_access(Route(access="token", token_sha256=None), "127.0.0.1", "Bearer x")[0] == 403  # fails closed


# -- the table -----------------------------------------------------------------------------------


def test_parse_table_drops_what_is_malformed():
    good = {"key": "p/llm/0", "host": "p", "address": "10.1.0.2", "port": 8000, "rtt_ms": 3, "healthy": True,
            "health": "/ready"}
    bad = [{**good, "port": 0}, {**good, "port": True}, {**good, "address": "not-an-ip"},
           {**good, "address": "0.0.0.0"}, {**good, "rtt_ms": float("nan")}, {**good, "healthy": "yes"},
           {**good, "key": ""}, {**good, "key": "x\n"}, "junk"]
    table = parse_table({"services": {
        "llm": {"access": "public", "token_sha256": None, "replicas": [good, {**good, "key": "q", "health": "x y"},
                                                                      *bad]},
        "Bad": {"access": "public", "token_sha256": None, "replicas": []},
        "tok": {"access": "token", "token_sha256": None, "replicas": []},
        "acc": {"access": "everyone", "token_sha256": None, "replicas": []},
        "lst": {"access": "public", "token_sha256": None, "replicas": "many"},
    }})
    assert list(table.routes) == ["llm"]
    assert [r.key for r in table.replicas] == ["p/llm/0", "q"]
    assert table.health == {"p/llm/0": "/ready", "q": "/healthz"}
    assert table.invalid == len(bad) + 4
    with pytest.raises(TableError):
        parse_table({"nope": 1})


class FakeDaemon:
    """A unix-socket server speaking the control socket's frames, answering ``serve.gateway``."""

    def __init__(self, path: str, table) -> None:
        self.path, self.table = path, table
        self.calls: list[dict[str, Any]] = []
        self.error: str | None = None
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        decoder = FrameDecoder()
        try:
            while data := await reader.read(65536):
                decoder.feed(data)
                while (message := decoder.next_message()) is not NOT_YET:
                    self.calls.append(message)
                    if self.error is not None:
                        reply = {"id": message["id"], "error": {"code": -32601, "message": self.error}, "final": True}
                    else:
                        reply = {"id": message["id"], "result": self.table, "final": True}
                    writer.write(encode_frame(reply))
        except ConnectionError:
            pass
        finally:
            writer.close()
            self._writers.discard(writer)

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, self.path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            await self._server.wait_closed()
            self._server = None


@aio
async def test_the_daemon_route_source(tmp_path):
    a = Upstream("a")
    await a.start()
    daemon = FakeDaemon(str(tmp_path / "swarmd.sock"), service_table([a]))
    await daemon.start()
    source = DaemonRoutes(daemon.path, timeout_s=1.0)
    gateway = Gateway(source, limits=Limits.local(), interval_s=0.05)
    try:
        address = await gateway.start("127.0.0.1", 0)
        async with aiohttp.ClientSession(f"http://127.0.0.1:{address[1]}") as client:
            status, body, _ = await get(client, "/llm/v1?q=1")
            assert (status, body["replica"], body["path"]) == (200, "a", "/v1?q=1")
            await get(client, "/nope/")
            await until(lambda: any(c["params"]["stats"].get("refused", {}).get("unknown_service")
                                    for c in daemon.calls), 3, "the refusal reported to the daemon")
            call = daemon.calls[-1]
            assert call["method"] == "serve.gateway" and isinstance(call["id"], int)
            stats = call["params"]["stats"]
            assert stats["services"]["llm"]["replicas"][a.key]["requests"] == 1
            daemon.error = "no such method"
            await until(lambda: gateway.stats()["table"]["errors"] >= 1, 3, "the refused call counted")
            daemon.error = None
            await daemon.stop()  # gone: the last table stays
            errors = gateway.stats()["table"]["errors"]
            await until(lambda: gateway.stats()["table"]["errors"] >= errors + 2, 3, "failed polls")
            assert (await get(client, "/llm/x"))[0] == 200
            await daemon.start()
            daemon.table = {"services": {}}
            await until(lambda: not gateway.stats()["services"], 3, "the new, empty table")
            assert (await get(client, "/llm/x"))[0] == 404
    finally:
        await gateway.close()
        source.close()
        await daemon.stop()
        await a.close()
