"""Routing figures (`make bench`, part `routing`): network coordinates and path choice on the
simulator's 1,000-node country placement, and a pair relayed through a third host in a 4-host lab
(needs root): its RTT and all-reduce bandwidth against direct, the detour's setup, failover."""

from __future__ import annotations

import statistics
import sys
import time


def detour_figures(nodes: int = 1000, seed: int = 1) -> dict[str, float | int | None]:
    """Path choice on the country matrix (sim/detours.py): the share of node pairs the switch
    rule detours through a relay and the median/p90 RTT it saves among them, with every leg
    known, with legs as records carry them, under the 16-path caps, and with legs from records
    and asked for (``asked``: every member measured and every pair asked, the steady state;
    ``asked_120s``: each node has measured the members its probes reached in 120 s and asked
    the pairs 120 s of asking reach); the share of pairs any faster relay
    would help, for comparison."""
    from sim import detours

    result = detours.run(nodes, seed)
    keys = dict(zip(detours.ROWS, ("any", "rule", "records", "capped", "asked")))
    out: dict[str, float | int | None] = {"sim_detour_nodes": result["nodes"],
                                          "sim_detour_countries": result["countries"]}
    for row, figures in result["rows"].items():
        key = keys[row]
        out[f"sim_detour_{key}_share_pct"] = round(100 * figures["detoured_share"], 2)
        for name in ("median_gain_ms", "p90_gain_ms", "median_gain_pct", "p90_gain_pct"):
            out[f"sim_detour_{key}_{name}"] = figures[name]
    for row, share in result["country_pairs_detoured"].items():
        out[f"sim_detour_country_pairs_{keys[row]}_pct"] = round(100 * share, 2)
    early = detours.run(nodes, seed, measured=detours.measured_after(120.0, nodes), ask_seconds=120.0)["rows"][
        detours.ROWS[4]]
    out["sim_detour_asked_120s_share_pct"] = round(100 * early["detoured_share"], 2)
    out["sim_detour_asked_120s_median_gain_ms"] = early["median_gain_ms"]
    return out


EXCHANGE_FRESH = 10.0  # swarmd/routing/exchange.py FRESH (not imported: it brings trio and libp2p)


def sim_figures(nodes: int = 1000, seed: int = 1) -> dict[str, float | int]:
    """Vivaldi on the country matrix (sim/coords.py): the median and p90 relative error of the
    coordinates' RTT estimates at 10, 30, 60 and 120 simulated s (target: median < 10 % at
    120 s), with membership's probe interval and with one probe a second, and the wall time;
    ``_records``: peers' coordinates as records carry them, republished at membership's refresh
    for this size (100 s at 1,000), up to 600 s; ``_exchange``: the same, but an update whose
    record is older than ``EXCHANGE_FRESH`` uses the peer's current coordinate (the routing
    service asks for it, swarmd/routing/exchange.py). With records, ``current_median`` is the
    embedding itself (every current coordinate known), ``median`` what nodes estimate."""
    from sim import coords

    out: dict[str, float | int] = {}
    records = {"seconds": 600.0, "checkpoints": (10.0, 30.0, 60.0, 120.0, 300.0),
               "publish_every": coords.record_refresh(nodes)}
    rows = (("", coords.Setup(nodes=nodes, seed=seed)),
            ("_1s", coords.Setup(nodes=nodes, seed=seed, probe_interval=1.0)),
            ("_records", coords.Setup(nodes=nodes, seed=seed, **records)),
            ("_exchange", coords.Setup(nodes=nodes, seed=seed, fresh_after=EXCHANGE_FRESH, **records)))
    for key, row in rows:
        result = coords.run(row)
        setup = result["setup"]
        if not key:
            out |= {"sim_coords_nodes": setup["nodes"], "sim_coords_countries": setup["countries"]}
        out |= {f"sim_coords{key}_probe_interval_s": setup["probe_interval"],
                f"sim_coords{key}_publish_every_s": setup["publish_every"] or 0,
                f"sim_coords{key}_resets": result["resets"], f"sim_coords{key}_wall_s": round(result["wall_s"], 2)}
        for c in result["checkpoints"]:
            t = f"{c['t_s']:g}s"
            out[f"sim_coords{key}_median_pct_{t}"] = round(100 * c["median"], 2)
            out[f"sim_coords{key}_p90_pct_{t}"] = round(100 * c["p90"], 2)
            if "current_median" in c:
                out[f"sim_coords{key}_current_median_pct_{t}"] = round(100 * c["current_median"], 2)
    return out


LAB = "benchr"
LAB_RTT = {frozenset(("h1", "h2")): 120.0, frozenset(("h1", "h3")): 20.0, frozenset(("h2", "h3")): 30.0}
LAB_OTHER_MS = 80.0  # h4 (and every other pair): a relay that never wins
LAB_EQUAL_MS = 50.0  # the relayed path's legs, 20 + 30: direct at this RTT compares the relay's own cost
FAILOVERS = 3
# the relay's cap (relay_max_mbit, all its pairs and both directions together: 1000 by default, 100 before) would
# bound a relayed all-reduce to half of it each way; raised far above what the lab's userspace
# WireGuard carries, so relayed vs direct is the relay's own cost; the default is measured at the end
LAB_ARGS = ["--sandbox", "off"]  # the all-reduce runs as root beside the daemons (as bench/mesh.py's)
RAISED_CAP_MBIT = 10_000
POLL_S = 0.05
LINK_BOUND_MBIT = 40.0  # the all-reduce once more with every link at this rate, as a WAN's links bound it:
# unbounded (~100 Mbit/s) this 2-core machine's CPU bounds it, and the relayed path's extra emulated hop (a
# wirefilter, two vde switches and two tap plugs in user space) costs CPU the direct path's does not. At 40
# Mbit/s the underlay's own second hop (underlay_control, no WireGuard) still costs 0.88-0.95 of one hop, so
# the relay's own cost is the link-bound ratio over that one (``..._relay_own_cost_link_bound``)
BOUND_LINKS = (("h1", "h2"), ("h1", "h3"), ("h2", "h3"))
LINK_BOUND_REPEATS = 5  # runs there vary by about 5 % (3.27-3.72 MB/s direct in one lab, 2026-11-24)
ALLREDUCE_REPEATS = 3  # the median of 3: one all-reduce on a shared machine varies by 10-20 %


def lab_figures() -> dict[str, float]:
    """Paths through a relay in a 4-host lab (needs root), as tests/netlab/test_routing.py builds
    it: h1-h2 120 ms direct but 20 + 30 ms through h3, h4 80 ms from everyone. In one run:

    - the overlay RTT h1->h2 (ping -c 20 -i 0.1, mean) and a 16 MB gloo all-reduce between h1
      and h2 on the mesh interface, once relayed via h3 and once direct with the h1-h2 link set
      to 50 ms (the relayed legs' sum), after the pair went back to direct: the same underlay
      RTT both ways, so the ratios are the relay's own cost (all-reduce target: >= 0.9; the
      median of ``ALLREDUCE_REPEATS`` runs each); each once more with the links at
      ``LINK_BOUND_MBIT``, where the links bound it and not this machine's CPU;
    - the detour's setup: from the h1-h2 link going back to 120 ms until both ends say `via h3`;
    - failover: from ``lab.crash("h3")`` until both ends say `direct` (the mesh rows polled every
      50 ms; the daemons evaluate paths once a second), three times, h3 revived and the pair
      relayed again in between (target: within 5 s);
    - the relayed all-reduce once more with the relay's default cap (h3 revived with it);
    - a control without daemons or WireGuard (``underlay_control``): the lab's own cost of a
      second hop.

    The daemons run with relay_max_mbit raised to ``RAISED_CAP_MBIT`` until then.
    """
    from sim.netlab import lab as labmod
    from sim.netlab import topology
    from sim.netlab.lab import mesh_interface
    from swarmd.rpc.client import Client

    from .mesh import ALLREDUCE_MB, _allreduce, _ping_ms

    def call(host: str, method: str, **params):
        with Client(lab.state.host(host).socket, timeout=10) as c:
            return c.call(method, **params)

    def path(host: str, other: str) -> str | None:
        """The relay (a host name) ``host`` reaches ``other`` through now, None when direct."""
        peer = lab.state.host(other).peer_id
        row = next((r for r in call(host, "mesh")["peers"] if r["peer"] == peer), None)
        if row is None:
            raise RuntimeError(f"bench: {other} is not in {host}'s mesh")
        if row["path"] == "direct":
            return None
        return names.get(row["relay"], row["relay"])

    def relayed() -> bool:
        return path("h1", "h2") == "h3" and path("h2", "h1") == "h3"

    def direct() -> bool:
        return path("h1", "h2") is None and path("h2", "h1") is None

    def wait(predicate, timeout: float, what: str) -> float:
        t0 = time.monotonic()
        while not predicate():
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"bench: {what} not within {timeout:g} s")
            time.sleep(POLL_S)
        return time.monotonic() - t0

    def allreduce(on_path, repeats: int) -> float:
        """The median of ``repeats`` all-reduces h1-h2, each on the path ``on_path`` checks
        (before and after it: a move away and back between repeats would mix two paths)."""
        runs = []
        for _ in range(repeats):
            if not on_path():
                raise RuntimeError(f"bench: h1-h2 left its path ({on_path.__name__}) during the measurement")
            runs.append(_allreduce(lab, over1, ifaces))
        if not on_path():
            raise RuntimeError(f"bench: h1-h2 left its path ({on_path.__name__}) during the measurement")
        return statistics.median(runs)

    def bound_allreduce(on_path) -> float:
        """``allreduce`` with every link h1, h2 and h3 use at ``LINK_BOUND_MBIT`` (the median of
        ``LINK_BOUND_REPEATS``), the links unbounded again after it."""
        for a, b in BOUND_LINKS:
            lab.set_link(a, b, bandwidth_mbit=LINK_BOUND_MBIT)
        try:
            return allreduce(on_path, LINK_BOUND_REPEATS)
        finally:
            for a, b in BOUND_LINKS:
                lab.set_link(a, b, bandwidth_mbit=0)

    def step(text: str) -> None:
        print(f"  routing lab: {text} ({time.monotonic() - started:.0f} s)", file=sys.stderr)

    started = time.monotonic()
    labmod.down(LAB)
    hosts, links = topology.plan(4, lambda a, b: LAB_RTT.get(frozenset((a.name, b.name)), LAB_OTHER_MS))
    lab = labmod.Lab.up(LAB, hosts, links, mesh=True,
                        daemon_args=[*LAB_ARGS, "--relay-max-mbit", str(RAISED_CAP_MBIT)])
    names = {h.peer_id: h.name for h in lab.state.hosts}
    results: dict[str, float] = {}
    try:
        lab.wait_formed(90)
        step("formed")
        results["routing_lab_formed_to_relayed_s"] = wait(relayed, 120, "h1 and h2 both via h3")
        step("h1-h2 via h3")
        ifaces = {h: mesh_interface(LAB, h) for h in ("h1", "h2")}
        over1, over2 = call("h1", "status")["mesh"]["address"], call("h2", "status")["mesh"]["address"]
        ping_relayed = _ping_ms(lab, "h1", over2)
        bw_relayed = allreduce(relayed, ALLREDUCE_REPEATS)
        bw_relayed_bound = bound_allreduce(relayed)
        step(f"relayed: {ping_relayed:.1f} ms, all-reduce {bw_relayed:.1f} MB/s, "
             f"{bw_relayed_bound:.2f} MB/s at {LINK_BOUND_MBIT:g} Mbit/s")

        lab.set_link("h1", "h2", rtt_ms=LAB_EQUAL_MS)
        results["routing_lab_back_to_direct_at_equal_rtt_s"] = wait(direct, 60, "h1-h2 back to direct at 50 ms")
        ping_direct = _ping_ms(lab, "h1", over2)
        # the relay's first leg lengthened meanwhile: the all-reduce's queues on the direct link
        # must not make the idle relayed path (also 50 ms) look faster and move the pair
        lab.set_link("h1", "h3", rtt_ms=LAB_RTT[frozenset(("h1", "h3"))] + LAB_EQUAL_MS)
        bw_direct = allreduce(direct, ALLREDUCE_REPEATS)
        bw_direct_bound = bound_allreduce(direct)
        lab.set_link("h1", "h3", rtt_ms=LAB_RTT[frozenset(("h1", "h3"))])
        step(f"direct at {LAB_EQUAL_MS:g} ms: {ping_direct:.1f} ms, all-reduce {bw_direct:.1f} MB/s, "
             f"{bw_direct_bound:.2f} MB/s at {LINK_BOUND_MBIT:g} Mbit/s")
        results |= {"routing_lab_ping_relayed_ms": ping_relayed, "routing_lab_ping_direct_equal_rtt_ms": ping_direct,
                    "routing_lab_ping_relayed_over_direct": ping_relayed / ping_direct,
                    f"routing_lab_allreduce_{ALLREDUCE_MB}mb_relayed_mb_s": bw_relayed,
                    f"routing_lab_allreduce_{ALLREDUCE_MB}mb_direct_equal_rtt_mb_s": bw_direct,
                    "routing_lab_allreduce_relayed_over_direct": bw_relayed / bw_direct,
                    f"routing_lab_allreduce_{ALLREDUCE_MB}mb_relayed_link_bound_mb_s": bw_relayed_bound,
                    f"routing_lab_allreduce_{ALLREDUCE_MB}mb_direct_link_bound_mb_s": bw_direct_bound,
                    "routing_lab_allreduce_link_bound_relayed_over_direct": bw_relayed_bound / bw_direct_bound}

        lab.set_link("h1", "h2", rtt_ms=LAB_RTT[frozenset(("h1", "h2"))])
        results["routing_lab_detour_setup_s"] = wait(relayed, 120, "h1-h2 via h3 again at 120 ms")
        step("relayed again")

        failovers, rerelays = [], []
        for i in range(FAILOVERS):
            if i:
                lab.revive("h3")
                rerelays.append(wait(relayed, 150, "h1-h2 via h3 after h3's revival"))
                step(f"h3 revived, relayed again after {rerelays[-1]:.1f} s")
            t0 = time.monotonic()
            lab.crash("h3")
            wait(direct, 30, "h1-h2 back to direct after h3 crashed")
            failovers.append(time.monotonic() - t0)
            step(f"h3 crashed: direct after {failovers[-1]:.2f} s")
        results |= {"routing_lab_failover_p50_s": statistics.median(failovers),
                    "routing_lab_failover_max_s": max(failovers)}

        lab.state.daemon_args = list(LAB_ARGS)  # h3 comes back with the default relay_max_mbit
        lab.revive("h3")
        rerelays.append(wait(relayed, 150, "h1-h2 via h3 after h3's revival"))
        bw_capped = allreduce(relayed, 1)
        step(f"relayed, h3 with the default cap: all-reduce {bw_capped:.1f} MB/s")
        results |= {"routing_lab_relayed_again_after_revive_max_s": max(rerelays),
                    f"routing_lab_allreduce_{ALLREDUCE_MB}mb_relayed_default_cap_mb_s": bw_capped}
    finally:
        labmod.down(LAB)
    results |= underlay_control()
    # the relay's own cost where the links bound the all-reduce: relayed / direct over the lab's
    # own second hop / one hop, both at LINK_BOUND_MBIT in this run (1.0: a relay costs what an IP
    # router in its place costs)
    results["routing_lab_relay_own_cost_link_bound"] = (results["routing_lab_allreduce_link_bound_relayed_over_direct"]
                                                        / results["routing_lab_underlay_link_bound_two_hops_over_one"])
    step("underlay control")
    results["routing_lab_wall_s"] = time.monotonic() - started
    return results


def underlay_control() -> dict[str, float]:
    """The lab's own cost of a second hop, with no daemon, WireGuard or relay: a 3-host lab with
    the same RTTs (h1-h2 at 50 ms), a gloo all-reduce between h1 and h2 over their segment, and
    over h1-h3-h2 with h3 routing it in the kernel (the same 50 ms). Each hop is a wirefilter
    and two vde switches in user space, so two hops cost this machine's CPU twice: the relayed
    all-reduce's ratio is the relay's cost only beside this one. Then both once more with the
    links at ``LINK_BOUND_MBIT`` (the anchor of the link-bound ratio)."""
    from sim.netlab import lab as labmod
    from sim.netlab import topology

    from .mesh import ALLREDUCE_MB, _allreduce, _ns

    rtts = LAB_RTT | {frozenset(("h1", "h2")): LAB_EQUAL_MS}
    labmod.down(f"{LAB}c")
    hosts, links = topology.plan(3, lambda a, b: rtts[frozenset((a.name, b.name))])
    lab = labmod.Lab.up(f"{LAB}c", hosts, links, daemons=False, mesh=False)
    try:
        d, l13, l23 = lab.state.link("h1", "h2"), lab.state.link("h1", "h3"), lab.state.link("h2", "h3")
        _ns(lab, "h3", "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _ns(lab, "h1", "ip", "route", "add", f"{l23.a_addr}/32", "via", l13.b_addr)  # h2's h2-h3 end via h3
        _ns(lab, "h2", "ip", "route", "add", f"{l13.a_addr}/32", "via", l23.b_addr)  # h1's h1-h3 end via h3
        def both(repeats: int) -> tuple[float, float]:
            one, two = [], []
            for _ in range(repeats):
                one.append(_allreduce(lab, d.a_addr, {"h1": "to-h2", "h2": "to-h1"}))
                two.append(_allreduce(lab, l13.a_addr, {"h1": "to-h3", "h2": "to-h3"}))
            return statistics.median(one), statistics.median(two)

        one_bw, two_bw = both(ALLREDUCE_REPEATS)
        for a, b in BOUND_LINKS:
            lab.set_link(a, b, bandwidth_mbit=LINK_BOUND_MBIT)
        one_bound, two_bound = both(LINK_BOUND_REPEATS)
    finally:
        labmod.down(f"{LAB}c")
    return {f"routing_lab_underlay_allreduce_{ALLREDUCE_MB}mb_one_hop_mb_s": one_bw,
            f"routing_lab_underlay_allreduce_{ALLREDUCE_MB}mb_two_hops_mb_s": two_bw,
            "routing_lab_underlay_two_hops_over_one": two_bw / one_bw,
            f"routing_lab_underlay_allreduce_{ALLREDUCE_MB}mb_one_hop_link_bound_mb_s": one_bound,
            f"routing_lab_underlay_allreduce_{ALLREDUCE_MB}mb_two_hops_link_bound_mb_s": two_bound,
            "routing_lab_underlay_link_bound_two_hops_over_one": two_bound / one_bound}
