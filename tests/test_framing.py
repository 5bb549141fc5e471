import msgpack
import pytest

from swarmd.rpc.framing import NOT_YET, FrameDecoder, FrameTooLarge, MalformedFrame, encode_frame


def test_round_trip_byte_by_byte():
    messages = [{"id": 1, "method": "status"}, {"id": "x", "params": {"a": [1, 2, b"\x00"]}}]
    wire = b"".join(encode_frame(m) for m in messages)
    decoder = FrameDecoder()
    got = []
    for i in range(len(wire)):
        decoder.feed(wire[i:i + 1])
        while (m := decoder.next_message()) is not NOT_YET:
            got.append(m)
    assert got == messages
    assert decoder.pending == 0


def test_incomplete_frame_is_pending():
    wire = encode_frame({"id": 1})
    decoder = FrameDecoder()
    decoder.feed(wire[:-1])
    assert decoder.next_message() is NOT_YET
    assert decoder.pending == len(wire) - 1


def test_oversize_refused_from_header_alone():
    decoder = FrameDecoder(max_frame=1024)
    decoder.feed((1025).to_bytes(4, "big"))
    with pytest.raises(FrameTooLarge, match="1025 bytes exceeds the 1024-byte limit"):
        decoder.next_message()


def test_encoding_an_oversize_message_is_refused():
    with pytest.raises(FrameTooLarge):
        encode_frame({"blob": b"x" * 2048}, max_frame=1024)


@pytest.mark.parametrize("body", [b"\xc1", b"\x92\x01", b"\x81\xa1a"])  # never-used byte, short array, short map
def test_malformed_body(body):
    decoder = FrameDecoder()
    decoder.feed(len(body).to_bytes(4, "big") + body)
    with pytest.raises(MalformedFrame, match="not valid msgpack"):
        decoder.next_message()


def test_non_map_messages_are_returned_for_the_dispatcher_to_judge():
    decoder = FrameDecoder()
    body = msgpack.packb([1, 2])
    decoder.feed(len(body).to_bytes(4, "big") + body)
    assert decoder.next_message() == [1, 2]
