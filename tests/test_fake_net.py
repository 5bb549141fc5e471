"""swarmd/testing/net.py, the in-memory network the driver tests stand on: it must behave as
py-libp2p's yamux streams do where the drivers look (EOF, reset, the authenticated peer),
or a test passes on a behaviour the real network never has."""

from __future__ import annotations

import pytest
import trio
from libp2p.network.stream.exceptions import StreamEOF, StreamReset

from swarmd.p2p.streams import read_frame, write_frame
from swarmd.testing import FakeNet, Faults


async def echo_once(stream) -> None:
    await stream.write(await stream.read(100))
    await stream.close()


async def test_a_stream_reaches_the_handler_with_the_dialers_peer_id_and_ends_in_eof():
    seen = []

    async def handler(stream):
        seen.append(stream.muxed_conn.peer_id)
        await echo_once(stream)

    async with trio.open_nursery() as nursery:
        net = FakeNet(nursery)
        net.host("B").set_stream_handler("/p/1", handler)
        s = await net.host("A").new_stream("B", ["/x/1", "/p/1"])
        assert s.muxed_conn.peer_id == "B" and s.protocol == "/p/1"
        await s.write(b"hello")
        assert await s.read(100) == b"hello"
        with pytest.raises(StreamEOF):
            await s.read(100)
    assert seen == ["A"]


async def test_a_reset_reaches_the_other_end_as_a_reset_not_an_eof():
    async def handler(stream):
        await stream.read(100)
        await stream.reset()

    async with trio.open_nursery() as nursery:
        net = FakeNet(nursery)
        net.host("B").set_stream_handler("/p/1", handler)
        s = await net.host("A").new_stream("B", ["/p/1"])
        await s.write(b"x")
        with pytest.raises(StreamReset):
            await s.read(100)
        with pytest.raises(StreamReset):
            await s.write(b"more")


async def test_a_peer_that_serves_nothing_asked_is_a_failed_dial():
    async with trio.open_nursery() as nursery:
        net = FakeNet(nursery)
        net.host("B").set_stream_handler("/p/1", echo_once)
        with pytest.raises(OSError, match="serves none"):
            await net.host("A").new_stream("B", ["/q/1"])
        with pytest.raises(OSError):
            await net.host("A").new_stream("C", ["/p/1"])


async def test_faults_duplicate_and_reset_as_seeded():
    got = []

    async def handler(stream):
        try:
            while True:
                got.append(await read_frame(stream, 100))
        except Exception:
            pass

    async with trio.open_nursery() as nursery:
        net = FakeNet(nursery, Faults(seed=1, duplicate=1.0))
        net.host("B").set_stream_handler("/p/1", handler)
        s = await net.host("A").new_stream("B", ["/p/1"])
        await write_frame(s, {"n": 1})
        await s.close()
    assert got == [{"n": 1}, {"n": 1}], "every write delivered twice"

    async with trio.open_nursery() as nursery:
        net = FakeNet(nursery, Faults(seed=1, reset=1.0))
        net.host("B").set_stream_handler("/p/1", handler)
        s = await net.host("A").new_stream("B", ["/p/1"])
        with pytest.raises(StreamReset):
            await s.write(b"x")
