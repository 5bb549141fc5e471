"""`swarmctl`: talk to the local swarmd over its Unix socket.

Exit status: 0 ok, 1 the operation failed, 2 usage, 3 the daemon is unreachable.
Nothing heavy is imported before a command runs (`swarmctl --help` in < 300 ms).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from swarmd import __version__
from swarmd.paths import client_socket
from swarmd.rpc.client import Client, DaemonUnreachable, RemoteError
from swarmd.rpc.protocol import ErrorCode

from . import console, jobs, render, serve

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

    sw = sub.add_parser("swarm", parents=[common], help="make, invite to, join a swarm; revoke members")
    swsub = sw.add_subparsers(dest="swarm_command", metavar="ACTION", required=True)
    swsub.add_parser("init", parents=[common], help="make a new swarm owned by this node")
    inv = swsub.add_parser("invite", parents=[common], help="print a token that admits one node (or --uses N)")
    inv.add_argument("--expires", type=_duration, default=86400.0, metavar="DURATION",
                     help="how long the token works, e.g. 30m, 12h, 7d (default 24h)")
    inv.add_argument("--uses", type=_uses, default=1, metavar="N",
                     help="how many nodes the token admits (default 1)")
    inv.add_argument("--cert-ttl", type=_duration, default=365 * 86400.0, metavar="DURATION",
                     help="how long the members' certificates are valid (default 365d)")
    jn = swsub.add_parser("join", parents=[common], help="join a swarm with a token from `swarm invite`")
    jn.add_argument("token")
    rv = swsub.add_parser("revoke", parents=[common],
                          help="remove a member for good (owner only): every member drops it within seconds")
    rv.add_argument("peer", metavar="PEER", help="its peer id, or enough of it to name one member")
    rv.add_argument("--reason", default="", help="kept with the revocation and logged by every member")
    swsub.add_parser("revocations", parents=[common], help="the revoked peers this node knows of")
    swsub.add_parser("renew", parents=[common], help="renew this node's certificate from the owner now")

    sub.add_parser("peers", parents=[common],
                   help="every member: state, RTT (measured, or ~estimated), GPUs, CPU, memory, labels")

    ms = sub.add_parser("mesh", parents=[common],
                        help="the WireGuard mesh: per peer overlay address, endpoint, path (direct or via a "
                             "relay) and its RTT, handshake, traffic")
    mssub = ms.add_subparsers(dest="mesh_command", metavar="ACTION")
    mssub.add_parser("rotate-key", parents=[common],
                     help="a new WireGuard key for this node (peers pick it up from its record)")

    rt = sub.add_parser("route", parents=[common],
                        help="why traffic to PEER goes direct or through a relay: RTTs, relays, hysteresis")
    rt.add_argument("peer", metavar="PEER",
                    help="its peer id, or at least 6 characters of its start or end (`swarmctl peers` shows the end)")

    jobs.add_parser(sub, common)
    serve.add_parser(sub, common)
    console.add_parser(sub, common)

    lb = sub.add_parser("labels", parents=[common], help="change this node's labels (re-advertised at once)")
    lbsub = lb.add_subparsers(dest="labels_command", metavar="ACTION", required=True)
    ls = lbsub.add_parser("set", parents=[common], help="set labels: K=V ...")
    ls.add_argument("pairs", nargs="+", type=_label, metavar="K=V")
    lr = lbsub.add_parser("rm", parents=[common], help="remove labels: K ...")
    lr.add_argument("keys", nargs="+", metavar="K")
    return p


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str) -> float:
    unit = text[-1:] if text[-1:] in _UNITS else "s"
    number = text[:-1] if text[-1:] in _UNITS else text
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a duration like 30m, 12h or 7d, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _uses(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 1 <= value <= 10_000:
        raise argparse.ArgumentTypeError(f"must be 1 to 10000, got {text}")
    return value


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected K=V, got {text!r}")
    return key, value


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


def cmd_swarm(client: Client, args: argparse.Namespace) -> int:
    if args.swarm_command == "init":
        result = client.call("swarm.init")
        render.as_json(result) if args.json else print(
            f"swarm {result['swarm']} created; this node owns it.\n"
            "Invite nodes with: swarmctl swarm invite")
    elif args.swarm_command == "invite":
        result = client.call("swarm.invite", expires=args.expires, cert_ttl=args.cert_ttl, uses=args.uses)
        if args.json:
            render.as_json(result)
        else:
            print(result["token"])
            nodes = "one node" if args.uses == 1 else f"{args.uses} nodes"
            print(f"# valid for {render.duration(args.expires)}, admits {nodes}; on the new node run: "
                  "swarmd --join TOKEN, or swarmctl swarm join TOKEN", file=sys.stderr)
    elif args.swarm_command == "revoke":
        result = client.call("swarm.revoke", peer=args.peer, reason=args.reason)
        render.as_json(result) if args.json else print(
            f"revoked {result['peer']}; the swarm drops it as the revocation spreads (seconds)")
    elif args.swarm_command == "revocations":
        result = client.call("swarm.revocations")
        if args.json:
            render.as_json(result)
        else:
            for r in result["revocations"]:
                print(render.plain(f"{r['peer']}  {render.when(r['issued'])}  {r['reason'] or '-'}"))
            if not result["revocations"]:
                print("no revoked peers")
    elif args.swarm_command == "renew":
        client.set_timeout(max(args.timeout, 30.0))
        result = client.call("swarm.renew")
        render.as_json(result) if args.json else print(
            f"certificate renewed; expires {render.when(result['expires'])}")
    else:
        client.set_timeout(max(args.timeout, 30.0))  # the owner may be far away
        result = client.call("swarm.join", token=args.token)
        render.as_json(result) if args.json else print(f"joined swarm {result['swarm']}")
    return EXIT_OK


def cmd_peers(client: Client, args: argparse.Namespace) -> int:
    result = client.call("peers")
    render.as_json(result) if args.json else render.peers(result)
    return EXIT_OK


def cmd_mesh(client: Client, args: argparse.Namespace) -> int:
    if args.mesh_command == "rotate-key":
        result = client.call("mesh.rotate-key")
        render.as_json(result) if args.json else print(f"WireGuard key rotated: {result['old']} -> {result['new']}")
        return EXIT_OK
    result = client.call("mesh")
    render.as_json(result) if args.json else render.mesh(result)
    return EXIT_OK


def cmd_route(client: Client, args: argparse.Namespace) -> int:
    result = client.call("route", peer=args.peer)
    render.as_json(result) if args.json else render.route(result)
    return EXIT_OK


def cmd_labels(client: Client, args: argparse.Namespace) -> int:
    if args.labels_command == "set":
        result = client.call("labels.set", labels=dict(args.pairs))
    else:
        result = client.call("labels.rm", keys=args.keys)
    if args.json:
        render.as_json(result)
    else:
        print(render.plain(", ".join(f"{k}={v}" for k, v in sorted(result["labels"].items())) or "no labels"))
    return EXIT_OK


COMMANDS: dict[str, Callable[[Client, argparse.Namespace], int]] = {
    "status": cmd_status, "version": cmd_version, "log-level": cmd_log_level,
    "swarm": cmd_swarm, "peers": cmd_peers, "labels": cmd_labels, "mesh": cmd_mesh, "route": cmd_route,
    "jobs": jobs.command,
    "serve": serve.command,
    "console": console.command,
}


def _hear_ctrl_c() -> None:
    """A Ctrl-C typed at our terminal is for us, whatever SIGINT disposition we inherited: a
    shell without job control starts background commands with it ignored, exec keeps it, and
    then every command (`jobs logs -f` following forever) was deaf to Ctrl-C. In the
    background, or with no terminal, the inherited disposition stands."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and jobs.in_foreground():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> int:
    _hear_ctrl_c()  # first: a Ctrl-C while the arguments are read or the daemon is reached counts too
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
        print(f"swarmctl: {render.plain(exc.message)}", file=sys.stderr)  # may quote a host
        return EXIT_USAGE if exc.code == ErrorCode.INVALID_PARAMS else EXIT_FAILED
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
