"""Services (issue 27): what the gateway costs and carries, beside nginx and Ray Serve on this
machine, and what a crashed replica host costs in a 4-host lab.

- Added latency: one replica (aiohttp on uvloop, a 200-byte answer) called directly and through
  each proxy, one request at a time (examples/load.py, 3,000 requests): p50 / p99, and the
  difference to direct.
- Throughput through one proxy on one core: the proxy pinned to core 1, the replica and the
  client (wrk, 32 connections, 10 s) on core 0. nginx: Debian's, one worker, keep-alive to the
  replica (the stock reverse-proxy recipe). Ray Serve: its HTTP proxy and one replica actor
  answering the same 200 bytes (Serve routes to its own replicas, not to an outside server).
- The embedding example (examples/serve_embed.py) alone and batched, fp32 and int8.
- Failover: the lab test's scenario (tests/netlab/test_serve.py), timed: requests through the
  spare host's gateway while a replica host is crashed; failed requests and seconds from the
  death being declared to a replacement healthy.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil

ROOT = Path(__file__).resolve().parent.parent
BODY = 200
REPLICA = textwrap.dedent(f"""
    import sys, uvloop
    from aiohttp import web
    body = b"x" * {BODY}
    async def answer(request): return web.Response(body=body)
    app = web.Application(); app.router.add_route("*", "/{{tail:.*}}", answer)
    uvloop.run(web._run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None))
""")
GATEWAY = textwrap.dedent("""
    import asyncio, sys, uvloop
    from swarmd.serve.gateway import Gateway, static_routes
    table = {"services": {"bench": {"access": "members", "token_sha256": None, "replicas": [
        {"key": "r", "host": "h", "address": "127.0.0.1", "port": int(sys.argv[2]), "rtt_ms": 0.0,
         "healthy": True, "health": "/"}]}}}
    async def main():
        g = Gateway(static_routes(table))
        await g.start("127.0.0.1", int(sys.argv[1]))
        await asyncio.Event().wait()
    uvloop.run(main())
""")
NGINX = """
worker_processes 1;
error_log {dir}/error.log;
pid {dir}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body; proxy_temp_path {dir}/proxy; fastcgi_temp_path {dir}/fcgi;
  uwsgi_temp_path {dir}/uwsgi; scgi_temp_path {dir}/scgi;
  upstream replica {{ server 127.0.0.1:{replica}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port};
    location /bench/ {{ proxy_pass http://replica/; proxy_http_version 1.1; proxy_set_header Connection ""; }}
  }}
}}
"""
RAY_SERVE = textwrap.dedent(f"""
    import sys, time, ray
    from ray import serve
    from starlette.responses import Response
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={{"host": "127.0.0.1", "port": int(sys.argv[1])}})
    @serve.deployment(num_replicas=1, max_ongoing_requests=64, ray_actor_options={{"num_cpus": 0}})
    class Bench:
        async def __call__(self, request): return Response(b"x" * {BODY})
    serve.run(Bench.bind(), route_prefix="/bench")
    print("ready", flush=True)
    while True: time.sleep(3600)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {timeout:g} s")
        time.sleep(0.1)


@contextmanager
def process(argv: list[str], core: int | None = None, **kw) -> Iterator[subprocess.Popen]:
    pin = ["taskset", "-c", str(core)] if core is not None and shutil.which("taskset") else []
    proc = subprocess.Popen([*pin, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, **kw)
    try:
        yield proc
    finally:
        try:
            os.killpg(proc.pid, 15)
        except ProcessLookupError:
            pass
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def latency(url: str, requests: int = 3000) -> dict:
    done = subprocess.run(["taskset", "-c", "0", sys.executable, str(ROOT / "examples" / "load.py"), url,
                           "--concurrency", "1", "--requests", str(requests), "--json"],
                          capture_output=True, text=True, timeout=600)
    return json.loads(done.stdout)


def throughput(url: str, seconds: int = 10) -> float | None:
    if shutil.which("wrk") is None:
        return None
    done = subprocess.run(["taskset", "-c", "0", "wrk", "-t1", "-c32", f"-d{seconds}s", url], capture_output=True,
                          text=True, timeout=seconds + 60)
    if "Non-2xx" in done.stdout or "Socket errors" in done.stdout:  # a proxy shedding load: not throughput
        print(f"serve: {url} answered errors under load:\n{done.stdout}", file=sys.stderr)
    for line in done.stdout.splitlines():
        if line.startswith("Requests/sec:"):
            return float(line.split()[1])
    return None


def proxies() -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    replica_port = free_port()
    with tempfile.TemporaryDirectory() as tmp, \
            process([sys.executable, "-c", REPLICA, str(replica_port)], core=0):
        direct = f"http://127.0.0.1:{replica_port}/"
        wait_http(direct)
        first = latency(direct)
        out["serve_direct_p50_ms"], out["serve_direct_p99_ms"] = first["p50_ms"], first["p99_ms"]
        out["serve_direct_req_s"] = throughput(direct)
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with process([sys.executable, "-c", GATEWAY, str(port), str(replica_port)], core=1, env=env):
            url = f"http://127.0.0.1:{port}/bench/"
            wait_http(url)
            via = latency(url)
            out["serve_gateway_p50_ms"], out["serve_gateway_p99_ms"] = via["p50_ms"], via["p99_ms"]
            out["serve_gateway_added_p50_ms"] = round(via["p50_ms"] - first["p50_ms"], 3)
            out["serve_gateway_added_p99_ms"] = round(via["p99_ms"] - first["p99_ms"], 3)
            out["serve_gateway_req_s"] = throughput(url)
        if shutil.which("nginx"):
            port = free_port()
            conf = Path(tmp) / "nginx.conf"
            conf.write_text(NGINX.format(dir=tmp, replica=replica_port, port=port))
            with process(["nginx", "-c", str(conf), "-p", tmp, "-g", "daemon off;"], core=1):
                url = f"http://127.0.0.1:{port}/bench/"
                wait_http(url)
                via = latency(url)
                out["serve_nginx_p50_ms"], out["serve_nginx_p99_ms"] = via["p50_ms"], via["p99_ms"]
                out["serve_nginx_added_p50_ms"] = round(via["p50_ms"] - first["p50_ms"], 3)
                out["serve_nginx_req_s"] = throughput(url)
        else:
            print("serve: nginx is not installed (make setup installs it): no nginx figures", file=sys.stderr)
    try:
        import ray  # noqa: F401
    except ImportError:
        print("serve: Ray is not installed: no Ray Serve figures", file=sys.stderr)
        return out
    port = free_port()
    ray_procs: list[psutil.Process] = []
    try:
        with process([sys.executable, "-c", RAY_SERVE, str(port)], core=1,
                     env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}) as ray_proc:
            try:
                url = f"http://127.0.0.1:{port}/bench/"
                wait_http(url, timeout=180)
                via = latency(url, requests=1000)
                out["serve_rayserve_p50_ms"], out["serve_rayserve_p99_ms"] = via["p50_ms"], via["p99_ms"]
                out["serve_rayserve_req_s"] = throughput(url)
            except RuntimeError as exc:
                print(f"serve: Ray Serve did not come up: {exc}", file=sys.stderr)
            finally:  # Ray's own processes leave the driver's group: these, not every Ray on the host
                with contextlib.suppress(psutil.NoSuchProcess):
                    ray_procs = psutil.Process(ray_proc.pid).children(recursive=True)
    finally:
        for p in ray_procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    return out


def failover() -> dict[str, float]:
    """The lab test's crash under load (tests/netlab/test_serve.py), its printed figures read back."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s",
                           str(ROOT / "tests" / "netlab" / "test_serve.py"), "-k", "crashed_host"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("crash under load:")), None)
    if line is None:
        print(f"serve: the failover lab printed no figures (exit {done.returncode}):\n{done.stdout[-2000:]}",
              file=sys.stderr)
        return {}
    words = line.split()
    total, failed = int(words[3]), int(words[5])
    seconds = float(line.split("replacement healthy ")[1].split()[0])
    return {"serve_failover_requests": float(total), "serve_failover_failed": float(failed),
            "serve_failover_failed_pct": round(100.0 * failed / max(total, 1), 3),
            "serve_failover_replacement_s": seconds}


def embedding() -> dict[str, float]:
    """examples/serve_embed.py in its four modes, one model thread, single-text requests from
    examples/load.py at concurrency 16 for 10 s (client and server share the 2 cores)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("serve: the models extra is not installed: no embedding figures", file=sys.stderr)
        return {}
    out: dict[str, float] = {}
    for mode, flags in (("fp32", ["--no-batching"]), ("fp32_batched", []), ("int8", ["--no-batching", "--int8"]),
                        ("int8_batched", ["--int8"])):
        port = free_port()
        with process([sys.executable, str(ROOT / "examples" / "serve_embed.py"), "--port", str(port), *flags]):
            wait_http(f"http://127.0.0.1:{port}/healthz", timeout=120)
            done = subprocess.run([sys.executable, str(ROOT / "examples" / "load.py"),
                                   f"http://127.0.0.1:{port}/embed", "--concurrency", "16", "--duration", "10",
                                   "--data", json.dumps({"texts": ["a cat sat on the mat"]}), "--json"],
                                  capture_output=True, text=True, timeout=120)
            got = json.loads(done.stdout)
            out[f"serve_embed_{mode}_req_s"] = got["req_per_s"]
            out[f"serve_embed_{mode}_p50_ms"] = got["p50_ms"]
    return out


def measure() -> dict[str, float | None]:
    out = proxies() | embedding()
    if os.geteuid() == 0:
        out |= failover()
    return out
