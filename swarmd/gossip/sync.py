"""Push-pull sync (anti-entropy): two members trade digests, then what the other lacks.

The core decides with whom (``Sync``: a random alive member every sync_interval, a dead one
every reconnect_interval); a new connection and a bootstrap address start one too.
Nothing is given to a peer before it proves membership, and nothing large is read from it
before that: the first frame either way is read with a small limit and must hold a valid
certificate for the stream's peer id. On the sync protocol:

    requester -> responder  {cert}                            (read with a 64 KiB limit)
    responder -> requester  {cert}                            (or {error}; 64 KiB limit)
    responder -> requester  {digest, claims, revoked}         (16 MiB; sent only after the check)
    requester -> responder  {records, want, claims, revoked}  (16 MiB; read only after the check)
    responder -> requester  {records}                         (16 MiB)

``digest`` is ``[peer, seq]`` of every record the responder holds; the requester sends the
records it holds newer or the responder lacks, and ``want``s the peers whose records it
lacks or holds older, which the responder then sends (syncmerge.py). So a converged pair
trades about 60 bytes a member, not every record (about a kilobyte each).

A payload also carries ``revoked``, the revocations its sender knows. A hello may instead
carry ``{cert, revoked, bye: true}``: a member that just revoked us tells us so and goes.

A payload is hostile input. A digest and a want are checked entry by entry and capped by
our view's size (``read_digest``, ``read_want``); its records are filtered first (syncmerge.py: ones we hold,
duplicates, more than the view can explain are not even verified), then verified and
checked by admission one by one, each refusal counted; its claims (``[peer, state, inc]``
about members the sender holds down) are type-checked, at most ``MAX_CLAIMS``. Only then
does the core merge them (``merge_sync``; only claims about us matter to it: we refute).
A merge that made us refute means the peer holds us suspect or dead: the core asks for a
sync with it (``Sync``), so it gets our new record at once, not by gossip it may not be part
of yet. ``request`` runs it right after the sync under way with that peer (at most once
more), or starts one (when we were the responder).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import structlog
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from ..rpc.framing import FrameTooLarge
from ..p2p.signed import Invalid
from ..p2p.streams import MAX_SMALL_FRAME, PeerError, close_quietly, open_stream, read_frame, write_frame
from .membership import REFUSED
from .protocols import MAX_SYNC_FRAME, SYNC_PROTOCOL
from .revocation import Revocation
from .state import Shared
from .syncmerge import digest, max_records, newer, read_digest, read_want, select_sync_records, wanted
from .wire import Record, Rumor

log = structlog.get_logger("swarmd.gossip")

SYNC_TIMEOUT = 5.0
MAX_CLAIMS = 100_000


class Merge(Protocol):
    """What a sync's records and rumors go through, as if they came by gossip (inbound.Inbound)."""

    def accept(self, msg: Record | Rumor | Revocation) -> str: ...
    def refused(self, record: Record, keys: list[tuple[str, bytes]] | None = None) -> bool: ...
    def merged(self, record: Record, result: str) -> None: ...
    def wg_keys(self) -> list[tuple[str, bytes]]: ...


class Syncs:
    """Wired by service.py: ``merge`` (inbound.py), ``connect`` dials a peer if need be
    (peers.py), ``own_record`` is this node's newest record (records.py), ``acted`` lets the
    core act on a merge (loop.input), ``check_member`` and ``hello_is_member`` are the gate's
    checks of a requester and of a responder, ``revocations`` and ``merge_revocations`` are
    admission's list to send and its merge of the one received."""

    def __init__(self, shared: Shared, *, merge: Merge, connect: Callable[[ID], Awaitable[None]],
                 own_record: Callable[[], Record | None], acted: Callable[[], None],
                 check_member: Callable[[Any, ID, INetStream], Awaitable[bool]],
                 hello_is_member: Callable[[Any, ID], bool], revocations: Callable[[], list[bytes]],
                 merge_revocations: Callable[[Any, str], None]) -> None:
        self.s = shared
        self._inbound, self._connect, self._own_record, self._acted = merge, connect, own_record, acted
        self._check_member, self._hello_is_member = check_member, hello_is_member
        self._revocations, self._merge_revocations = revocations, merge_revocations
        self._syncing: set[str] = set()  # peers we are syncing with, as the requester
        self._again: set[str] = set()  # ... and that the core wants synced once more after it

    def _counted(self, size: int) -> None:
        self.s.traffic.received("syncs", size)

    def busy(self, peer: str) -> bool:
        return peer in self._syncing

    def request(self, peer: str) -> None:
        """The core's ``Sync``: one with ``peer`` now, or once more right after the one under way
        (at most once more: the core asks again after a merge that made us refute)."""
        if peer in self._syncing:
            self._again.add(peer)
        else:
            self.s.start_soon(self.sync, peer)

    def held(self) -> list[Record]:
        """Every record we hold: the view's and our own newest."""
        s, own = self.s, self._own_record()
        assert s.core is not None
        records = [m.record for m in s.view()]
        if own is not None:
            records.append(own)
        return records

    def summary(self) -> dict[str, Any]:
        """The responder's first payload, once the requester proved membership: the digest of
        what we hold, our claims about members down, and the revocations we know."""
        assert self.s.core is not None
        return {"digest": digest(self.held()), "claims": self.s.core.sync_claims(), "revoked": self._revocations()}

    def offer(self, summary: Any, peer: ID) -> dict[str, Any]:
        """The requester's answer to a responder's ``summary``: the records it lacks or holds
        older, the peers we want its records of, our claims and revocations."""
        s = self.s
        assert s.core is not None
        held = self.held()
        raw = summary.get("digest") if isinstance(summary, dict) else None
        theirs, problem = read_digest(raw, len(held))
        if problem is not None:
            s.reject("sync_digest", str(peer), problem)
        want = wanted({r.peer: r.seq for r in held}, theirs, skip=s.excluded)
        return {"records": newer(held, theirs), "want": want, "claims": s.core.sync_claims(),
                "revoked": self._revocations()}

    def answer(self, offer: Any, peer: ID) -> dict[str, Any]:
        """The responder's last frame: the records of the peers the requester ``want``s that we hold."""
        held = {r.peer: r for r in self.held()}
        want, problem = read_want(offer.get("want", []) if isinstance(offer, dict) else [], len(held))
        if problem is not None:
            self.s.reject("sync_want", str(peer), problem)
        return {"records": [held[p].blob for p in want if p in held]}

    def merge(self, payload: Any, peer: ID) -> bool:
        """Merge a member's payload through the core; True when it made us refute (the core
        then asks for another sync with the peer: ``request``)."""
        s, by, inbound = self.s, str(peer), self._inbound
        assert s.core is not None and s.verifier is not None
        if not isinstance(payload, dict) or not isinstance(payload.get("records", []), list) \
                or not isinstance(payload.get("claims", []), list):
            s.reject("malformed", by, "sync payload: expected {records: [...], claims: [...]}")
            return False
        self._merge_revocations(payload.get("revoked"), by)
        view, own = s.view(), self._own_record()
        known = {m.record.blob for m in view} | ({own.blob} if own is not None else set())
        records = payload.get("records", [])
        chosen = select_sync_records(records, known, len(view))
        if len(records) > max_records(len(view)) and len(chosen) >= max_records(len(view)):
            s.reject("sync_records", by, f"sync payload: {len(records)} records for a view of {len(view)}; "
                                         f"{len(chosen)} read")
        verified: list[Record] = []
        keys = inbound.wg_keys()
        for blob in chosen:
            try:
                msg = s.verifier.decode(blob, time.time())
            except Invalid as exc:
                s.reject(exc.reason, by, exc.detail)
                continue
            if not isinstance(msg, Record):
                inbound.accept(msg)  # a rumor or a revocation: as if it came by gossip
            elif not inbound.refused(msg, keys):
                verified.append(msg)
                if msg.wg is not None:  # the first holder of a WireGuard key keeps it, within a sync too
                    keys.append((msg.peer, msg.wg.public))
        claims = []
        for c in payload.get("claims", [])[:MAX_CLAIMS]:
            if not (isinstance(c, list) and len(c) == 3 and isinstance(c[0], str) and isinstance(c[1], str)
                    and isinstance(c[2], int) and not isinstance(c[2], bool)):
                s.reject("malformed", by, f"sync claim {str(c)[:100]}: expected [peer, state, inc]")
                continue
            if c[0] == s.me:  # about others, our own probes decide: the core reads only these
                claims.append((c[0], c[1], c[2]))
        merged = s.core.merge_sync(trio.current_time(), verified, claims, by, time.time())
        for record, result in zip(verified, merged.records):
            inbound.merged(record, result)
        accusations = [(state, inc) for _, state, inc in claims if state in ("suspect", "dead")]
        for (state, inc), result in zip(accusations, merged.claims):  # one result per accusation, in order
            if result in REFUSED:
                s.reject(result, by, f"sync claim: this node {state} at incarnation {inc}")
        self._acted()
        return merged.refuted

    async def _once(self, pid: ID) -> str:
        s = self.s
        assert s.swarm is not None
        stream = await open_stream(s.host, pid, SYNC_PROTOCOL)
        try:
            await write_frame(stream, {"cert": s.swarm.cert.blob})
            if not self._hello_is_member(await read_frame(stream, MAX_SMALL_FRAME, self._counted), pid):
                return "refused"
            summary = await read_frame(stream, MAX_SYNC_FRAME, self._counted)
            await write_frame(stream, self.offer(summary, pid))
            answer = await read_frame(stream, MAX_SYNC_FRAME, self._counted)
        finally:
            await close_quietly(stream)
        theirs = dict(summary) if isinstance(summary, dict) else {}
        theirs["records"] = answer.get("records") if isinstance(answer, dict) else answer
        return "refuted" if self.merge(theirs, pid) else "done"

    async def sync(self, peer: str) -> None:
        """A sync with ``peer`` as the requester, within ``SYNC_TIMEOUT``."""
        if peer in self.s.excluded:
            return
        self._syncing.add(peer)
        pid = ID.from_base58(peer)
        started, outcome = trio.current_time(), "timeout"
        try:
            with trio.move_on_after(SYNC_TIMEOUT):
                await self._connect(pid)
                outcome = await self._once(pid)
                if peer in self._again:  # we had to refute: the peer still holds us down
                    self._again.discard(peer)
                    outcome = await self._once(pid)
        except PeerError as exc:
            outcome = str(exc)
        except Exception as exc:  # a frame too large, a bad answer
            outcome = "rejected"
            self.s.reject("sync", peer, f"{exc.__class__.__name__}: {exc}")
        finally:
            self._syncing.discard(peer)
            self._again.discard(peer)
            log.debug("sync", peer=peer, outcome=outcome, s=round(trio.current_time() - started, 3))

    async def tell_revoked(self, pid: ID, proof: list[bytes]) -> None:
        """A sync hello that carries the peer's own revocation and ends there (``bye``)."""
        s = self.s
        assert s.swarm is not None
        try:
            stream = await open_stream(s.host, pid, SYNC_PROTOCOL)
        except PeerError:
            return
        try:
            await write_frame(stream, {"cert": s.swarm.cert.blob, "revoked": proof, "bye": True})
        except PeerError:
            pass
        finally:
            await close_quietly(stream)

    async def handle_sync(self, stream: INetStream) -> None:
        """The responder's side."""
        s = self.s
        peer = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(SYNC_TIMEOUT * 2):
                hello = await read_frame(stream, MAX_SMALL_FRAME, self._counted)  # nothing large before the certificate
                if not await self._check_member(hello, peer, stream):
                    return
                if hello.get("bye") is True:  # a member that just revoked us tells us so, and goes
                    self._merge_revocations(hello.get("revoked"), str(peer))
                    return
                await write_frame(stream, {"cert": s.swarm.cert.blob})  # type: ignore[union-attr]
                await write_frame(stream, self.summary())
                offer = await read_frame(stream, MAX_SYNC_FRAME, self._counted)
                await write_frame(stream, self.answer(offer, peer))
                self.merge(offer, peer)  # a refute: the core asks for a sync back
        except FrameTooLarge as exc:
            s.reject("too_large", str(peer), f"sync request: {exc}")
        except Exception as exc:
            s.reject("sync", str(peer), f"sync request: {exc.__class__.__name__}: {exc}")
        finally:
            await close_quietly(stream)
