"""A UserspaceBackend in a process of its own, driven by JSON lines (tests/netlab/test_wg_backend.py).

Started as ``ip netns exec NS python wg_child.py IFACE`` so that, as in production, the
process that owns the backend lives inside the network namespace. One request per stdin
line, one reply per stdout line; logs (wireguard-go's verbose ones too) go to stderr as JSON lines.

  {"op": "start", "private_key": HEX, "listen_port": N, "addresses": [CIDR], "mtu": N}
  {"op": "set_peers", "peers": [{"public": HEX, "endpoint": S, "allowed_ips": [CIDR], "keepalive": N}]}
  {"op": "set_addresses", "addresses": [CIDR]}
  {"op": "state"}   -> {"listen_port": N, "peers": {HEX: {"last_handshake": T, "rx_bytes": N, ...}}}
  {"op": "info"}    -> {"pid": wireguard-go's pid or null, "restarts": N}
  {"op": "close"}   -> {}
Replies are {"ok": true, ...} or {"ok": false, "error": "Type: message"}. After a restart it
re-pushes the last peers it was given, as the reconciler does. EOF on stdin closes and exits.
"""

from __future__ import annotations

import json
import os
import sys

import trio

from swarmd import log
from swarmd.wg.uapi import PeerConfig
from swarmd.wg.userspace import UserspaceBackend


async def main(iface: str) -> None:
    log.configure("debug", "json")
    # quiet: wireguard-go logs errors only, as a daemon's does by default (a verbose one writes a
    # line every few seconds, and the first after its daemon was killed ends it with SIGPIPE)
    backend = UserspaceBackend(iface, verbose=os.environ.get("WG_CHILD_QUIET") != "1")
    peers: list[PeerConfig] = []

    async def repush() -> None:
        await backend.set_peers(peers)

    async def handle(req: dict, nursery: trio.Nursery) -> dict:
        op = req.pop("op")
        if op == "start":
            req["private_key"] = bytes.fromhex(req["private_key"])
            await backend.start(**req)
            nursery.start_soon(backend.supervise, repush)
            return {}
        if op == "set_peers":
            new = [PeerConfig(bytes.fromhex(p.pop("public")), **p) for p in req["peers"]]
            await backend.set_peers(new)
            peers[:] = new
            return {}
        if op == "set_addresses":
            await backend.set_addresses(req["addresses"])
            return {}
        if op == "state":
            state = await backend.state()
            return {"listen_port": state.listen_port,
                    "peers": {k.hex(): {"endpoint": p.endpoint, "allowed_ips": list(p.allowed_ips),
                                        "last_handshake": p.last_handshake, "rx_bytes": p.rx_bytes,
                                        "tx_bytes": p.tx_bytes, "keepalive": p.keepalive}
                              for k, p in state.peers.items()}}
        if op == "info":
            return {"pid": backend.pid, "restarts": backend.restarts}
        if op == "close":
            await backend.close()
            return {}
        raise ValueError(f"unknown op {op!r}")

    stdin = trio.wrap_file(sys.stdin)
    try:
        async with trio.open_nursery() as nursery:
            while line := await stdin.readline():
                try:
                    reply = {"ok": True, **await handle(json.loads(line), nursery)}
                except Exception as e:
                    reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                print(json.dumps(reply), flush=True)
            nursery.cancel_scope.cancel()
    finally:
        await backend.close()


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
