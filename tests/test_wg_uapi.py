"""UAPI encode/parse as tables, plus the socket client against a fake UAPI server."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import trio

from swarmd.wg.endpoint import split_endpoint
from swarmd.wg.uapi import (
    DeviceState,
    PeerConfig,
    UapiError,
    encode_set,
    parse_get,
    parse_set,
    uapi_get,
    uapi_set,
)

K1, K2, K3 = bytes([1] * 32), bytes([2] * 32), bytes(range(32))
H1, H2, H3 = K1.hex(), K2.hex(), K3.hex()


# -- encode_set -----------------------------------------------------------------------------

ENCODE = [
    ("empty", {}, "set=1\n\n"),
    ("device", {"private_key": K1, "listen_port": 51820},
     f"set=1\nprivate_key={H1}\nlisten_port=51820\n\n"),
    ("replace all peers", {"replace_peers": True}, "set=1\nreplace_peers=true\n\n"),
    ("full peer", {"peers": [PeerConfig(K2, endpoint="10.78.0.2:51820", allowed_ips=("10.211.0.2/32",),
                                        keepalive=25)]},
     f"set=1\npublic_key={H2}\nendpoint=10.78.0.2:51820\npersistent_keepalive_interval=25\n"
     "replace_allowed_ips=true\nallowed_ip=10.211.0.2/32\n\n"),
    ("bare peer still replaces its allowed ips", {"peers": [PeerConfig(K2)]},
     f"set=1\npublic_key={H2}\nreplace_allowed_ips=true\n\n"),
    ("keepalive 0 turns it off", {"peers": [PeerConfig(K2, keepalive=0)]},
     f"set=1\npublic_key={H2}\npersistent_keepalive_interval=0\nreplace_allowed_ips=true\n\n"),
    ("remove ignores other fields", {"peers": [PeerConfig(K2, endpoint="1.2.3.4:5", remove=True)]},
     f"set=1\npublic_key={H2}\nremove=true\n\n"),
    ("ipv6 endpoint, two prefixes, two peers",
     {"peers": [PeerConfig(K2, endpoint="[fd00::2]:7", allowed_ips=["fd11::2/128", "10.0.0.0/8"]),
                PeerConfig(K3, remove=True)]},
     f"set=1\npublic_key={H2}\nendpoint=[fd00::2]:7\nreplace_allowed_ips=true\nallowed_ip=fd11::2/128\n"
     f"allowed_ip=10.0.0.0/8\npublic_key={H3}\nremove=true\n\n"),
]


@pytest.mark.parametrize("name,kwargs,expected", ENCODE, ids=[e[0] for e in ENCODE])
def test_encode_set(name, kwargs, expected):
    assert encode_set(**kwargs) == expected.encode()


BAD_ENCODE = [
    ("short private key", lambda: encode_set(private_key=b"x" * 31), "private key must be 32 bytes, got 31"),
    ("port too big", lambda: encode_set(listen_port=65536), "listen port must be 0..65535"),
    ("negative port", lambda: encode_set(listen_port=-1), "listen port must be 0..65535"),
    ("not a PeerConfig", lambda: encode_set(peers=[{"public": K1}]), "peers must be PeerConfig"),
    ("short public key", lambda: PeerConfig(b"abc"), "peer public key must be 32 bytes, got 3"),
    ("str public key", lambda: PeerConfig(H1), "peer public key must be 32 bytes, got str"),
    ("hostname endpoint", lambda: PeerConfig(K1, endpoint="example.com:51820"), "endpoint must be"),
    ("endpoint without port", lambda: PeerConfig(K1, endpoint="10.0.0.1"), "endpoint must be"),
    ("endpoint port 0", lambda: PeerConfig(K1, endpoint="10.0.0.1:0"), "endpoint must be"),
    ("unbracketed v6", lambda: PeerConfig(K1, endpoint="fd00::1:51820"), "endpoint must be"),
    ("newline injection", lambda: PeerConfig(K1, endpoint="10.0.0.1:5\nremove=true"), "endpoint must be"),
    ("allowed ip without prefix", lambda: PeerConfig(K1, allowed_ips=("10.0.0.1",)), "CIDR prefix"),
    ("allowed ip garbage", lambda: PeerConfig(K1, allowed_ips=("10.0.0.1/33",)), "CIDR prefix"),
    ("allowed ip injection", lambda: PeerConfig(K1, allowed_ips=("10.0.0.1/32\nremove=true",)), "CIDR prefix"),
    ("keepalive too big", lambda: PeerConfig(K1, keepalive=70000), "keepalive must be 0..65535"),
]


@pytest.mark.parametrize("name,call,message", BAD_ENCODE, ids=[b[0] for b in BAD_ENCODE])
def test_encode_set_rejects(name, call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        call()


def test_split_endpoint():
    assert split_endpoint("10.78.0.2:51820") == ("10.78.0.2", 51820)
    assert split_endpoint("[fd00::2]:1") == ("fd00::2", 1)


# -- parse_get ------------------------------------------------------------------------------

# A reply as wireguard-go v0.0.20220316 (Debian bookworm) sent it here, one peer.
REAL = (f"private_key={H1}\nlisten_port=51820\npublic_key={H2}\npreshared_key={'0' * 64}\n"
        "protocol_version=1\nendpoint=10.78.0.2:51820\nlast_handshake_time_sec=1700000000\n"
        "last_handshake_time_nsec=500000000\ntx_bytes=1234\nrx_bytes=5678\n"
        "persistent_keepalive_interval=25\nallowed_ip=10.211.0.2/32\nallowed_ip=fd11::2/128\nerrno=0\n\n")


def test_parse_get_real_reply():
    state = parse_get(REAL)
    assert state.private_key == K1 and state.listen_port == 51820 and state.fwmark == 0
    peer = state.peers[K2]
    assert peer.endpoint == "10.78.0.2:51820"
    assert peer.allowed_ips == ("10.211.0.2/32", "fd11::2/128")
    assert peer.last_handshake == pytest.approx(1700000000.5)
    assert (peer.rx_bytes, peer.tx_bytes, peer.keepalive) == (5678, 1234, 25)


def test_public_key_derived_from_private():
    from nacl.public import PrivateKey

    key = PrivateKey.generate()
    assert DeviceState(private_key=bytes(key), listen_port=None).public_key == bytes(key.public_key)
    assert DeviceState(private_key=None, listen_port=None).public_key is None


GOOD = [
    ("fresh device: only errno", "errno=0\n\n", DeviceState(private_key=None, listen_port=None)),
    ("no trailing blank line", "errno=0", DeviceState(private_key=None, listen_port=None)),
    ("port 0 means none", "listen_port=0\nerrno=0\n\n", DeviceState(private_key=None, listen_port=None)),
    ("fwmark", "fwmark=7\nerrno=0\n\n", DeviceState(private_key=None, listen_port=None, fwmark=7)),
    ("unknown keys ignored", f"future_device_key=1\npublic_key={H2}\nfuture_peer_key=x\nerrno=0\n\n", None),
]


@pytest.mark.parametrize("name,text,expected", GOOD, ids=[g[0] for g in GOOD])
def test_parse_get_edge_cases(name, text, expected):
    state = parse_get(text)
    if expected is not None:
        assert state == expected


def test_never_handshaken_peer_and_two_peers():
    state = parse_get(f"public_key={H2}\nlast_handshake_time_sec=0\nlast_handshake_time_nsec=0\n"
                      f"public_key={H3}\nendpoint=[fd00::3]:9\nerrno=0\n\n")
    assert set(state.peers) == {K2, K3}
    assert state.peers[K2].last_handshake is None and state.peers[K2].endpoint is None
    assert state.peers[K3].endpoint == "[fd00::3]:9" and state.peers[K3].allowed_ips == ()


MALFORMED = [
    ("empty", "", "no errno= line"),
    ("truncated: no errno", f"private_key={H1}\nlisten_port=1\n", "no errno= line"),
    ("errno not last", "errno=0\nlisten_port=1\n\n", "no errno= line"),
    ("errno not a number", "errno=zero\n\n", "errno='zero' is not an integer"),
    ("blank line inside", "listen_port=1\n\nerrno=0\n\n", "blank line before errno="),
    ("line without =", "listen_port\nerrno=0\n\n", "line 1: expected key=value"),
    ("short key", f"private_key={H1[:-2]}\nerrno=0\n\n", "64 hex digits"),
    ("non-hex key", f"public_key={'zz' * 32}\nerrno=0\n\n", "64 hex digits"),
    ("key with spaces", f"public_key={'a ' * 32}\nerrno=0\n\n", "64 hex digits"),
    ("port not a number", "listen_port=http\nerrno=0\n\n", "integer 0..65535"),
    ("port too big", "listen_port=70000\nerrno=0\n\n", "integer 0..65535"),
    ("negative rx", f"public_key={H2}\nrx_bytes=-1\nerrno=0\n\n", "integer"),
    ("nsec out of range", f"public_key={H2}\nlast_handshake_time_nsec=1000000000\nerrno=0\n\n", "integer"),
    ("peer key before public_key", "endpoint=1.2.3.4:5\nerrno=0\n\n", "peer key endpoint before any public_key"),
    ("device key inside a peer", f"public_key={H2}\nlisten_port=1\nerrno=0\n\n", "device key listen_port after"),
    ("peer twice", f"public_key={H2}\npublic_key={H2}\nerrno=0\n\n", "listed twice"),
    ("bad endpoint", f"public_key={H2}\nendpoint=nowhere\nerrno=0\n\n", "endpoint must be"),
    ("bad allowed ip", f"public_key={H2}\nallowed_ip=10.0.0.300/32\nerrno=0\n\n", "CIDR prefix"),
    ("protocol version 2", f"public_key={H2}\nprotocol_version=2\nerrno=0\n\n", "protocol_version 2"),
]


@pytest.mark.parametrize("name,text,message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_parse_get_malformed(name, text, message):
    with pytest.raises(UapiError, match="malformed UAPI reply") as info:
        parse_get(text)
    assert message in str(info.value)


ERRNOS = [(-22, "EINVAL"), (-98, "EADDRINUSE"), (-5, "EIO"), (-71, "EPROTO"), (-55, "ENOANO")]


@pytest.mark.parametrize("code,name", ERRNOS)
def test_nonzero_errno_raises_naming_it(code, name):
    for parse in (parse_get, parse_set):
        with pytest.raises(UapiError, match=name) as info:
            parse(f"errno={code}\n\n")
        assert info.value.errno == code
    # A failed get carries no device lines, but an errno wins over whatever came before it.
    with pytest.raises(UapiError, match=name):
        parse_get(f"listen_port=1\nerrno={code}\n\n")


def test_port_in_use_says_so():
    with pytest.raises(UapiError, match="listen port is in use"):
        parse_set(f"errno={-errno.EADDRINUSE}\n\n")


@pytest.mark.parametrize("text", ["errno=0\n\n", "errno=0"])
def test_parse_set_ok(text):
    parse_set(text)


@pytest.mark.parametrize("text", ["", "listen_port=1\nerrno=0\n\n", "ok\n\n"])
def test_parse_set_malformed(text):
    with pytest.raises(UapiError, match="malformed UAPI"):
        parse_set(text)


# -- the socket client, against a fake server -----------------------------------------------

async def serve(path: Path, nursery: trio.Nursery, reply: bytes | None, requests: list[bytes],
                chunk: int = 1 << 16) -> None:
    """A one-shot fake UAPI: reads one request, sends ``reply`` in ``chunk``-byte pieces
    (None: never replies)."""
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(str(path))
    sock.listen(1)

    async def one() -> None:
        conn, _ = await sock.accept()
        with conn, sock:
            data = b""
            while not data.endswith(b"\n\n"):
                data += await conn.recv(4096)
            requests.append(data)
            if reply is None:
                await trio.sleep_forever()
            for i in range(0, len(reply), chunk):
                await conn.send(reply[i:i + chunk])

    nursery.start_soon(one)


async def test_get_over_a_socket_in_small_chunks(tmp_path):
    path, requests = tmp_path / "wg.sock", []
    async with trio.open_nursery() as nursery:
        await serve(path, nursery, REAL.encode(), requests, chunk=7)
        state = await uapi_get(path)
    assert requests == [b"get=1\n\n"]
    assert state.peers[K2].rx_bytes == 5678


async def test_set_over_a_socket(tmp_path):
    path, requests = tmp_path / "wg.sock", []
    data = encode_set(listen_port=1)
    async with trio.open_nursery() as nursery:
        await serve(path, nursery, b"errno=0\n\n", requests)
        await uapi_set(path, data)
    assert requests == [data]


async def test_set_error_reply(tmp_path):
    async with trio.open_nursery() as nursery:
        await serve(tmp_path / "wg.sock", nursery, b"errno=-22\n\n", [])
        with pytest.raises(UapiError, match="EINVAL"):
            await uapi_set(tmp_path / "wg.sock", encode_set(listen_port=1))


async def test_no_socket(tmp_path):
    with pytest.raises(UapiError, match="no WireGuard UAPI socket at .*is wireguard-go running"):
        await uapi_get(tmp_path / "missing.sock")


async def test_stale_socket(tmp_path):
    path = tmp_path / "stale.sock"
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(str(path))
    sock.close()  # the file stays, nobody listens
    with pytest.raises(UapiError, match="nothing listens .*stale socket"):
        await uapi_get(path)


async def test_silent_server_times_out(tmp_path):
    async with trio.open_nursery() as nursery:
        await serve(tmp_path / "wg.sock", nursery, None, [])
        with pytest.raises(UapiError, match=r"no reply .* within 0\.2 s"):
            await uapi_get(tmp_path / "wg.sock", timeout=0.2)
        nursery.cancel_scope.cancel()


async def test_server_hangs_up_mid_reply(tmp_path):
    async with trio.open_nursery() as nursery:
        await serve(tmp_path / "wg.sock", nursery, b"listen_port=1\n", [])
        with pytest.raises(UapiError, match="closed the connection before the reply ended"):
            await uapi_get(tmp_path / "wg.sock")


@pytest.mark.parametrize("data", [b"get=1\n\n", b"set=1\nlisten_port=1\n", b"set=1\n\nset=1\n\n"])
async def test_set_refuses_what_is_not_one_set_request(tmp_path, data):
    with pytest.raises(ValueError, match="one set=1 request"):
        await uapi_set(tmp_path / "unused.sock", data)
