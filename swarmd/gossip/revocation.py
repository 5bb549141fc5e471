"""Revocations: the owner's signed word that a member is out, and the list every member keeps.

A revocation is a signed blob ``{v, k: "revoke", swarm, peer, issued, reason}`` sealed by the
swarm's owner key (not by a member: it has its own decode path). Rules:

- It never expires and cannot be undone: a revoked peer id is out for good; the owner admits
  the machine again under a new identity (a new invite). So a revocation is small, final
  news, and every member can hold and pass on the whole list.
- It spreads two ways: published on the swarm topic, and carried in every push-pull sync
  (at most ``MAX_SYNC`` of them, newest first), so a member that was away learns it at its
  next sync. Every member keeps the list on disk (``STATE_DIR/revoked.json``).
- A member that holds a revocation refuses the peer's records, rumors and streams (counted
  as ``revoked``), drops it from its view, mesh and placement and hangs up on it. The revoked
  node itself learns it from the same gossip and says so in ``swarmctl status``.
- ``check_revocation`` checks the exact format: version, kind, this swarm, the owner's
  signature, a peer id, a time, a short reason. Nothing else is believed.

Pure: ``now`` is passed in; no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ..p2p.signed import Invalid, Signer, field, peer_bytes, peer_key, peer_str, seal, short, unseal
from .cert import CLOCK_SKEW

VERSION = 1
KIND = "revoke"
MAX_REASON = 200  # characters; a reason is for people, not a payload
MAX_BLOB = 1024  # a revocation is about 250 bytes
MAX_REVOCATIONS = 100_000  # a list this long is an attack or a swarm with other problems
MAX_SYNC = 1000  # carried in one sync payload (about 250 KB)


@dataclass(frozen=True, slots=True, kw_only=True)
class Revocation:
    swarm: str
    peer: str
    issued: float
    reason: str
    blob: bytes

    def to_dict(self) -> dict:
        return {"peer": self.peer, "issued": self.issued, "reason": self.reason}


def make_revocation(owner_sign: Signer, swarm: str, peer: str, *, now: float, reason: str = "") -> Revocation:
    reason = reason[:MAX_REASON]
    blob = seal({"v": VERSION, "k": KIND, "swarm": swarm, "peer": peer_bytes(peer), "issued": now,
                 "reason": reason}, owner_sign)
    return Revocation(swarm=swarm, peer=peer, issued=now, reason=reason, blob=blob)


def is_revocation(body: dict) -> bool:
    """Whether an unsealed body claims to be a revocation (before any check)."""
    return body.get("k") == KIND


def check_revocation(blob: object, *, owner_public: bytes, swarm: str, now: float) -> Revocation:
    """The revocation, if the owner of ``swarm`` signed it in exactly this format; ``Invalid``
    (reason ``revocation``, or the signature's) otherwise."""
    if isinstance(blob, bytes) and len(blob) > MAX_BLOB:
        raise Invalid("revocation", f"{len(blob)} bytes, a revocation is at most {MAX_BLOB}")
    try:
        body, _, _ = unseal(blob, owner_public)
    except Invalid as exc:
        raise Invalid("revocation", f"revocation: {exc.detail}") from None
    if body.get("v") != VERSION or body.get("k") != KIND:
        raise Invalid("revocation", "not a version-1 revocation")
    try:
        if field(body, "swarm", str, KIND) != swarm:
            raise Invalid("revocation", "revocation of another swarm")
        peer = field(body, "peer", bytes, KIND)
        peer_key(peer)
        issued = float(field(body, "issued", (int, float), KIND))
        reason = field(body, "reason", str, KIND)
    except Invalid as exc:
        raise Invalid("revocation", exc.detail) from None
    if not math.isfinite(issued) or issued > now + CLOCK_SKEW:
        raise Invalid("revocation", "revocation issued in the future")
    if len(reason) > MAX_REASON:
        raise Invalid("revocation", f"revocation reason longer than {MAX_REASON} characters")
    assert isinstance(blob, bytes)
    return Revocation(swarm=swarm, peer=peer_str(peer), issued=issued, reason=reason, blob=blob)


class Revocations:
    """The revoked peers of one swarm: peer id -> its revocation. ``add`` says whether it is news."""

    def __init__(self, items: Iterable[Revocation] = ()) -> None:
        self._by_peer: dict[str, Revocation] = {}
        for r in items:
            self.add(r)

    def add(self, r: Revocation) -> bool:
        if r.peer in self._by_peer or len(self._by_peer) >= MAX_REVOCATIONS:
            return False
        self._by_peer[r.peer] = r
        return True

    def __contains__(self, peer: object) -> bool:
        return peer in self._by_peer

    def __len__(self) -> int:
        return len(self._by_peer)

    def get(self, peer: str) -> Revocation | None:
        return self._by_peer.get(peer)

    def all(self) -> list[Revocation]:
        return sorted(self._by_peer.values(), key=lambda r: (-r.issued, r.peer))

    def for_sync(self) -> list[bytes]:
        """What a sync payload carries: the newest ``MAX_SYNC`` (older ones have had time to spread)."""
        return [r.blob for r in self.all()[:MAX_SYNC]]


def resolve_peer(text: str, candidates: Iterable[str]) -> str:
    """A peer named by its full id or an unambiguous prefix (or suffix, as ``short`` shows it)
    of one of ``candidates``; ValueError says what is wrong."""
    text = text.strip()
    pool = sorted(set(candidates))
    if text in pool:
        return text
    try:
        peer_bytes(text)
        return text  # a well-formed full id, not in the view: revoking it is still meaningful
    except Invalid:
        pass
    if len(text) < 4:
        raise ValueError(f"{text!r} is too short to name a peer: give at least 4 characters of its id")
    matches = [p for p in pool if p.startswith(text) or p.endswith(text)]
    if not matches:
        raise ValueError(f"no member's peer id starts or ends with {text!r} (see `swarmctl peers`)")
    if len(matches) > 1:
        raise ValueError(f"{text!r} names {len(matches)} members ({', '.join(m[-8:] for m in matches[:5])}): "
                         "give more of the id")
    return matches[0]
