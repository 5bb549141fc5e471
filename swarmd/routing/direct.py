"""Whether a pair's direct WireGuard path works, learnt from its handshakes (sans-IO).

Theory of operation. Behind NATs (issue 25) a direct path is a punch: both ends send
WireGuard to each other's reflexive endpoints. Theory says which pairings connect (an
endpoint-dependent mapping, ``edm``, against a port-restricted filter, another ``edm`` or a
``firewall`` does not: n0-computer/patchbay's matrix, DESIGN "NAT traversal"), but an
``eim`` NAT's filtering cannot be told from outside, so the verdict is empirical: a path
that completes no WireGuard handshake within ``grace_s`` of being set up has none. Paths
(paths.py) then relays the pair through a publicly reachable member for as long as that
lasts, with the reason ``symmetric NAT`` when either end's record says ``edm``, ``no direct
path`` otherwise (``faster`` is path choice's own reason).

Rules:
- Observations come from the driver once per evaluation: whether the pair is on its direct
  path now, and whether that path is *unshaken* (no handshake on it since it was set up:
  service.py reads Mesh.peer_rows). The grace starts at the first unshaken observation on
  the direct path, so a pair that just went direct is given the whole of it, and again when
  the fingerprint changes meanwhile (a verdict or endpoint that arrives during the grace: a
  restarted node behind a new mapping is given the grace from when peers can know it).
- A pair theory rules out (``impossible``) lacks a direct path at the first unshaken
  observation, and is tried again only when a record's NAT or reflexive endpoint changes.
- No flapping: a pair that lacks a direct path tries it again (``trying``: paths.py moves it
  direct) ``CHANGE_TRIES - 1`` times ``quick_s`` apart (an end may have lagged: both must send
  to punch, and the follower moves when the chooser's record reaches it), then after
  ``retry_s``, doubling after each failed try up to ``retry_max_s`` (but every ``quick_s``, for
  ``QUICK_TRIES`` tries, while an end is not yet measured, its record having no NAT kind, or while
  the pair's direct path once proved itself with the ends as they are now: ``worked``), and
  at once (then ``CHANGE_TRIES - 1`` times more, ``quick_s`` apart) when either end's (nat,
  reflexive) changes (a new mapping, a new verdict) or the endpoint we send its direct packets
  to does (its reflexive endpoint attested at last): ``fingerprint``. A try that shows a
  handshake ends it; one unshaken for ``grace_s`` on the direct path is a failure.
- What a member can do: its record's ``nat`` only picks a reason and whether a pairing is
  tried at once; a handshake is WireGuard's (authenticated), so no member can make a working
  pair look broken, or a broken one work. A member changing its record often makes its own
  pairs retry direct more often (each try costs that pair up to ``grace_s`` of outage), or keeps
  them on an unproven direct path: it cuts only itself off.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

NATED = frozenset({"eim", "edm", "firewall"})  # record wg.nat values of members nobody can dial unasked
FASTER = "faster"  # relayed because the relay's legs beat the direct path (paths.py's switch rule)
NO_DIRECT = "no direct path"  # relayed because the direct path completed no handshake
SYMMETRIC = "symmetric NAT"  # the same, and an end's record says its NAT maps per destination (edm)
REASONS = (FASTER, NO_DIRECT, SYMMETRIC)

# A punch completes in about one RTT once both ends send; WireGuard retries a handshake every 5 s
# (REKEY_TIMEOUT, whitepaper section 6.4), so two tries and a WAN RTT fit, and a member the mesh
# just gave an endpoint is not relayed before the other end had its chance to send.
GRACE_S = 10.0
QUICK_S = 30.0  # the first try after a pair is found lacking, or after a change's try failed: the other
# end may have lagged (its view of our record, the attestations of our endpoint, a few seconds behind)
RETRY_S = 300.0  # a pair relayed for lack of a direct path tries it again after this (5 min) ...
RETRY_MAX_S = 1800.0  # ... doubling after each failed try, up to 30 min: each try costs up to GRACE_S
SESSION_S = 180.0  # WireGuard's REJECT_AFTER_TIME: a handshake older than this holds no session
# A pair with an end whose record says no NAT kind yet (not measured: reach's verdict is unknown) tries
# again every QUICK_S for this many failed tries before backing off: a member is measured by public
# members that see its WireGuard packets on a direct path (a relayed observer attests nothing), so a
# pair relayed at a loaded start-up and tried rarely kept a symmetric NAT unmeasured, and so relayed
# to everyone, for good (CI: h5 unknown for the whole reach lab, every pair with it relayed). The same
# for a pair whose direct path once worked with both ends' NATs and endpoints as they are now: a failure
# of such a path is more likely a passing one (a loaded host's follower moving late) than theory's (CI:
# an address-restricted cone and a symmetric NAT, direct for minutes, failed three tries during a Ray
# job's start and stayed relayed for the back-off's 10 minutes).
QUICK_TRIES = 10
# Tries, ``quick_s`` apart, that a pair gets from the moment it is found lacking or either end changes,
# before the back-off. A punch with a symmetric NAT's end as the chooser needs the follower behind an
# address-restricted cone to send first, within one grace of the chooser's move: on a loaded host the
# chooser's record can reach it late, so two tries failed in CI (a pair theory allows stayed relayed for
# the 10 minutes of the back-off). Each failed try costs the pair up to ``grace_s`` without a path.
CHANGE_TRIES = 3
MAX_CHANGES = 1024  # changes kept for the driver's log between two drains


def nated(kind: object) -> bool:
    return kind in NATED


def impossible(a: object, b: object) -> bool:
    """Theory rules a direct path out: a symmetric NAT against another or a firewall (against an
    eim NAT it depends on that NAT's filtering, which only a try tells)."""
    return (a == "edm" and b in ("edm", "firewall")) or (b == "edm" and a in ("edm", "firewall"))


def fingerprint(here: tuple[object, object], there: tuple[object, object], target: object = None) -> Hashable:
    """What a retry of the direct path waits on changing: both ends' record (wg.nat, wg.reflexive)
    and ``target``, the endpoint our device sends the peer's direct packets to (a reflexive endpoint
    becomes a target only once two members attest it, mesh/driver.py). A symmetric NAT's reflexive
    port is per observer, so it changes with every reach round and tells nothing: only its IP counts."""
    def key(nat: object, reflexive: object) -> tuple[object, object]:
        if nat == "edm" and isinstance(reflexive, str):
            return nat, reflexive.rpartition(":")[0]
        return nat, reflexive
    return key(*here), key(*there), target


def shaken(row: Mapping[str, Any], *, since: float | None, wall: float, arrived: bool) -> bool:
    """A direct WireGuard path has shown that it works since it was set up, from one reading of
    its peer row (mesh/driver.py ``peer_rows``): a handshake holds a session (younger than
    ``SESSION_S``), WireGuard's endpoint is not at another member (``elsewhere``), and, after a
    move back from a relay at wall time ``since``, the handshake came after the move or the
    peer's packets kept arriving at its direct endpoint (``arrived``).

    WireGuard roams to wherever an authenticated packet came from: an end still relayed (its
    move lags ours, or a try fails on its side) sends its handshakes through the relay, which
    lands our endpoint on the relay's address. That handshake is the relay's path, not the
    direct one; taken for the direct one, both ends would stay "direct" over a relay that
    believes itself released (seen after a NAT rebind: a port-restricted cone and a symmetric
    NAT, a pairing theory rules out, stayed "direct" for minutes)."""
    age = row.get("handshake_age_s")
    if age is None or age >= SESSION_S or row.get("elsewhere"):
        return False
    return since is None or wall - age >= since or arrived


def reason(a: object, b: object) -> str:
    """Why a pair whose direct path failed is relayed, by its ends' record wg.nat."""
    return SYMMETRIC if "edm" in (a, b) else NO_DIRECT


@dataclass(slots=True)
class _Lacking:
    since: float  # when it was declared (or the last try failed)
    fingerprint: Hashable  # both ends' (nat, reflexive) as last tried: a change tries again at once
    reason: str
    failures: int = 0  # tries that failed in a row
    retry_at: float | None = None  # None: only when a record changes (impossible by theory)
    trying_since: float | None = None  # a try of the direct path is under way
    quick: int = 0  # failures from now on retried after quick_s, not backed off (CHANGE_TRIES)


class DirectWatch:
    """Per peer: since when its direct path is unshaken, and whether it lacks one."""

    def __init__(self, *, grace_s: float = GRACE_S, quick_s: float = QUICK_S, retry_s: float = RETRY_S,
                 retry_max_s: float = RETRY_MAX_S) -> None:
        if not (grace_s > 0 and 0 < quick_s <= retry_s <= retry_max_s):
            raise ValueError("need grace_s > 0 and 0 < quick_s <= retry_s <= retry_max_s")
        self.grace_s, self.quick_s, self.retry_s, self.retry_max_s = grace_s, quick_s, retry_s, retry_max_s
        self._since: dict[str, float] = {}  # peer -> first unshaken observation on its direct path
        self._since_fp: dict[str, Hashable] = {}  # peer -> the fingerprint since then (a change restarts it)
        self._lack: dict[str, _Lacking] = {}
        self._nats: dict[str, tuple[object, object]] = {}  # peer -> (mine, its) wg.nat, last seen
        self._worked: dict[str, Hashable] = {}  # peer -> the fingerprint its direct path last proved itself at
        self.declared = 0  # counter: pairs found without a direct path
        self.tries = 0  # counter: tries of the direct path again
        # (peer, what) for each change, for the driver's log: "lacking" (found so, or a try failed),
        # "trying", "works" (a try shook hands); drained by the driver (``take_changes``)
        self.changes: list[tuple[str, str]] = []

    def observe(self, now: float, peer: str, *, on_direct: bool, unshaken: bool, fingerprint: Hashable,
                nats: tuple[object, object]) -> None:
        """One evaluation's observation of the pair (me, ``peer``)."""
        self._nats[peer] = nats
        lack = self._lack.get(peer)
        if on_direct and not unshaken and (peer in self._since or (lack is not None and lack.trying_since is not None)):
            self._worked[peer] = fingerprint  # unproven, or on a try, until now: it shook hands on the direct path
        if lack is not None and lack.trying_since is None and (
                lack.fingerprint != fingerprint or (lack.retry_at is not None and now >= lack.retry_at)):
            if lack.fingerprint != fingerprint:  # a new mapping or verdict: try at once, back-off anew
                lack.fingerprint, lack.failures, lack.quick = fingerprint, 0, CHANGE_TRIES - 1
            lack.trying_since = now
            self.tries += 1
            self._changed(peer, "trying")
        if on_direct and unshaken:
            if self._since_fp.get(peer, fingerprint) != fingerprint:
                self._since.pop(peer, None)  # a new endpoint or verdict: the other end gets the whole grace for it
            since = self._since.setdefault(peer, now)
            self._since_fp[peer] = fingerprint
        else:
            self._since.pop(peer, None)
            self._since_fp.pop(peer, None)
            since = None
        if lack is None:
            if since is not None and (now - since >= self.grace_s or impossible(*nats)):
                self._lack[peer] = _Lacking(since=now, fingerprint=fingerprint, reason=reason(*nats),
                                            retry_at=None if impossible(*nats) else now + self.quick_s,
                                            quick=CHANGE_TRIES - 2)  # this was a try; the next is quick
                self.declared += 1
                self._changed(peer, "lacking")
        elif lack.trying_since is not None and on_direct:
            if not unshaken:
                del self._lack[peer]  # a handshake on the direct path: it works now
                self._changed(peer, "works")
            elif since is not None and now - since >= self.grace_s:
                if lack.quick > 0:
                    delay = self.quick_s
                    lack.quick -= 1
                else:
                    lack.failures += 1
                    delay = min(self.retry_s * 2 ** lack.failures, self.retry_max_s)
                    if lack.failures <= QUICK_TRIES and (None in nats or self._worked.get(peer) == lack.fingerprint):
                        delay = self.quick_s  # an end's measurement may need this path; or it worked as things are
                lack.since, lack.trying_since, lack.reason = now, None, reason(*nats)
                lack.retry_at = None if impossible(*nats) else now + delay
                self._changed(peer, "lacking")

    def forget(self, keep: Iterable[str]) -> None:
        keep = set(keep)
        for table in (self._since, self._since_fp, self._lack, self._nats, self._worked):
            for peer in [p for p in table if p not in keep]:
                del table[peer]

    def _changed(self, peer: str, what: str) -> None:
        if len(self.changes) < MAX_CHANGES:  # drained each evaluation; a core nobody drains stops at the cap
            self.changes.append((peer, what))

    def take_changes(self) -> list[tuple[str, str]]:
        """The changes since the last call (``changes``), oldest first."""
        changes, self.changes = self.changes, []
        return changes

    def lacking(self, peer: str) -> str | None:
        """The reason the pair must be relayed now (it has no direct path, no try under way), or None."""
        lack = self._lack.get(peer)
        return None if lack is None or lack.trying_since is not None else lack.reason

    def trying(self, peer: str) -> bool:
        """A try of the direct path is under way: the pair goes (and stays) direct until it ends."""
        lack = self._lack.get(peer)
        return lack is not None and lack.trying_since is not None

    def why(self, peer: str) -> str:
        """Why the pair would be on a relay now: for lack of a direct path when it is declared so or
        its direct path is unproven, else ``faster`` (what a follower records as it follows)."""
        if (lack := self._lack.get(peer)) is not None:
            return lack.reason
        if peer in self._since:
            return reason(*self._nats.get(peer, (None, None)))
        return FASTER

    def reason_now(self, peer: str) -> str:
        """Why a pair that lacks a direct path lacks it, by both ends' NATs as last observed (a
        follower's reason was taken when it began to follow, maybe before a verdict came)."""
        return reason(*self._nats.get(peer, (None, None)))

    def row(self, now: float, peer: str) -> dict:
        """Plain data for `swarmctl route`."""
        lack, since = self._lack.get(peer), self._since.get(peer)
        nats = self._nats.get(peer, (None, None))
        if lack is None:
            state = "unproven" if since is not None else "ok"
        else:
            state = "trying again" if lack.trying_since is not None else "none"
        return {"state": state, "unproven_for_s": None if since is None else round(now - since, 1),
                "grace_s": self.grace_s, "reason": None if lack is None else lack.reason,
                "impossible": impossible(*nats), "failures": 0 if lack is None else lack.failures,
                "retry_in_s": None if lack is None or lack.retry_at is None or lack.trying_since is not None
                else round(max(0.0, lack.retry_at - now), 1), "nat_here": nats[0], "nat_peer": nats[1]}
