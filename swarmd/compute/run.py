"""A job's life on its coordinator (sans-IO): states, what each node reported, the outcome.

States: placing → reserving → shipping → starting → running → succeeded | failed |
cancelled. Rules:
- The first rank to exit non-zero fails the job with its exit code; every other node is
  told to stop (`stop_others` becomes true) so no rank hangs in a collective.
- A node lost mid-job (its stream broke, its host died) fails the job with that reason.
- Cancel stops every node; the job is cancelled unless it had already failed.
- The job is over when every node has reported its ranks' exit codes or was lost.
- `restart_count` is carried for elastic restarts; nothing restarts yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STATES = ("placing", "reserving", "shipping", "starting", "running", "succeeded", "failed", "cancelled")
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})


@dataclass(slots=True)
class Run:
    job: str
    nodes: tuple[str, ...] = ()
    procs_per_node: int = 1
    state: str = "placing"
    restart_count: int = 0
    node_state: dict[str, str] = field(default_factory=dict)  # starting | running | exited | lost
    exit_codes: dict[int, int] = field(default_factory=dict)  # global rank -> code
    failure: tuple[int, int] | None = None  # (rank, exit code) of the first failing rank
    reason: str | None = None
    cancelled: bool = False

    def to(self, state: str) -> None:
        if state not in STATES:
            raise ValueError(f"unknown job state {state!r}")
        if self.state not in TERMINAL:
            self.state = state

    def placed(self, nodes: tuple[str, ...]) -> None:
        self.nodes = nodes
        self.node_state = {n: "starting" for n in nodes}

    def fail(self, reason: str) -> None:
        """Failed before any rank ran (placement, reservation, shipping)."""
        if self.state not in TERMINAL:
            self.reason = reason
            self.state = "failed"

    def node_started(self, node: str) -> None:
        if self.node_state.get(node) == "starting":
            self.node_state[node] = "running"
        if self.state == "starting" and all(s == "running" for s in self.node_state.values()):
            self.state = "running"

    def node_exited(self, node: str, codes: dict[int, int], first: tuple[int, int] | None = None,
                    oom: tuple[int, ...] = (), memory_limit: int | None = None) -> None:
        """`first`: the rank the node saw fail first (its other ranks were stopped because of it);
        `oom`: ranks the kernel killed for exceeding the job's memory there (`memory_limit`)."""
        if self.node_state.get(node) in ("exited", "lost"):
            return
        self.node_state[node] = "exited"
        self.exit_codes.update(codes)
        failed = [first] if first else sorted((r, c) for r, c in codes.items() if c != 0)
        if failed and not self.stop_others:  # the first cause only: later exits are its echo
            self.failure = failed[0]
            rank, code = failed[0]
            self.reason = f"rank {rank} on {node} exited with {code}"
            if rank in oom:
                limit = f" (limit {size(memory_limit)})" if memory_limit else ""
                self.reason = f"rank {rank} on {node}: out of memory{limit}"
        self._settle()

    def node_lost(self, node: str, why: str) -> None:
        if self.node_state.get(node) in ("exited", "lost"):
            return
        self.node_state[node] = "lost"
        if self.reason is None and not self.cancelled:
            self.reason = f"node {node} lost: {why}"
        self._settle()

    def cancel(self, why: str = "cancelled by the user") -> None:
        if self.state in TERMINAL or self.cancelled:
            return
        self.cancelled = True
        if self.failure is None and self.reason is None:
            self.reason = why
        if not self.node_state or self.state in ("placing", "reserving", "shipping"):
            self.state = "cancelled"
        else:
            self._settle()

    @property
    def stop_others(self) -> bool:
        return self.cancelled or self.failure is not None or self.reason is not None

    @property
    def over(self) -> bool:
        return self.state in TERMINAL

    @property
    def exit_code(self) -> int | None:
        if self.failure is not None:
            return self.failure[1]
        if self.state == "succeeded":
            return 0
        if self.state in TERMINAL:
            return 130 if self.state == "cancelled" else 1
        return None

    def _settle(self) -> None:
        if any(s in ("starting", "running") for s in self.node_state.values()):
            return
        if self.failure is not None:
            self.state = "failed"
        elif self.cancelled:
            self.state = "cancelled"
        elif self.reason is not None:
            self.state = "failed"
        else:
            self.state = "succeeded"


def size(n: int) -> str:
    """Bytes as a person reads them: 4 GiB, 256 MiB, 1.5 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"
