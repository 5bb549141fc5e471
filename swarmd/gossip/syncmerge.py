"""Which records of a sync payload are worth verifying: pure, no I/O.

A sync carries every record the other member holds. Verifying one costs about 0.3 ms (an
Ed25519 signature, a certificate, a key proof), so a member that sends 23,000 copies of one
valid record held the receiver's loop for 6.6 s (review finding 3). Rules:

- A blob byte-for-byte equal to one we hold (``known``: the blobs of our view and our own
  record) is news to nobody: skipped, unverified.
- A blob seen earlier in the same payload is skipped.
- At most ``max_records(view_size)`` blobs are kept: an honest view holds one record per
  member, ours has ``view_size``; twice that plus a margin leaves room for members we have not
  heard of yet (a partition heals) without letting one sync be a flood.

Entries that are not bytes are kept for the verifier to refuse and count (``malformed``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

SYNC_MARGIN = 64


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
