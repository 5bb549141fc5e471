"""mesh/driver.py's driver parts that need no device: what it tells routing about its writes."""

from __future__ import annotations

import pytest
import trio

from swarmd.mesh import Mesh
from swarmd.wg.uapi import PeerConfig


class Backend:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.seen: list[int] = []  # Mesh.writes while each write ran
        self.mesh: Mesh | None = None

    async def set_peers(self, configs) -> None:
        await trio.lowlevel.checkpoint()
        self.seen.append(self.mesh.writes)
        if self.fail:
            raise RuntimeError("wireguard-go is not running")


def mesh(tmp_path, backend: Backend) -> Mesh:
    m = Mesh(backend=backend, gossip=None, state_dir=tmp_path, interface="swtest0", network="10.211.0.0/16",
             port=51820, mtu=1420)
    backend.mesh = m
    return m


@pytest.mark.parametrize("fail", [False, True])
async def test_every_write_to_the_device_is_counted_as_it_starts_and_as_it_ends(tmp_path, fail):
    # routing proves a peer's WireGuard endpoint only across readings no write of ours touched
    # (Routing.proven: an endpoint we wrote came from the member's record, its claim)
    backend = Backend(fail=fail)
    m = mesh(tmp_path, backend)
    peer = PeerConfig(public=b"\x01" * 32, remove=True)
    if fail:
        with pytest.raises(RuntimeError):
            await m._set_peers([peer])
    else:
        await m._set_peers([peer])
    assert backend.seen == [1] and m.writes == 2, "seen while running, and ended even when it failed"
