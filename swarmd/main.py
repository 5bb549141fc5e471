"""`swarmd`: the daemon's entry point.

Exit status: 0 stopped cleanly, 1 failed while running, 2 configuration or identity
problem (systemd does not restart on it: RestartPreventExitStatus=2).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from . import __version__

EXIT_CONFIG = 2


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="swarmd", description="swarmd: a node of a decentralized cloud for AI.",
        epilog="Every flag can also be set in the TOML file or as SWARMD_<FLAG> in the environment "
               "(e.g. SWARMD_STATE_DIR); flags win, then the environment, then the file.")
    p.add_argument("--version", action="version", version=f"swarmd {__version__}")
    p.add_argument("--config", type=Path, metavar="FILE",
                   help="TOML configuration (default /etc/swarmd/swarmd.toml when it exists)")
    p.add_argument("--state-dir", metavar="DIR", help="identity and persistent state")
    p.add_argument("--socket", metavar="PATH", help="control socket for swarmctl")
    p.add_argument("--socket-group", metavar="GROUP", help="group allowed to use the socket (default swarm)")
    p.add_argument("--listen", action="append", metavar="MULTIADDR",
                   help="libp2p listen address, repeatable (default /ip4/0.0.0.0/tcp/4001)")
    p.add_argument("--bootstrap", action="append", metavar="MULTIADDR",
                   help="peer to dial at start, /ip4/…/tcp/…/p2p/PEER_ID, repeatable")
    p.add_argument("--announce", action="append", metavar="MULTIADDR",
                   help="address to advertise to peers, repeatable (default: listen addresses)")
    p.add_argument("--join", metavar="TOKEN", help="join a swarm with an invite token (swarmctl swarm invite)")
    p.add_argument("--label", action="append", dest="labels", metavar="K=V",
                   help="label advertised to peers, e.g. region=eu, repeatable")
    p.add_argument("--mdns", metavar="on|off", help="find peers on the local network with mDNS (default on)")
    p.add_argument("--gossip-timing", metavar="PRESET", help="failure-detector timers: wan (default), lan, local")
    p.add_argument("--mesh", metavar="BACKEND", help="WireGuard: auto (default), kernel, userspace or off")
    p.add_argument("--mesh-interface", metavar="NAME", help="WireGuard interface (default swarm0)")
    p.add_argument("--mesh-port", metavar="PORT", help="WireGuard UDP port (default 51820)")
    p.add_argument("--relay", metavar="auto|off", help="relay other members' WireGuard packets (default auto)")
    p.add_argument("--relay-max-mbit", metavar="N", help="bandwidth cap on relaying, Mbit/s (default 1000)")
    p.add_argument("--relay-ports", metavar="LOW-HIGH", help="UDP ports for relayed pairs (default 51821-52820)")
    p.add_argument("--serve-ports", metavar="LOW-HIGH", help="TCP ports service replicas get (default 30000-30999)")
    p.add_argument("--gateway-listen", metavar="HOST:PORT",
                   help="the service gateway (default 127.0.0.1:8080; port 0: any free port; 'off' to disable)")
    p.add_argument("--metrics-addr", metavar="HOST:PORT",
                   help="Prometheus endpoint (port 0: any free port; 'off' to disable)")
    p.add_argument("--job-user", metavar="USER", help="user job ranks run as when root (default nobody)")
    p.add_argument("--job-slots", metavar="N", help="jobs run at once (default: one per GPU, 2 without)")
    p.add_argument("--jobs-dir", metavar="DIR", help="where ranks run (default STATE_DIR-jobs)")
    p.add_argument("--sandbox", metavar="MODE", help="confine jobs: auto (default), required or off")
    p.add_argument("--job-uids", metavar="LOW-HIGH", help="uids jobs run as (default 61184-65519)")
    p.add_argument("--job-egress", metavar="POLICY", help="what jobs may reach: mesh (default) or internet")
    p.add_argument("--job-egress-allow", metavar="CIDR,...", help="networks jobs may also reach")
    p.add_argument("--job-paths", metavar="PATH,...", help="extra read-only paths jobs see")
    p.add_argument("--job-pids", metavar="N", help="processes and threads per job (default 4096)")
    p.add_argument("--log-level", metavar="LEVEL", help="debug, info, warning or error")
    p.add_argument("--log-format", metavar="FORMAT", help="json, console or auto (console on a TTY)")
    return p


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parser().parse_args(argv)
    from . import config as config_mod

    flags = {k: v for k, v in vars(args).items() if k != "config"}
    try:
        config = config_mod.load(config_file=args.config, flags=flags)
    except config_mod.ConfigError as exc:
        print(f"swarmd: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG

    import structlog

    from . import log

    log.configure(config.log_level, config.log_format)
    logger = structlog.get_logger("swarmd")

    import trio

    from .identity import IdentityError, load_or_create
    from .node import Node
    from .rpc.server import SocketInUse

    try:
        identity, created = load_or_create(config.state_dir)
    except IdentityError as exc:
        logger.error("cannot load identity", error=str(exc))
        print(f"swarmd: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    structlog.contextvars.bind_contextvars(peer=str(identity.peer_id))
    logger.info("identity " + ("created" if created else "loaded"), key=str(identity.path))

    from .gossip.swarmstate import SwarmStateError
    from .wg.backend import BackendError
    from .wg.keys import WgKeyError

    async def serve() -> None:
        node = Node(config, identity, started=started)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(node.run)
                async for signum in signals:
                    logger.info("stopping", signal=signal.Signals(signum).name)
                    await node.leave()
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(serve)
    except (BackendError, WgKeyError) as exc:
        logger.error("cannot set up the WireGuard mesh", error=str(exc))
        print(f"swarmd: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except SwarmStateError as exc:
        logger.error("cannot load the swarm state", error=str(exc))
        print(f"swarmd: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except SocketInUse as exc:
        logger.error("cannot serve the control socket", error=str(exc))
        return 1
    except OSError as exc:
        logger.error("cannot start", error=str(exc))
        return 1
    logger.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
