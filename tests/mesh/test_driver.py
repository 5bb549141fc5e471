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


async def test_an_observed_endpoint_is_one_the_peer_proved_after_our_last_write(tmp_path):
    # what the reach protocol attests of a member must be where its packets authenticate from,
    # never the endpoint we wrote from its record (its claim)
    import time

    from swarmd.wg.reconciler import Member
    from swarmd.wg.uapi import DeviceState, PeerState

    key = b"\x02" * 32
    state = {"endpoint": "203.0.113.5:40000", "handshake": None, "rx": 0}

    class Device(Backend):
        async def state(self):
            return DeviceState(private_key=None, listen_port=51820, peers={key: PeerState(
                public=key, endpoint=state["endpoint"], allowed_ips=(), last_handshake=state["handshake"],
                rx_bytes=state["rx"], tx_bytes=0, keepalive=25)})

    backend = Device()
    m = mesh(tmp_path, backend)
    m.started = True
    m._members = {"b": Member(peer="b", public=key, addr4="10.211.0.2", addr6=None, port=51820, endpoints=())}
    await m._set_peers([PeerConfig(public=key, endpoint="203.0.113.5:40000")])
    assert await m.observed_endpoint("b") is None, "nothing arrived since we wrote it"
    assert await m.observed_endpoint("b") is None, "still nothing"
    state["rx"] = 92  # a keepalive of the session authenticated: the endpoint is where it came from
    assert await m.observed_endpoint("b") == "203.0.113.5:40000"
    await m._set_peers([PeerConfig(public=key, endpoint="203.0.113.5:40000")])
    state["handshake"] = time.time() + 1  # a handshake after the write proves it at once
    assert await m.observed_endpoint("b") == "203.0.113.5:40000"
    assert await m.observed_endpoint("nobody") is None


async def test_reasserting_a_path_keeps_a_symmetric_nats_port_that_packets_proved(tmp_path):
    # after a path change routing writes the endpoint again for a while (the other end may still
    # send through the relay, roaming us there); a symmetric NAT's packets arrive from a port of
    # their own at its IP: that is the path working, and writing the record's port back would cut it
    from swarmd.wg.reconciler import Member
    from swarmd.wg.uapi import DeviceState, PeerState

    key = b"\x03" * 32
    device = {"endpoint": None}
    writes: list[list[PeerConfig]] = []

    class Device(Backend):
        async def state(self):
            return DeviceState(private_key=None, listen_port=51820, peers={key: PeerState(
                public=key, endpoint=device["endpoint"], allowed_ips=(), last_handshake=None, rx_bytes=0, tx_bytes=0,
                keepalive=25)})

        async def set_peers(self, configs) -> None:
            writes.append(list(configs))

    m = mesh(tmp_path, Device())
    m.started = True
    member = Member(peer="b", public=key, addr4="10.211.0.2", addr6=None, port=51820, endpoints=(),
                    reflexive="203.0.113.7:31813")
    m._members = {"b": member}
    m.reconciler.update_view(0.0, [member])
    device["endpoint"] = "203.0.113.7:49113"  # roamed: its NAT's port for us
    await m.reassert(["b"])
    assert writes == [], "the peer's own port at its NAT's address is kept"
    device["endpoint"] = "198.51.100.1:51830"  # still arriving through the relay: the path is written again
    await m.reassert(["b"])
    assert [c.endpoint for c in writes[-1]] == ["203.0.113.7:31813"]
    await m.set_relayed({"b": "198.51.100.1:51830"})
    writes.clear()
    device["endpoint"] = "198.51.100.1:51831"  # relayed: only the relay's own port will do
    await m.reassert(["b"])
    assert [c.endpoint for c in writes[-1]] == ["198.51.100.1:51830"]


async def test_a_relayed_peer_is_never_attested_at_the_relays_address(tmp_path):
    # through a relay, a peer's packets come from the relay's address and port: attesting that as
    # the peer's reflexive endpoint made a symmetric NAT's verdict name a relay's port (lab run)
    import time

    from swarmd.wg.reconciler import Member
    from swarmd.wg.uapi import DeviceState, PeerState

    key, relay_key = b"\x04" * 32, b"\x05" * 32
    device = {"endpoint": "198.51.100.1:51826"}

    class Device(Backend):
        async def state(self):
            return DeviceState(private_key=None, listen_port=51820, peers={key: PeerState(
                public=key, endpoint=device["endpoint"], allowed_ips=(), last_handshake=time.time() + 5,
                rx_bytes=100, tx_bytes=0, keepalive=25)})

        async def set_peers(self, configs) -> None:
            pass

    m = mesh(tmp_path, Device())
    m.started = True
    m._members = {"b": Member(peer="b", public=key, addr4="10.211.0.2", addr6=None, port=51820, endpoints=()),
                  "r": Member(peer="r", public=relay_key, addr4="10.211.0.3", addr6=None, port=51820,
                              endpoints=("198.51.100.1",))}
    await m.set_relayed({"b": "198.51.100.1:51826"})
    assert await m.observed_endpoint("b") is None, "relayed: the relay's address"
    await m.set_relayed({})
    assert await m.observed_endpoint("b") is None, "back to direct, but its packets still came through the relay"
    device["endpoint"] = "203.0.113.9:40000"
    assert await m.observed_endpoint("b") == "203.0.113.9:40000"
