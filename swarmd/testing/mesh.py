"""The WireGuard mesh (mesh.driver.Mesh) as its readers use it, from tables: the routing
driver (peers, direct_ip, set_relayed, reassert, peer_rows, writes) and the control API
(started, error, status, peer_rows). No device, no backend: a test sets what the device
would read back and looks at what was asked of it.

What `peer_rows` reads back, in order: `rows` if a test set them (whole rows, as
Mesh.peer_rows gives them); else one row a peer of `bytes` (peer -> (rx, tx): the counters
alone, no endpoint, so nothing is proven by them). `FakeMesh(peers)` fills `rows` with a full
row a peer (None: a device key no member owns), as a device that has handshaken with each."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import trio

ENDPOINT = "192.0.2.3:51820"  # every full row's endpoint (RFC 5737 TEST-NET-1)


def row(peer: str | None, *, rx: int = 1, tx: int = 2, endpoint: str | None = ENDPOINT) -> dict[str, Any]:
    """A full row of Mesh.peer_rows for `peer`: not a direct path, a handshake 3 s ago."""
    return {"peer": peer, "overlay": None, "endpoint": endpoint, "direct": False, "handshake_age_s": 3.0,
            "rx_bytes": rx, "tx_bytes": tx}


class FakeMesh:
    """A started mesh whose device answers from `rows` / `bytes`; `direct` is peer -> the
    underlay IP its WireGuard is reached at directly.

    Faults and races: `down` makes that many next set_relayed calls and peer_rows reads raise
    (the backend being restarted); `write_while_read` makes the next reading overlap a write of
    ours (`writes` grows by two, as Mesh.writes does at a write's start and end)."""

    started, error = True, None

    def __init__(self, peers: Iterable[str | None] | None = None, *, direct: dict[str, str] | None = None) -> None:
        self.direct = direct or {}
        self.rows: list[dict[str, Any]] | None = None if peers is None else [row(p) for p in peers]
        self.bytes: dict[str, tuple[int, int]] = {}
        self.set_calls: list[tuple[float, dict[str, str]]] = []  # (trio time, relayed) of each set_relayed
        self.down = 0
        self.writes = 0
        self.write_while_read = False

    def status(self) -> dict[str, Any]:
        return {"interface": "wrd0", "backend": "kernel", "address": "10.211.0.1", "public_key": "k"}

    def peers(self) -> set[str]:
        return set()

    def info(self) -> None:
        return None

    def direct_ip(self, peer: str, version: int | None = None) -> str | None:
        return self.direct.get(peer)

    async def reassert(self, peers: Iterable[str]) -> None:
        await trio.lowlevel.checkpoint()

    async def set_relayed(self, relayed: dict[str, str]) -> None:
        self.set_calls.append((trio.current_time(), dict(relayed)))
        if self.down:
            self.down -= 1
            raise RuntimeError("wireguard-go is not running")

    async def peer_rows(self) -> list[dict[str, Any]]:
        if self.down:
            raise RuntimeError("wireguard-go is not running")
        if self.write_while_read:
            self.write_while_read = False
            self.writes += 2
        if self.rows is not None:
            return list(self.rows)
        return [{"peer": peer, "rx_bytes": rx, "tx_bytes": tx} for peer, (rx, tx) in self.bytes.items()]
