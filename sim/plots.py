"""A run's PNG figures (matplotlib's Agg renderer, no display, no pyplot state).

One function per figure, each taking the run's :class:`~sim.runner.Outcome` and a path;
:func:`write_all` writes those the run has data for and returns their paths. PNGs carry no
version or date metadata, so a figure's bytes depend only on its data (report.json is the
file whose bytes are promised; the PNGs are close to it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .runner import Outcome
from .scenario import Congest

METADATA = {"Software": None}  # no matplotlib version in the PNG
SIZE = (7.0, 4.2)
DPI = 110


def _figure():
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE, dpi=DPI, layout="constrained")
    return fig, fig.add_subplot()


def _save(fig, path: Path) -> Path:
    fig.savefig(path, format="png", metadata=METADATA)
    return path


def _title(o: Outcome, what: str) -> str:
    s = o.scenario
    return f"{s.name}: {what} ({s.nodes:,} nodes, seed {s.seed})"


def detection_cdf(o: Outcome, path: Path) -> Path:
    fig, ax = _figure()
    samples = np.sort(np.asarray(o.metrics.detection_samples(), dtype=float))
    if samples.size:
        y = np.arange(1, samples.size + 1) / samples.size
        ax.step(samples, y, where="post", color="C0", label=f"{samples.size:,} (crash, observer) pairs")
        for q, style in ((50, ":"), (99, "--")):
            v = float(np.percentile(samples, q))
            ax.axvline(v, color="C3", linestyle=style, linewidth=1, label=f"p{q} {v:.2f} s")
        ax.legend(loc="lower right")
    else:
        ax.text(0.5, 0.5, "no crash in this scenario", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("seconds from the crash to the observer's DEAD")
    ax.set_ylabel("fraction of (crash, observer) pairs")
    ax.set_ylim(0, 1.02)
    ax.set_title(_title(o, "detection time CDF"), fontsize=10)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def convergence(o: Outcome, path: Path) -> Path:
    fig, ax = _figure()
    if o.arrivals is not None:
        t = np.sort(o.arrivals[np.isfinite(o.arrivals)])
        ax.plot(t, np.arange(1, t.size + 1) / o.arrivals.size, color="C0", label="one record")
        what = "dissemination over the gossipsub model"
    else:
        what = "change convergence"
        changes = o.metrics.changes
        for i, rec in enumerate(changes):
            if rec.targets <= 0:
                continue
            t = np.asarray([0.0, *rec.arrivals])
            y = np.arange(0, t.size) / rec.targets
            ax.step(t, y, where="post", color="C0", alpha=max(0.15, 1 / max(1, len(changes)) ** 0.5),
                    linewidth=1, label=f"{len(changes)} changes" if i == 0 else None)
        if not changes:
            ax.text(0.5, 0.5, "no change in this scenario", ha="center", va="center", transform=ax.transAxes)
    ax.axvline(o.max_one_way_s, color="C3", linestyle="--", linewidth=1,
               label=f"longest one-way delay {o.max_one_way_s * 1e3:.0f} ms")
    ax.set_xlabel("seconds after the publish" if o.arrivals is not None else "seconds after the change")
    ax.set_ylabel("fraction of nodes with the record")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="lower right")
    ax.set_title(_title(o, what), fontsize=10)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _buckets(times: list[float], seconds: float, width: float) -> tuple[np.ndarray, np.ndarray]:
    edges = np.arange(0.0, seconds + width, width)
    counts, _ = np.histogram(np.asarray(times, dtype=float), bins=edges)
    return edges[:-1], counts / width


def false_positives(o: Outcome, path: Path) -> Path:
    m = o.metrics
    fig, ax = _figure()
    seconds = o.scenario.seconds
    width = max(1.0, seconds / 120)
    t, suspects = _buckets(m.suspect_times, seconds, width)
    _, false = _buckets([x for x, _, _ in m.false_dead], seconds, width)
    ax.step(t, suspects, where="post", color="C1", label="suspect declarations /s (left axis)")
    right = ax.twinx()  # a few false deads must not vanish under thousands of suspicions
    right.step(t, false * width, where="post", color="C3", label=f"false dead per bin ({len(m.false_dead)} in all)")
    right.set_ylabel("false dead per bin", color="C3")
    right.set_ylim(bottom=0, top=max(1.0, float((false * width).max()) * 1.15))
    for rec in m.crashes:
        ax.axvline(rec.at, color="0.6", linewidth=0.6)
    for cut in m.cuts:
        ax.axvspan(cut.start, cut.end, color="C4", alpha=0.12)
    for ev in o.scenario.events:
        if isinstance(ev, Congest):
            ax.axvspan(ev.at, ev.until, color="C8", alpha=0.15)
    ax.set_xlabel(f"simulated seconds ({width:g} s bins; grey lines: crashes; violet: partitions; "
                  f"yellow: congestion)")
    ax.set_ylabel("per second, whole swarm")
    ax.set_xlim(0, seconds)
    ax.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right")
    ax.set_title(_title(o, "suspicions and false dead"), fontsize=10)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def bandwidth(o: Outcome, path: Path) -> Path:
    s = o.metrics.series
    fig, ax = _figure()
    t = np.asarray(s["t"], dtype=float)
    window = max(1, round(o.scenario.seconds / 60))  # syncs make single seconds spiky: average a few
    kernel = np.ones(window) / window
    for key, color, style, label in (("bytes_sent_mean", "C0", "-", "sent, mean across nodes"),
                                     ("bytes_sent_p99", "C0", ":", "sent, p99 across nodes"),
                                     ("bytes_recv_mean", "C2", "-", "received, mean across nodes"),
                                     ("bytes_recv_p99", "C2", ":", "received, p99 across nodes")):
        y = np.asarray(s[key], dtype=float) / 1e3
        if y.size >= window:
            ax.plot(t[window - 1:], np.convolve(y, kernel, mode="valid"), color=color, linestyle=style,
                    linewidth=1.2, label=label)
    ax.set_xlabel(f"simulated seconds (each point: the {window} s before it)" if window > 1 else "simulated seconds")
    ax.set_ylabel("kB per node per second")
    ax.set_ylim(bottom=0)
    fig.legend(loc="outside lower center", ncols=2, fontsize=8)
    ax.set_title(_title(o, "traffic per node: probes, gossip, syncs"), fontsize=10)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def bandwidth_by_kind(o: Outcome, path: Path) -> Path:
    """What a node receives, by message kind, stacked: the mean across nodes of each second."""
    s = o.metrics.series
    fig, ax = _figure()
    t = np.asarray(s["t"], dtype=float)
    window = max(1, round(o.scenario.seconds / 60))
    kernel = np.ones(window) / window
    kinds = [k[5:-5] for k in s if k.startswith("recv_") and k.endswith("_mean")]
    ys = [np.asarray(s[f"recv_{k}_mean"], dtype=float) / 1e3 for k in kinds]
    if kinds and t.size >= window:
        ax.stackplot(t[window - 1:], *(np.convolve(y, kernel, mode="valid") for y in ys), labels=kinds, alpha=0.8)
        fig.legend(loc="outside lower center", ncols=len(kinds), fontsize=8)
    else:
        ax.text(0.5, 0.5, "no traffic by kind recorded", transform=ax.transAxes, ha="center")
    ax.set_xlabel(f"simulated seconds (each point: the {window} s before it)" if window > 1 else "simulated seconds")
    ax.set_ylabel("kB received per node per second (mean)")
    ax.set_ylim(bottom=0)
    ax.set_title(_title(o, "traffic per node by message kind"), fontsize=10)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def write_all(o: Outcome, out: Path) -> list[Path]:
    if o.metrics is None:
        return [convergence(o, out / "dissemination.png")]
    return [detection_cdf(o, out / "detection_cdf.png"), convergence(o, out / "convergence.png"),
            false_positives(o, out / "false_positives.png"), bandwidth(o, out / "bandwidth.png"),
            bandwidth_by_kind(o, out / "bandwidth_by_kind.png")]
