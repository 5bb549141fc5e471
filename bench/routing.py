"""Routing figures (`make bench`, part `routing`): network coordinates and path choice on the
simulator's 1,000-node country placement (the lab's relayed-path figures are added beside them)."""

from __future__ import annotations


def detour_figures(nodes: int = 1000, seed: int = 1) -> dict[str, float | int | None]:
    """Path choice on the country matrix (sim/detours.py): the share of node pairs the switch
    rule detours through a relay and the median/p90 RTT it saves among them, with every leg
    known, with legs as records carry them, and under the 16-path caps; the share of pairs
    any faster relay would help, for comparison."""
    from sim import detours

    result = detours.run(nodes, seed)
    keys = dict(zip(detours.ROWS, ("any", "rule", "records", "capped")))
    out: dict[str, float | int | None] = {"sim_detour_nodes": result["nodes"],
                                          "sim_detour_countries": result["countries"]}
    for row, figures in result["rows"].items():
        key = keys[row]
        out[f"sim_detour_{key}_share_pct"] = round(100 * figures["detoured_share"], 2)
        for name in ("median_gain_ms", "p90_gain_ms", "median_gain_pct", "p90_gain_pct"):
            out[f"sim_detour_{key}_{name}"] = figures[name]
    for row, share in result["country_pairs_detoured"].items():
        out[f"sim_detour_country_pairs_{keys[row]}_pct"] = round(100 * share, 2)
    return out


EXCHANGE_FRESH = 30.0  # swarmd/routing/exchange.py FRESH (not imported: it brings trio and libp2p)


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
