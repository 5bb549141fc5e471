"""A swarm as one node sees it, for swarmd/routing/paths.py's core: its own measurements, the
others' reported RTTs (what their records carry), who offers relaying, announcements, failing
relays, and the reach fields (NATs, public members, unshaken direct paths, direct endpoints).
Each field starts at what PathView defaults to; ``view()`` snapshots it for one evaluation."""

from swarmd.routing.paths import PathView


class World:
    def __init__(self, me: str = "a") -> None:
        self.me = me
        self.peers: set[str] = set()
        self.relays: set[str] = set()
        self.own: dict[str, float] = {}
        self.reported: dict[str, dict[str, float]] = {}
        self.via: dict[str, str] = {}  # peer -> the relay its record names for me
        self.failing: set[str] = set()
        self.refused: set[tuple[str, str]] = set()  # (peer, relay): the driver's per-pair refusals
        self.coords: dict[tuple[str, str], float] = {}
        self.busy: set[str] = set()  # peers with heavy WireGuard traffic now (the driver's counters)
        self.nat: dict[str, tuple[str | None, str | None]] = {}  # peer (me too) -> (wg.nat, wg.reflexive)
        self.public: set[str] = set()
        self.unshaken: set[str] = set()
        self.target: dict[str, str] = {}  # peer -> the endpoint its direct packets go to

    def add(self, *peers: str, relay: bool = True, nat: str | None = None) -> None:
        """Members behind ``nat`` (None: no reach in their records), each NATed one with its own
        reflexive endpoint; "public" ones are public relays too."""
        self.peers |= set(peers)
        for p in peers:
            if relay:
                self.relays.add(p)
            self.nat[p] = (nat, None if nat in (None, "public") else f"203.0.113.{len(self.nat) + 1}:51820")
            if nat == "public":
                self.public.add(p)

    def link(self, a: str, b: str, ms: float) -> None:
        """Both ends measured the link (and the one that is me keeps it as its own)."""
        self.report(a, b, ms)
        self.report(b, a, ms)

    def report(self, by: str, to: str, ms: float) -> None:
        if by == self.me:
            self.own[to] = ms
        else:
            self.reported.setdefault(by, {})[to] = ms

    def view(self) -> PathView:
        return PathView(me=self.me, peers=frozenset(self.peers), relays=frozenset(self.relays), own=dict(self.own),
                        reports=lambda p: self.reported.get(p, {}), estimate=lambda a, b: self.coords.get((a, b)),
                        announced=self.via.get, failing=frozenset(self.failing), refused=frozenset(self.refused),
                        busy=frozenset(self.busy), reach=lambda p: self.nat.get(p, (None, None)),
                        public=frozenset(self.public), unshaken=frozenset(self.unshaken), target=self.target.get)
