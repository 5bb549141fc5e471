"""The job protocol's `forward` op against hostile members: a member that is not the job's
coordinator, a port of the wrong type or range, a job not running here, a listener that is
not the job's: each refused with its reason and counted, and the handler goes on serving.
And the coordinator's side (RemoteHost.forward) over an in-memory stream to a real handler:
bytes cross to the job's listener, and the forward ends when the job's ranks do."""

from __future__ import annotations

import socket

import msgpack
import pytest
import trio

from swarmd.compute.forward import Broken
from swarmd.compute.coordinator.hosts import HostError, RemoteHost
from swarmd.compute.host.service import JOB_PROTOCOL
from swarmd.testing import FakeNet
from swarmd.rpc.framing import HEADER
from fake_stream import FakeStream
from test_forward import echo  # noqa: F401 - the fixture
from test_job_protocol import JOB, Host, req

COORD = "peerC"
PEER = "12D3KooWEdBirCjWzeQP47EVJnyFirU4agfMYgkFLuaY3BknE5ty"  # the host, as the coordinator names it


def run_here(host: Host, uid: int, coordinator: str = COORD) -> None:
    """The job's ranks run on `host` for `coordinator`, as `uid` (what Worker.start records)."""
    ledger, now = host.worker.ledger, trio.current_time()
    ledger.reserve(now, JOB, coordinator, 0, 1, 30.0)
    ledger.commit(now, JOB, coordinator, 600.0)
    ledger.start(JOB, coordinator, 1)
    host.worker.forwards.running((coordinator, JOB), uid)


def split(out: bytes) -> tuple[dict, bytes]:
    """The host's first frame, and the raw bytes after it."""
    (n,) = HEADER.unpack(out[:HEADER.size])
    return msgpack.unpackb(out[HEADER.size:HEADER.size + n], raw=False), out[HEADER.size + n:]


@pytest.mark.parametrize("port", ["8000", True, 8000.0, None, 0, 65536, -1, [8000], 2**63, -2**63])
async def test_a_port_of_the_wrong_type_or_range_is_refused(tmp_path, port):
    host = Host(tmp_path)
    run_here(host, 61185)
    assert await host.ask(COORD, req("forward", port=port)) == [
        {"error": "forward: 'port' must be an integer from 1 to 65535"}]
    assert host.rejected == {"malformed": 1}


async def test_a_job_not_running_here_or_not_the_requesters_is_refused_and_counted(tmp_path, echo):  # noqa: F811
    uid, port = echo
    host = Host(tmp_path)
    assert await host.ask(COORD, req("forward", port=port)) == [
        {"error": f"forward: job {JOB} is not running on this host"}]
    host.worker.ledger.reserve(trio.current_time(), JOB, COORD, 0, 1, 30.0)
    host.worker.ledger.commit(trio.current_time(), JOB, COORD, 600.0)
    assert await host.ask(COORD, req("forward", port=port)) == [
        {"error": f"forward: job {JOB} is not running on this host"}], "committed is not running"
    assert host.rejected == {"not_running": 2}
    host.worker.ledger.start(JOB, COORD, 1)
    host.worker.forwards.running((COORD, JOB), uid)
    replies = await host.ask("intruder", req("forward", port=port))
    assert replies == [{"error": f"forward: job {JOB} is held for another coordinator"}] and COORD not in str(replies)
    assert host.rejected["not_holder"] == 1, "another member learned the id: refused, the holder not named"


async def test_a_listener_that_is_not_the_jobs_is_refused_and_the_handler_goes_on(tmp_path, echo):  # noqa: F811
    uid, port = echo
    host = Host(tmp_path)
    run_here(host, uid + 1)
    assert await host.ask(COORD, req("forward", port=port)) == [
        {"error": f"forward: port {port} is served by uid {uid}, not by the job (uid {uid + 1})"}]
    assert host.rejected == {"forward_target": 1}
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        free = unused.getsockname()[1]
        assert await host.ask(COORD, req("forward", port=free)) == [
            {"error": f"forward: nothing listens on port {free} of this host"}]
    assert host.rejected == {"forward_target": 1}, "nothing listening is not the requester's fault"

    host.worker.forwards.running((COORD, JOB), uid)  # the same handler, the job's own listener now
    stream = FakeStream(COORD, [req("forward", port=port)], raw=b"ping")
    await host.handler.handle(stream)  # the fake's end is passed on, the echo server closes: done
    assert split(bytes(stream.out)) == ({"port": port}, b"ping")
    assert host.worker.forwards.open((COORD, JOB)) == 0 and host.handler.streams.open == {}


def one_host(nursery: trio.Nursery, handler, me: str):
    """`me`'s libp2p host on an in-memory network whose host PEER serves the job protocol with `handler`."""
    net = FakeNet(nursery)
    net.host(PEER).set_stream_handler(JOB_PROTOCOL, handler.handle)
    return net.host(me)


async def test_the_coordinator_forwards_through_the_host_until_the_jobs_ranks_end(tmp_path, echo):  # noqa: F811
    uid, port = echo
    host = Host(tmp_path)
    run_here(host, uid)
    async with trio.open_nursery() as nursery:
        remote = RemoteHost(PEER, one_host(nursery, host.handler, COORD), b"member")
        async with remote.forward(JOB, port) as (end, stop):
            assert stop is None  # the host ends it: its stream closes
            await end.send(b"hello over the swarm")
            got = b""
            while len(got) < 20:
                got += await end.receive(1024)
            assert got == b"hello over the swarm"
            assert host.worker.forwards.open((COORD, JOB)) == 1
            host.worker.forwards.ended((COORD, JOB))  # the job's ranks ended on the host
            # the host resets the stream (the coordinator must not write on into it), as yamux
            # shows it: the in-memory fake that returned b"" there had no reset at all
            with trio.fail_after(5), pytest.raises(Broken, match="reset"):
                await end.receive(1024)
        with pytest.raises(HostError, match=f"job {JOB} is not running on this host"):
            async with remote.forward(JOB, port):
                pass
    assert host.rejected == {"not_running": 1}


async def test_the_origin_forwards_to_its_job_while_a_successor_coordinates_it_and_commands_nothing(
        tmp_path, echo):  # noqa: F811
    """`jobs forward` from the owner's daemon after a hand-over: the host passes its origin's
    forward at the old epoch (a forward commands nothing) while the fence refuses its commands;
    another member naming the origin's job is refused as before."""
    from compute.test_succession import PEER as PEERS
    from test_job_handover import the_charter

    uid, port = echo
    origin, successor, intruder = PEERS["o"], PEERS["h2"], PEERS["x"]
    host = Host(tmp_path)
    run_here(host, uid, coordinator=origin)
    charter = the_charter()
    host.worker.authorize(JOB, successor, origin, 1, charter)  # the successor attached at epoch 1
    claim = {"origin": origin, "epoch": 0, "charter": charter.blob}
    stream = FakeStream(origin, [req("forward", port=port, **claim)], raw=b"ping")
    await host.handler.handle(stream)
    assert split(bytes(stream.out)) == ({"port": port}, b"ping")
    refused = await host.ask(origin, req("cancel", **claim))
    assert "successor took it over" in refused[0]["error"] and host.rejected == {"stale_epoch": 1}
    refused = await host.ask(intruder, req("forward", port=port, **claim))
    assert "error" in refused[0] and host.rejected["not_replica"] == 1, (refused, host.rejected)
    assert host.worker.forwards.open((origin, JOB)) == 0 and host.worker.ledger.state_of(JOB, origin) == "running"
