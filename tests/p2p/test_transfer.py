"""Chunked transfer (p2p/transfer.py) over an in-memory stream pair (swarmd.testing's FakeNet):
the frames a sender writes, and each refusal of a receiver, on trio's MockClock."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
import trio.testing

from swarmd.p2p.streams import read_frame, write_frame
from swarmd.p2p.transfer import CHUNK, CHUNK_TIMEOUT, TransferError, receive_chunks, send_chunks
from swarmd.testing import FakeNet, NetStream


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def ends(nursery: trio.Nursery) -> tuple[NetStream, NetStream]:
    """The two ends of one stream: the sender's and the receiver's."""
    net = FakeNet(nursery)
    far: list[NetStream] = []
    opened = trio.Event()

    async def handler(stream: NetStream) -> None:
        far.append(stream)
        opened.set()

    net.host("receiver").set_stream_handler("/t", handler)
    near = await net.host("sender").new_stream("receiver", ["/t"])
    await opened.wait()
    return near, far[0]


async def receive(stream: NetStream, size: int, **kw) -> bytes:
    got = bytearray()
    await receive_chunks(stream, size, got.extend, what="checkpoint", **kw)
    return bytes(got)


async def frames(stream: NetStream, *sent: object) -> None:
    for frame in sent:
        await write_frame(stream, frame)


async def test_a_file_of_several_chunks_crosses_whole_from_where_its_descriptor_stands(nursery, tmp_path: Path):
    data = os.urandom(2 * CHUNK + 12345)
    (tmp_path / "f").write_bytes(b"skipped" + data)
    near, far = await ends(nursery)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        os.lseek(fd, len(b"skipped"), os.SEEK_SET)
        nursery.start_soon(send_chunks, near, fd)
        taken: list[bytes] = []

        async def take(chunk: bytes) -> None:  # an async `take` is awaited, in order
            await trio.lowlevel.checkpoint()
            taken.append(chunk)

        await receive_chunks(far, len(data), take, what="checkpoint")
    finally:
        os.close(fd)
    assert b"".join(taken) == data and [len(c) for c in taken] == [CHUNK, CHUNK, 12345]


async def test_bytes_go_as_data_frames_of_chunk_bytes_then_end_telling_progress(nursery):
    near, far = await ends(nursery)
    told: list[int] = []
    await send_chunks(near, b"0123456789", chunk=4, progress=told.append)
    got = [await read_frame(far, 100) for _ in range(4)]
    assert got == [{"data": b"0123"}, {"data": b"4567"}, {"data": b"89"}, {"end": True}] and told == [4, 8, 10]


async def test_nothing_to_send_is_one_end_frame(nursery):
    near, far = await ends(nursery)
    await send_chunks(near, b"")
    assert await receive(far, 0) == b""


async def test_a_sender_going_past_the_size_is_refused_before_the_chunk_is_taken(nursery):
    near, far = await ends(nursery)
    nursery.start_soon(frames, near, {"data": b"wei"}, {"data": b"ghts"}, {"end": True})
    got = bytearray()
    with pytest.raises(TransferError, match="the checkpoint's chunks are more than its 5 bytes") as refused:
        await receive_chunks(far, 5, got.extend, what="checkpoint")
    assert refused.value.reason == "over" and got == b"wei"


async def test_an_end_short_of_the_size_is_refused(nursery):
    near, far = await ends(nursery)
    nursery.start_soon(frames, near, {"data": b"wei"}, {"end": True})
    with pytest.raises(TransferError, match="the checkpoint ended after 3 of its 5 bytes") as refused:
        await receive(far, 5)
    assert refused.value.reason == "short"


@pytest.mark.parametrize("frame, why", [
    ({"data": "weights"}, "must be {data: bytes} or {end: true}"),
    ({"data": b""}, "must be {data: bytes} or {end: true}"),  # an empty chunk would never move
    ({"end": 1}, "must be {data: bytes} or {end: true}"),
    (["weights"], "must be a map"),
])
async def test_a_frame_other_than_data_or_end_is_refused_as_malformed(nursery, frame, why):
    near, far = await ends(nursery)
    nursery.start_soon(frames, near, frame)
    with pytest.raises(TransferError, match=why) as refused:
        await receive(far, 7)
    assert refused.value.reason == "malformed"


async def test_check_sees_each_frame_first_and_may_refuse_it(nursery):
    near, far = await ends(nursery)
    nursery.start_soon(frames, near, {"data": b"wei"}, {"error": "the disk is full"})

    def check(frame: object) -> None:
        if isinstance(frame, dict) and "error" in frame:
            raise RuntimeError(frame["error"])

    with pytest.raises(RuntimeError, match="the disk is full"):
        await receive(far, 7, check=check)


async def test_a_sender_that_stalls_is_given_up_after_the_chunk_timeout(nursery, autojump_clock):
    near, far = await ends(nursery)
    nursery.start_soon(frames, near, {"data": b"wei"})
    started = trio.current_time()
    with pytest.raises(TransferError, match=f"no checkpoint chunk for {CHUNK_TIMEOUT:g} s") as refused:
        await receive(far, 7)
    assert refused.value.reason == "stalled" and trio.current_time() - started == pytest.approx(CHUNK_TIMEOUT)


async def test_a_sender_that_trickles_within_each_pause_is_given_up_at_the_deadline(nursery, autojump_clock):
    near, far = await ends(nursery)

    async def trickle() -> None:
        while True:
            await trio.sleep(CHUNK_TIMEOUT - 1)
            await write_frame(near, {"data": b"w"})

    nursery.start_soon(trickle)
    started = trio.current_time()
    with pytest.raises(TransferError, match="the checkpoint took more than 100 s to arrive") as refused:
        await receive(far, 1000, within=100.0)
    assert refused.value.reason == "late" and trio.current_time() - started == pytest.approx(100.0)
    nursery.cancel_scope.cancel()
