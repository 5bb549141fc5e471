"""`swarmctl`: talk to the local swarmd over its Unix socket.

Exit status: 0 ok, 1 the operation failed, 2 usage, 3 the daemon is unreachable.
Nothing heavy is imported before a command runs (`swarmctl --help` in < 300 ms).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from swarmd import __version__
from swarmd.paths import client_socket
from swarmd.rpc.client import Client, DaemonUnreachable, RemoteError
from swarmd.rpc.protocol import ErrorCode

from . import render

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
LOG_LEVELS = ("debug", "info", "warning", "error")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if value < 0.1:
        raise argparse.ArgumentTypeError(f"must be at least 0.1 s, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print JSON instead of tables")
    common.add_argument("--socket", default=argparse.SUPPRESS, metavar="PATH",
                        help="daemon socket (default $SWARMD_SOCKET, else /run/swarmd/swarmd.sock "
                             "or the user's state dir)")
    p = argparse.ArgumentParser(prog="swarmctl", parents=[common],
                                description="Control and inspect the local swarmd.")
    p.add_argument("--timeout", type=_positive, default=10.0, metavar="SECONDS",
                   help="give up on the daemon after this long (default 10)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    s = sub.add_parser("status", parents=[common], help="this node: identity, addresses, uptime")
    s.add_argument("--watch", nargs="?", const=2.0, type=_positive, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until interrupted")
    sub.add_parser("version", parents=[common], help="client and daemon versions")
    lv = sub.add_parser("log-level", parents=[common], help="change the daemon's log level")
    lv.add_argument("level", choices=LOG_LEVELS)
    return p


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    if args.watch is None:
        result = client.call("status")
        render.as_json(result) if args.json else render.status(result)
        return EXIT_OK
    for snapshot in client.stream("status.watch", interval=args.watch):
        if args.json:
            render.as_json(snapshot)
        else:
            sys.stdout.write("\x1b[2J\x1b[H" if sys.stdout.isatty() else "\n")
            render.status(snapshot)
    return EXIT_OK


def cmd_version(client: Client, args: argparse.Namespace) -> int:
    info: dict[str, Any] = {"client": __version__}
    try:
        info["daemon"] = client.call("version")
    except DaemonUnreachable as exc:
        info["daemon"] = None
        render.as_json(info) if args.json else print(f"swarmctl {__version__}")
        raise exc
    if args.json:
        render.as_json(info)
    else:
        d = info["daemon"]
        print(f"swarmctl {__version__}\nswarmd   {d['version']} (python {d['python']}, libp2p {d['libp2p']})")
    return EXIT_OK


def cmd_log_level(client: Client, args: argparse.Namespace) -> int:
    result = client.call("log.level", level=args.level)
    render.as_json(result) if args.json else print(f"log level {result['previous']} -> {result['level']}")
    return EXIT_OK


COMMANDS: dict[str, Callable[[Client, argparse.Namespace], int]] = {
    "status": cmd_status, "version": cmd_version, "log-level": cmd_log_level,
}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.json = getattr(args, "json", False)
    socket_path = str(getattr(args, "socket", None) or client_socket(os.environ))
    client = Client(socket_path, timeout=args.timeout)
    try:
        with client:
            return COMMANDS[args.command](client, args)
    except DaemonUnreachable as exc:
        print(f"swarmctl: {exc}\nhint: is swarmd running? (systemctl status swarmd) "
              "Use --socket or SWARMD_SOCKET to reach another daemon.", file=sys.stderr)
        return EXIT_UNREACHABLE
    except RemoteError as exc:
        print(f"swarmctl: {exc.message}", file=sys.stderr)
        return EXIT_USAGE if exc.code == ErrorCode.INVALID_PARAMS else EXIT_FAILED
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
