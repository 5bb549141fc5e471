"""The intruder's attacks on a host's jobs, as a certified member (see intruder.py).

Each takes the intruder's libp2p host, the target's peer id, the member certificate it
issued itself and the command line's arguments, sends what a rogue member could send over
the job protocol, and returns one line saying what it sent and what came back.
"""

from __future__ import annotations

import argparse
import secrets
import time
from typing import Any

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID

from swarmd.compute import ids
from swarmd.compute.messages import role_to_wire
from swarmd.compute.host.service import JOB_PROTOCOL
from swarmd.compute.torchenv import NodeRole
from swarmd.p2p.streams import MAX_SMALL_FRAME, PeerError, close_quietly, read_frame, write_frame

BAD_IDS = ["/var/lib/swarmd", "../x", "/tmp/swarmd-intruder-x", ".", "0" * 5000, "０１２３４５６７８９ab",
           "0123456789ab/../../etc"]
# a rank that prints as fast as it can, for a coordinator that never reads
CHATTY = "import sys\nwhile True:\n    sys.stdout.write('x' * 1000 + '\\n')\n"


def new_id() -> str:
    return ids.encode((int(time.time() * 1000) << ids.RANDOM_BITS) | secrets.randbits(ids.RANDOM_BITS))


def start_body(job: str, procs: int, cmd: list[str]) -> dict[str, Any]:
    role = NodeRole(job_id=job, node_rank=0, nnodes=1, procs_per_node=procs, master_addr="127.0.0.1",
                    master_port=29500, ifname=None, gpus=(), node_ips=("127.0.0.1",), checkpoint_dir="")
    return {"role": role_to_wire(role), "cmd": cmd, "env": {}, "python": None, "workdir": None}


class Member:
    """The job protocol as a rogue member speaks it."""

    def __init__(self, host: IHost, target: ID, cert: bytes) -> None:
        self.host, self.target, self.cert = host, target, cert

    async def ask(self, op: str, job: str, *more: dict[str, Any], **fields: Any) -> Any:
        """One request (and any further frames); the first reply, or what went wrong."""
        with trio.fail_after(30):
            stream = await self.host.new_stream(self.target, [JOB_PROTOCOL])
            try:
                await write_frame(stream, {"op": op, "job": job, "cert": self.cert, **fields})
                for frame in more:
                    await write_frame(stream, frame)
                return await read_frame(stream, MAX_SMALL_FRAME)
            except PeerError as exc:
                return {"closed": str(exc)}
            finally:
                await close_quietly(stream)

    async def hold(self, job: str, ranks: int) -> None:
        """Reserve and commit a job slot for `ranks` ranks, as a coordinator would."""
        for op, fields in (("reserve", {"gpus": 0, "ranks": ranks, "lease": 60.0}), ("commit", {})):
            reply = await self.ask(op, job, **fields)
            if not isinstance(reply, dict) or "error" in reply:
                raise SystemExit(f"intruder: the target refused {op}: {reply}")


def refused(reply: Any) -> bool:
    return isinstance(reply, dict) and "error" in reply


async def attack(name: str, host: IHost, target: ID, cert: bytes, args: argparse.Namespace) -> str:
    m = Member(host, target, cert)
    match name:
        case "job-ids":
            replies = [await m.ask("reserve", job, gpus=0, ranks=1, lease=60.0) for job in BAD_IDS]
            replies.append(await m.ask("start", "/tmp/swarmd-intruder-x", start_body("/tmp/swarmd-intruder-x", 1, ["id"])))
            return (f"sent {len(replies)} job requests with path-like and oversize ids; "
                    f"{sum(map(refused, replies))} refused; first reply: {replies[0]}")
        case "job-no-commit":
            job = new_id()
            await m.ask("reserve", job, gpus=0, ranks=1, lease=60.0)
            reply = await m.ask("start", job, start_body(job, 1, ["id"]))
            await m.ask("release", job)
            return f"started job {job} without committing its reservation; reply: {reply}"
        case "job-foreign":
            if not args.job:
                raise SystemExit("intruder: job-foreign needs --job (a real job's id)")
            replies = {op: await m.ask(op, args.job, *more) for op, more in
                       (("start", (start_body(args.job, 1, ["id"]),)), ("cancel", ()), ("release", ()))}
            return (f"sent start, cancel and release of another coordinator's job {args.job}; "
                    f"{sum(map(refused, replies.values()))} refused; replies: {replies}")
        case "job-ranks":
            job = new_id()
            await m.hold(job, ranks=1)
            reply = await m.ask("start", job, start_body(job, 8, ["id"]))
            await m.ask("release", job)
            return f"started 8 ranks of job {job} after reserving 1; reply: {reply}"
        case "job-no-read":
            job = new_id()
            await m.hold(job, ranks=1)
            with trio.fail_after(30):
                stream = await host.new_stream(target, [JOB_PROTOCOL])
                await write_frame(stream, {"op": "start", "job": job, "cert": cert})
                await write_frame(stream, start_body(job, 1, ["python", "-c", CHATTY]))
            await trio.sleep(args.seconds)  # never reading a byte of what the rank prints
            await close_quietly(stream)
            return f"started job {job} with a rank printing as fast as it can and read nothing for {args.seconds:g} s"
    raise AssertionError(name)
