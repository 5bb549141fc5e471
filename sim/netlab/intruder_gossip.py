"""The intruder's attacks on membership, as a certified member (see intruder.py; issue 11).

Each takes what the intruder holds (its libp2p host and signing key, the member certificate
it issued itself, a way to gossip on the swarm topic) and the command line's arguments,
sends what a rogue member could send, and returns one line saying what it sent and what
came back.

- ``incarnation``: suspect and dead rumors about the target at incarnations up to 2^64 - 2,
  and a sync claiming the target dead at 2^64 - 1 (once, the target refuted with seq + 1,
  which msgpack could not encode, and died).
- ``false-dead``: a burst of ``--count`` dead rumors about a healthy member (``--about``) at
  ``--inc``: one member's word must not evict anyone.
- ``presync-oversize``: a 16 MiB sync frame, without a certificate: refused from its header.
- ``streams``: ``--count`` concurrent sync streams from this one peer, held ``--seconds``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID

from swarmd.gossip.cert import Cert
from swarmd.p2p.signed import Signer
from swarmd.gossip.protocols import MAX_SYNC_FRAME, SYNC_PROTOCOL
from swarmd.p2p.streams import MAX_SMALL_FRAME, PeerError, close_quietly, open_stream, read_frame, write_frame
from swarmd.gossip.wire import MAX_SEQ, make_rumor
from swarmd.rpc.framing import HEADER

GOSSIP_ATTACKS = ("incarnation", "false-dead", "presync-oversize", "streams")


async def sync_exchange(host: IHost, peer: ID, hello: dict[str, Any],
                        payload: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """A sync as protocol 3 runs it (sync.py): our certificate, theirs, their digest, our
    records and the peers we want (by default every one their digest names), their records.
    Returns (their first answer, their digest's frame with the records they sent, or None
    when they refused)."""
    stream = await open_stream(host, peer, SYNC_PROTOCOL)
    try:
        await write_frame(stream, hello)
        answer = await read_frame(stream, MAX_SMALL_FRAME)
        if not isinstance(answer, dict) or "error" in answer:
            return answer, None
        theirs = await read_frame(stream, MAX_SYNC_FRAME)
        digest = theirs.get("digest") if isinstance(theirs, dict) else None
        want = [e[0] for e in digest if isinstance(e, list) and e] if isinstance(digest, list) else []
        await write_frame(stream, {"records": [], "claims": [], "want": want, **(payload or {})})
        sent = await read_frame(stream, MAX_SYNC_FRAME)
        with trio.move_on_after(2):  # until the target hangs up: it has read our records then
            try:
                await stream.read(1)
            except Exception:
                pass
        if isinstance(theirs, dict) and isinstance(sent, dict):
            theirs = {**theirs, "records": sent.get("records", [])}
        return answer, theirs
    finally:
        await close_quietly(stream)


async def attack(name: str, *, host: IHost, target: ID, me: str, sign: Signer, swarm: str, cert: Cert,
                 gossip: Callable[[list[bytes]], Awaitable[None]], args: argparse.Namespace) -> str:
    def rumor(kind: str, about: str, inc: int) -> bytes:
        return make_rumor(sign, kind=kind, swarm=swarm, sender=me, about=about, incarnation=inc, issued=time.time(),
                          cert=cert)

    victim = str(target)
    match name:
        case "incarnation":
            await gossip([rumor("suspect", victim, 2**64 - 2), rumor("dead", victim, MAX_SEQ - 1),
                          rumor("suspect", victim, MAX_SEQ - 2)])
            claims = [[victim, "dead", 2**64 - 1], [victim, "suspect", MAX_SEQ - 1]]
            with trio.fail_after(30):
                answer, _ = await sync_exchange(host, target, {"cert": cert.blob}, {"records": [], "claims": claims})
            return (f"gossiped suspect/dead rumors about the target at 2^64-2, 2^63-1, 2^63-2 and synced claims at "
                    f"2^64-1 and 2^63-1; its certificate came back: {isinstance(answer, dict) and 'cert' in answer}")
        case "false-dead":
            about = args.about or victim
            inc = args.inc if args.inc is not None else 0
            await gossip([rumor("dead", about, inc) for _ in range(args.count)])  # at once: a burst
            return f"gossiped {args.count} dead rumors about {about} at incarnation {inc}"
        case "presync-oversize":
            stream = await host.new_stream(target, [SYNC_PROTOCOL])
            answer: Any = "nothing"
            try:
                await stream.write(HEADER.pack(MAX_SYNC_FRAME) + os.urandom(64 * 1024))
                with trio.move_on_after(10):
                    try:
                        answer = await read_frame(stream, MAX_SMALL_FRAME)
                    except PeerError as exc:
                        answer = str(exc)
            finally:
                await close_quietly(stream)
            return f"sent a {MAX_SYNC_FRAME}-byte sync frame's header and 64 KiB of it, no certificate; answer: {answer}"
        case "streams":
            opened: list[Any] = []
            failed = 0

            async def open_one() -> None:
                nonlocal failed
                try:
                    opened.append(await host.new_stream(target, [SYNC_PROTOCOL]))
                except Exception:
                    failed += 1

            with trio.move_on_after(60):
                async with trio.open_nursery() as nursery:
                    for _ in range(args.count):
                        nursery.start_soon(open_one)
            refused = 0

            async def probe(stream: Any) -> None:
                nonlocal refused
                with trio.move_on_after(args.seconds):
                    try:
                        if not await stream.read(1):
                            refused += 1
                    except Exception:
                        refused += 1  # reset by the target: refused at once

            async with trio.open_nursery() as nursery:
                for stream in opened:
                    nursery.start_soon(probe, stream)
            for stream in opened:
                with trio.move_on_after(1):
                    try:
                        await stream.reset()
                    except Exception:
                        pass
            return (f"opened {len(opened)} concurrent sync streams ({failed} could not be opened); "
                    f"{refused} were refused within {args.seconds:g} s")
    raise AssertionError(name)
