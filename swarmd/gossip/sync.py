"""Push-pull sync (anti-entropy): two members exchange everything they hold.

The core decides with whom (``Sync``: a random alive member every sync_interval, a dead one
every reconnect_interval); a new connection and a bootstrap address start one too.
Nothing is given to a peer before it proves membership, and nothing large is read from it
before that: the first frame either way is read with a small limit and must hold a valid
certificate for the stream's peer id. On the sync protocol:

    requester -> responder  {cert}                  (read with a 64 KiB limit)
    responder -> requester  {cert}                  (or {error}; 64 KiB limit)
    responder -> requester  {records, claims}       (16 MiB; sent only after the check)
    requester -> responder  {records, claims}       (16 MiB; read only after the check)

A payload also carries ``revoked``, the revocations its sender knows. A hello may instead
carry ``{cert, revoked, bye: true}``: a member that just revoked us tells us so and goes.

A payload is hostile input. Its records are filtered first (syncmerge.py: ones we hold,
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
from typing import TYPE_CHECKING, Any

import structlog
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from ..rpc.framing import FrameTooLarge
from ..p2p.signed import Invalid
from ..p2p.streams import MAX_SMALL_FRAME, MAX_SYNC_FRAME, SYNC_PROTOCOL, PeerError, close_quietly, open_stream, \
    read_frame, write_frame
from .membership import REFUSED
from .syncmerge import max_records, select_sync_records
from .wire import Record

if TYPE_CHECKING:
    from .service import Gossip

log = structlog.get_logger("swarmd.gossip")

SYNC_TIMEOUT = 5.0
MAX_CLAIMS = 100_000


class Syncs:
    def __init__(self, gossip: Gossip) -> None:
        self.g = gossip
        self._syncing: set[str] = set()  # peers we are syncing with, as the requester
        self._again: set[str] = set()  # ... and that the core wants synced once more after it

    def busy(self, peer: str) -> bool:
        return peer in self._syncing

    def request(self, peer: str) -> None:
        """The core's ``Sync``: one with ``peer`` now, or once more right after the one under way
        (at most once more: the core asks again after a merge that made us refute)."""
        if peer in self._syncing:
            self._again.add(peer)
        elif self.g.nursery is not None:
            self.g.nursery.start_soon(self.sync, peer)

    def payload(self) -> dict[str, Any]:
        """What a sync sends once the other side proved membership: every record we hold, our
        claims about members down, and the revocations we know."""
        g = self.g
        records = [m.record.blob for m in g.view()]
        if g.own_record is not None:
            records.append(g.own_record.blob)
        return {"records": records, "claims": g.core.sync_claims(), "revoked": g.admission.for_sync()}

    def merge(self, payload: Any, peer: ID) -> bool:
        """Merge a member's payload through the core; True when it made us refute (the core
        then asks for another sync with the peer: ``request``)."""
        g, by = self.g, str(peer)
        if not isinstance(payload, dict) or not isinstance(payload.get("records", []), list) \
                or not isinstance(payload.get("claims", []), list):
            g.reject("malformed", by, "sync payload: expected {records: [...], claims: [...]}")
            return False
        g.admission.merge(payload.get("revoked"), by)
        view = g.view()
        known = {m.record.blob for m in view} | ({g.own_record.blob} if g.own_record is not None else set())
        records = payload.get("records", [])
        chosen = select_sync_records(records, known, len(view))
        if len(records) > max_records(len(view)) and len(chosen) >= max_records(len(view)):
            g.reject("sync_records", by, f"sync payload: {len(records)} records for a view of {len(view)}; "
                                         f"{len(chosen)} read")
        verified: list[Record] = []
        keys = g.inbound.wg_keys()
        for blob in chosen:
            try:
                msg = g.verifier.decode(blob, time.time())  # type: ignore[union-attr]
            except Invalid as exc:
                g.reject(exc.reason, by, exc.detail)
                continue
            if not isinstance(msg, Record):
                g.inbound.accept(msg)  # a rumor or a revocation: as if it came by gossip
            elif not g.inbound.refused(msg, keys):
                verified.append(msg)
                if msg.wg is not None:  # the first holder of a WireGuard key keeps it, within a sync too
                    keys.append((msg.peer, msg.wg.public))
        claims = []
        for c in payload.get("claims", [])[:MAX_CLAIMS]:
            if not (isinstance(c, list) and len(c) == 3 and isinstance(c[0], str) and isinstance(c[1], str)
                    and isinstance(c[2], int) and not isinstance(c[2], bool)):
                g.reject("malformed", by, f"sync claim {str(c)[:100]}: expected [peer, state, inc]")
                continue
            if c[0] == g.me:  # about others, our own probes decide: the core reads only these
                claims.append((c[0], c[1], c[2]))
        merged = g.core.merge_sync(trio.current_time(), verified, claims, by, time.time())
        for record, result in zip(verified, merged.records):
            g.inbound.merged(record, result)
        accusations = [(state, inc) for _, state, inc in claims if state in ("suspect", "dead")]
        for (state, inc), result in zip(accusations, merged.claims):  # one result per accusation, in order
            if result in REFUSED:
                g.reject(result, by, f"sync claim: this node {state} at incarnation {inc}")
        g.loop.input()
        return merged.refuted

    async def _once(self, pid: ID) -> str:
        g = self.g
        assert g.swarm is not None
        stream = await open_stream(g.host, pid, SYNC_PROTOCOL)
        try:
            await write_frame(stream, {"cert": g.swarm.cert.blob})
            if not g.gate.hello_is_member(await read_frame(stream, MAX_SMALL_FRAME), pid):
                return "refused"
            theirs = await read_frame(stream, MAX_SYNC_FRAME)
            await write_frame(stream, self.payload())
        finally:
            await close_quietly(stream)
        return "refuted" if self.merge(theirs, pid) else "done"

    async def sync(self, peer: str) -> None:
        """A sync with ``peer`` as the requester, within ``SYNC_TIMEOUT``."""
        g = self.g
        if peer in g.excluded:
            return
        self._syncing.add(peer)
        pid = ID.from_base58(peer)
        started, outcome = trio.current_time(), "timeout"
        try:
            with trio.move_on_after(SYNC_TIMEOUT):
                await g.peers.ensure_connected(pid)
                outcome = await self._once(pid)
                if peer in self._again:  # we had to refute: the peer still holds us down
                    self._again.discard(peer)
                    outcome = await self._once(pid)
        except PeerError as exc:
            outcome = str(exc)
        except Exception as exc:  # a frame too large, a bad answer
            outcome = "rejected"
            g.reject("sync", peer, f"{exc.__class__.__name__}: {exc}")
        finally:
            self._syncing.discard(peer)
            self._again.discard(peer)
            log.debug("sync", peer=peer, outcome=outcome, s=round(trio.current_time() - started, 3))

    async def tell_revoked(self, pid: ID, proof: list[bytes]) -> None:
        """A sync hello that carries the peer's own revocation and ends there (``bye``)."""
        g = self.g
        assert g.swarm is not None
        try:
            stream = await open_stream(g.host, pid, SYNC_PROTOCOL)
        except PeerError:
            return
        try:
            await write_frame(stream, {"cert": g.swarm.cert.blob, "revoked": proof, "bye": True})
        except PeerError:
            pass
        finally:
            await close_quietly(stream)

    async def handle_sync(self, stream: INetStream) -> None:
        """The responder's side."""
        g = self.g
        peer = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(SYNC_TIMEOUT * 2):
                hello = await read_frame(stream, MAX_SMALL_FRAME)  # nothing large before the certificate
                if not await g.check_member(hello, peer, stream):
                    return
                if hello.get("bye") is True:  # a member that just revoked us tells us so, and goes
                    g.admission.merge(hello.get("revoked"), str(peer))
                    return
                await write_frame(stream, {"cert": g.swarm.cert.blob})  # type: ignore[union-attr]
                await write_frame(stream, self.payload())
                self.merge(await read_frame(stream, MAX_SYNC_FRAME), peer)  # a refute: the core asks for a sync back
        except FrameTooLarge as exc:
            g.reject("too_large", str(peer), f"sync request: {exc}")
        except Exception as exc:
            g.reject("sync", str(peer), f"sync request: {exc.__class__.__name__}: {exc}")
        finally:
            await close_quietly(stream)
