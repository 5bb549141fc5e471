"""The trio side of swarm admission: joins and renewals on the owner, revocations everywhere.

Inputs: join and renew requests (owner node), revocations from gossip and syncs, records
entering the view, the clock. Outputs: certificates, the revocation list on disk, exclusions
from the membership (``Gossip.exclude_peer``), refusals counted in
``swarmd_rejected_total{subsystem="gossip", reason}``. Checks are the sans-IO ones in ``cert.py``,
``revocation.py`` and ``owner.py``; this module only reads and writes files, talks to peers
and keeps time.

- Join (owner): a ticket the owner recorded, with uses left, admits the authenticated peer
  once; the certificate names an overlay address the owner allocated (``owner.Members``). A
  peer it already certified (a retry after a lost reply) gets its certificate again without
  using the ticket up. A revoked peer is refused.
- Renew (owner): a peer showing its own current certificate, not revoked, gets a fresh one
  with the same roles and address (or a first address, for an older certificate).
- Renewal (member): from ``cert.renew_due`` on, ask the owner node (found by its
  certificate's ``owner`` role in the view, else the bootstrap addresses), with backoff,
  and save the new certificate to ``swarm.json``.
- Revocations: kept on disk, fed to the ``Verifier`` (a revoked signer's messages are
  refused) and the membership (``exclude_peer``); the revoked node itself notes it.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import structlog
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from multiaddr import Multiaddr

from ..wg import address
from ..p2p.signed import Invalid, peer_bytes
from ..p2p.streams import PeerError, close_quietly, read_frame, request, write_frame
from . import swarmstate
from .cert import EXPIRY_WARNING, Cert, check_cert, read_ticket, renew_due
from .owner import Refused
from .protocols import JOIN_PROTOCOL
from .revocation import MAX_SYNC, Revocation, Revocations, check_revocation, make_revocation
from .state import Shared
from .wire import MeshInfo, Record

log = structlog.get_logger("swarmd.admission")

JOIN_TIMEOUT = 10.0
RENEW_RETRY = (10.0, 3600.0)  # first and longest wait between renewal attempts
CHECK_INTERVAL = 1.0  # how often the clock-driven checks run (expiry, renewal due)


class Admission:
    """Wired by service.py: ``exclude`` takes a revoked member out of the view
    (``Gossip.exclude_peer``), ``publish`` puts a revocation on the swarm topic,
    ``readvertise`` publishes our record after a renewal, ``mesh_info`` is this node's side
    of the mesh (its overlay address is in use)."""

    def __init__(self, shared: Shared, *, exclude: Callable[[str, str], None], publish: Callable[[bytes], None],
                 readvertise: Callable[[], None], mesh_info: Callable[[], MeshInfo | None]) -> None:
        self.s = shared
        self._exclude, self._publish, self._readvertise, self._mesh_info = exclude, publish, readvertise, mesh_info
        self.state_dir: Path | None = None  # None: nothing on disk (tests)
        self.network = address.DEFAULT_NETWORK
        self.revocations = Revocations()
        self.revoked_self: Revocation | None = None
        self.renewal: dict[str, Any] = {"last": None, "error": None, "next": None}

    def configure(self, state_dir: Path, network: str) -> None:
        self.state_dir = Path(state_dir)
        self.network = ipaddress.IPv4Network(network)

    # --- start and the clock ------------------------------------------------------------

    def start(self) -> None:
        """The swarm is known (at start or after a join): load the revocations kept on disk."""
        swarm = self.s.swarm
        assert swarm is not None
        if self.state_dir is None:
            return
        try:
            kept = swarmstate.load_revocations(self.state_dir, swarm, time.time())
        except swarmstate.SwarmStateError as exc:  # members send them again at the next sync
            damaged = self.state_dir / swarmstate.REVOKED_FILE
            damaged.rename(damaged.with_name(damaged.name + ".damaged"))
            log.error("revocations on disk unreadable; moved aside, relearning them from members", error=str(exc))
            kept = []
        for r in kept:
            self._learn(r)

    async def run(self) -> None:
        delay, next_try = RENEW_RETRY[0], 0.0
        while True:
            await trio.sleep(CHECK_INTERVAL)
            swarm = self.s.swarm
            if swarm is None or self.revoked_self is not None:
                continue
            now = time.time()
            if now < renew_due(swarm.cert) or trio.current_time() < next_try:
                continue
            # a certificate without an address is due at once (cert.renew_due); an owner that still
            # gives none (older software) is asked again with backoff, not every second
            ok = await self.renew() and self.s.swarm.cert.addr4 is not None
            delay = RENEW_RETRY[0] if ok else min(RENEW_RETRY[1], delay * 2)
            next_try = trio.current_time() + (0 if ok else self.s.rng.uniform(delay / 2, delay))
            self.renewal["next"] = None if ok else now + (next_try - trio.current_time())

    # --- revocations --------------------------------------------------------------------

    def received(self, r: Revocation) -> None:
        """A checked revocation, from gossip or a sync."""
        if self._learn(r):
            self._save()

    def _save(self) -> None:
        if self.state_dir is not None:
            swarmstate.save_revocations(self.state_dir, self.revocations.all())

    def _learn(self, r: Revocation) -> bool:
        """Apply a revocation; True when it is news (the caller saves the list)."""
        if not self.revocations.add(r):
            return False
        verifier = self.s.verifier
        if verifier is not None and r.peer != self.s.me:  # our own record is still decoded here
            verifier.revoked.add(r.peer)
        if r.peer == self.s.me:
            self.revoked_self = r
            log.error("this node's membership was revoked by the swarm's owner", reason=r.reason)
            return True
        swarm = self.s.swarm
        if swarm is not None and swarm.is_owner and self.state_dir is not None:
            members = swarmstate.load_members(self.state_dir)
            members.revoke(r.peer, r.issued)
            swarmstate.save_members(self.state_dir, members)
        log.warning("member revoked", peer=r.peer, reason=r.reason)
        self._exclude(r.peer, "revoked" + (f": {r.reason}" if r.reason else ""))
        return True

    def merge(self, blobs: Any, peer: str) -> None:
        """The revocation list a sync payload carries."""
        if blobs is None:
            return
        swarm = self.s.swarm
        if not isinstance(blobs, list) or len(blobs) > MAX_SYNC or swarm is None:
            self.s.reject("malformed", peer, f"sync.revoked: expected a list of at most {MAX_SYNC}")
            return
        news = False
        for blob in blobs:
            try:
                r = check_revocation(blob, owner_public=swarm.owner_public, swarm=swarm.swarm, now=time.time())
            except Invalid as exc:
                self.s.reject(exc.reason, peer, exc.detail)
                continue
            news |= self._learn(r)
        if news:
            self._save()  # once per sync, not once per revocation

    def for_sync(self) -> list[bytes]:
        return self.revocations.for_sync()

    def revoke(self, peer: str, reason: str) -> Revocation:
        """Owner: revoke ``peer`` here and tell the swarm."""
        swarm = self.s.swarm
        assert swarm is not None and swarm.is_owner
        existing = self.revocations.get(peer)
        if existing is not None:
            return existing
        r = make_revocation(swarmstate.owner_signer(swarm), swarm.swarm, peer, now=time.time(), reason=reason)
        self.received(r)
        self._publish(r.blob)
        return r

    def proof_of_revocation(self, peer: str) -> list[bytes]:
        """The revocation of ``peer``, sent with a refusal: a node revoked while it was away
        learns it from the first member that turns it down (it checks the owner's signature)."""
        r = self.revocations.get(peer)
        return [] if r is None else [r.blob]

    def refuses(self, peer: str) -> str | None:
        """Why a stream from ``peer`` is not served (its certificate already checked), or None."""
        if peer in self.revocations:
            return f"{peer} is revoked by the swarm's owner"
        return None

    def refuse_record(self, record: Record, view: Iterable[tuple[str, bytes]]) -> tuple[str, str] | None:
        """(reason, detail) when a checked record must not enter the view: its WireGuard key is
        held by another member (the first holder keeps it), given ``view`` as (peer, key)."""
        if record.wg is None:
            return None
        for peer, public in view:
            if public == record.wg.public and peer != record.peer:
                return "wg_key_taken", f"WireGuard key already held by {peer}"
        return None

    # --- the owner's side of joins and renewals -----------------------------------------

    async def handle_join(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(JOIN_TIMEOUT):
                req = await read_frame(stream, 8192)
                try:
                    cert = self._answer(req, str(peer))
                except swarmstate.SwarmStateError as exc:
                    log.error("cannot admit: the owner's records need attention", error=str(exc))
                    await write_frame(stream, {"error": "the owner's node cannot admit anyone now (its records "
                                                        "need its operator's attention)"})
                    return
                except (Refused, Invalid) as exc:
                    reason = exc.reason if isinstance(exc, Invalid) else "join_refused"
                    self.s.reject(reason, str(peer), str(exc) if not isinstance(exc, Invalid) else exc.detail)
                    await write_frame(stream, {"error": exc.detail if isinstance(exc, Invalid) else str(exc)})
                    return
                await write_frame(stream, {"cert": cert.blob})
                log.info("certified", peer=str(peer), expires=round(cert.expires), addr4=cert.addr4,
                         renewal=isinstance(req, dict) and "renew" in req)
        except Exception as exc:
            self.s.reject("join", str(peer), f"{exc.__class__.__name__}: {exc}")
        finally:
            await close_quietly(stream)

    def _answer(self, req: Any, peer: str) -> Cert:
        swarm = self.s.swarm
        if swarm is None or not swarm.is_owner:
            raise Refused("this node does not hold the swarm's owner key")
        if not isinstance(req, dict) or ("ticket" in req) == ("renew" in req):
            raise Invalid("malformed", "a join request holds a ticket or a certificate to renew")
        if peer in self.revocations:
            raise Invalid("revoked", "this peer is revoked by the swarm's owner")
        now = time.time()
        if "renew" in req:  # the signatures first: nothing is read from disk for a stranger
            old = check_cert(req["renew"], owner_public=swarm.owner_public, swarm=swarm.swarm,
                             peer=peer_bytes(peer), now=now)
            roles, ttl, addr, ticket = old.roles, max(60.0, old.expires - old.issued), old.addr4, None
        else:
            ticket = read_ticket(req["ticket"], owner_public=swarm.owner_public, now=now)
            roles, ttl, addr = ticket.roles, ticket.cert_ttl, None
        state_dir = self.state_dir
        members = swarmstate.load_members(state_dir) if state_dir else None
        if members is not None and members.is_revoked(peer):
            raise Invalid("revoked", "this peer is revoked by the swarm's owner")
        if ticket is not None:
            if state_dir is not None:
                invites = swarmstate.load_invites(state_dir)
                if members is not None and members.holds_valid(peer, now):
                    pass  # certified before (a retry after a lost reply): no use consumed
                else:
                    invites.use(ticket.nonce, peer, now)
                invites.prune(now)
                swarmstate.save_invites(state_dir, invites)
        assert swarm.owner_key is not None
        return swarmstate.certify(state_dir, swarm.owner_key, peer_bytes(peer), now=now, network=self.network,
                                  roles=roles, ttl=ttl, addr4=addr, in_use=self._addresses_in_use(peer),
                                  members=members)

    def _addresses_in_use(self, peer: str) -> set[ipaddress.IPv4Address]:
        """Overlay addresses other members advertise or hold by certificate (ours too)."""
        out = set()
        for m in self.s.view():
            if m.peer == peer:
                continue
            for a in (m.record.wg.addr4 if m.record.wg else None, m.record.cert.addr4):
                if a is not None:
                    out.add(ipaddress.IPv4Address(a))
        own = self._mesh_info()
        if own is not None:
            out.add(ipaddress.IPv4Address(own.addr4))
        return out

    def record_invite(self, ticket: bytes, uses: int) -> None:
        """Owner: remember an invite just made, so that a join can use it up."""
        swarm = self.s.swarm
        assert swarm is not None and self.state_dir is not None
        t = read_ticket(ticket, owner_public=swarm.owner_public, now=time.time())
        invites = swarmstate.load_invites(self.state_dir)
        invites.add(t.nonce, uses=uses, expires=t.expires, now=time.time())
        swarmstate.save_invites(self.state_dir, invites)

    # --- a member's renewal -------------------------------------------------------------

    async def renew(self) -> bool:
        """Ask the owner for a fresh certificate; True when one was saved."""
        swarm = self.s.swarm
        assert swarm is not None
        self.renewal["last"] = time.time()
        try:
            if swarm.is_owner:  # an owner certificate from before addresses gets one here
                assert swarm.owner_key is not None
                cert = swarmstate.certify(self.state_dir, swarm.owner_key, peer_bytes(self.s.me),
                                          now=time.time(), network=self.network, roles=swarm.cert.roles,
                                          ttl=max(60.0, swarm.cert.expires - swarm.cert.issued),
                                          addr4=swarm.cert.addr4, in_use=self._addresses_in_use(self.s.me))
            else:
                cert = await self._ask_owner(swarm)
        except (PeerError, Refused, Invalid, OSError, trio.TooSlowError) as exc:
            detail = exc.detail if isinstance(exc, Invalid) else str(exc)
            self.renewal["error"] = detail
            log.warning("certificate renewal failed", error=detail, expires=round(swarm.cert.expires))
            return False
        self.adopt_cert(cert)
        return True

    def adopt_cert(self, cert: Cert) -> None:
        swarm = self.s.swarm
        assert swarm is not None
        if self.state_dir is not None:
            swarm = swarmstate.save_cert(self.state_dir, swarm, cert)
        else:
            swarm = swarmstate.SwarmMembership(swarm=swarm.swarm, owner_public=swarm.owner_public, cert=cert,
                                               bootstrap=swarm.bootstrap, owner_key=swarm.owner_key)
        self.s.swarm = swarm
        self.renewal["error"] = None
        log.info("certificate renewed", expires=round(cert.expires), addr4=cert.addr4)
        self._readvertise()

    async def _ask_owner(self, swarm: swarmstate.SwarmMembership) -> Cert:
        errors = []
        for pid, addrs in self._owner_candidates(swarm):
            try:
                with trio.fail_after(JOIN_TIMEOUT):
                    if addrs:
                        await self.s.host.connect(PeerInfo(pid, addrs))
                    reply = await request(self.s.host, pid, JOIN_PROTOCOL, {"renew": swarm.cert.blob})
            except Exception as exc:
                errors.append(f"{pid}: {exc.__class__.__name__}: {exc}")
                continue
            if not isinstance(reply, dict) or "cert" not in reply:
                reason = reply.get("error") if isinstance(reply, dict) else "a malformed answer"
                raise Refused(f"the owner refused: {str(reason)[:300]}")
            cert = check_cert(reply["cert"], owner_public=swarm.owner_public, swarm=swarm.swarm,
                              peer=peer_bytes(self.s.me), now=time.time())
            if cert.expires <= swarm.cert.expires:
                raise Refused("the owner sent a certificate that expires no later than ours")
            return cert
        raise PeerError("no owner node reachable: " + ("; ".join(errors) or "none in the view"))

    def _owner_candidates(self, swarm: swarmstate.SwarmMembership) -> list[tuple[ID, list[Multiaddr]]]:
        out: list[tuple[ID, list[Multiaddr]]] = []
        for m in self.s.view():
            if "owner" in m.record.cert.roles:
                out.append((ID.from_base58(m.peer), []))
        for addr in swarm.bootstrap:
            try:
                info = info_from_p2p_addr(Multiaddr(addr))
            except Exception:
                continue
            if all(info.peer_id != pid for pid, _ in out):
                out.append((info.peer_id, list(info.addrs)))
        return out

    # --- status -------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        swarm = self.s.swarm
        now = time.time()
        out: dict[str, Any] = {"revoked": None if self.revoked_self is None else self.revoked_self.to_dict(),
                               "revocations": len(self.revocations)}
        if swarm is not None:
            expires = swarm.cert.expires
            out |= {"cert_addr4": swarm.cert.addr4, "cert_renew_at": renew_due(swarm.cert),
                    "cert_expires_in_s": round(expires - now),
                    "cert_expiring": expires - now < EXPIRY_WARNING,
                    "renewal_error": self.renewal["error"]}
        return out

