"""A job's life on its coordinator (sans-IO): states, attempts, what each node reported, the outcome.

States and the moves between them (`MOVES`; a pair not in it raises `IllegalMove`, and a
finished job absorbs every late move):

    placing → reserving → shipping → starting → running → succeeded
        ↘ (a refused gang: reserving → reserving with other hosts; a host refusing the
           workdir or a checkpoint: shipping → reserving without it)
    starting | running → restarting → … → running     (a loss with restarts left)
    running → restarting → … → running                (a growth: `grow`, growth.py)
    any live state → failed | cancelled

While `restarting`, the next attempt's placement, reservation, shipping and start are the
`phase` of that state: the job reads "restarting (1/3): host XaN6WKvN lost" until every rank
of the new attempt runs.

Rules:
- The first rank to exit non-zero ends the attempt with its exit code; a node lost mid-job
  (its stream or heartbeat broke, membership declared it dead) ends it with that reason.
  Every other node is then told to stop (`stop_others`), so no rank hangs in a collective.
- An ended attempt restarts the job while `restart_count < max_restarts` and the job was not
  cancelled; otherwise the job fails, its reason naming how every attempt ended.
- The attempt is over when every node has reported its ranks' exit codes or was lost
  (`settled`); only then may the next one be placed (`begin_attempt`), on at least
  `min_nodes` hosts.
- A job with a `driver` (a Ray job: rank 0 on the first node runs the user's command against
  a cluster of the others) ends when the driver exits, with its code: the other nodes are
  then stopped, and their exits are the stop's echo. Another node exiting or lost does not
  end it (Ray reschedules inside its cluster); the driver's node lost ends it.
- Cancel stops every node; the job is cancelled unless it had already failed.
- A growth (`grow`, once the coordinator holds the hosts that join) stops a running attempt
  like a loss, without being one: no restart is spent, the ended attempt's `why` says why,
  and the next attempt keeps the survivors and places the `joining` hosts beside them.
  `growth` says the current attempt began with one (its marker line), `grown_at` when the
  last was (growth.py's rate limit).
- Timestamps come from the caller (`now`): each attempt keeps when its loss was detected,
  its gang reserved, its checkpoints were in place and its ranks all ran.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ...p2p.signed import short

STATES = ("placing", "reserving", "shipping", "starting", "running", "restarting", "succeeded", "failed",
          "cancelled")
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
PHASES = ("stopping", "placing", "reserving", "shipping", "starting")  # of a restart
_LIVE = ("placing", "reserving", "shipping", "starting", "running", "restarting")
LOST_RETRY_FIRST = 1.0  # seconds before a lost host is placed again, doubling with each restart,
LOST_RETRY_MAX = 60.0  # up to this (Kubernetes' CrashLoopBackOff: 10 s doubling to 5 min)

# (state, requested) -> the state the job is in afterwards
MOVES: dict[tuple[str, str], str] = {
    ("placing", "reserving"): "reserving",
    ("reserving", "reserving"): "reserving",  # the gang was refused: other hosts
    ("reserving", "shipping"): "shipping",
    ("shipping", "reserving"): "reserving",  # a host refused the workdir or a checkpoint: other hosts
    ("shipping", "starting"): "starting",
    ("starting", "running"): "running",
    ("starting", "restarting"): "restarting",
    ("starting", "succeeded"): "succeeded",  # ranks that ended before every node said it started
    ("running", "restarting"): "restarting",
    ("running", "succeeded"): "succeeded",
    **{("restarting", phase): "restarting" for phase in PHASES},
    ("restarting", "running"): "running",
    ("restarting", "succeeded"): "succeeded",  # a resumed job whose ranks all ended before every start was told
    **{(state, "failed"): "failed" for state in _LIVE},
    **{(state, "cancelled"): "cancelled" for state in _LIVE},
}


class IllegalMove(Exception):
    """A move the state machine has no row for: a bug in the caller, never a peer's doing."""


@dataclass(slots=True, kw_only=True)
class Attempt:
    n: int  # 1-based
    nodes: tuple[str, ...]
    started: float | None = None  # every rank ran
    ended: float | None = None  # every node reported or was lost
    why: str | None = None  # how it ended: None while running or when it succeeded
    resumed_from: str | None = None  # the checkpoint its ranks found in $SWARM_CHECKPOINT_DIR
    placed: float | None = None
    detected: float | None = None  # the loss that ended it was noticed
    reserved: float | None = None  # the gang was committed
    checkpoints_ready: float | None = None  # every host held the checkpoints it starts from

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["nodes"] = list(self.nodes)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Attempt:
        """`to_dict`'s inverse for a record a replica passed on: each field checked (ValueError)."""
        if not isinstance(d, dict) or set(d) != _ATTEMPT_FIELDS:
            raise ValueError(f"an attempt must be a map of {sorted(_ATTEMPT_FIELDS)}")
        times = {k: _time(f"attempt.{k}", d[k]) for k in _ATTEMPT_TIMES}
        return cls(n=_count("attempt.n", d["n"], 1, MAX_RESTARTS + 1), nodes=_peers("attempt.nodes", d["nodes"]),
                   why=_text("attempt.why", d["why"]), resumed_from=_text("attempt.resumed_from", d["resumed_from"]),
                   **times)


@dataclass(slots=True)
class Run:
    job: str
    procs_per_node: int = 1
    min_nodes: int = 1
    max_restarts: int = 0
    driver: bool = False  # rank 0 drives the job (Ray): its exit ends it
    state: str = "placing"
    phase: str | None = None  # what a restart is doing (PHASES)
    restart_count: int = 0
    nodes: tuple[str, ...] = ()  # the current attempt's, node_rank order
    attempts: list[Attempt] = field(default_factory=list)
    node_state: dict[str, str] = field(default_factory=dict)  # starting | running | exited | lost
    exit_codes: dict[int, int] = field(default_factory=dict)  # global rank -> code, this attempt
    failure: tuple[int, int] | None = None  # (rank, exit code) of the first failing rank, this attempt
    reason: str | None = None
    cancelled: bool = False
    stopping: bool = False  # the current attempt's nodes are being stopped (a failure, a loss, a cancel)
    verdict: str | None = None  # how the current attempt's end is taken: "restart" | "fail"
    lost: set[str] = field(default_factory=set)  # hosts lost in any attempt: avoided when placing
    kept: tuple[str, ...] = ()  # the ended attempt's surviving hosts, which the next one keeps
    lost_workers: list[str] = field(default_factory=list)  # a driven job's worker hosts lost, and why
    joining: tuple[str, ...] = ()  # hosts a growth holds for the next attempt, beside `kept`
    growth: str | None = None  # why the current (or next) attempt grew the job; None: it did not
    grown_at: float | None = None  # when the job last grew (growth.py: at most once per N s)

    def to_wire(self) -> dict[str, Any]:
        """The coordinator's state of the job, as its replicas keep it (succession.py): a
        successor goes on from `from_wire` of it exactly where this one was. The attempts
        kept are the last MAX_ATTEMPTS_KEPT (the front end's store has them all)."""
        return {"job": self.job, "procs_per_node": self.procs_per_node, "min_nodes": self.min_nodes,
                "max_restarts": self.max_restarts, "driver": self.driver, "state": self.state, "phase": self.phase,
                "restart_count": self.restart_count, "nodes": list(self.nodes),
                "attempts": [a.to_dict() for a in self.attempts[-MAX_ATTEMPTS_KEPT:]],
                "node_state": dict(self.node_state), "exit_codes": sorted([r, c] for r, c in self.exit_codes.items()),
                "failure": list(self.failure) if self.failure is not None else None, "reason": self.reason,
                "cancelled": self.cancelled, "stopping": self.stopping, "verdict": self.verdict,
                "lost": sorted(self.lost), "kept": list(self.kept), "lost_workers": list(self.lost_workers),
                "joining": list(self.joining), "growth": self.growth, "grown_at": self.grown_at}

    @classmethod
    def from_wire(cls, d: Any) -> Run:
        """`to_wire`'s inverse. The record comes from a replica (a member): every field is
        checked for its type, range and the states it may hold, ValueError naming the first
        that is not."""
        if not isinstance(d, dict) or set(d) != _RUN_FIELDS:
            raise ValueError(f"a job's record must be a map of {sorted(_RUN_FIELDS)}")
        state, phase, verdict = d["state"], d["phase"], d["verdict"]
        if state not in STATES:
            raise ValueError(f"record.state {str(state)[:40]!r} is not a job state")
        if phase is not None and (phase not in PHASES or state != "restarting"):
            raise ValueError("record.phase must be a restart's phase, only while restarting")
        if verdict not in (None, "restart", "fail"):
            raise ValueError("record.verdict must be restart, fail or none")
        nodes = _peers("record.nodes", d["nodes"])
        node_state = d["node_state"]
        if not isinstance(node_state, dict) or set(node_state) != set(nodes) or \
                not all(v in _NODE_STATES for v in node_state.values()):
            raise ValueError(f"record.node_state must map each node to one of {', '.join(_NODE_STATES)}")
        codes = d["exit_codes"]
        if not isinstance(codes, list) or len(codes) > MAX_RANKS or not all(
                isinstance(p, list) and len(p) == 2 for p in codes):
            raise ValueError("record.exit_codes must be [rank, code] pairs")
        exit_codes = {_count("record.exit_codes rank", r, 0, MAX_RANKS): _code(c) for r, c in codes}
        failure = d["failure"]
        if failure is not None:
            if not isinstance(failure, list) or len(failure) != 2:
                raise ValueError("record.failure must be [rank, code] or none")
            failure = (_count("record.failure rank", failure[0], 0, MAX_RANKS), _code(failure[1]))
        attempts = d["attempts"]
        if not isinstance(attempts, list) or len(attempts) > MAX_ATTEMPTS_KEPT:
            raise ValueError(f"record.attempts must be a list of at most {MAX_ATTEMPTS_KEPT}")
        max_restarts = _count("record.max_restarts", d["max_restarts"], 0, MAX_RESTARTS)
        lost_workers = d["lost_workers"]
        if not isinstance(lost_workers, list) or len(lost_workers) > MAX_NODES:
            raise ValueError("record.lost_workers must be a list")
        return cls(job=_text("record.job", d["job"]) or "", procs_per_node=_count("record.procs_per_node",
                   d["procs_per_node"], 1, MAX_RANKS), min_nodes=_count("record.min_nodes", d["min_nodes"], 1, MAX_NODES),
                   max_restarts=max_restarts, driver=_flag("record.driver", d["driver"]), state=state, phase=phase,
                   restart_count=_count("record.restart_count", d["restart_count"], 0, max_restarts), nodes=nodes,
                   attempts=[Attempt.from_dict(a) for a in attempts], node_state=dict(node_state),
                   exit_codes=exit_codes, failure=failure, reason=_text("record.reason", d["reason"]),
                   cancelled=_flag("record.cancelled", d["cancelled"]), stopping=_flag("record.stopping", d["stopping"]),
                   verdict=verdict, lost=set(_peers("record.lost", d["lost"])), kept=_peers("record.kept", d["kept"]),
                   lost_workers=[_text("record.lost_workers", w) or "" for w in lost_workers],
                   joining=_peers("record.joining", d["joining"]), growth=_text("record.growth", d["growth"]),
                   grown_at=_time("record.grown_at", d["grown_at"]))

    def to(self, state: str) -> None:
        if state not in STATES and state not in PHASES:
            raise ValueError(f"unknown job state {state!r}")
        if self.state in TERMINAL:
            return
        after = MOVES.get((self.state, state))
        if after is None:
            raise IllegalMove(f"job {self.job}: no move from {self.state} to {state}")
        self.phase = state if after == "restarting" and state in PHASES else None
        self.state = after

    def placed(self, nodes: tuple[str, ...], now: float | None = None) -> None:
        """The hosts of the attempt being set up (again, when a gang was refused); a growth's
        `joining` hosts are among them now, or were left out."""
        self.nodes = nodes
        self.joining = ()
        self.node_state = {n: "starting" for n in nodes}
        if not self.attempts or self.attempts[-1].why is not None:  # the last one ended in a restart
            self.attempts.append(Attempt(n=len(self.attempts) + 1, nodes=nodes, placed=now))
        else:
            self.attempts[-1].nodes = nodes
            self.attempts[-1].placed = now

    def fail(self, reason: str) -> None:
        """Failed outside a running attempt (placement, reservation, shipping, a restart that found
        too few hosts)."""
        if self.state in TERMINAL:
            return
        self.reason = f"{reason}; {self.history()}" if self._ended_attempts() else reason
        self.to("failed")

    def node_started(self, node: str, now: float | None = None) -> None:
        if self.node_state.get(node) == "starting":
            self.node_state[node] = "running"
        self._maybe_running(now)

    def _maybe_running(self, now: float | None) -> None:
        """Running once no node is still starting (a driven job's lost worker nodes aside)."""
        done = ("running", "exited", "lost") if self.driver else ("running", "exited")
        if self.state in ("starting", "restarting") and not self.stopping \
                and all(s in done for s in self.node_state.values()):
            self.to("running")
            self.attempts[-1].started = now

    def node_exited(self, node: str, codes: dict[int, int], first: tuple[int, int] | None = None,
                    oom: tuple[int, ...] = (), memory_limit: int | None = None, now: float | None = None) -> None:
        """`first`: the rank the node saw fail first (its other ranks were stopped because of it);
        `oom`: ranks the kernel killed for exceeding the job's memory there (`memory_limit`)."""
        if self.node_state.get(node) in (None, "exited", "lost"):
            return
        self.node_state[node] = "exited"
        self.exit_codes.update(codes)
        if self.driver:
            self._driver_exited(node, codes, now)
            return
        failed = [first] if first else sorted((r, c) for r, c in codes.items() if c != 0)
        if failed and not self.stopping:  # the first cause only: later exits are its echo
            self.failure = failed[0]
            rank, code = failed[0]
            why = f"rank {rank} on {node} exited with {code}"
            if rank in oom:
                limit = f" (limit {size(memory_limit)})" if memory_limit else ""
                why = f"rank {rank} on {node}: out of memory{limit}"
            self._attempt_over(why, now)
        self._settle(now)

    def node_lost(self, node: str, why: str, now: float | None = None) -> None:
        if self.node_state.get(node) in (None, "exited", "lost"):
            return
        self.node_state[node] = "lost"
        self.lost.add(node)
        if self.driver and node != self.nodes[0]:
            self.lost_workers.append(f"host {short(node)} lost: {why}")  # Ray goes on without it
            self._maybe_running(now)
        elif not self.stopping:
            self._attempt_over(f"host {short(node)} lost: {why}", now)
        self._settle(now)

    def _driver_exited(self, node: str, codes: dict[int, int], now: float | None) -> None:
        """A driven job: only rank 0's exit decides; the rest of the cluster is then stopped."""
        if 0 in codes and not self.stopping:
            if codes[0] != 0:
                self.failure = (0, codes[0])
                lost = f" (while {'; '.join(self.lost_workers)})" if self.lost_workers else ""
                self._attempt_over(f"the driver (rank 0 on {short(node)}) exited with {codes[0]}{lost}", now)
            else:
                self.stopping = True  # succeeded once the others have stopped
        self._settle(now)

    def cancel(self, why: str = "cancelled by the user") -> None:
        if self.state in TERMINAL or self.cancelled:
            return
        self.cancelled = self.stopping = True
        if self.verdict != "fail":
            self.reason = why
        setting_up = self.state in ("placing", "reserving", "shipping") or \
            (self.state == "restarting" and self.phase in ("placing", "reserving", "shipping"))
        if not self.node_state or setting_up or (self.state == "restarting" and self.settled):
            self.to("cancelled")
        else:
            self._settle(None)

    def grow(self, joining: tuple[str, ...], why: str, now: float | None = None) -> None:
        """The coordinator holds `joining` (growth.py): the running attempt ends with `why`, its
        nodes are stopped, and the next is placed on its survivors and `joining`. No restart is
        spent: a growth is no failure (torchrun's "membership changes do not count as retries")."""
        if self.state != "running" or self.stopping or self.cancelled or self.driver or not joining:
            raise IllegalMove(f"job {self.job}: only a running attempt with no stop under way grows")
        self.stopping = True
        attempt = self.attempts[-1]
        attempt.why, attempt.detected = why, now
        self.verdict, self.reason = "restart", why
        self.joining = tuple(p for p in joining if p not in self.nodes and p not in self.lost)
        self.growth, self.grown_at = why, now
        self.to("restarting")
        self.phase = "stopping"

    def begin_attempt(self) -> None:
        """The ended attempt's hosts have all reported or are lost: the next may be placed."""
        if self.state != "restarting" or self.verdict != "restart" or not self.settled:
            raise IllegalMove(f"job {self.job}: a new attempt needs a restart whose last attempt is over")
        self.to("placing")
        self.kept = self.survivors
        self.joining = tuple(p for p in self.joining if p not in self.lost)
        self.nodes, self.node_state, self.exit_codes = (), {}, {}
        self.failure, self.stopping, self.verdict = None, False, None

    def redo_setup(self) -> None:
        """A successor took over a job whose attempt was being set up (placed, reserved,
        shipping, or started with no rank yet known to run): its hosts' holds were released
        (a start that did reach one is stopped with it), and the attempt is placed again, as
        the same attempt (no restart is spent on the hand-over)."""
        if self.state == "restarting":
            self.phase = "placing"
        elif self.state in ("reserving", "shipping", "starting"):
            self.state = "placing"
        self.nodes, self.node_state = (), {}

    @property
    def stop_others(self) -> bool:
        return self.stopping

    @property
    def settled(self) -> bool:
        """No node of the current attempt is still starting or running."""
        return not any(s in ("starting", "running") for s in self.node_state.values())

    @property
    def survivors(self) -> tuple[str, ...]:
        """The current attempt's hosts that were not lost, in node-rank order."""
        return tuple(n for n in self.nodes if self.node_state.get(n) != "lost")

    @property
    def lost_retry_pause(self) -> float:
        """Seconds before a host lost earlier is placed again, where nothing else fits: 1 s
        doubling with each restart, up to a minute (the count comes from a record: its range is
        checked, and the doubling stops well before a float could overflow)."""
        return min(LOST_RETRY_FIRST * 2 ** min(max(self.restart_count - 1, 0), 16), LOST_RETRY_MAX)

    @property
    def over(self) -> bool:
        return self.state in TERMINAL

    @property
    def exit_code(self) -> int | None:
        if self.state == "failed":
            return self.failure[1] if self.failure is not None else 1
        if self.state == "succeeded":
            return 0
        if self.state == "cancelled":
            return 130
        return None

    def history(self) -> str:
        """How each attempt ended, for a failed job's reason."""
        return "attempts: " + "; ".join(f"#{a.n} {a.why}" for a in self._ended_attempts())

    def _ended_attempts(self) -> list[Attempt]:
        return [a for a in self.attempts if a.why is not None]

    def _attempt_over(self, why: str, now: float | None) -> None:
        """The current attempt failed (`why`): its other nodes are stopped; the job restarts if
        restarts are left and it was not cancelled, else it fails. A finished job absorbs it
        (a host lost after the end does not rewrite how its last attempt ended)."""
        if self.over:
            return
        self.stopping = True
        attempt = self.attempts[-1]
        attempt.why, attempt.detected = why, now
        if self.cancelled:
            return
        if self.restart_count < self.max_restarts:
            self.verdict = "restart"
            self.restart_count += 1
            self.reason = why
            self.growth, self.joining = None, ()  # a failure's restart: none of a growth it cut short
            if self.state != "restarting":  # else the attempt of a restart failed while starting
                self.to("restarting")
            self.phase = "stopping"
        else:
            self.verdict = "fail"
            self.reason = why if not self.max_restarts else \
                f"{why}; restarts exhausted ({self.restart_count}/{self.max_restarts}); {self.history()}"

    def _settle(self, now: float | None) -> None:
        if not self.settled or self.state in TERMINAL:
            return
        if self.attempts and self.attempts[-1].ended is None:
            self.attempts[-1].ended = now
        if self.cancelled and self.verdict != "fail":
            self.to("cancelled")
        elif self.verdict == "fail":
            self.to("failed")
        elif self.verdict is None:
            self.reason = None  # an earlier attempt's end is in its own record, not the job's outcome
            self.to("succeeded")
        # "restart": the coordinator places the next attempt (begin_attempt)


MAX_ATTEMPTS_KEPT = 32  # in a replicated record (succession.MAX_RECORD bounds it all)
MAX_NODES = 1024  # spec.MAX_NODES
MAX_RESTARTS = 1000  # spec.MAX_RESTARTS
MAX_RANKS = 1 << 20
MAX_REASON = 4096  # characters of a reason or a checkpoint's name in a record
MAX_PEER = 64  # characters of a peer id (an Ed25519 one is 52)
_NODE_STATES = ("starting", "running", "exited", "lost")
_ATTEMPT_TIMES = ("started", "ended", "placed", "detected", "reserved", "checkpoints_ready")
_ATTEMPT_FIELDS = {"n", "nodes", "why", "resumed_from", *_ATTEMPT_TIMES}
_RUN_FIELDS = {"job", "procs_per_node", "min_nodes", "max_restarts", "driver", "state", "phase", "restart_count",
               "nodes", "attempts", "node_state", "exit_codes", "failure", "reason", "cancelled", "stopping",
               "verdict", "lost", "kept", "lost_workers", "joining", "growth", "grown_at"}


def _count(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer from {low} to {high}")
    return value


def _code(value: Any) -> int:
    return _count("an exit code", value, -2**31, 2**31)  # what events.py lets a host report


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false")
    return value


def _time(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e11:
        raise ValueError(f"{name} must be a Unix time or none")
    return float(value)


def _text(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_REASON:
        raise ValueError(f"{name} must be a string of at most {MAX_REASON} characters")
    return value


def _peers(name: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_NODES or not all(
            isinstance(p, str) and 0 < len(p) <= MAX_PEER and p.isalnum() and p.isascii() for p in value):
        raise ValueError(f"{name} must be a list of at most {MAX_NODES} peer ids")
    return tuple(value)


def size(n: int) -> str:
    """Bytes as a person reads them: 4 GiB, 256 MiB, 1.5 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"
