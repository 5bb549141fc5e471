"""When an elastic job below its maximum grows back (sans-IO): the coordinator's "grow now?".

A job of MIN:MAX nodes runs on fewer than MAX when no more fitted at its start or it shrank
to its survivors after a loss (run.py). When hosts are free again it grows back toward MAX.
Growing costs one restart of every rank from a checkpoint, so:

- it is looked at only right after a new checkpoint of the running attempt was recorded (the
  hub's `announced`): the restart resumes from it and loses no work;
- at most once per `every` seconds (the daemon's `job_grow_every`, GROW_EVERY_S by default),
  counted from the job's last growth; a job that never grew may grow at its first chance;
- never past the spec's maximum: the hosts that join are those placement adds to the
  attempt's own (`joining`), at most MAX minus the hosts it has; placement is asked with the
  running hosts required, so it never trades one of them away;
- not for a job whose owner said `--no-grow` (spec `grow: false`), a Ray job (Ray resizes its
  own cluster; a restart would end the user's driver), nor while the attempt is anything
  but running with no stop under way.

What the coordinator then does (coordinator.py, the trio side): hold the joining hosts
first (a gang reservation of them alone); only once every one of them is held does it stop
the attempt (`Run.grow`) and start the next on the bigger gang; a refused reservation (a
race for those hosts) leaves the job running as it is, with no restart. The growth is not a
failure: it spends none of `max_restarts` and leaves TORCHELASTIC_RESTART_COUNT as it is
(torchrun's elastic agent: "membership changes do not count as retries",
torch/distributed/elastic/agent/server/api.py).

What a member can do: only rank 0's host's checkpoints are recorded (hub.py), so a hostile
rank 0 host announcing checkpoints often can make the coordinator *look* for free hosts
often, but a growth still needs `every` seconds since the last one and a size below MAX; no
message of a member asks for hosts.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...p2p.signed import short

# a restart costs 6-9 s to the first step (README: elastic restarts, p50 of shrink and replace),
# so growing at most once per 300 s spends at most ~3 % of a job's time restarting to grow
GROW_EVERY_S = 300.0
PREFIX = "growing from "  # how a growth's reason, and its marker in the output, begin


def ready(*, grow: bool, driver: bool, most: int, size: int, running: bool, last: float | None, now: float,
          every: float) -> str | None:
    """Whether to look for free hosts now, right after a new checkpoint of the attempt:
    None, or why not (for the log)."""
    if not grow:
        return "growth is off for this job (--no-grow)"
    if driver:
        return "a Ray job resizes its own cluster"
    if size >= most:
        return f"at its maximum of {most} node(s)"
    if not running:
        return "the attempt is not running"
    if last is not None and now - last < every:
        return f"grew {now - last:.0f} s ago (at most once per {every:g} s)"
    return None


def joining(most: int, current: Sequence[str], placed: Sequence[str]) -> tuple[str, ...]:
    """The hosts a placement of the bigger gang adds to the running ones (`current`), in its
    order: at most `most` minus the hosts the job has; () when it dropped a running one (a
    growth never moves the job off a host) or adds none."""
    if not set(current) <= set(placed):
        return ()
    extra = [p for p in dict.fromkeys(placed) if p not in current]
    return tuple(extra[:max(most - len(current), 0)])


def why(current: Sequence[str], joining: Sequence[str], checkpoint: str) -> str:
    """The growth's reason, in the job's history and its output:
    "growing from 2 to 4 nodes at checkpoint epoch-0005.pt (3xKp9Q2a, Vb7cRt1Z free again)"."""
    return (f"{PREFIX}{len(current)} to {len(current) + len(joining)} nodes at checkpoint {checkpoint} "
            f"({', '.join(short(p) for p in joining)} free again)")
