"""What a sync sends and which of what it received is worth verifying: pure, no I/O.

A sync trades digests first (sync.py): the responder sends ``[peer, seq]`` for every record
it holds; the requester answers with the records it holds newer (``newer``) and the peers
whose records it lacks or holds older (``wanted``); the responder sends those. A converged
pair so exchanges ids and numbers, not views: about 60 bytes a member instead of a record's
thousand. ``read_digest`` and ``read_want`` check the hostile lists where they enter.

The records a sync brings (an offer, an answer) are whatever the other member chose to send,
not only what the digests called for. Verifying one costs about 0.3 ms (an Ed25519 signature,
a certificate, a key proof), so a member that sends 23,000 copies of one valid record held the
receiver's loop for 6.6 s (review finding 3). Rules (``select_sync_records``):

- A blob byte-for-byte equal to one we hold (``known``: the blobs of our view and our own
  record) is news to nobody: skipped, unverified.
- A blob seen earlier in the same payload is skipped.
- At most ``max_records(view_size)`` blobs are kept: an honest view holds one record per
  member, ours has ``view_size``; twice that plus a margin leaves room for members we have not
  heard of yet (a partition heals) without letting one sync be a flood.

Entries that are not bytes are kept for the verifier to refuse and count (``malformed``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from .membership import MAX_SEQ

SYNC_MARGIN = 64
MAX_PEER = 64  # characters of a peer id in a digest or a want (an Ed25519 one is 52)


def max_records(view_size: int) -> int:
    return 2 * max(view_size, 0) + SYNC_MARGIN


def select_sync_records(blobs: Iterable[Any], known: set[bytes], view_size: int) -> list[Any]:
    """The entries of a sync payload's ``records`` to verify, in their order."""
    limit = max_records(view_size)
    seen: set[bytes] = set()
    out: list[Any] = []
    for blob in blobs:
        if len(out) >= limit:
            break
        if isinstance(blob, bytes):
            if blob in known or blob in seen:
                continue
            seen.add(blob)
        out.append(blob)
    return out


class Carried(Protocol):
    """What a digest is made of, of a record we hold: its peer, seq and bytes (wire.Record)."""

    peer: str
    seq: int
    blob: bytes


def digest(held: Iterable[Carried]) -> list[list[Any]]:
    """``[peer, seq]`` of every record we hold: a sync's first payload."""
    return [[r.peer, r.seq] for r in held]


def _peer(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_PEER and value.isascii() and value.isalnum()


def read_digest(raw: Any, view_size: int) -> tuple[dict[str, int], str | None]:
    """A member's digest as ``{peer: seq}``, and what was wrong with it (None when nothing).
    Entries that are not ``[peer id, seq in 0..2^63)`` are skipped; a peer named twice keeps
    its highest seq; past ``max_records(view_size)`` entries the rest is not read."""
    if not isinstance(raw, list):
        return {}, f"sync digest: expected a list of [peer, seq], got {type(raw).__name__}"
    limit, out, bad = max_records(view_size), {}, 0
    for entry in raw[:limit]:
        if (isinstance(entry, list) and len(entry) == 2 and _peer(entry[0]) and isinstance(entry[1], int)
                and not isinstance(entry[1], bool) and 0 <= entry[1] < MAX_SEQ):
            if entry[1] >= out.get(entry[0], -1):
                out[entry[0]] = entry[1]
        else:
            bad += 1
    problems = []
    if bad:
        problems.append(f"{bad} entries not [peer id, seq in 0..2^63)")
    if len(raw) > limit:
        problems.append(f"{len(raw)} entries for a view of {view_size}; {limit} read")
    return out, ("sync digest: " + "; ".join(problems)) if problems else None


def newer(held: Iterable[Carried], theirs: Mapping[str, int]) -> list[bytes]:
    """The blobs of the records we hold that the digest's owner lacks or holds older."""
    return [r.blob for r in held if theirs.get(r.peer, -1) < r.seq]


def wanted(held: Mapping[str, int], theirs: Mapping[str, int], skip: Iterable[str] = ()) -> list[str]:
    """The peers whose records the digest's owner holds newer than ours (``held``: peer -> seq)
    or we lack, but for ``skip`` (peers we exclude)."""
    skipped = set(skip)
    return [p for p, seq in theirs.items() if seq > held.get(p, -1) and p not in skipped]


def read_want(raw: Any, view_size: int) -> tuple[list[str], str | None]:
    """A member's ``want``: the peer ids it asks our records of, each once, at most one per
    record we hold (``view_size`` + our own); what was wrong with it, or None."""
    if not isinstance(raw, list):
        return [], f"sync want: expected a list of peer ids, got {type(raw).__name__}"
    limit = view_size + 1
    out = list(dict.fromkeys(p for p in raw[:limit] if _peer(p)))
    problems = []
    if len(raw) > limit:
        problems.append(f"{len(raw)} peers asked of {limit} records")
    if any(not _peer(p) for p in raw[:limit]):
        problems.append("entries that are not peer ids")
    return out, ("sync want: " + "; ".join(problems)) if problems else None
