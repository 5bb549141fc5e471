"""`swarmctl console`: the web console (swarmd/console), served on loopback as the calling user.

It asks the daemon nothing the user could not ask with swarmctl (it is this user's client of
the control socket), makes a random token for this run and prints the page's URL with it:
whoever does not have the URL gets a 401. `--url` prints it without opening a browser, for
a browser elsewhere (`ssh -L PORT:127.0.0.1:PORT` first). It serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import secrets
import socket
import sys
from typing import Any

from swarmd.rpc.client import Client

TOKEN_BYTES = 32


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    c = sub.add_parser("console", parents=[common],
                       help="the web console: members on a map, jobs, services and this node, live")
    c.add_argument("--url", action="store_true", help="print the page's URL (with its token) and open no browser")
    c.add_argument("--port", type=_port, default=0, metavar="PORT",
                   help="the loopback port to serve on (default: any free one)")
    c.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                   help="how often the page's live view is refreshed (default 1, at least 0.2)")


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0-65535, got {text!r}")
    return int(text)


def command(client: Client, args: argparse.Namespace) -> int:
    if args.interval < 0.2:
        print("swarmctl: console: --interval must be at least 0.2 s", file=sys.stderr)
        return 2
    client.call("version")  # the daemon answers, or swarmctl says it does not, before a page is promised
    import asyncio

    from aiohttp import web

    from swarmd.client import Swarm
    from swarmd.console.app import make_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", args.port))
    except OSError as exc:
        print(f"swarmctl: console: cannot listen on 127.0.0.1:{args.port}: {exc.strerror}", file=sys.stderr)
        return 1
    sock.listen(128)
    port = sock.getsockname()[1]
    token = secrets.token_urlsafe(TOKEN_BYTES)
    app = make_app(Swarm(client.path), token, port=port, interval=args.interval)
    url = f"http://127.0.0.1:{port}/login?token={token}"

    async def serve() -> None:
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock, shutdown_timeout=1.0).start()
        print(url, flush=True)
        print(f"swarmctl: the console for {client.path} is served at http://127.0.0.1:{port}/ "
              "(the URL above carries its token); Ctrl-C stops it", file=sys.stderr, flush=True)
        if not args.url:
            import webbrowser

            if not webbrowser.open(url):
                print("swarmctl: no browser to open here: open the URL above", file=sys.stderr)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0
