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
