"""Membership and failure detection: SWIM with Lifeguard, as a sans-IO core.

Theory of operation (Das et al., "SWIM", 2002; Dadgar et al., "Lifeguard", 2018;
hashicorp/memberlist's ``state.go`` and ``suspicion.go``):

- The view maps each peer to its newest verified record and a state: alive, suspect,
  dead or left. A record's seq is the peer's incarnation: a record with a higher seq than
  the one held replaces it and refutes any suspicion or death at a lower incarnation; an
  equal or lower seq is ignored (replays change nothing).
- Every ``probe_interval`` (stretched by local health) the next member in a shuffled
  round-robin is probed directly (``Probe``). If no ack comes within the probe timeout, up
  to ``indirect_probes`` other members are asked to probe it (``ProbeVia``); they answer
  ack or nack. With no ack at all the member becomes suspect, and a ``suspect`` rumor is
  gossiped. Probes overlap: a slow peer does not delay the probing of others.
- Another member's ``suspect`` or ``dead`` rumor is an accusation, never a verdict: a
  certificate proves membership, not honesty, and one member must not be able to evict
  another. The accused becomes suspect here and is probed at once; an ack from it (ours,
  or a helper's) is local evidence and drops the accusation. Death is declared only by
  this node's own suspicion timeout, which starts at Lifeguard's maximum for a single
  accuser and shrinks as independent members confirm (suspicion.py; memberlist gives
  every ``suspect`` from a new sender the same role). A ``left`` rumor is the leaver's
  own word (the wire checks that it is about its signer) and is believed.
- Accusations are rate-limited per accuser (a token bucket, ``accusation_burst`` and
  ``accusation_rate``): beyond it they are dropped and counted, so one member cannot
  make every node probe, suspect or refute in a loop.
- The suspect refutes by issuing a record with a higher seq; this node does the same when
  it hears a suspect or dead rumor, or a sync claim, about its current incarnation. No
  honest member can hold an incarnation of ours above ``seq`` (each life starts at
  ``epoch << 32``, above every older one), so a rumor or claim above it is a lie: it is
  refused and counted (``future_incarnation``), never adopted (a seq jumped to 2^64 - 1
  could not even be encoded), and not passed on (``screen``, for gossip validation). A
  record of ours with a higher seq is our own signature (an older life that got further): we
  jump past it, within ``MAX_SEQ``.
- A lost connection is a hint, not a verdict: the member is probed at once.
- Records expire (the README's promise): a member's record is good until ``issued + ttl``
  (wall clock, converted to this core's monotonic clock when the record arrives, its age
  taken off). A member whose newest record expired is *stale*: still probed, but out of
  the mesh and placement until it publishes again. A member whose certificate expires is
  dropped from the view at that moment; records carrying an expired certificate are
  refused.
- ``exclude(peer)`` (a revocation) drops a member and refuses everything from and about it
  until ``readmit(peer)``.
- Own record: published on change (at most once per ``publish_interval``), refreshed every
  ``refresh_interval``, each time with the next seq. ``PublishRecord`` asks the driver to
  build and sign it.
- Anti-entropy: every ``sync_interval`` a push-pull ``Sync`` with a random alive member;
  every ``reconnect_interval`` one with a random dead member, which is how both sides of a
  healed partition find each other again. Each side sends every record it holds and its
  ``sync_claims()`` (the members it holds suspect or dead); ``merge_sync`` takes the other
  side's. A merge that made us refute (the peer holds us suspect or dead) emits
  ``Sync(peer)`` at once: the peer gets our new record now, not by gossip it may not be part
  of yet (a healed partition); the driver starts it, or runs it once more right after the
  sync with that peer in progress.
- Readers outside this module (the mesh, placement, the control API, the driver) see the
  view only through ``view()``: an immutable, versioned snapshot, rebuilt only after a
  change, safe to hand to another thread. ``members`` is this core's own.

Data structures and their costs (N members; the simulator runs thousands of cores at once, so
no event may cost O(N), and each member is paid for N times over):

- Columns, not objects: a member is a row, its peer id interned as a small int by a
  ``PeerIndex`` (one per core in the daemon; one shared by every core in the simulator, whose
  n cores of n members then keep no per-core map of names). Per row: the record (a list, 8 B),
  state and flags (a bytearray, 1 B), since and expires and its timer's time (``array('d')``, 24 B;
  the simulator's ``compact`` cores keep float32, 12 B), its position in its state's list (4 B);
  what only some members have lives in dicts beside them (its RTT once a probe measured it,
  ``_rtt``; a suspicion while suspect, ``_suspicions``; a finite certificate expiry, ``_certs``).
  About 50 B a member with the indexes below (a compact core's 37 B; ``bench/core_cost.py``
  measures 39 B under a shared ``PeerIndex``, 96 B with a core's own), where a row of slots was
  170 B. ``members`` is a read-only mapping over the rows for tests and
  debugging; nothing outside this module reads it.
- ``_in``: per state, an ``array('i')`` of its rows (``_pos`` is the index). Counts are
  lengths; a random alive or dead member is one draw; indirect helpers are k draws with
  rejection; ``sync_claims`` and forgetting enumerate only the members down; a state change
  is a swap-remove and an append. All O(1) (O(k), O(members down)).
- Two heaps of lazy entries. The timer heap holds rows (4 B), each at most once (the ``TIMED``
  flag), keyed by ``_due``, at or before the row's own deadline (record or certificate
  expiry): a newer record leaves the heap alone and the entry moves to the real time when it
  comes up or ``next_deadline`` peeks at it; a deadline moved earlier (a shorter ttl, or a
  member dropped and back while its entry waits: rare) gets an event entry. It is heapq's
  algorithm on an array, by key (``heapq`` itself compares the items: a ``(time, row)`` tuple
  would cost each member 64 B, where a row in an array is 4). The event heap holds ``(time, kind, key)`` for probe and
  suspicion deadlines; an entry whose probe or suspicion moved since is skipped. A heap is
  rebuilt without its stale entries when it grows past twice its size at the last rebuild
  plus 64. ``next_deadline()``: O(1) plus O(log N) per stale entry it pops;
  ``handle_timeout``: O(log N) per due thing.
- Probes by id and by target (one at a time per target); the probe order is a shuffled list
  of the rows up, rebuilt once per round (O(N) per N probes), a newcomer put at a random
  place in O(1). ``view()`` is O(N), only when something changed and someone asks.
- Deterministic for a given ``rng`` and inputs: nothing iterates a set of str (its order
  changes with PYTHONHASHSEED); every order comes from the inputs and ``rng``.

Inputs are method calls with ``now`` (monotonic seconds; ``wall`` where a wall-clock time
is needed, for records' and certificates' expiry), split by what arrived: ``receive_record``,
``receive_rumor`` (after ``screen``), ``merge_sync``, ``probe_result``, ``via_result``;
outputs are actions collected until ``take_actions()``. No clock, no I/O, no wire format:
the core is generic over the record it carries and reads only what ``Carried`` and
``Rumored`` name (the daemon's signed ``wire.Record``, the simulator's small records).
Randomness from the ``random.Random`` given.
"""

from __future__ import annotations

import enum
import heapq
import math
import itertools
import random
from array import array
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Generic, Protocol, TypeVar

from .suspicion import Awareness, Suspicion, expected_confirmations, suspicion_bounds

# Every seq and incarnation on the wire is below this: a node adds one to a seq it has seen (to
# refute), and msgpack encodes no integer above 2^64 - 1; 2^63 leaves room and fits an int64.
# The wire (``wire.MAX_SEQ``) refuses anything at or above it; this is the one definition.
MAX_SEQ = 2**63
MAX_TTL = 43_200.0  # the longest ttl this node gives its records (the wire takes up to a day)
_SETTLED = 20  # records issued after which the refresh step (2^n refresh intervals) is past any swarm's period


class Carried(Protocol):
    """What the core reads of a record it carries (``wire.Record``, the simulator's records):
    ``issued`` (wall clock) and ``cert_expires`` only when an input gives ``wall``."""

    @property
    def peer(self) -> str: ...
    @property
    def seq(self) -> int: ...
    @property
    def ttl(self) -> float: ...
    @property
    def issued(self) -> float: ...
    @property
    def cert_expires(self) -> float: ...


class Rumored(Protocol):
    """What the core reads of a rumor (``wire.Rumor``): ``kind`` is suspect, dead or left."""

    @property
    def kind(self) -> str: ...
    @property
    def sender(self) -> str: ...
    @property
    def about(self) -> str: ...
    @property
    def incarnation(self) -> int: ...


R = TypeVar("R", bound=Carried)


class State(enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


PROBED = (State.ALIVE, State.SUSPECT)


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """Timers; each preset says why. Times in seconds."""

    probe_interval: float = 0.5  # one probe started per interval; 5 s p99 detection needs < 1 s
    probe_timeout: float = 0.5  # floor; per peer at least 3 RTT + 0.1 s (a stream may need a TCP retransmit)
    indirect_timeout: float = 1.0  # helpers need two legs and their own probe
    indirect_probes: int = 3  # SWIM's k; memberlist uses 3
    suspicion_mult: float = 4.0  # memberlist's SuspicionMult: min timeout = 4 x log10(n) x interval
    suspicion_max_mult: float = 6.0  # Lifeguard's alpha: an unconfirmed suspicion waits 6x longer
    # memberlist's min timeout grows with log10(n) because its gossip takes log n rounds to tell the
    # suspect and bring its refutation back; gossipsub's eager push does that in a third of a second
    # at 100,000 nodes (sim: disseminate-100k), so the factor stops at 1.2 (16 members): a 2.4 s
    # floor, against a lab's 2 s. swarm-2k-5pct (2,000 nodes, 5 % loss) then detects a crash in
    # 4.21 / 4.90 s (p50 / p99; memberlist's factor: 8.22 / 9.10 s), with no false dead either way
    # (cap 1.4: 4.54 / 5.90 s). inf: memberlist's.
    suspicion_log_cap: float = 1.2
    awareness_limit: int = 8  # memberlist's AwarenessMaxMultiplier
    publish_interval: float = 0.25  # at most 4 records/s from a node that changes quickly
    refresh_interval: float = 30.0  # keeps records fresh; N/30 records/s per node, not N per s
    record_ttl: float = 120.0  # four missed refreshes
    sync_interval: float = 15.0  # push-pull with one alive member (memberlist: 30 s LAN)
    reconnect_interval: float = 2.0  # try one dead member: heals partitions in seconds
    forget_after: float = 3600.0  # dead and left members leave the view
    rtt_alpha: float = 0.2  # EWMA weight of a new RTT sample
    # An honest member accuses at most twice per peer it sees fail (a suspect, then a dead
    # rumor), so 30 covers 15 members failing at once; beyond it our own probes still find
    # them, one probe interval per member. One accusation per 2 s sustained.
    accusation_burst: int = 30
    accusation_rate: float = 0.5  # tokens per second
    # Confirmations gossiped per suspicion, expected: every member probes an accused one at
    # once, so in a swarm of n each failed probe would be a rumor to all (2n rumors of n
    # deliveries each per crash: 8 M at 2,000 nodes). Lifeguard needs K = 2 confirmations to
    # reach its shortest timeout; a member publishes its own with probability
    # min(1, confirm_fanout / n) (every one of them in a swarm of at most 6).
    confirm_fanout: float = 6.0
    # What a node receives would grow with the swarm: every member's refreshes, and syncs. Refreshes:
    # the swarm as a whole refreshes at most ``refresh_rate`` records/s (a node every
    # max(refresh_interval, n / refresh_rate) s: 30 s up to 120 members, 500 s at 2,000), its ttl
    # stretched alike, so each node receives about refresh_rate records/s at any size (a record of
    # ~1 kB and gossipsub's ~5.6 duplicates of each: ~25 kB/s). A node that just started refreshes
    # sooner: its period doubles from refresh_interval after each record up to the swarm's (Trickle's
    # timer, RFC 6206), so the coordinate it learns in its first minutes reaches the others then
    # (records carry the coordinates that routing's estimates use: a cold 1,000-node swarm's median
    # error at 120 s is 6.9 % at 4/s, against 10.9 % at 10/s without the doubling; sim/coords.py).
    # Syncs: memberlist's pushPullScale, the interval times ceil(log2(n) - log2(32)) + 1 above 32
    # members (7x at 2,000).
    refresh_rate: float = 4.0
    sync_scale_threshold: int = 32

    @classmethod
    def wan(cls) -> Timing:
        """Default: providers on the internet, RTTs up to ~300 ms."""
        return cls()

    @classmethod
    def lan(cls) -> Timing:
        return cls(probe_interval=0.3, probe_timeout=0.2, indirect_timeout=0.5)

    @classmethod
    def local(cls) -> Timing:
        """Unit tests and single-machine runs."""
        return cls(probe_interval=0.1, probe_timeout=0.1, indirect_timeout=0.2, refresh_interval=5.0,
                   sync_interval=2.0, reconnect_interval=0.5, forget_after=60.0)


def refresh_period(timing: Timing, members: int) -> float:
    """How often a member of a swarm of ``members`` (up, itself included) refreshes its record:
    the swarm as a whole refreshes at most ``timing.refresh_rate`` records/s."""
    return max(timing.refresh_interval, members / timing.refresh_rate)


def record_ttl(timing: Timing, members: int) -> float:
    """The ttl of a record in a swarm of ``members``: ``timing.record_ttl``, stretched as the refresh is."""
    return min(MAX_TTL, timing.record_ttl * refresh_period(timing, members) / timing.refresh_interval)


def sync_scale(interval: float, members: int, threshold: int = 32) -> float:
    """memberlist's ``pushPullScale``: the sync interval, longer above ``threshold`` members
    (a sync carries the whole view, so syncs cost each node O(n) bytes)."""
    if members <= threshold:
        return interval
    return interval * (math.ceil(math.log2(members) - math.log2(threshold)) + 1)


# --- actions --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PublishRecord:
    seq: int


@dataclass(frozen=True, slots=True)
class PublishRumor:
    kind: str
    about: str
    incarnation: int


@dataclass(frozen=True, slots=True)
class Probe:
    id: int
    peer: str
    timeout: float


@dataclass(frozen=True, slots=True)
class ProbeVia:
    id: int
    via: str
    target: str
    timeout: float  # for the helper's own probe of the target


@dataclass(frozen=True, slots=True)
class Sync:
    peer: str


@dataclass(frozen=True, slots=True)
class Changed:
    """A member's state changed (``old`` or ``new`` None: it joined or left the view), or
    only its freshness (``old is new``; the reason says which way)."""
    peer: str
    old: State | None
    new: State | None
    reason: str


Action = PublishRecord | PublishRumor | Probe | ProbeVia | Sync | Changed


# --- the snapshot ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class MemberView(Generic[R]):
    """One member as the view shows it. Times are the core's monotonic clock."""
    peer: str
    state: State
    stale: bool  # its newest record is past its ttl
    record: R
    since: float  # when it entered ``state``
    expires: float  # when that record goes stale
    rtt_ewma: float | None
    rtt_min: float | None

    @property
    def in_service(self) -> bool:
        """Whether the mesh and placement should use it: up (a suspect may be a false
        alarm; SWIM keeps it) and its record current."""
        return self.state in PROBED and not self.stale


@dataclass(frozen=True, slots=True, kw_only=True)
class View(Generic[R]):
    """An immutable snapshot of the membership: safe to keep, compare by ``version``, and
    hand to another thread. ``members`` is read-only and never changes after creation."""
    version: int
    me: str
    members: Mapping[str, MemberView[R]]

    @classmethod
    def empty(cls, me: str) -> View[R]:
        return cls(version=0, me=me, members=MappingProxyType({}))

    def get(self, peer: str) -> MemberView[R] | None:
        return self.members.get(peer)

    def __contains__(self, peer: object) -> bool:
        return peer in self.members

    def __iter__(self) -> Iterator[MemberView[R]]:
        return iter(self.members.values())

    def __len__(self) -> int:
        return len(self.members)

    def in_service(self) -> list[MemberView[R]]:
        return [m for m in self.members.values() if m.in_service]

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in State}
        for m in self.members.values():
            out[m.state.value] += 1
        return out


# --- state ----------------------------------------------------------------------------

INF = float("inf")  # shared: a member whose certificate never runs out (simulations) holds no float of its own

_INDEXES: list[int] = []


def _index(i: int) -> int:
    """``i``, as one int object shared by every core in the process: an int above 256 is a
    28-byte object of its own, and a simulation holding 10,000 cores of 10,000 members each
    would otherwise pay 2.8 GB for members' list positions alone."""
    if i >= len(_INDEXES):
        _INDEXES.extend(range(len(_INDEXES), 2 * i + 1024))
    return _INDEXES[i]


# kinds of entries in the event heap: (time, kind, key)
_PROBE = 0  # key: probe id; the probe (direct or indirect) times out
_SUSPECT = 1  # key: peer; its suspicion times out
_EARLY = 2  # key: peer; its own deadline moved before the one its timer entry holds (rare)


class PeerIndex:
    """Peer ids as small ints, the rows of a core's columns. One per core (the daemon's), or one
    shared by cores that see the same peers (the simulator's). It only grows: a forgotten peer
    keeps its int (a peer id is a certificate's; a member cannot mint new ones, and a record or
    rumor about a peer not admitted interns nothing)."""

    __slots__ = ("rows", "names")

    def __init__(self, names: Iterable[str] = ()) -> None:
        self.rows: dict[str, int] = {}
        self.names: list[str] = []
        for name in names:
            self.of(name)

    def of(self, peer: str) -> int:
        """``peer``'s int, given one if it has none."""
        i = self.rows.get(peer)
        if i is None:
            i = self.rows[peer] = _index(len(self.names))
            self.names.append(peer)
        return i

    def __len__(self) -> int:
        return len(self.names)


# A row's byte in ``Membership._st``: its state's code (0: not a member) and two flags.
_STATES: tuple[State | None, ...] = (None, State.ALIVE, State.SUSPECT, State.DEAD, State.LEFT)
_CODE = {s: i for i, s in enumerate(_STATES) if s is not None}
_STATE = 7  # the bits of the state's code
_STALE = 8  # its newest record is past its ttl
_TIMED = 16  # in the timer heap (at ``_due``); kept while a dropped row's entry waits to come up
_UNMEASURED = (None, None)  # a member's RTT (EWMA, minimum) in the view until a probe measured it


def _single(t: float) -> float:
    """``t`` as a float32 column holds it (a compact core's times all round the same way, so a timer due
    at a certificate's expiry finds it expired)."""
    return array("f", (t,))[0]


class Member(Generic[R]):
    """A member as the core's columns hold it now (``Membership.members``: tests, debugging)."""

    __slots__ = ("_core", "row")

    def __init__(self, core: Membership[R], row: int) -> None:
        self._core, self.row = core, row

    @property
    def peer(self) -> str:
        return self._core._ix.names[self.row]

    @property
    def record(self) -> R:
        return self._core._rec[self.row]  # type: ignore[return-value]

    @property
    def incarnation(self) -> int:
        return self.record.seq

    @property
    def state(self) -> State:
        return self._core._state(self.row)

    @property
    def stale(self) -> bool:
        return bool(self._core._st[self.row] & _STALE)

    @property
    def since(self) -> float:
        return self._core._since[self.row]

    @property
    def expires(self) -> float:
        return self._core._expires[self.row]

    @property
    def pos(self) -> int:
        return self._core._pos[self.row]


class _Members(Mapping[str, Member[R]]):
    """peer -> ``Member``, read-only, over the core's rows (in row order)."""

    __slots__ = ("_core",)

    def __init__(self, core: Membership[R]) -> None:
        self._core = core

    def __getitem__(self, peer: str) -> Member[R]:
        i = self._core._row(peer)
        if i is None:
            raise KeyError(peer)
        return Member(self._core, i)

    def __iter__(self) -> Iterator[str]:
        names = self._core._ix.names
        return (names[i] for i, r in enumerate(self._core._rec) if r is not None)

    def __len__(self) -> int:
        return self._core._count


def _sift_down(heap: array, key: array, start: int, pos: int) -> None:
    """heapq's ``_siftdown`` on an array of rows ordered by ``key[row]``."""
    item = heap[pos]
    k = key[item]
    while pos > start:
        parent = (pos - 1) >> 1
        if k < key[heap[parent]]:
            heap[pos] = heap[parent]
            pos = parent
            continue
        break
    heap[pos] = item


def _sift_up(heap: array, key: array, pos: int) -> None:
    """heapq's ``_siftup`` (the same comparisons, so the same order among equal keys)."""
    end, start, item = len(heap), pos, heap[pos]
    child = 2 * pos + 1
    while child < end:
        right = child + 1
        if right < end and not key[heap[child]] < key[heap[right]]:
            child = right
        heap[pos] = heap[child]
        pos = child
        child = 2 * pos + 1
    heap[pos] = item
    _sift_down(heap, key, start, pos)


def _heap_push(heap: array, key: array, row: int) -> None:
    heap.append(row)
    _sift_down(heap, key, 0, len(heap) - 1)


def _heap_pop(heap: array, key: array) -> int:
    last = heap.pop()
    if heap:
        top, heap[0] = heap[0], last
        _sift_up(heap, key, 0)
        return top
    return last


@dataclass(slots=True)
class _Probe:
    id: int
    target: str
    deadline: float
    indirect: bool = False
    helpers: frozenset[str] = frozenset()
    nacks: int = 0


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


@dataclass(slots=True)
class Counters:
    probes: int = 0
    probes_failed: int = 0
    indirect_probes: int = 0
    suspicions: int = 0
    accusations_cleared: int = 0  # suspicions dropped because the accused answered us
    refutations: int = 0
    deaths: int = 0
    records_accepted: int = 0
    records_old: int = 0
    records_expired: int = 0  # members that went stale
    certs_expired: int = 0
    seq_exhausted: int = 0  # publishes skipped: the seq would leave the wire's range
    confirmations_unsaid: int = 0  # suspect or dead rumors not gossiped (Timing.confirm_fanout)


# receive_record/receive_rumor/merge_sync results that mean "refused": the driver counts them
# as rejected input
REFUSED = ("future_incarnation", "accusation_rate", "excluded", "cert_expired")


@dataclass(frozen=True, slots=True)
class SyncMerge:
    """What ``merge_sync`` did: one ``receive_record`` result per record, in order; one result
    per claim about us; whether it made us refute (then a ``Sync(by)`` action follows)."""
    records: list[str]
    claims: list[str]
    refuted: bool


class Membership(Generic[R]):
    def __init__(self, me: str, seq: int, timing: Timing, rng: random.Random, now: float,
                 peers: PeerIndex | None = None, first_refresh: float | None = None, compact: bool = False) -> None:
        """``peers``: the peer ids' ints, if shared with other cores (the simulator's); else its own.
        ``compact``: the member times (since, expiry, timer) in float32, 4 B each instead of 8: the simulator's
        thousands of cores, whose clock starts at 0 and stays within hours (float32 is exact to 0.25 ms below
        4,096 s); a daemon's monotonic clock counts its host's uptime, and keeps float64.
        ``first_refresh``: when the first periodic refresh is due (default: a refresh interval after
        the first record, now, then doubling); the simulator's warm start spreads them over the period
        of the swarm it builds, as in a swarm that has run a while, whose members refresh at the
        swarm's period."""
        if not 0 <= seq < MAX_SEQ:
            raise ValueError(f"seq {seq} is outside 0..2^63")
        self.me = me
        self.seq = seq  # the seq of the newest own record; the next one is seq + 1
        self.timing = timing
        self.rng = rng
        self.members: Mapping[str, Member[R]] = _Members(self)  # tests and debugging: others read view()
        self.awareness = Awareness(timing.awareness_limit)
        self.counters = Counters()
        self.leaving = False
        self._actions: list[Action] = []
        self._ids = itertools.count(1)
        # the columns, one row per peer id in _ix (rows not in the view: record None, state 0)
        self._ix = peers if peers is not None else PeerIndex()
        self._rec: list[R | None] = []
        self._st = bytearray()  # state code | _STALE | _TIMED
        times = "f" if compact else "d"
        self._since, self._expires = array(times), array(times)
        self._due = array(times)  # its time in the timer heap, while _TIMED
        self._compact = compact  # then other times kept (certificates' expiry) are rounded as the columns round
        self._rtt: dict[int, tuple[float, float]] = {}  # row -> its RTT's EWMA and minimum, once measured
        self._pos = array("i")  # its index in _in[its state]
        self._count = 0
        self._grow()
        self._in: dict[State, array] = {s: array("i") for s in State}  # rows by state
        self._timers = array("i")  # heap of rows by _due: record and certificate expiry
        self._events: list[tuple[float, int, int | str]] = []  # heap: probe and suspicion deadlines
        self._timers_limit = self._events_limit = 64  # rebuild a heap when it grows past this
        self._probes: dict[int, _Probe] = {}
        self._probing: dict[str, _Probe] = {}  # target -> its probe (one at a time)
        self._suspicions: dict[str, Suspicion] = {}  # suspect members only
        self._certs: dict[str, float] = {}  # peer -> when its certificate runs out (monotonic), if ever
        self._order = array("i")  # rows: this round's probe order
        self._buckets: dict[str, _Bucket] = {}
        self._excluded: dict[str, str] = {}  # peer -> reason
        self._view: View[R] | None = None  # None: something changed since the last snapshot
        self._version = 0
        self._last_publish = float("-inf")
        self._publish_pending = True  # the first record goes out at once
        self._next_probe = now + rng.uniform(0, timing.probe_interval)
        self._next_refresh = now + timing.refresh_interval
        # records issued since this core started (a warm start's core is a settled member's)
        self._issued = 0 if first_refresh is None else _SETTLED
        self._next_sync = now + rng.uniform(0, timing.sync_interval)
        self._next_reconnect = now + timing.reconnect_interval
        self.handle_timeout(now)
        if first_refresh is not None:
            self._next_refresh = first_refresh

    # --- inputs -------------------------------------------------------------------------

    def receive_record(self, now: float, record: R, wall: float | None = None) -> str:
        """Merge a verified record; the result names what it did (for metrics and tests).
        ``wall``: the wall-clock time now, for the record's age and its certificate's expiry
        (None: the record is taken as just issued, as in simulations)."""
        return self._receive_record(now, record, wall)

    def load(self, now: float, records: Iterable[R]) -> None:
        """Take the records of a formed swarm at once (the simulator's warm start: each of its n cores
        takes n records): the same columns, heaps and random draws as ``receive_record(now, r)`` for
        each in turn, in about half the time, and no ``Changed`` actions (a start's members did not join).
        Only records of peers not in the view (else ValueError), taken as just issued."""
        records = list(records)
        for r in records:
            if r.peer == self.me or r.peer in self._excluded or self._row(r.peer) is not None:
                raise ValueError(f"load: {r.peer!r} is not a new member")
        rows = [self._ix.of(r.peer) for r in records]
        if len(set(rows)) != len(rows):
            raise ValueError("load: a peer's record twice")
        self._grow()
        rec, st, since, expires, pos = self._rec, self._st, self._since, self._expires, self._pos
        # _add's appends, into arrays made at their exact size (appends keep 1/16 spare)
        alive = self._in[State.ALIVE] = self._in[State.ALIVE] + array("i", rows)
        order = self._order = self._order + array("i", bytes(4 * len(rows)))
        first, last = len(alive) - len(rows), len(order) - len(rows)  # the new rows' places in each
        draw, schedule, code = self.rng.randrange, self._schedule, _CODE[State.ALIVE]
        for k, (i, r) in enumerate(zip(rows, records)):
            rec[i], st[i], since[i], expires[i], pos[i] = r, code | (st[i] & _TIMED), now, now + r.ttl, first + k
            j = draw(last + k + 1)  # _add's random place in the probe order: the same draw as its randint(0, len)
            order[last + k], order[j] = order[j], i
            schedule(i)
        self._count += len(rows)
        self.counters.records_accepted += len(rows)
        self._view = None

    def receive_rumor(self, now: float, msg: Rumored) -> str:
        """Merge a verified rumor; the result names what it did."""
        if msg.sender in self._excluded or msg.about in self._excluded:
            return "excluded"
        if msg.kind == "left":
            return self._left(now, msg)
        if msg.about == self.me:
            return self._accused_me(now, msg.incarnation, msg.sender)
        i = self._row(msg.about)
        if i is None:
            return "unknown"
        if msg.incarnation < self._rec[i].seq or self._state(i) not in PROBED:  # type: ignore[union-attr]
            return "old"
        if not self._allow_accusation(now, msg.sender):
            return "accusation_rate"
        return self._accuse(now, i, by=msg.sender)

    def screen(self, msg: Rumored) -> str | None:
        """Why a rumor must not even be passed on (gossip validation), or None. Pure: a lie
        about an incarnation of ours we never issued stops here instead of reaching the whole
        swarm through us. (Records need no screening: any seq below MAX_SEQ is a signature.)"""
        if msg.about == self.me and msg.kind != "left" and msg.incarnation > self.seq:
            return "future_incarnation"
        return None

    def probe_result(self, now: float, probe_id: int, ok: bool, rtt: float | None = None) -> None:
        """The driver's direct probe finished: an ack (with its RTT) or a failure."""
        p = self._probes.get(probe_id)
        if rtt is not None and p is not None:
            self.rtt_sample(p.target, rtt)
        if p is None or p.indirect:
            return
        if ok:
            self._probe_succeeded(now, p)
        else:
            self._go_indirect(now, p)

    def via_result(self, now: float, probe_id: int, via: str, ok: bool) -> None:
        """A helper answered: ack (the target answered it) or nack (it did not)."""
        p = self._probes.get(probe_id)
        if p is None or not p.indirect or via not in p.helpers:
            return
        if ok:
            self._probe_succeeded(now, p)
            return
        p.nacks += 1
        if p.nacks == len(p.helpers):
            self._probe_failed(now, p)

    def rtt_sample(self, peer: str, rtt: float) -> None:
        i = self._row(peer)
        if i is None or not 0 <= rtt < 3600:  # NaN fails both
            return
        a, old = self.timing.rtt_alpha, self._rtt.get(i)
        self._rtt[i] = (rtt, rtt) if old is None else ((1 - a) * old[0] + a * rtt, min(old[1], rtt))
        self._view = None

    def connection_lost(self, now: float, peer: str) -> None:
        i = self._row(peer)
        if i is not None and self._state(i) in PROBED and peer not in self._probing and not self.leaving:
            self._start_probe(now, peer)

    def merge_sync(self, now: float, records: Iterable[R], claims: Iterable[tuple[str, str, int]], by: str,
                   wall: float | None = None) -> SyncMerge:
        """Merge a push-pull sync from member ``by``: its records (verified by the driver) and its
        claims ``(peer, state, incarnation)`` about members it holds down (type-checked by the
        driver). Only claims about us matter: about others our own probes decide. If the merge
        made us refute, ``by`` holds us suspect or dead and may not hear our gossip yet: a
        ``Sync(by)`` action follows, so it gets our new record at once (refute, then resync)."""
        seq = self.seq
        results = [self._receive_record(now, r, wall) for r in records]
        said = [self._accused_me(now, inc, by) for peer, state, inc in claims
                if peer == self.me and state in ("suspect", "dead")]
        refuted = self.seq != seq
        if refuted:
            self._actions.append(Sync(by))
        return SyncMerge(results, said, refuted)

    def local_change(self, now: float) -> None:
        """Own labels or resources changed: re-advertise (rate-limited)."""
        self._publish_pending = True
        self.handle_timeout(now)

    def leave(self, now: float) -> None:
        self.leaving = True
        self._probes.clear()  # their heap entries are skipped when they come up
        self._probing.clear()
        self._actions.append(PublishRumor("left", self.me, self.seq))

    def exclude(self, now: float, peer: str, reason: str) -> None:
        """Drop ``peer`` from the view (a revocation, an expired certificate) and refuse its
        records, and rumors from or about it, until ``readmit(peer)``."""
        if peer == self.me:
            return
        self._excluded[peer] = reason
        self._buckets.pop(peer, None)
        i = self._row(peer)
        if i is not None:
            self._drop(i, "excluded: " + reason)

    def readmit(self, peer: str) -> None:
        """Undo ``exclude``: the peer's next record is taken again."""
        self._excluded.pop(peer, None)

    def excluded(self) -> dict[str, str]:
        return dict(self._excluded)

    def handle_timeout(self, now: float) -> None:
        t = self.timing
        if self._publish_pending and now >= self._last_publish + t.publish_interval and not self.leaving:
            self._publish(now)
        if now >= self._next_refresh and not self.leaving:
            self._publish(now)
        events, timers, due, rec = self._events, self._timers, self._due, self._rec
        while True:  # what is due, earliest first within each heap: O(log N) each
            if events and events[0][0] <= now:
                self._fire(now, *heapq.heappop(events))
            elif timers and due[timers[0]] <= now:
                i = _heap_pop(timers, due)
                self._st[i] &= ~_TIMED
                if rec[i] is not None:  # else dropped since
                    self._expire(now, i)
                    if rec[i] is not None:
                        self._schedule(i)
            else:
                break
        if now >= self._next_probe:
            every = self.awareness.scale(t.probe_interval)  # late (a busy loop, a warm start): same phase, no burst
            self._next_probe = now + every - (now - self._next_probe) % every
            target = self._next_target()
            if target is not None and not self.leaving:
                self._start_probe(now, target)
        if now >= self._next_sync:
            self._next_sync = now + sync_scale(t.sync_interval, self._up(), t.sync_scale_threshold) * self._jitter()
            alive = self._in[State.ALIVE]
            if alive:
                self._actions.append(Sync(self._ix.names[self.rng.choice(alive)]))
            self._forget(now)
        if now >= self._next_reconnect:
            self._next_reconnect = now + t.reconnect_interval
            dead = self._in[State.DEAD]
            if dead:
                self._actions.append(Sync(self._ix.names[self.rng.choice(dead)]))

    def next_deadline(self) -> float:
        """The earliest time ``handle_timeout`` has something to do. Amortized O(log N): entries
        made stale since they were pushed are popped (or moved to their member's real time)."""
        out = min(self._next_probe, self._next_refresh, self._next_sync, self._next_reconnect)
        if self._publish_pending:
            out = min(out, self._last_publish + self.timing.publish_interval)
        events, timers, due = self._events, self._timers, self._due
        while events and not self._live(*events[0]):
            heapq.heappop(events)
        if events:
            out = min(out, events[0][0])
        while timers:
            i = timers[0]
            if self._rec[i] is None:  # dropped since
                self._st[_heap_pop(timers, due)] &= ~_TIMED
            elif self._deadline(i) > due[i]:  # a newer record: move it to its real time
                self._st[_heap_pop(timers, due)] &= ~_TIMED
                self._schedule(i)
            else:
                return min(out, due[i])
        return out

    def take_actions(self) -> list[Action]:
        actions, self._actions = self._actions, []
        return actions

    # --- views --------------------------------------------------------------------------

    def view(self) -> View[R]:
        """The current snapshot; the same object until something in the view changes."""
        if self._view is None:
            self._version += 1
            names, st, rtts = self._ix.names, self._st, self._rtt
            members = {}
            for i, r in enumerate(self._rec):
                if r is not None:
                    ewma, low = rtts.get(i, _UNMEASURED)
                    members[names[i]] = MemberView(
                        peer=names[i], state=_STATES[st[i] & _STATE], stale=bool(st[i] & _STALE), record=r,
                        since=self._since[i], expires=self._expires[i], rtt_ewma=ewma, rtt_min=low)
            self._view = View(version=self._version, me=self.me, members=MappingProxyType(members))
        return self._view

    def suspicion(self, peer: str) -> Suspicion | None:
        """The suspicion of a suspect member (who confirmed it, when it runs out), else None."""
        return self._suspicions.get(peer)

    def counts(self) -> dict[str, int]:
        """Members by state (for metrics, after every input: without building a snapshot)."""
        return {s.value: len(self._in[s]) for s in State}

    def sync_claims(self) -> list[tuple[str, str, int]]:
        """Our claims for a push-pull sync: the members we hold suspect or dead."""
        names, rec = self._ix.names, self._rec
        return [(names[i], s.value, rec[i].seq) for s in (State.SUSPECT, State.DEAD)  # type: ignore[union-attr]
                for i in self._in[s]]

    # --- internals: the member table ------------------------------------------------------

    def _grow(self) -> None:
        """Columns for every peer id in ``_ix`` (a shared index may have grown by other cores' peers)."""
        k = len(self._ix) - len(self._rec)
        if k <= 0:
            return
        k = max(k, len(self._rec) // 2, 16)  # amortized: a daemon's view grows one member at a time
        self._rec.extend([None] * k)
        self._st.extend(bytes(k))
        for name in ("_since", "_expires", "_due", "_pos"):  # new arrays of the exact size (extend keeps 1/16 spare)
            col = getattr(self, name)
            setattr(self, name, col + array(col.typecode, bytes(col.itemsize * k)))

    def _row(self, peer: str) -> int | None:
        """``peer``'s row if it is in the view, else None."""
        i = self._ix.rows.get(peer)
        return i if i is not None and i < len(self._rec) and self._rec[i] is not None else None

    def _state(self, i: int) -> State:
        return _STATES[self._st[i] & _STATE]  # type: ignore[return-value]

    def _add(self, peer: str, record: R, now: float, expires: float) -> None:
        i = self._ix.of(peer)
        if i >= len(self._rec):
            self._grow()
        self._rec[i] = record
        self._st[i] = _CODE[State.ALIVE] | (self._st[i] & _TIMED)
        self._since[i] = now
        self._expires[i] = expires
        self._count += 1
        group = self._in[State.ALIVE]
        self._pos[i] = len(group)
        group.append(i)
        order = self._order  # a random place in this round's probe order: Fisher-Yates, inside out
        j = self.rng.randint(0, len(order))
        order.append(i)
        order[j], order[-1] = order[-1], order[j]
        self._schedule(i)

    def _unlist(self, i: int) -> None:
        group = self._in[self._state(i)]
        last = group.pop()
        if last != i:
            group[self._pos[i]] = last
            self._pos[last] = self._pos[i]

    def _set_state(self, now: float, i: int, state: State, reason: str) -> None:
        old = self._state(i)
        self._unlist(i)
        group = self._in[state]
        self._st[i] = _CODE[state] | (self._st[i] & ~_STATE)
        self._since[i] = now
        self._pos[i] = len(group)
        group.append(i)
        peer = self._ix.names[i]
        if state is not State.SUSPECT:
            self._suspicions.pop(peer, None)
        if state not in PROBED:
            self._forget_probe(peer)
        self._changed(peer, old, state, reason)

    def _drop(self, i: int, reason: str) -> None:
        peer, state = self._ix.names[i], self._state(i)
        self._unlist(i)
        self._rec[i] = None
        self._st[i] &= _TIMED  # its timer entry, if any, is skipped when it comes up
        self._count -= 1
        self._rtt.pop(i, None)
        self._forget_probe(peer)
        for extra in (self._suspicions, self._certs):
            extra.pop(peer, None)
        self._changed(peer, state, None, reason)

    def _forget_probe(self, peer: str) -> None:
        p = self._probing.pop(peer, None)
        if p is not None:
            del self._probes[p.id]

    # --- internals: the two heaps -----------------------------------------------------------

    def _schedule(self, i: int) -> None:
        """Keep row ``i`` in the timer heap at most once, at or before its deadline: a later
        deadline (a newer record) is picked up lazily when its entry comes up; an earlier one
        (rare: a shorter ttl) gets an ``_EARLY`` event of its own."""
        d = self._deadline(i)
        if d == INF:
            return
        if not self._st[i] & _TIMED:
            self._st[i] |= _TIMED
            self._due[i] = d
            _heap_push(self._timers, self._due, i)
            if len(self._timers) > self._timers_limit:  # members dropped since: keep the others
                self._rebuild_timers()
        elif d < self._due[i]:
            self._push(d, _EARLY, self._ix.names[i])

    def _rebuild_timers(self) -> None:
        timers, due = self._timers, self._due
        keep = array("i")
        for i in timers:
            if self._rec[i] is not None:
                keep.append(i)
            else:
                self._st[i] &= ~_TIMED
        timers[:] = keep  # in place: callers hold it
        for pos in reversed(range(len(timers) // 2)):  # heapq.heapify
            _sift_up(timers, due, pos)
        self._timers_limit = 2 * len(timers) + 64

    def _push(self, t: float, kind: int, key: int | str) -> None:
        heapq.heappush(self._events, (t, kind, key))
        if len(self._events) > self._events_limit:  # mostly stale entries: keep the live ones
            self._events[:] = [e for e in self._events if self._live(*e)]  # in place: callers hold it
            heapq.heapify(self._events)
            self._events_limit = 2 * len(self._events) + 64

    def _live(self, t: float, kind: int, key: int | str) -> bool:
        """Whether an event entry still stands: what it was pushed for has not moved since."""
        if kind == _PROBE:
            p = self._probes.get(key)  # type: ignore[call-overload]
            return p is not None and p.deadline == t
        i = self._row(key)  # type: ignore[arg-type]
        if i is None:
            return False
        if kind == _SUSPECT:
            s = self._suspicions.get(key)  # type: ignore[call-overload]
            return s is not None and s.deadline == t
        return self._deadline(i) == t

    def _fire(self, now: float, t: float, kind: int, key: int | str) -> None:
        if not self._live(t, kind, key):
            return
        if kind == _PROBE:
            p = self._probes[key]  # type: ignore[index]
            if p.indirect:
                self._probe_failed(now, p)
            else:
                self._go_indirect(now, p)
            return
        i: int = self._row(key)  # type: ignore[arg-type,assignment]
        if kind == _SUSPECT:
            self.counters.deaths += 1
            self._set_state(now, i, State.DEAD, "suspicion timed out")
            if self._speak():
                self._actions.append(PublishRumor("dead", key, self._rec[i].seq))  # type: ignore[arg-type,union-attr]
        else:
            self._expire(now, i)
            if self._rec[i] is not None:  # stale now: its certificate may run out before its timer
                self._schedule(i)

    def _deadline(self, i: int) -> float:
        """When something happens to row ``i`` by itself: its certificate runs out or its record goes stale."""
        cert = self._certs.get(self._ix.names[i], INF) if self._certs else INF
        expires = self._expires[i]
        return cert if self._st[i] & _STALE or cert < expires else expires

    def _expire(self, now: float, i: int) -> None:
        peer = self._ix.names[i]
        if self._certs.get(peer, INF) <= now:
            self.counters.certs_expired += 1
            self._drop(i, "certificate expired")
        elif not self._st[i] & _STALE and self._expires[i] <= now:
            self._st[i] |= _STALE
            self.counters.records_expired += 1
            state = self._state(i)
            self._changed(peer, state, state, "stale: no record within its ttl")

    # --- internals: the protocol ------------------------------------------------------------

    def _receive_record(self, now: float, r: R, wall: float | None) -> str:
        if r.peer == self.me:
            if r.seq > self.seq and not self.leaving:  # an older life of ours got further: jump past it
                self._refute(now, r.seq)
                return "refuted"
            return "self"
        if r.peer in self._excluded:
            return "excluded"
        cert_expires = INF
        age = 0.0
        if wall is not None:
            age = min(max(0.0, wall - r.issued), r.ttl)  # a clock ahead of ours (skew) counts as fresh
            cert_left = r.cert_expires - wall
            if cert_left <= 0:
                return "cert_expired"
            if cert_left != INF:
                cert_expires = now + cert_left
        expires = now - age + r.ttl
        i = self._row(r.peer)
        held = None if i is None else self._rec[i]
        if held is None or r.seq > held.seq:
            if cert_expires == INF:
                if self._certs:
                    self._certs.pop(r.peer, None)
            else:
                self._certs[r.peer] = _single(cert_expires) if self._compact else cert_expires
        if i is None or held is None:
            self._add(r.peer, r, now, expires)
            self.counters.records_accepted += 1
            self._changed(r.peer, None, State.ALIVE, "joined")
            return "new"
        if r.seq == held.seq:
            return "duplicate"  # the same record by another path (sync and gossip): normal
        if r.seq < held.seq:
            self.counters.records_old += 1
            return "old"  # a replay, or a straggler overtaken by a newer record
        self.counters.records_accepted += 1
        self._rec[i], self._expires[i] = r, expires
        self._view = None
        state = self._state(i)
        if self._st[i] & _STALE and expires > now:
            self._st[i] &= ~_STALE
            self._changed(r.peer, state, state, "fresh record")
        self._schedule(i)
        if state is not State.ALIVE:
            reason = "refuted suspicion" if state is State.SUSPECT else "rejoined"
            self._set_state(now, i, State.ALIVE, reason)
        return "updated"

    def _left(self, now: float, msg: Rumored) -> str:
        i = self._row(msg.about)
        if i is None or msg.about == self.me:
            return "unknown" if i is None else "old"
        if msg.incarnation < self._rec[i].seq or self._state(i) is State.LEFT:  # type: ignore[union-attr]
            return "old"
        self._set_state(now, i, State.LEFT, "left")
        return "left"

    def _accused_me(self, now: float, inc: int, by: str) -> str:
        if inc > self.seq:
            return "future_incarnation"  # no honest member holds a seq of ours we have not issued
        if inc < self.seq or self.leaving:
            return "old"
        if not self._allow_accusation(now, by):
            return "accusation_rate"
        self._refute(now)
        return "refuted"

    def _allow_accusation(self, now: float, by: str) -> bool:
        """Token bucket per accuser (memberlist has none: every member there is trusted)."""
        t = self.timing
        b = self._buckets.get(by)
        if b is None:
            if len(self._buckets) > 4 * self._count + 64:  # accusers no longer in the view
                self._buckets = {p: x for p, x in self._buckets.items() if self._row(p) is not None}
            b = self._buckets[by] = _Bucket(tokens=float(t.accusation_burst), at=now)
        b.tokens = min(float(t.accusation_burst), b.tokens + max(0.0, now - b.at) * t.accusation_rate)
        b.at = max(b.at, now)
        if b.tokens < 1:
            return False
        b.tokens -= 1
        return True

    def _accuse(self, now: float, i: int, by: str) -> str:
        result = self._suspect(now, i, by)
        peer = self._ix.names[i]
        if peer not in self._probing and not self.leaving:
            self._start_probe(now, peer)  # our own evidence, at once
        return result

    def _changed(self, peer: str, old: State | None, new: State | None, reason: str) -> None:
        self._view = None
        self._actions.append(Changed(peer, old, new, reason))

    def _suspect(self, now: float, i: int, by: str) -> str:
        peer, state = self._ix.names[i], self._state(i)
        if state is State.ALIVE:
            n = len(self._in[State.ALIVE]) + len(self._in[State.SUSPECT]) + 1
            low, high = suspicion_bounds(n, self.timing.probe_interval, self.timing.suspicion_mult,
                                         self.timing.suspicion_max_mult, self.timing.suspicion_log_cap)
            self._set_state(now, i, State.SUSPECT, "suspected by " + by)
            k = expected_confirmations(n, self.timing.suspicion_mult)
            s = self._suspicions[peer] = Suspicion(started=now, k=k, low=low, high=high, confirmers={by})
            self._push(s.deadline, _SUSPECT, peer)
            self.counters.suspicions += 1
            return "suspect"
        s = self._suspicions.get(peer)
        if state is State.SUSPECT and s is not None and s.confirm(by):
            self._push(s.deadline, _SUSPECT, peer)  # sooner: the one pushed before is stale
            return "confirmed"
        return "old"

    def _refute(self, now: float, incarnation: int = 0) -> None:
        self.seq = max(self.seq, incarnation)
        self.counters.refutations += 1
        self.awareness.apply(+1)  # being suspected is a hint that we are the slow one
        self._publish(now)

    def _publish(self, now: float) -> None:
        self._last_publish = now
        self._publish_pending = False
        self._next_refresh = now + self._refresh_step() * self._jitter()
        self._issued = min(self._issued + 1, _SETTLED)
        if self.seq + 1 >= MAX_SEQ:  # unreachable in practice (2^31 restarts x 2^32 records)
            self.counters.seq_exhausted += 1
            return
        self.seq += 1
        self._actions.append(PublishRecord(self.seq))

    def _next_target(self) -> str | None:
        """The next member in a shuffled round-robin: the list is rebuilt once per round (O(N)
        per N probes); members gone, down or already being probed are skipped."""
        names, rec, st = self._ix.names, self._rec, self._st
        for _ in range(2):
            while self._order:
                i = self._order.pop()
                if rec[i] is not None and _STATES[st[i] & _STATE] in PROBED and names[i] not in self._probing:
                    return names[i]
            self._order = array("i", [i for s in PROBED for i in self._in[s]])
            self.rng.shuffle(self._order)
        return None

    def _timeout_for(self, peer: str, floor: float) -> float:
        i = self._row(peer)
        rtt = self._rtt.get(i) if i is not None else None  # type: ignore[arg-type]
        return self.awareness.scale(max(floor, 3 * (0.0 if rtt is None else rtt[0]) + 0.1))

    def _start_probe(self, now: float, peer: str) -> None:
        timeout = self._timeout_for(peer, self.timing.probe_timeout)
        p = _Probe(id=next(self._ids), target=peer, deadline=now + timeout)
        self._probes[p.id] = self._probing[peer] = p
        self._push(p.deadline, _PROBE, p.id)
        self.counters.probes += 1
        self._actions.append(Probe(p.id, peer, timeout))

    def _helpers(self, target: str) -> list[str]:
        """Up to ``indirect_probes`` random alive members other than ``target``, without building
        a list of all of them: rejection sampling over the alive list (O(k) expected)."""
        alive = self._in[State.ALIVE]
        k = self.timing.indirect_probes
        names = self._ix.names
        if len(alive) <= 2 * k + 1:  # few: SWIM's plain sample
            candidates = [names[i] for i in alive if names[i] != target]
            return self.rng.sample(candidates, min(k, len(candidates)))
        chosen: list[str] = []
        while len(chosen) < k:
            peer = names[alive[self.rng.randrange(len(alive))]]
            if peer != target and peer not in chosen:
                chosen.append(peer)
        return chosen

    def _go_indirect(self, now: float, p: _Probe) -> None:
        helpers = self._helpers(p.target)
        if not helpers:
            self._probe_failed(now, p)
            return
        wait = self._timeout_for(p.target, self.timing.indirect_timeout)
        p.indirect, p.helpers, p.deadline = True, frozenset(helpers), now + wait
        self._push(p.deadline, _PROBE, p.id)
        self.counters.indirect_probes += 1
        self._actions += [ProbeVia(p.id, h, p.target, wait * 0.6) for h in helpers]

    def _end_probe(self, p: _Probe) -> None:
        del self._probes[p.id]
        if self._probing.get(p.target) is p:
            del self._probing[p.target]

    def _probe_succeeded(self, now: float, p: _Probe) -> None:
        self._end_probe(p)
        self.awareness.apply(-1)
        i = self._row(p.target)
        if i is not None and self._state(i) is State.SUSPECT:  # it answered: the accusation was wrong
            self.counters.accusations_cleared += 1
            self._set_state(now, i, State.ALIVE, "answered our probe")

    def _probe_failed(self, now: float, p: _Probe) -> None:
        self._end_probe(p)
        self.counters.probes_failed += 1
        # Lifeguard: helpers that did not even nack suggest our own links are the problem
        self.awareness.apply(len(p.helpers) - p.nacks if p.helpers else 1)
        i = self._row(p.target)
        if i is None or self._state(i) not in PROBED:
            return
        was_alive = self._state(i) is State.ALIVE
        result = self._suspect(now, i, by=self.me)
        if was_alive or (result == "confirmed" and self._speak()):  # the first accuser always speaks
            self._actions.append(PublishRumor("suspect", p.target, self._rec[i].seq))  # type: ignore[union-attr]

    def _up(self) -> int:
        """Members up, this node included."""
        return len(self._in[State.ALIVE]) + len(self._in[State.SUSPECT]) + 1

    def _jitter(self) -> float:
        """A periodic timer's spread (x0.75-1.25): members that started together (a swarm formed at
        once, a mass restart, the simulator's warm start) do not sync and refresh in step forever."""
        return self.rng.uniform(0.75, 1.25)

    def _refresh_every(self) -> float:
        return refresh_period(self.timing, self._up())

    def _refresh_step(self) -> float:
        """Until the next refresh: the refresh interval after this node's first record, doubling
        with each record it issues, up to the swarm's period (Trickle's timer)."""
        return min(self._refresh_every(), self.timing.refresh_interval * 2 ** self._issued)

    @property
    def record_ttl(self) -> float:
        """The ttl for this node's next record (``record_ttl`` for the members up now)."""
        return record_ttl(self.timing, self._up())

    def _speak(self) -> bool:
        """Whether to gossip a confirmation (a suspect or dead rumor about a member others accuse
        too): about ``confirm_fanout`` of the swarm do, whatever its size."""
        n = self._up()
        if n <= self.timing.confirm_fanout or self.rng.random() * n < self.timing.confirm_fanout:
            return True
        self.counters.confirmations_unsaid += 1
        return False

    def _forget(self, now: float) -> None:
        """Dead and left members leave the view after ``forget_after``, and not before their
        last record expired (in a large swarm the ttl outlives ``forget_after``: a sync or a
        replay carrying that record would bring the member back as new): O(members down)."""
        after, since, expires = self.timing.forget_after, self._since, self._expires
        down = [i for s in (State.DEAD, State.LEFT) for i in self._in[s]]
        for i in [i for i in down if now - since[i] > after and expires[i] <= now]:
            self._drop(i, "forgotten")
