"""Membership and failure detection: SWIM with Lifeguard, as a sans-IO core.

Theory of operation (Das et al., "SWIM", 2002; Dadgar et al., "Lifeguard", 2018):

- The view maps each peer to its newest verified record and a state: alive, suspect,
  dead or left. A record's seq is the peer's incarnation: a record with a higher seq than
  the one held replaces it and refutes any suspicion or death at a lower incarnation; an
  equal or lower seq is ignored (replays change nothing).
- Every ``probe_interval`` (stretched by local health) the next member in a shuffled
  round-robin is probed directly (``Probe``). If no ack comes within the probe timeout, up
  to ``indirect_probes`` other members are asked to probe it (``ProbeVia``); they answer
  ack or nack. With no ack at all the member becomes suspect, and a ``suspect`` rumor is
  gossiped. Probes overlap: a slow peer does not delay the probing of others.
- A suspicion ends in a death at a Lifeguard timeout that shrinks with independent
  confirmations (suspicion.py). The suspect refutes by issuing a record with a higher seq;
  this node does the same whenever it hears a suspect or dead rumor, or a sync claim,
  about itself.
- A lost connection is a hint, not a verdict: the member is probed at once.
- Own record: published on change (at most once per ``publish_interval``), refreshed every
  ``refresh_interval``, each time with the next seq. ``PublishRecord`` asks the driver to
  build and sign it.
- Anti-entropy: every ``sync_interval`` a push-pull ``Sync`` with a random alive member;
  every ``reconnect_interval`` one with a random dead member, which is how both sides of a
  healed partition find each other again.

Inputs are method calls with ``now`` (monotonic seconds); outputs are actions collected
until ``take_actions()``. No clock, no I/O; randomness from the ``random.Random`` given.
"""

from __future__ import annotations

import enum
import itertools
import random
from dataclasses import dataclass, field

from .suspicion import Awareness, Suspicion, expected_confirmations, suspicion_bounds
from .wire import Record, Rumor


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
    awareness_limit: int = 8  # memberlist's AwarenessMaxMultiplier
    publish_interval: float = 0.25  # at most 4 records/s from a node that changes quickly
    refresh_interval: float = 30.0  # keeps records fresh; N/30 records/s per node, not N per s
    record_ttl: float = 120.0  # four missed refreshes
    sync_interval: float = 15.0  # push-pull with one alive member (memberlist: 30 s LAN)
    reconnect_interval: float = 2.0  # try one dead member: heals partitions in seconds
    forget_after: float = 3600.0  # dead and left members leave the view
    rtt_alpha: float = 0.2  # EWMA weight of a new RTT sample

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
    peer: str
    old: State | None
    new: State | None
    reason: str


Action = PublishRecord | PublishRumor | Probe | ProbeVia | Sync | Changed


# --- state ----------------------------------------------------------------------------

@dataclass(slots=True)
class Member:
    record: Record
    state: State
    since: float
    heard: float  # when the newest record arrived
    suspicion: Suspicion | None = None
    rtt_ewma: float | None = None
    rtt_min: float | None = None

    @property
    def peer(self) -> str:
        return self.record.peer

    @property
    def incarnation(self) -> int:
        return self.record.seq


@dataclass(slots=True)
class _Probe:
    id: int
    target: str
    deadline: float
    indirect: bool = False
    helpers: frozenset[str] = frozenset()
    nacks: int = 0


@dataclass(slots=True)
class Counters:
    probes: int = 0
    probes_failed: int = 0
    indirect_probes: int = 0
    suspicions: int = 0
    refutations: int = 0
    deaths: int = 0
    records_accepted: int = 0
    records_old: int = 0


class Membership:
    def __init__(self, me: str, seq: int, timing: Timing, rng: random.Random, now: float) -> None:
        self.me = me
        self.seq = seq  # the seq of the newest own record; the next one is seq + 1
        self.timing = timing
        self.rng = rng
        self.members: dict[str, Member] = {}
        self.awareness = Awareness(timing.awareness_limit)
        self.counters = Counters()
        self.leaving = False
        self._actions: list[Action] = []
        self._ids = itertools.count(1)
        self._probes: dict[int, _Probe] = {}
        self._order: list[str] = []
        self._last_publish = float("-inf")
        self._publish_pending = True  # the first record goes out at once
        self._next_probe = now + rng.uniform(0, timing.probe_interval)
        self._next_refresh = now + timing.refresh_interval
        self._next_sync = now + rng.uniform(0, timing.sync_interval)
        self._next_reconnect = now + timing.reconnect_interval
        self.handle_timeout(now)

    # --- inputs -------------------------------------------------------------------------

    def receive(self, now: float, msg: Record | Rumor) -> str:
        """Merge a verified message; the result names what it did (for metrics and tests)."""
        if isinstance(msg, Record):
            return self._receive_record(now, msg)
        if msg.about == self.me:
            if msg.kind in ("suspect", "dead") and msg.incarnation >= self.seq and not self.leaving:
                self._refute(now, msg.incarnation)
                return "refuted"
            return "old"
        m = self.members.get(msg.about)
        if m is None:
            return "unknown"
        if msg.incarnation < m.incarnation:
            return "old"
        if msg.kind == "suspect":
            return self._suspect(now, m, by=msg.sender)
        if m.state in (State.DEAD, State.LEFT):
            return "old"
        self._set_state(now, m, State.DEAD if msg.kind == "dead" else State.LEFT,
                        "declared dead by " + msg.sender if msg.kind == "dead" else "left")
        return msg.kind

    def probe_result(self, now: float, probe_id: int, ok: bool, rtt: float | None = None) -> None:
        """The driver's direct probe finished: an ack (with its RTT) or a failure."""
        p = self._probes.get(probe_id)
        if rtt is not None and p is not None:
            self.rtt_sample(p.target, rtt)
        if p is None or p.indirect:
            return
        if ok:
            self._probe_succeeded(p)
        else:
            self._go_indirect(now, p)

    def via_result(self, now: float, probe_id: int, via: str, ok: bool) -> None:
        """A helper answered: ack (the target answered it) or nack (it did not)."""
        p = self._probes.get(probe_id)
        if p is None or not p.indirect or via not in p.helpers:
            return
        if ok:
            self._probe_succeeded(p)
            return
        p.nacks += 1
        if p.nacks == len(p.helpers):
            self._probe_failed(now, p)

    def rtt_sample(self, peer: str, rtt: float) -> None:
        m = self.members.get(peer)
        if m is None or rtt < 0:
            return
        a = self.timing.rtt_alpha
        m.rtt_ewma = rtt if m.rtt_ewma is None else (1 - a) * m.rtt_ewma + a * rtt
        m.rtt_min = rtt if m.rtt_min is None else min(m.rtt_min, rtt)

    def connection_lost(self, now: float, peer: str) -> None:
        m = self.members.get(peer)
        if m is not None and m.state in PROBED and not self._probing(peer) and not self.leaving:
            self._start_probe(now, peer)

    def claims(self, now: float, claims: list[tuple[str, str, int]]) -> None:
        """A sync peer's view of members it thinks are down; only claims about us matter."""
        for peer, state, inc in claims:
            if peer == self.me and state in ("suspect", "dead") and inc >= self.seq and not self.leaving:
                self._refute(now, inc)

    def local_change(self, now: float) -> None:
        """Own labels or resources changed: re-advertise (rate-limited)."""
        self._publish_pending = True
        self.handle_timeout(now)

    def leave(self, now: float) -> None:
        self.leaving = True
        self._probes.clear()
        self._actions.append(PublishRumor("left", self.me, self.seq))

    def handle_timeout(self, now: float) -> None:
        t = self.timing
        if self._publish_pending and now >= self._last_publish + t.publish_interval and not self.leaving:
            self._publish(now)
        if now >= self._next_refresh and not self.leaving:
            self._publish(now)
        for p in [p for p in self._probes.values() if p.deadline <= now]:
            if p.indirect:
                self._probe_failed(now, p)
            else:
                self._go_indirect(now, p)
        for m in self.members.values():
            if m.state is State.SUSPECT and m.suspicion is not None and m.suspicion.deadline <= now:
                self.counters.deaths += 1
                self._set_state(now, m, State.DEAD, "suspicion timed out")
                self._actions.append(PublishRumor("dead", m.peer, m.incarnation))
        if now >= self._next_probe:
            self._next_probe = now + self.awareness.scale(t.probe_interval)
            target = self._next_target()
            if target is not None and not self.leaving:
                self._start_probe(now, target)
        if now >= self._next_sync:
            self._next_sync = now + t.sync_interval
            alive = [m.peer for m in self.members.values() if m.state is State.ALIVE]
            if alive:
                self._actions.append(Sync(self.rng.choice(alive)))
            self._forget(now)
        if now >= self._next_reconnect:
            self._next_reconnect = now + t.reconnect_interval
            dead = [m.peer for m in self.members.values() if m.state is State.DEAD]
            if dead:
                self._actions.append(Sync(self.rng.choice(dead)))

    def next_deadline(self) -> float:
        deadlines = [self._next_probe, self._next_refresh, self._next_sync, self._next_reconnect]
        if self._publish_pending:
            deadlines.append(self._last_publish + self.timing.publish_interval)
        deadlines += [p.deadline for p in self._probes.values()]
        deadlines += [m.suspicion.deadline for m in self.members.values()
                      if m.state is State.SUSPECT and m.suspicion is not None]
        return min(deadlines)

    def take_actions(self) -> list[Action]:
        actions, self._actions = self._actions, []
        return actions

    # --- views --------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in State}
        for m in self.members.values():
            out[m.state.value] += 1
        return out

    def down_claims(self) -> list[tuple[str, str, int]]:
        return [(m.peer, m.state.value, m.incarnation) for m in self.members.values()
                if m.state in (State.SUSPECT, State.DEAD)]

    # --- internals ----------------------------------------------------------------------

    def _receive_record(self, now: float, r: Record) -> str:
        if r.peer == self.me:
            if r.seq > self.seq:  # an older life of ours got further: jump past it
                self._refute(now, r.seq)
                return "refuted"
            return "self"
        m = self.members.get(r.peer)
        if m is None:
            self.members[r.peer] = Member(record=r, state=State.ALIVE, since=now, heard=now)
            self._order.insert(self.rng.randint(0, len(self._order)), r.peer)
            self.counters.records_accepted += 1
            self._actions.append(Changed(r.peer, None, State.ALIVE, "joined"))
            return "new"
        if r.seq == m.record.seq:
            return "duplicate"  # the same record by another path (sync and gossip): normal
        if r.seq < m.record.seq:
            self.counters.records_old += 1
            return "old"  # a replay, or a straggler overtaken by a newer record
        self.counters.records_accepted += 1
        m.record, m.heard = r, now
        if m.state is not State.ALIVE:
            reason = "refuted suspicion" if m.state is State.SUSPECT else "rejoined"
            self._set_state(now, m, State.ALIVE, reason)
        return "updated"

    def _set_state(self, now: float, m: Member, state: State, reason: str) -> None:
        old, m.state, m.since = m.state, state, now
        if state is not State.SUSPECT:
            m.suspicion = None
        if state not in PROBED:
            for p in [p for p in self._probes.values() if p.target == m.peer]:
                del self._probes[p.id]
        self._actions.append(Changed(m.peer, old, state, reason))

    def _suspect(self, now: float, m: Member, by: str) -> str:
        if m.state is State.ALIVE:
            n = sum(1 for x in self.members.values() if x.state in PROBED) + 1
            low, high = suspicion_bounds(n, self.timing.probe_interval, self.timing.suspicion_mult,
                                         self.timing.suspicion_max_mult)
            self._set_state(now, m, State.SUSPECT, "suspected by " + by)
            m.suspicion = Suspicion(started=now, k=expected_confirmations(n, self.timing.suspicion_mult),
                                    low=low, high=high, confirmers={by})
            self.counters.suspicions += 1
            return "suspect"
        if m.state is State.SUSPECT and m.suspicion is not None and m.suspicion.confirm(by):
            return "confirmed"
        return "old"

    def _refute(self, now: float, incarnation: int) -> None:
        self.seq = max(self.seq, incarnation)
        self.counters.refutations += 1
        self.awareness.apply(+1)  # being suspected is a hint that we are the slow one
        self._publish(now)

    def _publish(self, now: float) -> None:
        self.seq += 1
        self._actions.append(PublishRecord(self.seq))
        self._last_publish = now
        self._publish_pending = False
        self._next_refresh = now + self.timing.refresh_interval

    def _probing(self, peer: str) -> bool:
        return any(p.target == peer for p in self._probes.values())

    def _next_target(self) -> str | None:
        for _ in range(2):
            while self._order:
                peer = self._order.pop()
                m = self.members.get(peer)
                if m is not None and m.state in PROBED and not self._probing(peer):
                    return peer
            self._order = [p for p, m in self.members.items() if m.state in PROBED]
            self.rng.shuffle(self._order)
        return None

    def _timeout_for(self, peer: str, floor: float) -> float:
        m = self.members.get(peer)
        rtt = m.rtt_ewma if m is not None and m.rtt_ewma is not None else 0.0
        return self.awareness.scale(max(floor, 3 * rtt + 0.1))

    def _start_probe(self, now: float, peer: str) -> None:
        timeout = self._timeout_for(peer, self.timing.probe_timeout)
        p = _Probe(id=next(self._ids), target=peer, deadline=now + timeout)
        self._probes[p.id] = p
        self.counters.probes += 1
        self._actions.append(Probe(p.id, peer, timeout))

    def _go_indirect(self, now: float, p: _Probe) -> None:
        candidates = [m.peer for m in self.members.values() if m.state is State.ALIVE and m.peer != p.target]
        helpers = self.rng.sample(candidates, min(self.timing.indirect_probes, len(candidates)))
        if not helpers:
            self._probe_failed(now, p)
            return
        wait = self._timeout_for(p.target, self.timing.indirect_timeout)
        p.indirect, p.helpers, p.deadline = True, frozenset(helpers), now + wait
        self.counters.indirect_probes += 1
        self._actions += [ProbeVia(p.id, h, p.target, wait * 0.6) for h in helpers]

    def _probe_succeeded(self, p: _Probe) -> None:
        del self._probes[p.id]
        self.awareness.apply(-1)

    def _probe_failed(self, now: float, p: _Probe) -> None:
        del self._probes[p.id]
        self.counters.probes_failed += 1
        # Lifeguard: helpers that did not even nack suggest our own links are the problem
        self.awareness.apply(len(p.helpers) - p.nacks if p.helpers else 1)
        m = self.members.get(p.target)
        if m is None or m.state not in PROBED:
            return
        was_alive = m.state is State.ALIVE
        if self._suspect(now, m, by=self.me) == "old" and not was_alive:
            return
        self._actions.append(PublishRumor("suspect", m.peer, m.incarnation))

    def _forget(self, now: float) -> None:
        for peer, m in list(self.members.items()):
            if m.state in (State.DEAD, State.LEFT) and now - m.since > self.timing.forget_after:
                del self.members[peer]
                self._actions.append(Changed(peer, m.state, None, "forgotten"))

