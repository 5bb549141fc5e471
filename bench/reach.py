"""Reach figures (`make bench`, part `reach`; issue 25): members behind NATs and firewalls, in one
6-host lab of real daemons behind nftables NAT routers (sim/netlab/nat.py), every link 20 ms and
40 Mbit/s: h1, h2 public, h3 eim-adf, h4 eim-apdf, h5 edm (symmetric), h6 firewall (as
tests/netlab/test_reach.py; seven, or an eighth behind a full cone, did not form within 300 s on this
2-core machine). In one run (needs root):

1. the pair matrix: each pair direct (both ends' `mesh` rows say `direct`, with a handshake),
   relayed (`via X`), or failed (no overlay ping either way), against what theory says (DESIGN,
   "NAT traversal": only a symmetric NAT against one that filters by port, or against another
   symmetric NAT, needs a relay);
2. punching after a restart: a NATed daemon stopped, its router rebound while it is down (every
   mapping gone, new external ports: its old endpoint is dead), started again; for each pair
   theory calls direct, the time from both records known (the peer holds the restarted host's
   record that carries its new reflexive endpoint, and the restarted host holds the peer's) to
   a handshake since the restart on a direct path at both ends (target p50 <= 5 s, p95 <= 10
   s; 0 where the pair was direct before the record arrived: the host's own packets opened it);
3. TCP throughput over the overlay, relayed (h5 -> h6 through a public member: two 20 ms legs)
   against direct at the same RTT (h3 -> h4 with their link at 40 ms), every link 40 Mbit/s
   (target >= 0.9);
4. healing after a rebinding of h3's router (endpoint-independent mapping) while its daemon runs: until every
   peer pings it over the overlay again, and until its record carries the new reflexive
   endpoint (its own verdict, then every peer holding that record);
5. the share of direct pairs in a population whose NAT mix is a published census
   (``CENSUS``), from the measured matrix (theory where the lab has no such pair), against
   DCUtR's 70 % and Tailscale's > 90 % (target >= 95 %).

The weighting and the percentiles are pure (tests/test_bench_reach.py); the lab is
``lab_figures``.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping

LAB = "benchreach"
NAT = {"h3": "eim-adf", "h4": "eim-apdf", "h5": "edm", "h6": "firewall"}
HOSTS = 6  # seven starve two cores (tests/netlab/test_reach.py)
LINK_MS = 20.0
LINK_MBIT = 40.0
CONVERGE_S = 240.0  # tests/netlab/test_reach.py: ~100-180 s on 2 cores
RESTARTS = ("h3", "h4", "h5")  # one of each translating class in the lab
RESTART_TIMEOUT_S = 100.0
STOP_TIMEOUT_S = 60.0
HEAL_TIMEOUT_S = 90.0
POLL_S = 0.5  # each round asks every daemon: faster would load this 2-core machine's daemons
TCP_SECONDS = 10.0
TCP_REPEATS = 2
TCP_PORT = 5201
DIRECT_PAIR = ("h3", "h4")  # eim-adf -> eim-apdf: punched, its link set to the relayed legs' sum
RELAYED_PAIR = ("h5", "h6")  # edm -> firewall: through a public member, two LINK_MS legs
ANCHORS = {"dcutr_pct": 70.0, "tailscale_pct": 90.0}  # Trautwein et al. 2025 (arXiv 2510.27500); Tailscale
TARGET_PCT = 95.0

# --- theory and the census --------------------------------------------------------------------------------------

PUBLIC, EIM, ADF, APDF, EDM, FIREWALL = "public", "eim", "eim-adf", "eim-apdf", "edm", "firewall"
CLASSES = (PUBLIC, EIM, ADF, APDF, EDM, FIREWALL)
# a symmetric NAT's port for a peer is unknown before it sends: it meets only a peer that admits
# any port of an address it contacted (eim-adf), anyone (eim, public), never one that filters by
# port (eim-apdf, firewall) or another symmetric NAT (DESIGN, "NAT traversal"; RFC 4787)
RELAYED_CLASSES = {frozenset((EDM, APDF)), frozenset((EDM, FIREWALL)), frozenset((EDM,))}


def theory_direct(a: str, b: str) -> bool:
    return frozenset((a, b)) not in RELAYED_CLASSES


# The NAT census. Trautwein et al. 2025 (arXiv 2510.27500, "Challenging Tribal Knowledge") report
# DCUtR's success (70 % +- 7.1 %) per transport, relay and attempt, but no distribution of NAT
# classes (nor of the failures by class) that a pair matrix could be weighted with. The census used
# instead: Halkes & Pouwelse, "UDP NAT and Firewall Puncturing in the Wild", IFIP Networking 2011
# (Tribler peers, STUN-style classification): 79 % behind a NAT or firewall, 64 % behind one that
# lets hole punching work (endpoint-independent mapping, or a firewall), 11 % behind an
# endpoint-dependent (symmetric) NAT; the remaining 4 % unclassified are left out (weights
# renormalised). The census does not split its 64 % into our classes: CENSUS puts all of it in
# eim-apdf (port-restricted cone, the common home router, and the class that meets fewest: a
# symmetric NAT never punches it; a firewall behaves the same), a lower bound;
# CENSUS_OPTIMISTIC puts it in eim (full cone), an upper bound.
CENSUS = {PUBLIC: 21.0, APDF: 64.0, EDM: 11.0}
CENSUS_OPTIMISTIC = {PUBLIC: 21.0, EIM: 64.0, EDM: 11.0}
CENSUS_SOURCE = "Halkes & Pouwelse 2011 (IFIP Networking, Tribler): 21 % public, 64 % punchable, 11 % symmetric"


def normalised(weights: Mapping[str, float]) -> dict[str, float]:
    """The weights as shares summing to 1 (classes with weight 0 dropped)."""
    if any(w < 0 or not math.isfinite(w) for w in weights.values()):
        raise ValueError(f"weights must be finite and >= 0: {dict(weights)}")
    total = sum(weights.values())
    if total <= 0:
        raise ValueError("weights sum to 0")
    return {c: w / total for c, w in weights.items() if w > 0}


def class_matrix(measured: Mapping[frozenset[str], bool],
                 theory: Callable[[str, str], bool] = theory_direct) -> tuple[dict[frozenset[str], bool], set]:
    """Direct or not for every pair of classes: ``measured`` ({frozenset of one or two classes:
    every lab pair of those classes was direct}), theory's word where the lab had no such pair.
    The matrix and the class pairs theory filled in."""
    out, from_theory = {}, set()
    for a, b in itertools.combinations_with_replacement(CLASSES, 2):
        key = frozenset((a, b))
        if key in measured:
            out[key] = measured[key]
        else:
            out[key] = theory(a, b)
            from_theory.add(key)
    return out, from_theory


def weighted_direct_share(weights: Mapping[str, float], direct: Mapping[frozenset[str], bool]) -> float:
    """The share of pairs that are direct when both ends are drawn independently from
    ``weights`` (per class): sum over class pairs of w_a * w_b where (a, b) is direct."""
    w = normalised(weights)
    share = 0.0
    for a, wa in w.items():
        for b, wb in w.items():
            if direct[frozenset((a, b))]:
                share += wa * wb
    return share


def weight_from_theory(weights: Mapping[str, float], from_theory: Iterable[frozenset[str]]) -> float:
    """The share of the weighted pairs whose class pair the lab did not measure."""
    w, theory = normalised(weights), set(from_theory)
    return sum(wa * wb for a, wa in w.items() for b, wb in w.items() if frozenset((a, b)) in theory)


def edm_share_at(target: float, direct: Mapping[frozenset[str], bool], rest: Mapping[str, float]) -> float:
    """The largest share of symmetric NATs (the rest in the proportions of ``rest``) at which the
    direct share still reaches ``target`` (bisection; direct share falls as it grows)."""
    def share(e: float) -> float:
        others = normalised(rest)
        return weighted_direct_share({**{c: (1 - e) * w for c, w in others.items()}, EDM: e}, direct)

    if share(0.0) < target:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if share(mid) >= target else (lo, mid)
    return lo


def percentile(samples: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between closest ranks (numpy's
    default and statistics.quantiles' inclusive method); None without samples."""
    xs = sorted(samples)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within 0-100, got {q}")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def classify(path_ab: str | None, path_ba: str | None, reachable: bool) -> str:
    """A pair's outcome from both ends' `mesh` paths and whether an overlay ping got through."""
    if not reachable:
        return "failed"
    if path_ab == "direct" and path_ba == "direct":
        return "direct"
    return "relayed"


def heal_time(known_at: float | None, direct_at: float | None) -> float | None:
    """From both records known to a direct path: 0 when the path came first (the host's own
    packets opened it); None when either never happened."""
    if known_at is None or direct_at is None:
        return None
    return max(0.0, direct_at - known_at)


# --- the lab ----------------------------------------------------------------------------------------------------

RECEIVER = """
import socket, sys, time, json
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(60)
print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 16)
    if not b: break
    if t0 is None: t0 = time.monotonic()
    n += len(b)
print(json.dumps({"bytes": n, "seconds": time.monotonic() - t0}), flush=True)
"""
SENDER = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
buf = b"x" * (1 << 16); end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end: c.sendall(buf)
c.close()
"""


def lab_figures() -> dict[str, float | None]:
    from sim.netlab import lab as labmod
    from sim.netlab import topology
    from swarmd.rpc.client import Client

    started = time.monotonic()

    def step(text: str) -> None:
        print(f"  reach lab: {text} ({time.monotonic() - started:.0f} s)", file=sys.stderr)

    def call(host: str, method: str, **params):
        with Client(lab.state.host(host).socket, timeout=10) as c:
            return c.call(method, **params)

    def try_call(host: str, method: str):
        try:
            return call(host, method)
        except Exception:  # a daemon restarting, or busy past the timeout: asked again next round
            return None

    def mesh_rows(host: str) -> dict[str, dict]:
        got = try_call(host, "mesh")
        return {} if got is None else {names.get(r["peer"], "?"): r for r in got["peers"]}

    def path(row: dict | None) -> str | None:
        if row is None or row.get("handshake_age_s") is None:
            return None
        return "direct" if row["path"] == "direct" else row["path"]

    def overlay(host: str) -> str:
        return call(host, "status")["mesh"]["address"]

    def ns(host: str) -> list[str]:
        return ["ip", "netns", "exec", lab.state.host(host).netns]

    def pings(pairs: list[tuple[str, str]], wait_s: int = 2) -> dict[tuple[str, str], bool]:
        procs = {p: subprocess.Popen([*ns(p[0]), "ping", "-n", "-c", "1", "-W", str(wait_s), addrs[p[1]]],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in pairs}
        return {p: proc.wait() == 0 for p, proc in procs.items()}

    def ping_ms(src: str, dst: str) -> float:
        out = subprocess.run([*ns(src), "ping", "-n", "-q", "-c", "10", "-i", "0.2", addrs[dst]],
                             capture_output=True, text=True, timeout=60).stdout
        return float(out.rsplit("=", 1)[1].split("/")[1])

    def matrix() -> dict[frozenset[str], tuple[str | None, str | None]]:
        rows = {h: mesh_rows(h) for h in hosts}
        return {frozenset((a, b)): (path(rows[a].get(b)), path(rows[b].get(a)))
                for a, b in itertools.combinations(hosts, 2)}

    def as_theory(m) -> bool:
        for pair, (ab, ba) in m.items():
            a, b = sorted(pair)
            want_direct = theory_direct(lab.state.host(a).nat, lab.state.host(b).nat)
            for p in (ab, ba):
                if p is None or (p == "direct") != want_direct:
                    return False
        return True

    def tcp_mb_s(src: str, dst: str) -> float:
        rx = subprocess.Popen([*ns(dst), sys.executable, "-c", RECEIVER, addrs[dst], str(TCP_PORT)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert rx.stdout is not None
            if rx.stdout.readline().strip() != "ready":
                raise RuntimeError(f"bench: receiver on {dst} failed: {rx.stderr.read()[-2000:]}")
            subprocess.run([*ns(src), sys.executable, "-c", SENDER, addrs[dst], str(TCP_PORT), str(TCP_SECONDS)],
                           check=True, capture_output=True, timeout=TCP_SECONDS + 60)
            out, err = rx.communicate(timeout=60)
        finally:
            if rx.poll() is None:
                rx.kill()
                rx.wait()
        got = json.loads(out.strip().splitlines()[-1])
        return got["bytes"] / got["seconds"] / 1e6

    labmod.down(LAB)
    host_list, links = topology.plan(HOSTS, topology.uniform(LINK_MS), bandwidth_mbit=LINK_MBIT)
    # the sandbox off: the TCP test runs as root beside the daemons (as bench/mesh.py's all-reduce)
    lab = labmod.Lab.up(LAB, host_list, links, mesh=True, nat=NAT, daemon_args=["--sandbox", "off"])
    names = {h.peer_id: h.name for h in lab.state.hosts}
    hosts = [h.name for h in lab.state.hosts]
    kind = {h.name: h.nat for h in lab.state.hosts}
    results: dict[str, float | None] = {}
    try:
        try:
            results["reach_lab_formed_s"] = lab.wait_formed(CONVERGE_S)
            step("formed")
        except labmod.LabError as exc:  # the matrix below says which pairs never met
            results["reach_lab_formed_s"] = None
            step(f"not formed: {exc}")
        t0 = time.monotonic()
        while not as_theory(m := matrix()) and time.monotonic() - t0 < CONVERGE_S:
            time.sleep(2.0)
        results["reach_lab_formed_to_paths_as_theory_s"] = time.monotonic() - t0 if as_theory(m) else None
        step(f"paths {'as theory says' if as_theory(m) else 'NOT as theory says'}")
        addrs = {h: overlay(h) for h in hosts}

        # 1. the pair matrix
        pairs = list(itertools.combinations(hosts, 2))
        ok = pings(pairs) | pings([(b, a) for a, b in pairs])
        for _ in range(2):  # a ping lost on a busy machine is asked again
            lost = [p for p in pairs if not (ok[p] or ok[(p[1], p[0])])]
            ok |= pings(lost)
        m = matrix()
        outcome = {}
        for a, b in pairs:
            ab, ba = m[frozenset((a, b))]
            outcome[(a, b)] = classify(ab, ba, ok[(a, b)] or ok[(b, a)])
        counts = {k: sum(1 for v in outcome.values() if v == k) for k in ("direct", "relayed", "failed")}
        wrong = [f"{a}-{b}:{v}" for (a, b), v in outcome.items()
                 if v != ("direct" if theory_direct(kind[a], kind[b]) else "relayed")]
        results |= {"reach_pairs": len(pairs), "reach_pairs_direct": counts["direct"],
                    "reach_pairs_relayed": counts["relayed"], "reach_pairs_failed": counts["failed"],
                    "reach_pairs_not_as_theory": len(wrong)}
        step(f"pairs: {counts}, not as theory: {wrong}")
        measured: dict[frozenset[str], bool] = {}
        for (a, b), v in outcome.items():
            key = frozenset((kind[a], kind[b]))
            measured[key] = measured.get(key, True) and v == "direct"

        # 3. relayed vs direct TCP at equal RTT (a failure is reported, and the other figures measured)
        try:
            results |= throughput(lab, matrix, tcp_mb_s, ping_ms, kind, hosts, step)
        except (subprocess.SubprocessError, RuntimeError, OSError, ValueError) as exc:
            detail = getattr(exc, "stderr", None) or ""
            step(f"throughput not measured: {exc.__class__.__name__}: {str(exc)[:200]} {str(detail)[-600:]}")

        # 4. a rebinding of h3's router, its daemon running
        results |= rebinding(lab, call, try_call, pings, hosts, step)

        # 2. punching after a restart behind a rebound router
        samples, punched, before = [], [], 0
        for h in RESTARTS:
            got, results[f"reach_restart_{h}_stop_s"] = restart(lab, h, call, try_call, mesh_rows, hosts, kind, step)
            for other, took in got.items():
                if took is None:
                    continue
                samples.append(took)
                if kind[other] != PUBLIC:
                    punched.append(took)
                before += took == 0.0
            results[f"reach_restart_{h}_pairs_not_direct"] = sum(1 for v in got.values() if v is None)
        results |= {"reach_records_to_direct_punched_p50_s": percentile(punched, 50),
                    "reach_records_to_direct_punched_p95_s": percentile(punched, 95),
                    "reach_records_to_direct_punched_samples": len(punched),
                    "reach_records_to_direct_all_p50_s": percentile(samples, 50),
                    "reach_records_to_direct_all_p95_s": percentile(samples, 95),
                    "reach_records_to_direct_samples": len(samples),
                    "reach_direct_before_records_samples": before}
    finally:
        labmod.down(LAB)

    # 5. the census-weighted direct share
    direct, from_theory = class_matrix(measured)
    results |= {"reach_weighted_direct_pct": 100 * weighted_direct_share(CENSUS, direct),
                "reach_weighted_direct_optimistic_pct": 100 * weighted_direct_share(CENSUS_OPTIMISTIC, direct),
                "reach_weighted_from_theory_pct": 100 * weight_from_theory(CENSUS, from_theory),
                "reach_edm_share_at_95pct_direct_pct": 100 * edm_share_at(TARGET_PCT / 100, direct,
                                                                         {k: v for k, v in CENSUS.items() if k != EDM}),
                "reach_anchor_dcutr_pct": ANCHORS["dcutr_pct"], "reach_anchor_tailscale_pct": ANCHORS["tailscale_pct"]}
    step(f"weighted ({CENSUS_SOURCE}): {results['reach_weighted_direct_pct']:.1f} % direct")
    results["reach_lab_wall_s"] = time.monotonic() - started
    return results


def throughput(lab, matrix, tcp_mb_s, ping_ms, kind, hosts, step) -> dict[str, float]:
    """Relayed h5 -> h6 (two LINK_MS legs) against direct h3 -> h4 at their sum, TCP_REPEATS each
    (the median), each checked on its path before and after."""
    a, b = RELAYED_PAIR
    c, d = DIRECT_PAIR

    def on(pair, direct: bool) -> bool:
        ab, ba = matrix()[frozenset(pair)]
        return all(p is not None and (p == "direct") == direct for p in (ab, ba))

    def runs(src, dst, direct: bool) -> float:
        got = []
        for _ in range(TCP_REPEATS):
            if not on((src, dst), direct):
                raise RuntimeError(f"bench: {src}-{dst} is not {'direct' if direct else 'relayed'}")
            got.append(tcp_mb_s(src, dst))
        if not on((src, dst), direct):
            raise RuntimeError(f"bench: {src}-{dst} left its path during the measurement")
        return statistics.median(got)

    ping_relayed = ping_ms(a, b)
    relayed = runs(a, b, False)
    step(f"relayed {a}->{b}: {ping_relayed:.1f} ms, {relayed:.2f} MB/s")
    lab.set_link(c, d, rtt_ms=2 * LINK_MS)
    # every other leg from c longer meanwhile: a relay must not look faster than the loaded direct link
    others = [h for h in hosts if h not in (c, d)]
    for h in others:
        lab.set_link(c, h, rtt_ms=4 * LINK_MS)
    try:
        time.sleep(3.0)  # the daemons probe RTTs once a second: the pair stays direct (checked)
        ping_direct = ping_ms(c, d)
        direct = runs(c, d, True)
    finally:
        for h in others:
            lab.set_link(c, h, rtt_ms=LINK_MS)
        lab.set_link(c, d, rtt_ms=LINK_MS)
    step(f"direct {c}->{d} at {2 * LINK_MS:g} ms: {ping_direct:.1f} ms, {direct:.2f} MB/s")
    return {"reach_tcp_relayed_mb_s": relayed, "reach_tcp_direct_equal_rtt_mb_s": direct,
            "reach_tcp_relayed_over_direct": relayed / direct, "reach_ping_relayed_ms": ping_relayed,
            "reach_ping_direct_equal_rtt_ms": ping_direct}


def note_holders(try_call, peers, peer_id: str, seq: int, seen: dict[str, float], t0: float = 0.0) -> None:
    """Note in ``seen`` (monotonic time less ``t0``) each of ``peers`` that now holds ``peer_id``'s
    record ``seq`` or a later one."""
    for p in peers:
        if p in seen:
            continue
        got = try_call(p, "peers")
        row = None if got is None else next((r for r in got["peers"] if r["peer"] == peer_id), None)
        if row is not None and row["seq"] >= seq:
            seen[p] = time.monotonic() - t0


def rebinding(lab, call, try_call, pings, hosts, step, host: str = "h3") -> dict[str, float | None]:
    """``lab.rebind(host)`` with its daemon running: until every peer's overlay ping gets through
    (the last peer, and the median one), until its own verdict names the new reflexive endpoint,
    and until every peer holds a record of it that carries it."""
    before = call(host, "status")["reach"]["reflexive"]
    peers = [h for h in hosts if h != host]
    seq_old = call(host, "status")["record"]["seq"]
    t0 = time.monotonic()
    lab.rebind(host)
    back: dict[str, float] = {}
    verdict_at = seq_new = None
    seen: dict[str, float] = {}
    while time.monotonic() - t0 < HEAL_TIMEOUT_S and (len(back) < len(peers) or len(seen) < len(peers)):
        now = time.monotonic()
        left = [p for p in peers if p not in back]
        if left:
            for (p, _), up in pings([(p, host) for p in left], wait_s=1).items():
                if up:
                    back[p] = time.monotonic() - t0
        st = try_call(host, "status")
        if st is not None and st.get("record") and st.get("reach"):
            reflexive, seq = st["reach"]["reflexive"], st["record"]["seq"]
            if verdict_at is None and reflexive not in (None, before):
                verdict_at = time.monotonic() - t0
            if verdict_at is not None and seq_new is None and seq > seq_old:
                seq_new = seq  # the first record issued once the verdict changed carries it
            elif verdict_at is None:
                seq_old = seq
        if seq_new is not None:
            note_holders(try_call, peers, lab.state.host(host).peer_id, seq_new, seen, t0)
        time.sleep(max(0.0, POLL_S - (time.monotonic() - now)))
    step(f"rebind {host}: pings back {sorted(back.values())}, verdict {verdict_at}, records {sorted(seen.values())}")
    done = len(back) == len(peers)
    return {"reach_rebind_ping_back_max_s": max(back.values()) if done else None,
            "reach_rebind_ping_back_p50_s": percentile(back.values(), 50) if done else None,
            "reach_rebind_peers_not_back": len(peers) - len(back),
            "reach_rebind_verdict_s": verdict_at,
            "reach_rebind_record_at_all_peers_s": max(seen.values()) if len(seen) == len(peers) else None}


def restart(lab, host, call, try_call, mesh_rows, hosts, kind, step) -> tuple[dict[str, float | None], float]:
    """Stop ``host``'s daemon, rebind its router, start it; for every peer theory calls direct
    with it, the time from both records known to a handshake since the start on a direct path at
    both ends (``heal_time``); None for a pair that got neither within RESTART_TIMEOUT_S. And the
    seconds its daemon took to stop."""
    old = call(host, "status")["reach"]["reflexive"]
    peer_id = lab.state.host(host).peer_id
    ids = {h: lab.state.host(h).peer_id for h in hosts}
    # a graceful stop under six daemons' load on two cores once took over the lab's default 10 s
    stopped = lab.kill(host, timeout=STOP_TIMEOUT_S)
    step(f"restart {host}: its daemon stopped in {stopped:.1f} s")
    lab.rebind(host)
    lab.start(host)
    t0 = time.monotonic()
    peers = [p for p in hosts if p != host and theory_direct(kind[host], kind[p])]
    seq_old, seq_new = -1, None
    mine: dict[str, float] = {}  # when the host holds the peer's record
    theirs: dict[str, float] = {}  # when the peer holds the host's record with its new reflexive endpoint
    direct: dict[str, float] = {}
    while time.monotonic() - t0 < RESTART_TIMEOUT_S and (len(direct) < len(peers) or len(theirs) < len(peers)):
        now = time.monotonic()
        st = try_call(host, "status")
        if st is not None and st.get("record") and st.get("reach"):
            reflexive, seq = st["reach"]["reflexive"], st["record"]["seq"]
            if reflexive in (None, old):
                seq_old = seq
            elif seq_new is None and seq > seq_old:
                seq_new = seq
        got = try_call(host, "peers")
        if got is not None:
            have = {r["peer"] for r in got["peers"] if r["state"] == "alive"}
            for p in peers:
                if p not in mine and ids[p] in have:
                    mine[p] = time.monotonic()
        if seq_new is not None:
            note_holders(try_call, peers, peer_id, seq_new, theirs)
        rows = mesh_rows(host)
        elapsed = time.monotonic() - t0
        for p in peers:
            if p in direct:
                continue
            mine_row, their_row = rows.get(p), mesh_rows(p).get(host)
            if all(r is not None and r["path"] == "direct" and r["handshake_age_s"] is not None
                   and r["handshake_age_s"] < elapsed for r in (mine_row, their_row)):
                direct[p] = time.monotonic()
        time.sleep(max(0.0, POLL_S - (time.monotonic() - now)))
    out = {}
    for p in peers:
        known = None if p not in mine or p not in theirs else max(mine[p], theirs[p])
        out[p] = heal_time(known, direct.get(p))
    step(f"restart {host} ({kind[host]}, rebound): " + ", ".join(
        f"{p} {'-' if v is None else f'{v:.1f}'}" for p, v in out.items()))
    return out, stopped
