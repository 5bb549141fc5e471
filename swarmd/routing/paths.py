"""Path choice: for each peer, the direct path or one relay through a third member, sans-IO.

Theory of operation. The driver builds a ``PathView`` from its snapshots once a second and
calls ``evaluate(now, view)``; the core returns actions (``UsePath`` when a peer's path
changes, ``Measure`` for RTTs it would like to know) and keeps, per peer, the path in use and
the hysteresis state. It never reads a clock or the network.

Rules:
- Roles. For a pair {A, B} the end with the lower peer id (string order) is the *chooser*:
  it decides with hysteresis and announces its choice in its signed record (``via``). The
  other end, the *follower*, uses what the chooser announces for it, and nothing else. Both
  ends then act on the same data (the chooser's record), so traffic takes one path both ways.
- Legs. A relay R for the pair (me, B) is judged on measured RTTs only, never on coordinates:
  an embedding obeys the triangle inequality, so it cannot itself predict a detour (Ledlie et
  al., NSDI'07; RON, SOSP'01). ``me``-R is my own measurement. R-B is what B reports (its
  record's rtts); where R also reports it, the larger of the two counts. A relay's own
  report alone never makes a leg. Direct is my own measurement, else what B reports.
- What a lying member can do. A relay can only claim its own legs, and a claim can only make
  it look *worse*: the chooser measures its leg to R itself (and a probe cannot be answered
  faster than the network carries it), the R-B leg needs B's report and takes the larger of
  B's and R's. So a relay cannot attract a pair's traffic by lying; once chosen it can still
  delay or drop the (end-to-end encrypted) packets, which the driver's relay pings catch only
  for its leg: that is the residual risk of using any relay. The ends themselves (B's
  reports, the chooser's announcement) can steer only their own pair's traffic, which they
  could degrade anyway. A hostile announcement (a relay that is the follower itself, the
  chooser, not an alive member offering relaying, failing or held down here) means direct.
- Coordinates only shortlist: among B's reported relays whose leg from me is unmeasured, the
  ``shortlist`` best by ``estimate(me, R) + leg(R, B)`` that could pass the switch rule are
  asked for (``Measure``), each at most once per ``MEASURE_INTERVAL_S``.
- Legs asked for. B's record reports only its ``MAX_RTTS`` nearest members, but B has an RTT
  to every member its probes reached; so a chooser asks B (``AskLegs``, the driver's
  exchange) for its legs to the ``ask_legs`` relays outside B's record that rank best by my
  leg (measured, else estimated) + the estimate R-B. No threshold: coordinates cannot predict
  a detour, they only rank. Each evaluation asks at most ``ASK_PER_ROUND`` chooser peers with
  a known direct RTT, in rotation, each at most once per ``ask_interval_s``; a pair on a relay
  is asked first when due, for the relay in use first, so its leg never runs out. The answer
  (``legs_answered``) is B's claim like its record's rtts and counts the same way (the larger
  of B's and R's report), for ``legs_ttl_s``; the record's own value wins where both have one.
  It is dropped whole, and counted, unless it is exactly the expected kind: a map of relays
  from the last ask (pending, at most once) to finite RTTs in (0, ``MAX_RTT_MS``].
- Hysteresis (chooser). A move needs ``stable_rounds`` consecutive evaluations (at least
  ``MIN_ROUND_S`` apart: an extra evaluation does not count) wanting the same kind of move:
  to a relay when ``best_relay`` finds one at most ``ratio`` x the current path and at least
  ``min_gain_ms`` faster (from direct; or from the relay in use, to a better one); back to
  direct when the relay in use is more than ``back_ratio`` x direct, gains under
  ``BACK_MIN_GAIN_MS``, or its legs are no longer known. Between ratio and back_ratio
  nothing moves, so jitter around one threshold cannot flap. The relay taken is the best at
  the moment of the move (two near-equal relays alternating as best do not reset the count).
- Busy pairs stay put. A chooser pair whose traffic is heavy now (``PathView.busy``: the
  driver reads WireGuard's byte counters) is not moved for latency, only by a failure: its
  own packets queue on the path it uses, so that path's RTTs rise under the load while the
  idle one's do not, and the pair would move, load the other path, and move back (seen in
  the lab: a relayed all-reduce on 40 Mbit/s links went direct and back every ~20 s); a move
  would also disturb the flows it carries. Once the traffic calms down, one clean probe
  brings the RTT (a minimum over the last few) back and the rule applies again.
- Failure. A relay that is failing (the driver pings relays in use) or no longer an alive
  relay-offering member sends its pairs back to direct at once, on both roles, and is held
  down (not chosen nor followed) for ``hold_down_s``, so a flaky relay cannot make paths flap.
  A relay that refused one pair, or whose pair the other end never asked for, or whose relayed
  path did not carry that pair's packets (``refused``) is held down for that pair only: a
  hostile peer that never asks cannot take a relay away from our other pairs.
- Bounds. At most ``max_relayed`` chosen relayed paths (the biggest gains: a new one beyond
  the cap must gain ``min_gain_ms`` more than the weakest in use, which goes back to direct)
  and at most ``max_relayed`` followed ones (those followed keep their place; new ones in
  peer order); beyond that, direct. All state is per peer in the view and pruned with it.
- No direct path (issue 25, direct.py). A pair whose direct WireGuard path completes no
  handshake within ``direct.GRACE_S`` of being set up (``PathView.unshaken``), or whose ends'
  NATs rule one out, *lacks* a direct path: the chooser moves it to the best usable relay at
  once (no stable rounds: the pair has no connectivity meanwhile), ranked by my leg (measured,
  else estimated) + the relay's leg to the peer (reported, else estimated), ties by id, and
  asks for the missing legs. Such a pair never goes back to direct for latency, only for a
  try (direct.py: rarely, with back-off, or when a record's NAT or reflexive endpoint
  changes); it may move to a faster relay by the switch rule. It takes a place under
  ``max_relayed`` before any pair relayed for speed (the weakest of those goes direct). The
  path's reason (``reason``): ``symmetric NAT``, ``no direct path`` or ``faster``; a
  follower records, as it follows, whether its own direct path was unproven then.
- Reachable relays. For a pair with an end behind a NAT or firewall (its record's wg.nat:
  ``eim``, ``edm``, ``firewall``) only members in ``PathView.public`` (record wg.nat
  ``public``, or unmeasured with addresses: the driver's rule) can relay: the NATed end must
  reach the relay unasked. A chooser's announcement naming another is refused by the follower.
- Units: milliseconds. A non-finite, negative or over ``MAX_RTT_MS`` value in the view is
  ignored and counted in ``ignored_values``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from . import direct as dp

SWITCH_RATIO = 0.9  # a relay must be >= 10 % faster ... (Ledlie et al. count pairs 20 % faster;
SWITCH_MIN_GAIN_MS = 2.0  # ... and >= 2 ms: 10 % of a 5 ms path is within one probe's jitter)
STABLE_ROUNDS = 3  # evaluations (1 s apart) wanting the move: one lucky probe cannot move a path
BACK_RATIO = 0.95  # on a relay, back to direct when it is no longer 5 % faster ...
BACK_MIN_GAIN_MS = 1.0  # ... or gains under 1 ms: the band between 0.9 and 0.95 stops flapping
SHORTLIST = 3  # unmeasured relays per peer worth a probe, ranked by coordinates
MAX_RELAYED = 16  # relayed paths a node chooses (and, separately, follows): the record's `via` cap
MEASURE_INTERVAL_S = 60.0  # a relay leg is asked for at most this often (membership probes too)
MEASURE_PER_ROUND = 8  # probes asked for per evaluation (the driver's extra load: 8 pings/s)
# Legs asked for (a peer's RTTs to relays its record does not carry; exchange.py asks, service.py feeds
# the answers in with ``legs_answered``). sim/detours.py, 1,000 nodes: the switch rule detours 1.0 % of
# pairs on the records' legs, 2.5 % with 4 relays asked for per peer, 2.7 % with 8, 3.1 % with 16 (3.7 %
# with every leg known); 8 ids fit a small request and are a fair share of what more would find.
ASK_LEGS = 8  # relays per peer asked for, the best by my leg (measured, else estimated) + est(R, peer)
ASK_PER_ROUND = 2  # peers asked per evaluation: ranking every relay for a peer is O(members), 2/s bounds it
ASK_INTERVAL_S = 300.0  # a peer is asked at most this often (500 chooser pairs at 2/s: a 250 s cycle)
LEGS_TTL_S = 600.0  # answered legs count this long (two cycles: a leg stays known between two askings
# of a large swarm), then they are forgotten: a peer's RTT drifts, and an old answer is not its report
MIN_ROUND_S = 0.5  # evaluations closer than this to the last counted one do not count as rounds
HOLD_DOWN_S = 60.0  # a relay that failed is not used again for this long (RON's outage scale)
MAX_RTT_MS = 60000.0  # the wire's bound on a reported RTT


@dataclass(frozen=True, slots=True, kw_only=True)
class PathView:
    """What the core sees at one evaluation, built by the driver from immutable snapshots."""

    me: str
    peers: frozenset[str]  # alive members with a mesh side (the path targets), me excluded
    relays: frozenset[str]  # of those, the ones whose record offers relaying
    own: Mapping[str, float]  # peer -> RTT ms measured by this node, recent (a min over the last
    # few probes, not since ever: a leg that got worse must show it)
    reports: Callable[[str], Mapping[str, float]]  # peer -> its record's rtts (peer -> ms); {} if none
    estimate: Callable[[str, str], float | None]  # coordinate estimate ms; None if either has none
    announced: Callable[[str], str | None]  # peer -> the relay its record's `via` names for me
    failing: frozenset[str] = frozenset()  # relays this node cannot reach now (driver pings)
    refused: frozenset[tuple[str, str]] = frozenset()  # (peer, relay): the relay refused that pair, or the
    # pair's other end never asked it, or the relayed path did not carry our packets (driver's checks)
    busy: frozenset[str] = frozenset()  # peers our WireGuard traffic with is heavy now (a bulk transfer)
    # Reach (issue 25; the defaults: nobody behind a NAT, every direct path working)
    reach: Callable[[str], tuple[str | None, str | None]] = lambda peer: (None, None)  # peer (me too) -> its
    # record's (wg.nat, wg.reflexive): one of direct.NATED or "public" or None; a change retries direct
    public: frozenset[str] = frozenset()  # members anyone can reach unasked: the only relays for a NATed pair
    unshaken: frozenset[str] = frozenset()  # peers whose direct WireGuard path has completed no handshake
    # since it was set up (the driver, from Mesh.peer_rows; only peers on their direct path)
    target: Callable[[str], str | None] = lambda peer: None  # peer -> the endpoint its direct packets go
    # to (Mesh.direct_endpoint): one that changes retries direct


@dataclass(frozen=True, slots=True, kw_only=True)
class UsePath:
    """The path for ``peer`` changed: through ``relay``, or direct (None)."""

    __match_args__ = ("peer", "relay")
    peer: str
    relay: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Measure:
    """Probe these peers' RTT from this node (they become ``PathView.own``); best effort."""

    __match_args__ = ("peers",)
    peers: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class AskLegs:
    """Ask ``peer`` for its RTTs to ``relays`` (the driver's coordinate exchange); the answer goes
    to ``Paths.legs_answered``; best effort."""

    __match_args__ = ("peer", "relays")
    peer: str
    relays: tuple[str, ...]


Action = UsePath | Measure | AskLegs


def best_relay(direct_ms: float, legs: Mapping[str, tuple[float, float]], *, ratio: float = SWITCH_RATIO,
               min_gain_ms: float = SWITCH_MIN_GAIN_MS) -> tuple[str, float] | None:
    """The relay with the lowest leg1 + leg2 (ties: lowest id) if it beats ``direct_ms`` by the
    switch rule (total <= direct x ratio and direct - total >= min_gain_ms), with its total;
    else None. The pure rule, also used by the simulator's detour figures."""
    best: tuple[float, str] | None = None
    for relay, (a, b) in legs.items():
        key = (a + b, relay)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    total, relay = best
    if total <= direct_ms * ratio and direct_ms - total >= min_gain_ms:
        return relay, total
    return None


@dataclass(slots=True)
class _Chosen:
    relay: str | None = None  # in use
    want: str | None = None  # the kind of move wanted: "relay", "direct" or None
    target: str | None = None  # where the move would go now (a relay; None: direct)
    rounds: int = 0  # consecutive counted rounds wanting it


@dataclass(slots=True)
class _Round:
    """One evaluation's data for one chooser pair: direct and the relays with both legs known."""

    direct: float | None = None
    legs: dict[str, tuple[float, float]] = field(default_factory=dict)


class Paths:
    def __init__(self, me: str, *, ratio: float = SWITCH_RATIO, min_gain_ms: float = SWITCH_MIN_GAIN_MS,
                 stable_rounds: int = STABLE_ROUNDS, back_ratio: float = BACK_RATIO,
                 back_min_gain_ms: float = BACK_MIN_GAIN_MS, shortlist: int = SHORTLIST,
                 max_relayed: int = MAX_RELAYED, hold_down_s: float = HOLD_DOWN_S,
                 measure_interval_s: float = MEASURE_INTERVAL_S, ask_legs: int = ASK_LEGS,
                 ask_per_round: int = ASK_PER_ROUND, ask_interval_s: float = ASK_INTERVAL_S,
                 legs_ttl_s: float = LEGS_TTL_S, grace_s: float = dp.GRACE_S, retry_direct_s: float = dp.RETRY_S,
                 retry_direct_max_s: float = dp.RETRY_MAX_S) -> None:
        if not 0 < ratio <= back_ratio <= 1:
            raise ValueError(f"need 0 < ratio <= back_ratio <= 1, got {ratio} and {back_ratio}")
        if min_gain_ms < back_min_gain_ms or back_min_gain_ms < 0:
            raise ValueError("need min_gain_ms >= back_min_gain_ms >= 0")
        if stable_rounds < 1 or shortlist < 0 or max_relayed < 0 or hold_down_s < 0 or measure_interval_s <= 0:
            raise ValueError("stable_rounds >= 1, shortlist, max_relayed, hold_down_s >= 0, measure_interval_s > 0")
        if ask_legs < 0 or ask_per_round < 0 or ask_interval_s <= 0 or legs_ttl_s <= 0:
            raise ValueError("ask_legs, ask_per_round >= 0, ask_interval_s, legs_ttl_s > 0")
        self.me = me
        self.ratio, self.min_gain_ms, self.stable_rounds = ratio, min_gain_ms, stable_rounds
        self.back_ratio, self.back_min_gain_ms = back_ratio, back_min_gain_ms
        self.shortlist, self.max_relayed, self.hold_down_s = shortlist, max_relayed, hold_down_s
        self.measure_interval_s = measure_interval_s
        self.ask_legs, self.ask_per_round = ask_legs, ask_per_round
        self.ask_interval_s, self.legs_ttl_s = ask_interval_s, legs_ttl_s
        self.legs_taken = 0  # counter: answers to AskLegs taken
        self.legs_dropped = 0  # counter: answers dropped (the driver also counts them as rejected input)
        self.ignored_values = 0  # counter: bad RTTs in views (the driver exports it)
        self.switches = 0  # counter: path changes made
        self._chosen: dict[str, _Chosen] = {}  # chooser pairs: peer -> state
        self._followed: dict[str, str] = {}  # follower pairs on a relay: peer (the chooser) -> relay
        self._refused: dict[str, str] = {}  # follower pairs whose announcement was not followed -> why
        self._held: dict[str, float] = {}  # relay -> held down until
        self._held_pairs: dict[tuple[str, str], float] = {}  # (peer, relay) -> held down until
        self._asked: dict[str, float] = {}  # peer -> when its RTT was last asked for
        self._last_round: float | None = None
        # per view: peer -> (its record's reports cleaned, those with the legs it answered)
        self._cache: tuple[PathView | None, dict[str, tuple[dict[str, float], dict[str, float]]]] = (None, {})
        self._legs_asked: dict[str, tuple[float, frozenset[str] | None]] = {}  # peer -> when, relays (None:
        # answered)
        self._legs: dict[str, tuple[float, dict[str, float]]] = {}  # peer -> when answered, its legs
        self._ask_after = ""  # the rotation: the next peers asked come after this id
        self.direct = dp.DirectWatch(grace_s=grace_s, retry_s=retry_direct_s, retry_max_s=retry_direct_max_s)
        self._reasons: dict[str, str] = {}  # followed pairs -> why (direct.why when the follow began)

    # --- queries ------------------------------------------------------------------------

    def role(self, peer: str) -> str:
        return "chooser" if self.me < peer else "follower"

    def path(self, peer: str) -> str | None:
        """The relay in use for ``peer`` (None: direct)."""
        if peer in self._chosen:
            return self._chosen[peer].relay
        return self._followed.get(peer)

    def paths(self) -> dict[str, str]:
        """Every relayed path in use: peer -> relay (chosen and followed)."""
        out = {p: s.relay for p, s in self._chosen.items() if s.relay is not None}
        out.update(self._followed)
        return dict(sorted(out.items()))

    def announced(self) -> dict[str, str]:
        """peer -> relay for this node's record (`via`): the pairs it chooses for, on a relay."""
        return {p: s.relay for p, s in sorted(self._chosen.items()) if s.relay is not None}

    def reason(self, peer: str) -> str | None:
        """Why ``peer``'s path is a relay (direct.REASONS), None when it is direct."""
        if self.path(peer) is None:
            return None
        if peer in self._chosen:
            return self.direct.lacking(peer) or dp.FASTER
        why = self._reasons.get(peer, dp.FASTER)
        return why if why == dp.FASTER else self.direct.reason_now(peer)

    def held(self, now: float) -> dict[str, float]:
        """Relays held down after a failure -> seconds left."""
        return {r: round(t - now, 3) for r, t in sorted(self._held.items()) if t > now}

    # --- the evaluation -----------------------------------------------------------------

    def evaluate(self, now: float, view: PathView) -> list[Action]:
        if view.me != self.me:
            raise ValueError(f"a view for {view.me}, this core is {self.me}")
        actions: list[Action] = []
        counting = self._last_round is None or now - self._last_round >= MIN_ROUND_S
        if counting:
            self._last_round = now
        for relay in view.failing:
            self._held[relay] = now + self.hold_down_s
        self._held = {r: t for r, t in self._held.items() if t > now and r in view.peers}
        for pair in view.refused:  # only that pair: one member cannot take a relay from our other pairs
            self._held_pairs[pair] = now + self.hold_down_s
        self._held_pairs = {k: t for k, t in self._held_pairs.items() if t > now and k[0] in view.peers}
        self._asked = {p: t for p, t in self._asked.items() if now - t < self.measure_interval_s and p in view.peers}
        self._legs_asked = {p: v for p, v in self._legs_asked.items() if now - v[0] < self.ask_interval_s
                            and p in view.peers}
        self._legs = {p: v for p, v in self._legs.items() if now - v[0] < self.legs_ttl_s and p in view.peers}
        for peer in sorted(set(self._chosen) - view.peers):
            if self._chosen.pop(peer).relay is not None:
                actions.append(UsePath(peer=peer, relay=None))
        for peer in sorted(set(self._followed) - view.peers):
            del self._followed[peer]
            actions.append(UsePath(peer=peer, relay=None))
        self._refused = {p: why for p, why in self._refused.items() if p in view.peers}
        self._reasons = {p: why for p, why in self._reasons.items() if p in self._followed}
        self.direct.forget(view.peers)
        here = view.reach(self.me)
        for peer in sorted(view.peers - {self.me}):
            there = view.reach(peer)
            self.direct.observe(now, peer, on_direct=self.path(peer) is None, unshaken=peer in view.unshaken,
                                fingerprint=dp.fingerprint(here, there, view.target(peer)), nats=(here[0], there[0]))

        own = self._clean(view.own)
        wanted: list[tuple[float, str]] = []
        askable: list[str] = []  # chooser pairs with direct known: those worth asking for legs
        ready: list[tuple[float, str, str]] = []  # (-gain, peer, relay): direct -> relay moves due
        forced: list[str] = []  # chooser pairs without a direct path, on no relay: moved first, after the loop
        gains: dict[str, float] = {}  # chooser pairs on a relay -> its gain now
        for peer in sorted(view.peers):
            if peer == self.me:
                continue
            if self.me > peer:
                actions += self._follow(now, peer, view)
                continue
            state = self._chosen.setdefault(peer, _Chosen())
            if state.relay is not None and self._unusable(now, state.relay, peer, view):
                actions.append(self._switch(peer, None))
            lacking = self.direct.lacking(peer) is not None
            if self.direct.trying(peer) and state.relay is not None:
                actions.append(self._switch(peer, None))  # a try of the direct path (direct.py)
            data = self._measure(peer, view, own, wanted)
            if data.direct is not None:
                askable.append(peer)
            if lacking and state.relay is None:
                forced.append(peer)
                continue
            move = self._wanted(state, data)
            if state.relay is not None:  # counted against the cap; unknown gain: the first to go
                known = data.direct is not None and state.relay in data.legs
                gains[peer] = data.direct - sum(data.legs[state.relay]) if known else 0.0
                if lacking:
                    gains[peer] = math.inf  # never the weakest: without it the pair has no path
            if move is not None and ((lacking and move[0] == "direct") or (move[0] == "relay" and state.relay is None
                                                                            and self.direct.trying(peer))):
                move = None  # lacking: direct only for a try; trying: the try decides first
            if move is None or peer in view.busy:  # busy: moved by a failure only (module header)
                state.want, state.target, state.rounds = None, None, 0
                continue
            kind, relay, gain = move
            if counting:
                state.rounds = state.rounds + 1 if state.want == kind else 1
                state.want, state.target = kind, relay
            if state.want != kind or state.rounds < self.stable_rounds:
                continue
            if kind == "direct":
                actions.append(self._switch(peer, None))
                gains.pop(peer, None)
            elif state.relay is not None:
                actions.append(self._switch(peer, relay))
                gains[peer] = gain
            else:
                ready.append((-gain, peer, relay))
        for peer in forced:
            relay = self._pick(now, peer, view, own, wanted)
            if relay is None:
                continue  # no usable relay: direct, the only path there is (explain says so)
            if len(gains) >= self.max_relayed:
                weakest = min((p for p in gains if gains[p] != math.inf), key=lambda p: (gains[p], p), default=None)
                if weakest is None:
                    continue
                actions.append(self._switch(weakest, None))
                del gains[weakest]
            actions.append(self._switch(peer, relay))
            gains[peer] = math.inf
        for neg_gain, peer, relay in sorted(ready):
            if len(gains) >= self.max_relayed:
                weakest = min((p for p in gains if p not in view.busy), key=lambda p: (gains[p], p), default=None)
                if weakest is None or -neg_gain < gains[weakest] + self.min_gain_ms:
                    continue  # stays direct; the move stays due and is tried again next round
                actions.append(self._switch(weakest, None))
                del gains[weakest]
            actions.append(self._switch(peer, relay))
            gains[peer] = -neg_gain
        ask = self._ask(now, wanted)
        if ask:
            actions.append(Measure(peers=ask))
        actions += self._ask_legs(now, view, own, askable)
        return actions

    # --- legs asked for -----------------------------------------------------------------

    def _ask_legs(self, now: float, view: PathView, own: Mapping[str, float], known: list[str]) -> list[AskLegs]:
        """Up to ``ask_per_round`` of ``known`` (sorted) not asked within ``ask_interval_s``:
        first those on a relay (at most ``max_relayed``: their leg is asked again before its
        ``legs_ttl_s`` runs out, however many peers the rotation has), then the rotation going
        on after the last one asked; each asked for its best-ranked relays."""
        if self.ask_legs == 0 or self.ask_per_round == 0:
            return []
        due = [p for p in known if p not in self._legs_asked]
        relayed = [p for p in due if self._chosen[p].relay is not None]
        due = relayed + [p for p in due if p > self._ask_after and p not in relayed] \
            + [p for p in due if p <= self._ask_after and p not in relayed]
        out = []
        for peer in due[:self.ask_per_round]:
            if peer not in relayed:
                self._ask_after = peer
            relays = self._rank(peer, view, own)
            self._legs_asked[peer] = (now, frozenset(relays) if relays else None)  # None: no answer expected
            if relays:
                out.append(AskLegs(peer=peer, relays=relays))
        return out

    def _rank(self, peer: str, view: PathView, own: Mapping[str, float]) -> tuple[str, ...]:
        """The ``ask_legs`` usable relays for the pair (me, peer) that ``peer``'s record does not
        report, the best by my leg (measured, else estimated) + the estimate R-peer; the relay in
        use first (its leg must stay known, or the pair would go back to direct)."""
        recorded = self._reports(peer, view, asked=False)
        current = self._chosen[peer].relay
        first = () if current is None or current in recorded else (current,)
        scored = []
        for relay in view.relays:
            if relay in (self.me, peer) or relay in recorded or relay not in view.peers or relay in view.failing \
                    or relay in self._held or (peer, relay) in self._held_pairs or relay in first \
                    or not self._reachable(relay, peer, view):
                continue
            mine = own[relay] if relay in own else view.estimate(self.me, relay)
            theirs = view.estimate(relay, peer)
            if mine is None or theirs is None or not math.isfinite(mine + theirs):
                continue
            scored.append((mine + theirs, relay))
        scored.sort()
        return (first + tuple(relay for _, relay in scored))[:self.ask_legs]

    def legs_answered(self, now: float, peer: str, legs: object) -> str | None:
        """``peer``'s answer to the pending ``AskLegs``: relay -> its RTT in ms. Taken only whole:
        a map of at most the relays asked, each a finite RTT in (0, ``MAX_RTT_MS``]; it replaces
        the peer's earlier answer and counts for ``legs_ttl_s``. Returns why it was dropped (the
        driver counts it as rejected input), None when taken. A peer's answer is taken once per
        ask: a second one (or one never asked for) is dropped."""
        pending = self._legs_asked.get(peer)
        why = None
        if pending is None or pending[1] is None:
            why = "not asked"
        elif not isinstance(legs, Mapping):
            why = "legs: expected a map of relay -> ms"
        elif len(legs) > len(pending[1]):
            why = f"legs: {len(legs)} entries, {len(pending[1])} asked"
        else:
            for relay, ms in legs.items():
                if not isinstance(relay, str) or relay not in pending[1]:
                    why = "legs: a relay that was not asked for"
                    break
                if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) \
                        or not 0 < ms <= MAX_RTT_MS:
                    why = f"legs: an RTT outside (0, {MAX_RTT_MS:g}] ms"
                    break
        if why is not None:
            self.legs_dropped += 1
            return why
        self._legs_asked[peer] = (pending[0], None)
        self._legs[peer] = (now, {relay: float(ms) for relay, ms in legs.items()})
        self._cache = (None, {})
        self.legs_taken += 1
        return None

    def legs(self, peer: str) -> dict[str, float]:
        """The legs ``peer`` answered, still counted (relay -> ms)."""
        found = self._legs.get(peer)
        return dict(found[1]) if found is not None else {}

    def _follow(self, now: float, peer: str, view: PathView) -> list[Action]:
        """A follower pair: the chooser's announcement if it is safe to use, else direct."""
        want = view.announced(peer)
        why = None
        if want is not None:
            why = self._refusal(now, want, peer, view)
            if why is None and peer not in self._followed and len(self._followed) >= self.max_relayed:
                why = f"already following {self.max_relayed} relayed paths"
            if why is not None:
                want = None
        if why is None:
            self._refused.pop(peer, None)
        else:
            self._refused[peer] = why
        if want == self._followed.get(peer):
            return []
        if want is None:
            del self._followed[peer]
        else:
            if peer not in self._followed:
                self._reasons[peer] = self.direct.why(peer)
            self._followed[peer] = want
        self.switches += 1
        return [UsePath(peer=peer, relay=want)]

    def _refusal(self, now: float, relay: str, peer: str, view: PathView) -> str | None:
        """Why ``relay`` cannot carry the pair (me, peer) now, or None."""
        if not isinstance(relay, str):
            return "not a peer id"
        if relay == self.me:
            return "names this node as the relay"
        if relay == peer:
            return "names the peer itself as the relay"
        if relay not in view.peers:
            return "not an alive member"
        if relay not in view.relays:
            return "does not offer relaying"
        if relay in view.failing:
            return "failing from here"
        if not self._reachable(relay, peer, view):
            return "not publicly reachable, and an end of the pair is behind a NAT or firewall"
        if self._held.get(relay, 0.0) > now:
            return "held down after a failure"
        if (peer, relay) in view.refused or self._held_pairs.get((peer, relay), 0.0) > now:
            return "refused or did not carry this pair lately"
        return None

    def _reachable(self, relay: str, peer: str, view: PathView) -> bool:
        """``relay`` can carry the pair (me, peer): either end behind a NAT or firewall needs a
        relay anyone can reach (``PathView.public``)."""
        return relay in view.public or not (dp.nated(view.reach(self.me)[0]) or dp.nated(view.reach(peer)[0]))

    def _pick(self, now: float, peer: str, view: PathView, own: Mapping[str, float],
              wanted: list[tuple[float, str]]) -> str | None:
        """The relay for a pair without a direct path: the usable one with the least my leg
        (measured, else estimated) + its leg to the peer (reported, else estimated), ties and
        unknowns by id; the unmeasured ones among the best ``shortlist`` are asked for."""
        scored = []
        for relay in view.relays & view.peers:
            if relay in (self.me, peer) or self._refusal(now, relay, peer, view) is not None:
                continue
            mine = own[relay] if relay in own else view.estimate(self.me, relay)
            theirs = self.leg(relay, peer, view)
            theirs = view.estimate(relay, peer) if theirs is None else theirs
            total = mine + theirs if mine is not None and theirs is not None else math.inf
            scored.append((total if math.isfinite(total) else math.inf, relay))
        scored.sort()
        wanted += [(-0.5, relay) for _, relay in scored[:self.shortlist] if relay not in own]
        return scored[0][1] if scored else None

    def _unusable(self, now: float, relay: str, peer: str, view: PathView) -> bool:
        return self._refusal(now, relay, peer, view) is not None

    def _switch(self, peer: str, relay: str | None) -> UsePath:
        state = self._chosen[peer]
        state.relay, state.want, state.target, state.rounds = relay, None, None, 0
        self.switches += 1
        return UsePath(peer=peer, relay=relay)

    def _wanted(self, state: _Chosen, data: _Round) -> tuple[str, str | None, float] | None:
        """The move this round's data asks for: (kind, relay, gain) or None (stay)."""
        direct = data.direct
        if state.relay is None:
            if direct is None:
                return None
            found = best_relay(direct, data.legs, ratio=self.ratio, min_gain_ms=self.min_gain_ms)
            return None if found is None else ("relay", found[0], direct - found[1])
        legs = data.legs.get(state.relay)
        total = None if legs is None else legs[0] + legs[1]
        if direct is not None and (total is None or total > direct * self.back_ratio
                                   or direct - total < self.back_min_gain_ms):
            return "direct", None, 0.0
        if total is None:
            return None  # nothing known either way: keep the relay while it answers
        others = {r: leg for r, leg in data.legs.items() if r != state.relay}
        found = best_relay(total, others, ratio=self.ratio, min_gain_ms=self.min_gain_ms)
        if found is None:
            return None
        return "relay", found[0], (direct - found[1]) if direct is not None else total - found[1]

    def _measure(self, peer: str, view: PathView, own: Mapping[str, float],
                 wanted: list[tuple[float, str]]) -> _Round:
        """Direct and the measured legs of each candidate relay for the pair (me, peer); the
        unmeasured promising ones are added to ``wanted`` as (rank, relay)."""
        reported = self._reports(peer, view)
        direct = own.get(peer, reported.get(self.me))
        if direct is None:
            wanted.append((-1.0, peer))
        legs: dict[str, tuple[float, float]] = {}
        shortlist: list[tuple[float, str]] = []
        for relay in reported:
            if relay in (self.me, peer) or relay not in view.relays or relay not in view.peers \
                    or relay in view.failing or relay in self._held or (peer, relay) in self._held_pairs \
                    or not self._reachable(relay, peer, view):
                continue
            leg2 = self.leg(relay, peer, view, reported)
            if leg2 is None:
                continue
            leg1 = own.get(relay)
            if leg1 is not None:
                legs[relay] = (leg1, leg2)
            elif direct is not None:
                guess = view.estimate(self.me, relay)
                total = (guess if guess is not None and math.isfinite(guess) else math.inf) + leg2
                if total <= direct * self.ratio or math.isinf(total):
                    shortlist.append((total / direct if direct > 0 else math.inf, relay))
        shortlist.sort()
        wanted += shortlist[:self.shortlist]
        return _Round(direct=direct, legs=legs)

    def leg(self, relay: str, peer: str, view: PathView, reported: Mapping[str, float] | None = None) -> float | None:
        """The relay-peer leg: the peer's own report, or the larger of it and the relay's (a
        relay's report alone is its claim and never makes a leg; it can only lengthen one)."""
        by_peer = (reported if reported is not None else self._reports(peer, view)).get(relay)
        if by_peer is None:
            return None
        by_relay = self._reports(relay, view).get(peer)
        return by_peer if by_relay is None else max(by_peer, by_relay)

    def _ask(self, now: float, wanted: list[tuple[float, str]]) -> tuple[str, ...]:
        out: list[str] = []
        for _, peer in sorted(wanted):
            if len(out) >= MEASURE_PER_ROUND:
                break
            if peer in self._asked or peer in out:
                continue
            self._asked[peer] = now
            out.append(peer)
        return tuple(out)

    def _reports(self, peer: str, view: PathView, *, asked: bool = True) -> dict[str, float]:
        """``peer``'s reported RTTs, cleaned once per view: its record's, and (``asked``) the
        legs it answered where its record has none."""
        if self._cache[0] is not view:
            self._cache = (view, {})
        found = self._cache[1].get(peer)
        if found is None:
            record = self._clean(view.reports(peer))
            found = self._cache[1][peer] = (record, {**self._legs[peer][1], **record} if peer in self._legs else record)
        return found[1] if asked else found[0]

    def _clean(self, values: Mapping[str, float]) -> dict[str, float]:
        out = {}
        for peer, ms in values.items():
            if isinstance(ms, (int, float)) and not isinstance(ms, bool) and math.isfinite(ms) \
                    and 0 <= ms <= MAX_RTT_MS:
                out[peer] = float(ms)
            else:
                self.ignored_values += 1
        return out

    # --- explanation --------------------------------------------------------------------

    def explain(self, peer: str, view: PathView, *, now: float, top: int = 5) -> dict:
        """Plain JSON-able data for `swarmctl route`: the role, the path in use, direct, the
        best relays considered with their two legs, the hysteresis state. KeyError for a peer
        not in the view."""
        if peer not in view.peers or peer == self.me:
            raise KeyError(peer)
        own = self._clean(view.own)
        reported, published = self._reports(peer, view), self._reports(peer, view, asked=False)
        direct = own.get(peer, reported.get(self.me))
        source = "measured" if peer in own else ("reported by the peer" if direct is not None else None)
        candidates = []
        for relay in sorted(reported):
            if relay in (self.me, peer) or relay not in view.peers or relay not in view.relays:
                continue
            leg1, leg2 = own.get(relay), self.leg(relay, peer, view, reported)
            guess = view.estimate(self.me, relay)
            why = self._refusal(now, relay, peer, view)
            candidates.append({"relay": relay, "leg1_ms": _r(leg1), "leg2_ms": _r(leg2),
                               "leg2_source": "record" if relay in published else "asked",
                               "total_ms": _r(leg1 + leg2) if leg1 is not None and leg2 is not None else None,
                               "estimate_ms": _r(guess + leg2) if guess is not None and leg2 is not None else None,
                               "usable": why is None, "why_not": why})
        candidates.sort(key=lambda c: (c["total_ms"] is None, c["total_ms"] or 0.0,
                                       c["estimate_ms"] is None, c["estimate_ms"] or 0.0, c["relay"]))
        relay = self.path(peer)
        out: dict = {"peer": peer, "role": self.role(peer), "path": "direct" if relay is None else "relay",
                     "current": relay, "direct_ms": _r(direct), "direct_source": source,
                     "path_ms": _r(direct) if relay is None else _r(self._total(relay, peer, view, own)),
                     "estimate_ms": _r(view.estimate(self.me, peer)), "candidates": candidates[:top],
                     "thresholds": {"switch_ratio": self.ratio, "switch_min_gain_ms": self.min_gain_ms,
                                    "back_ratio": self.back_ratio, "back_min_gain_ms": self.back_min_gain_ms,
                                    "stable_rounds": self.stable_rounds},
                     "held_down": self.held(now), "busy": peer in view.busy and self.role(peer) == "chooser",
                     "reason": self.reason(peer), "direct_path": self.direct.row(now, peer),
                     "nated_pair": dp.nated(view.reach(self.me)[0]) or dp.nated(view.reach(peer)[0])}
        if self.role(peer) == "chooser":
            state = self._chosen.get(peer, _Chosen())
            out["hysteresis"] = {"wants": state.want, "candidate": state.target, "rounds": state.rounds,
                                 "needed": self.stable_rounds}
        else:
            out["announced"] = view.announced(peer)
            out["refused"] = self._refused.get(peer)
        return out

    def _total(self, relay: str, peer: str, view: PathView, own: Mapping[str, float]) -> float | None:
        leg1, leg2 = own.get(relay), self.leg(relay, peer, view)
        return None if leg1 is None or leg2 is None else leg1 + leg2


def _r(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 2)
