"""A record's RTTs to its signer's nearest members, in 10 bytes an entry.

A record lists the RTTs its signer measured to its nearest members (at most ``MAX_RTTS``):
placement and routing read them for pairs they do not measure themselves. With a peer id (38
bytes) and a float per entry they were half of a large swarm's record (16 entries, 800 of
1,600 bytes), and a record is what gossip carries most. Here an entry is the member's *tag*,
the first 8 bytes of BLAKE2b of its peer id, and the RTT in tenths of a millisecond (uint16,
so at most 6,553.5 ms; a longer RTT is shown as that). On the wire: field ``rtt``, one bytes
string of ``[tag | ms×10 big-endian]`` entries.

A tag names a member only to those who know the member: a reader looks an RTT up by peer id
(``rtts[peer]``, hashing it), or lists them against the members it knows (``named``, with
``tag_index``). Two members' tags collide by chance with probability about n²/2⁶⁵ (10⁻¹¹ at
10,000 members); a member that wants to pass off its RTTs as another member's has to find a key
whose tag is that member's, 2⁶⁴ tries. What it can claim either way is its own RTTs, which
routing never takes alone (routing/paths.py).

Records of daemons before this one carry ``rtts``, a list of [peer id, ms]; they are read
into the same form (wire.py), and those daemons ignore ``rtt``: they see no RTTs from newer
ones, as from a node that measured none.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
from collections.abc import Iterable, Mapping

from ..p2p.signed import Invalid, peer_bytes

MAX_RTTS = 16  # the nearest members a record reports RTTs to (placement's pairwise view)
TAG_BYTES = 8
_ENTRY = struct.Struct(">8sH")  # tag, tenths of a millisecond


@functools.lru_cache(maxsize=1 << 16)
def rtt_tag(peer: str) -> bytes:
    """The 8 bytes that stand for `peer` in a record's RTTs."""
    return hashlib.blake2b(peer_bytes(peer), digest_size=TAG_BYTES).digest()


def tag_index(peers: Iterable[str]) -> dict[bytes, str]:
    """tag -> peer id for the members `peers` (those a reader can name)."""
    return {rtt_tag(p): p for p in peers}


class Rtts:
    """RTTs in ms by member tag; looked up by peer id."""

    __slots__ = ("_by_tag",)

    def __init__(self, by_tag: Mapping[bytes, float] | None = None) -> None:
        self._by_tag: dict[bytes, float] = dict(by_tag or {})

    @classmethod
    def of(cls, by_peer: Mapping[str, float]) -> Rtts:
        """From peer id -> ms (this node's own measurements), each kept to 0.1 ms and 6,553.5 ms;
        one that is not a finite number is left out (it would stop this node's record)."""
        return cls({rtt_tag(p): min(max(round(ms * 10), 0), 0xFFFF) / 10 for p, ms in by_peer.items()
                    if math.isfinite(ms)})

    def __contains__(self, peer: object) -> bool:
        return isinstance(peer, str) and rtt_tag(peer) in self._by_tag

    def __getitem__(self, peer: str) -> float:
        return self._by_tag[rtt_tag(peer)]

    def get(self, peer: str, default: float | None = None) -> float | None:
        return self._by_tag.get(rtt_tag(peer), default)

    def __len__(self) -> int:
        return len(self._by_tag)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Rtts):
            return self._by_tag == other._by_tag
        if isinstance(other, Mapping):  # peer id -> ms: the same entries
            return len(other) == len(self) and all(self.get(p) == ms for p, ms in other.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Rtts({len(self)} entries)"

    def named(self, index: Mapping[bytes, str]) -> dict[str, float]:
        """peer id -> ms for the entries whose member is in `index` (``tag_index``)."""
        return {index[tag]: ms for tag, ms in self._by_tag.items() if tag in index}

    def to_wire(self) -> bytes:
        return b"".join(_ENTRY.pack(tag, round(ms * 10)) for tag, ms in self._by_tag.items())

    @classmethod
    def from_wire(cls, data: object) -> Rtts:
        if not isinstance(data, bytes) or len(data) % _ENTRY.size or len(data) > MAX_RTTS * _ENTRY.size:
            raise Invalid("malformed", f"record.rtt: expected at most {MAX_RTTS} entries of {_ENTRY.size} bytes "
                                       "(a member's tag and its RTT in tenths of a ms)")
        by_tag = {tag: tenths / 10 for tag, tenths in _ENTRY.iter_unpack(data)}
        if len(by_tag) * _ENTRY.size != len(data):
            raise Invalid("malformed", "record.rtt: a member listed twice")
        return cls(by_tag)
