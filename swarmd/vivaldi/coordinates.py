"""Network coordinates: Vivaldi with a height, as hashicorp/serf's ``coordinate`` package
computes them, sans-IO.

Each node keeps a point in an 8-dimensional Euclidean space plus a *height* (its access link:
the part of every RTT that no direction can explain). The estimated RTT between two nodes
is the distance between their points plus both heights, plus both *adjustments* (a per-node
offset, the mean residual over recent samples, which absorbs what the embedding cannot
fit). A node never measures most pairs; it estimates them from coordinates the others
publish in their signed records.

Theory of operation (``Client.update``: serf's ``Client.Update``, step by step):
1. The peer's coordinate is checked (same dimensionality, every field finite and within the
   wire's bounds) and the RTT too: outside (0, ``MAX_RTT``] or not a number, the sample is
   refused and counted in ``rejections[reason]``; the coordinate is unchanged. (serf takes an
   RTT of exactly 0, seen with coarse clocks; we refuse it: the probes here time with a
   monotonic clock in nanoseconds, and a zero RTT from the network is not one.)
2. Latency filter: the RTT used is the median of the peer's last ``latency_filter_size``
   samples (Ledlie et al.: rides out one slow probe without a lag).
3. Vivaldi (Dabek et al., Fig. 3): ``weight = e_me / (e_me + e_peer)``; the error becomes a
   moving average of the sample's relative error, with gain ``vivaldi_ce * weight``, capped at
   ``vivaldi_error_max``; the point moves toward (RTT shorter than the estimate) or away from
   the peer by ``vivaldi_cc * weight * (rtt - estimate)``, and the height by the same force
   in proportion (serf's ``ApplyForce``), never below ``height_min``.
4. Adjustment (Lee et al.): ``rtt - raw distance`` into a window of ``adjustment_window_size``
   samples; the adjustment is their sum / (2 * window) (half of the residual is each end's).
5. Gravity (Ledlie et al.): a pull toward the origin of ``(|x| / gravity_rho)^2`` against the
   slow drift of the whole system.
6. A result that is not finite, or that the wire would refuse (a component beyond
   ``MAX_COMPONENT``, ...), resets the client to the origin, its adjustment window cleared,
   counted in ``resets``: our own coordinate always goes out in our record, and no peer's
   coordinate, hostile or not, can make it NaN, infinite or huge.

A hostile peer (not serf's: serf trusts its members' coordinates). A member passes the checks
of step 1 with any coordinate inside the wire's bounds, claims any error, and can delay its
answers (lengthen an RTT, never shorten it). Unbounded, one sample from a coordinate at those
bounds claiming error 0 moved ours by ~12 s or reset it. So (``Config``: each value with its
reason and what it was measured to cost honest runs):
- before step 3, a sample whose estimate is absurd against its RTT (above 10x the RTT + 1 s) is
  dropped and counted in ``rejections["implausible"]``; when 5 different peers in a row are
  absurd, ours is the odd one out and resets (counted in ``resets``);
- in step 3, the peer's error as the weight sees it is at least a quarter of ours (no peer
  weighs more than 4/5), and the disagreement ``rtt - estimate`` counts for at most ``max(rtt, 100 ms)``, in
  the force and in the adjustment window; the height moves no further than the point.
One sample thus moves our point and our height each by at most ``vivaldi_cc * 4/5 * max(rtt,
100 ms)`` (20 ms, or a fifth of a longer RTT), and its entry in the adjustment window is worth
at most ``max(rtt, 100 ms) / 40`` of our adjustment. Honest samples pull us back. What is left:
a liar inside the plausible range, or one that follows our coordinate, or one that delays its
answers (a push away is bounded by the RTT it made), still drags us a bounded step at a time,
the harder the larger its share of our samples (tests/test_routing_coordinates.py measures
it against serf's rule). A liar can also raise our error (serf's update, up to
``vivaldi_error_max``): that only makes us trust our own coordinate less.

Units are seconds throughout (as serf's). Randomness (the direction to move when two points
coincide, as every node does at the start) comes from a ``random.Random`` seeded by the
caller, so a run is reproducible. Every value from a peer is hostile: ``Coordinate.from_wire``
refuses malformed ones with a ``ValueError`` naming what is wrong.

Embeddings obey the triangle inequality, so they estimate RTTs, they cannot find detours:
path choice uses coordinates only to shortlist relays (``routing/paths.py``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

MAX_RTT = 10.0  # seconds; serf's Client.Update bound: beyond it a "RTT" is a clock or probe bug
# Wire bounds for a coordinate from a peer. Real ones are far inside: the longest RTT on the
# internet is ~0.5 s, and gravity pulls points toward the origin.
MAX_COMPONENT = 10.0  # seconds, each |vec[i]|
MAX_HEIGHT = 10.0  # seconds
MAX_ADJUSTMENT = 10.0  # seconds, |adjustment|
ZERO = 1.0e-6  # serf's zeroThreshold: below it two points coincide, an RTT is taken as this


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The algorithm's parameters: serf's ``coordinate.DefaultConfig`` (config.go), which
    cites [1] Dabek et al., "Vivaldi: A decentralized network coordinate system", SIGCOMM
    2004; [2] Ledlie et al., "Network Coordinates in the Wild", NSDI 2007; [3] Lee et al.,
    "On suitability of Euclidean embedding for host-based network coordinate systems",
    IEEE/ACM ToN 2010."""

    dimensionality: int = 8  # [2]: more dimensions help up to a point; 8 plus a height
    vivaldi_error_max: float = 1.5  # a new node's error, and its ceiling
    vivaldi_ce: float = 0.25  # [1] c_e: the most one sample moves the error estimate
    vivaldi_cc: float = 0.25  # [1] c_c: the most one sample moves the coordinate
    adjustment_window_size: int = 20  # [3]: samples averaged into the adjustment; 0 = off
    height_min: float = 10.0e-6  # seconds; a height must stay positive, and small beside real ones
    latency_filter_size: int = 3  # [2]: median of the last 3 RTTs per peer rides out blips
    gravity_rho: float = 150.0  # [2]: seconds; how weakly gravity pulls toward the origin
    # Not serf's: bounds on what samples from a hostile member can do (module header, "A hostile
    # peer"). Measured not to change honest convergence: the daemon's policy in the simulator
    # (1,000 nodes, 120 s, seeds 1-4) has a mean median error of 8.94 % with them, 8.90 % without
    # (9.91 % at worst, seed 4, against 9.81 %); serf's scenarios stay within their bounds.
    # The peer's error, as the weight sees it, is at least this share of ours: so no peer weighs
    # more than 1 / (1 + 0.25) = 4/5, however sure it claims to be (a liar claiming error 0 got
    # weight 1, the whole force). A share, not an absolute floor: honest errors fall as far as
    # the network embeds (0.03-0.14 on the country matrix at 120 s, ~0.001 on serf's LAN
    # scenarios); a floor of 0.05 put serf's split scenario at 8.7x its bound. Why a quarter: half
    # (a weight of 2/3 at most) slowed honest convergence (the daemon's policy: 9.10 % with the
    # clamp below; seed 4 at 10.14 %, over the target); a quarter does not measurably.
    peer_error_share: float = 0.25
    # A sample's disagreement |rtt - estimate| counts for at most max(rtt, this) seconds, in the
    # force and in the adjustment window; the height moves no further than the point. A push away
    # (rtt > estimate) is never more than the RTT anyway: this bounds the pull toward a peer whose
    # estimate exceeds the RTT, which a coordinate at the wire bounds made ~50 s (a 12 s move, or a
    # reset). One sample thus moves our point, and our height, by at most vivaldi_cc * 4/5 *
    # max(rtt, 100 ms): 20 ms, or a fifth of the RTT when it is longer. Why 100 ms: honest
    # estimates from stale records run at up to a few times the RTT while the swarm converges
    # (this bound held back 0.5 % of the simulator's samples); 50 ms slowed that (the daemon's
    # policy, without the floor above: 9.00 % mean median at 120 s, against 8.90 %), 100 ms does
    # not measurably (8.93 %), 200 ms neither (8.88 %) at twice the move.
    force_rtt_min: float = 0.100
    # A sample whose estimate (our coordinate to the peer's) is above implausible_ratio * rtt +
    # implausible_slack is dropped and counted (``rejections["implausible"]``): a coordinate that
    # far from what was measured is a lie or a broken node, and the clamp above would still let it
    # pull us a little at each sample. Why these: an honest estimate is bounded by the spread of
    # the coordinates (the longest RTTs on the internet, ~0.5 s), not by the RTT: on the country
    # matrix (1,000 nodes, to 600 s, also from stale records) estimates reached 0.47 s and 275x a
    # same-country RTT, at most 0.42 of this threshold, and none was dropped. The slack is what
    # admits them; the ratio keeps the threshold above long (or delayed) RTTs. Only this side is
    # checked: an estimate below the RTT is every node's start, and a peer can only lengthen its
    # RTT (by answering late), whose push away is bounded by the RTT itself.
    implausible_ratio: float = 10.0
    implausible_slack: float = 1.0  # seconds
    # When this many different peers' samples were implausible in a row (no plausible one between
    # them), the odd one out is our own coordinate (many hostile samples with no honest one between
    # can carry it off, e.g. in a 2-node swarm, or it predates these checks): reset to the origin
    # (``resets``), from where honest estimates are plausible again. One peer alone, however often
    # sampled, never triggers it; 5 colluding ones must be all we sample, 5 times running.
    implausible_reset: int = 5

    def __post_init__(self) -> None:
        if not 1 <= self.dimensionality <= 64:
            raise ValueError(f"dimensionality must be 1..64, got {self.dimensionality}")
        if self.adjustment_window_size < 0 or self.latency_filter_size < 1:
            raise ValueError("the adjustment window must be >= 0 and the latency filter >= 1 samples")
        for name in ("vivaldi_error_max", "vivaldi_ce", "vivaldi_cc", "height_min", "gravity_rho", "force_rtt_min",
                     "implausible_ratio", "implausible_slack"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value}")
        if not (math.isfinite(self.peer_error_share) and self.peer_error_share >= 0):
            raise ValueError(f"peer_error_share must be a number >= 0, got {self.peer_error_share}")
        if self.implausible_reset < 2:
            raise ValueError("implausible_reset must be at least 2 peers (one peer alone must never reset us)")
        if self.vivaldi_ce > 1 or self.vivaldi_cc > 1:
            raise ValueError("vivaldi_ce and vivaldi_cc must be at most 1 (a sample moves at most all the way)")
        if self.height_min > MAX_HEIGHT:
            raise ValueError(f"height_min must be at most {MAX_HEIGHT} s")


DEFAULT = Config()


@dataclass(frozen=True, slots=True, kw_only=True)
class Coordinate:
    """A node's position (seconds): ``vec`` (the Euclidean part), ``height`` (its access link),
    ``adjustment`` (its share of the residual the embedding cannot fit) and ``error`` (the
    node's confidence in all that: dimensionless, 0 = sure)."""

    vec: tuple[float, ...]
    error: float
    adjustment: float
    height: float

    def raw_distance_to(self, other: Coordinate) -> float:
        """Seconds: the distance between the points plus both heights, without adjustments."""
        return _norm(self.vec, other.vec) + self.height + other.height

    def distance_to(self, other: Coordinate) -> float:
        """The estimated RTT in seconds (serf's ``DistanceTo``): adjustments are added unless
        that would make the estimate zero or negative."""
        if len(self.vec) != len(other.vec):
            raise ValueError(f"coordinates of {len(self.vec)} and {len(other.vec)} dimensions")
        dist = _norm(self.vec, other.vec) + self.height + other.height
        adjusted = dist + self.adjustment + other.adjustment
        return adjusted if adjusted > 0.0 else dist

    def to_wire(self) -> list[float]:
        """``[*vec, height, error, adjustment]``: what a record carries."""
        return [*self.vec, self.height, self.error, self.adjustment]

    @classmethod
    def from_wire(cls, data: object, dimensionality: int = DEFAULT.dimensionality, *,
                  config: Config = DEFAULT) -> Coordinate:
        """A peer's coordinate from its record; ``ValueError`` naming what is wrong: not a
        list, the wrong length, a value that is not a finite number, or one out of range."""
        if not isinstance(data, (list, tuple)):
            raise ValueError(f"a coordinate must be a list of numbers, got {type(data).__name__}")
        if len(data) != dimensionality + 3:
            raise ValueError(f"a coordinate must have {dimensionality + 3} values ({dimensionality} dimensions, "
                             f"height, error, adjustment), got {len(data)}")
        values = []
        for i, x in enumerate(data):
            if type(x) not in (float, int):  # bool is an int subclass, and not a number here
                raise ValueError(f"coordinate value {i} is not a number ({type(x).__name__})")
            if type(x) is int and abs(x) > 2**53:
                raise ValueError(f"coordinate value {i} is out of range")  # float() would overflow or round
            values.append(float(x))
        coord = cls(vec=tuple(values[:dimensionality]), height=values[dimensionality],
                    error=values[dimensionality + 1], adjustment=values[dimensionality + 2])
        problem = _problem(coord, dimensionality, config)
        if problem is not None:
            raise ValueError(problem)
        return coord


def origin(config: Config = DEFAULT) -> Coordinate:
    """Where every node starts: the origin, with the largest error and the least height."""
    return Coordinate(vec=(0.0,) * config.dimensionality, error=config.vivaldi_error_max, adjustment=0.0,
                      height=config.height_min)


def _norm(a: Sequence[float], b: Sequence[float]) -> float:
    return math.sqrt(sum((x - y) * (x - y) for x, y in zip(a, b)))


def _problem(coord: Coordinate, dimensionality: int, config: Config) -> str | None:
    """Why ``coord`` may not be used (None: it may), checked in a fixed order."""
    if len(coord.vec) != dimensionality:
        return f"a coordinate of {len(coord.vec)} dimensions, expected {dimensionality}"
    for i, x in enumerate(coord.vec):
        if not math.isfinite(x):
            return f"coordinate component {i} is not finite"
        if abs(x) > MAX_COMPONENT:
            return f"coordinate component {i} ({x:g} s) is beyond +-{MAX_COMPONENT:g} s"
    for name in ("height", "error", "adjustment"):
        if not math.isfinite(getattr(coord, name)):
            return f"coordinate {name} is not finite"
    if not config.height_min <= coord.height <= MAX_HEIGHT:
        return f"coordinate height {coord.height:g} s is outside [{config.height_min:g}, {MAX_HEIGHT:g}] s"
    if not 0.0 <= coord.error <= config.vivaldi_error_max:
        return f"coordinate error {coord.error:g} is outside [0, {config.vivaldi_error_max:g}]"
    if abs(coord.adjustment) > MAX_ADJUSTMENT:
        return f"coordinate adjustment {coord.adjustment:g} s is beyond +-{MAX_ADJUSTMENT:g} s"
    return None


class Client:
    """One node's coordinate, updated from the RTTs it measures to peers and their coordinates
    (module header: the steps and their sources). Counters for the driver to export:
    ``updates`` (samples used), ``rejections`` (reason -> samples refused: ``rtt``,
    ``coordinate``, ``implausible``), ``resets`` (results that were not finite or out of bounds,
    and our own coordinate found absurd by ``implausible_reset`` peers in a row)."""

    def __init__(self, config: Config = DEFAULT, *, seed: int | str = 0) -> None:
        self.config = config
        self._rng = random.Random(seed)
        self._origin = origin(config)
        self._coord = self._origin
        self._window = [0.0] * config.adjustment_window_size
        self._window_at = 0
        self._filters: dict[str, list[float]] = {}  # peer -> its last RTTs, oldest first
        self._odd: set[str] = set()  # peers of the implausible samples since the last plausible one
        self.updates = 0
        self.resets = 0
        self.rejections: dict[str, int] = {}

    @property
    def coordinate(self) -> Coordinate:
        return self._coord

    @property
    def rejected(self) -> int:
        return sum(self.rejections.values())

    def estimate(self, other: Coordinate) -> float:
        """The estimated RTT to a node at ``other``, seconds."""
        return self._coord.distance_to(other)

    def forget(self, peer: str) -> None:
        """Drop what is kept for ``peer`` (its latency filter): it left or died."""
        self._filters.pop(peer, None)
        self._odd.discard(peer)

    def update(self, peer: str, other: Coordinate, rtt: float) -> Coordinate | None:
        """Take one RTT (seconds) measured to ``peer``, whose coordinate is ``other``; the new
        coordinate, or None when the sample was refused (counted in ``rejections``)."""
        cfg = self.config
        if isinstance(rtt, bool) or not (isinstance(rtt, (int, float)) and 0.0 < rtt <= MAX_RTT):  # NaN fails
            self._reject("rtt")
            return None
        if not isinstance(other, Coordinate) or _problem(other, cfg.dimensionality, cfg) is not None:
            self._reject("coordinate")
            return None
        rtt = max(self._filter(peer, float(rtt)), ZERO)  # kept even if implausible: it was measured
        me = self._coord
        dist = me.distance_to(other)
        if dist > cfg.implausible_ratio * rtt + cfg.implausible_slack:  # NaN (ours poisoned) fails: reset below
            return self._implausible(peer)
        self._odd.clear()

        # Vivaldi: the error and the force weighted by how sure each end is; the peer's confidence
        # and the force bounded (Config: peer_error_share, force_rtt_min).
        wrongness = abs(dist - rtt) / rtt
        weight = me.error / max(me.error + max(other.error, cfg.peer_error_share * me.error), ZERO)
        limit = max(rtt, cfg.force_rtt_min)
        diff = min(max(rtt - dist, -limit), limit)
        error = min(cfg.vivaldi_ce * weight * wrongness + me.error * (1.0 - cfg.vivaldi_ce * weight),
                    cfg.vivaldi_error_max)
        vec, height = self._apply_force(me.vec, me.height, cfg.vivaldi_cc * weight * diff, other.vec, other.height)

        # Adjustment: the mean residual of the raw distance (the new point, no adjustments).
        adjustment = me.adjustment
        if self._window:
            residual = rtt - (_norm(vec, other.vec) + height + other.height)
            self._window[self._window_at] = min(max(residual, -limit), limit)
            self._window_at = (self._window_at + 1) % len(self._window)
            adjustment = sum(self._window) / (2.0 * len(self._window))

        # Gravity: the distance from the origin as serf measures it (heights and adjustment in).
        raw = math.sqrt(sum(x * x for x in vec)) + cfg.height_min + height
        from_origin = raw + adjustment if raw + adjustment > 0.0 else raw
        vec, height = self._apply_force(vec, height, -((from_origin / cfg.gravity_rho) ** 2), self._origin.vec,
                                        self._origin.height)

        coord = Coordinate(vec=vec, error=error, adjustment=adjustment, height=height)
        if _problem(coord, cfg.dimensionality, cfg) is not None:
            return self._reset()
        self._coord = coord
        self.updates += 1
        return coord

    def _implausible(self, peer: str) -> Coordinate | None:
        """Drop a sample whose estimate is absurd against its RTT; reset when so many peers in a
        row disagree with us that our own coordinate must be the one that is off."""
        self._reject("implausible")
        self._odd.add(peer)
        if len(self._odd) < self.config.implausible_reset:
            return None
        return self._reset()

    def _reset(self) -> Coordinate:
        self.resets += 1
        self._coord = self._origin
        self._window = [0.0] * len(self._window)
        self._odd.clear()
        return self._coord

    def _reject(self, reason: str) -> None:
        self.rejections[reason] = self.rejections.get(reason, 0) + 1

    def _filter(self, peer: str, rtt: float) -> float:
        samples = self._filters.setdefault(peer, [])
        samples.append(rtt)
        if len(samples) > self.config.latency_filter_size:
            del samples[0]
        return sorted(samples)[len(samples) // 2]

    def _apply_force(self, vec: tuple[float, ...], height: float, force: float, at: tuple[float, ...],
                     at_height: float) -> tuple[tuple[float, ...], float]:
        """serf's ``ApplyForce``: move ``vec`` by ``force`` seconds away from ``at`` (toward it
        when negative), and the height in proportion to the force over the distance, but (not
        serf's) by no more than ``force`` itself: over a tiny distance serf's ratio is unbounded,
        and a peer placed just beside us with a large height could fling ours past the bounds."""
        unit, mag = self._unit_from(at, vec)
        vec = tuple(x + u * force for x, u in zip(vec, unit))
        if mag > ZERO:
            step = (height + at_height) * force / mag
            height = max(height + min(max(step, -abs(force)), abs(force)), self.config.height_min)
        return vec, height

    def _unit_from(self, a: tuple[float, ...], b: tuple[float, ...]) -> tuple[tuple[float, ...], float]:
        """(the unit vector from ``a`` toward ``b``, their distance); a random direction and 0
        when they coincide (serf's ``unitVectorAt``)."""
        d = [y - x for x, y in zip(a, b)]
        mag = math.sqrt(sum(x * x for x in d))
        if mag > ZERO:
            return tuple(x / mag for x in d), mag
        d = [self._rng.random() - 0.5 for _ in d]
        m = math.sqrt(sum(x * x for x in d))
        if m > ZERO:
            return tuple(x / m for x in d), 0.0
        return (1.0,) + (0.0,) * (len(d) - 1), 0.0
