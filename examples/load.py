"""A small HTTP load generator: N threads, each one keep-alive connection, request after request.

Standard library only, so it runs anywhere Python does (a laptop forwarding a port to the
swarm, a bare container). Each of --concurrency threads sends its next request as soon as
the last answer has come back (a closed loop, like N users clicking as fast as they can):
throughput is what the server sustains at that concurrency, and the latency percentiles
are what each of those requests saw.

    python examples/load.py http://localhost:8000/batched --concurrency 16 --duration 10
    python examples/load.py http://localhost:8000/plain --requests 2000 --json
    python examples/load.py http://localhost:8000/plain --data '{"pixels": [0, 0, 5, ...]}'   # POSTs it

Prints `<n> requests in <t> s: <x> req/s, p50 <a> ms, p99 <b> ms, errors <e>`; with --json,
one JSON object with the same figures instead. Latencies are of the answered (2xx) requests;
an error is any other status, or a connection that failed (the thread then reconnects,
after a pause of 50 ms).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url", help="http://host:port/path?query")
    p.add_argument("--concurrency", type=int, default=8, help="threads, each with its own connection")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=float, default=None, help="seconds to run (default 10)")
    stop.add_argument("--requests", type=int, default=None, help="send this many requests in all, then stop")
    p.add_argument("--data", default=None, help="a body to POST (as application/json) instead of GET")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for one answer")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the line")
    args = p.parse_args(argv)
    if urllib.parse.urlsplit(args.url).scheme != "http":
        p.error("url: only http:// is supported")
    if args.concurrency < 1:
        p.error("--concurrency: at least 1")
    if args.requests is not None and args.requests < 1:
        p.error("--requests: at least 1")
    if args.duration is not None and args.duration <= 0:
        p.error("--duration: more than 0")
    if args.requests is None and args.duration is None:
        args.duration = 10.0
    return args


def percentile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank percentile: the smallest value with at least q % of them at or below it."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass
class Tally:
    """What every thread adds to, under one lock; `budget` counts down the requests still to send."""

    budget: int | None
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> bool:
        """May this thread send one more request?"""
        if self.budget is None:
            return True
        with self.lock:
            if self.budget <= 0:
                return False
            self.budget -= 1
            return True

    def done(self, latency: float | None) -> None:
        with self.lock:
            if latency is None:
                self.errors += 1
            else:
                self.latencies.append(latency)


# After a failed connection, before the next: a server that is down is not hammered in a
# tight loop (which would also spin this process at 100 % CPU counting refusals).
RECONNECT_PAUSE = 0.05


def worker(url: urllib.parse.SplitResult, body: bytes | None, timeout: float, deadline: float | None,
           tally: Tally) -> None:
    target = url.path or "/"
    if url.query:
        target += "?" + url.query
    headers = {"Content-Type": "application/json"} if body is not None else {}
    conn = None
    while (deadline is None or time.perf_counter() < deadline) and tally.take():
        if conn is None:
            # One connection per thread, kept alive across requests (HTTP/1.1 does by default).
            conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=timeout)
        started = time.perf_counter()
        try:
            conn.request("POST" if body is not None else "GET", target, body=body, headers=headers)
            response = conn.getresponse()
            response.read()  # the whole answer, or the connection cannot be reused
            ok = 200 <= response.status < 300
        except (OSError, http.client.HTTPException):
            ok = False
            conn.close()
            conn = None
        tally.done(time.perf_counter() - started if ok else None)
        if conn is None:
            time.sleep(RECONNECT_PAUSE)
    if conn is not None:
        conn.close()


def run(url: str, concurrency: int = 8, duration: float | None = 10.0, requests: int | None = None,
        data: str | None = None, timeout: float = 30.0) -> dict:
    """Run the load; return the figures (what --json prints)."""
    split = urllib.parse.urlsplit(url)
    tally = Tally(budget=requests)
    started = time.perf_counter()
    deadline = started + duration if requests is None and duration is not None else None
    body = data.encode() if data is not None else None
    threads = [threading.Thread(target=worker, args=(split, body, timeout, deadline, tally), daemon=True)
               for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    latencies = sorted(tally.latencies)
    n = len(latencies) + tally.errors
    return {
        "url": url,
        "concurrency": concurrency,
        "requests": n,
        "seconds": round(elapsed, 3),
        "req_per_s": round(len(latencies) / elapsed, 1) if elapsed > 0 else 0.0,
        "p50_ms": round(percentile(latencies, 50) * 1000, 2) if latencies else None,
        "p99_ms": round(percentile(latencies, 99) * 1000, 2) if latencies else None,
        "errors": tally.errors,
    }


def line(r: dict) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"
    return (f"{r['requests']} requests in {r['seconds']:.1f} s: {r['req_per_s']:.1f} req/s, "
            f"p50 {ms(r['p50_ms'])} ms, p99 {ms(r['p99_ms'])} ms, errors {r['errors']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args.url, args.concurrency, args.duration, args.requests, args.data, args.timeout)
    print(json.dumps(result) if args.json else line(result), flush=True)
    return 1 if result["errors"] == result["requests"] else 0


if __name__ == "__main__":
    sys.exit(main())
