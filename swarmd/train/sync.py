"""How ranks keep their models together: every step (DDP), or every H steps (local SGD,
DiLoCo), inside latency groups every step and across them every H (hierarchical).

``plan(spec)`` reads the spec a script takes on its command line and the swarm's groups
from the environment (env.py), and builds the process groups:

- ``ddp``: DistributedDataParallel over all ranks; nothing else.
- ``local:H``: local SGD. Each rank steps on its own; every H steps the parameters are
  averaged over all ranks (torch's ``PeriodicModelAverager``, fp32).
- ``diloco:H``: DiLoCo (Douillard et al. 2023). Each rank takes H inner steps; then the
  outer gradient (the round's start minus where the inner steps took this rank) is averaged
  over all ranks, sent as fp16 or int8 (compress.py), and an outer SGD with Nesterov
  momentum (``OUTER_LR``, ``OUTER_MOMENTUM``) moves the round's start, from which every rank
  continues. Only the outer step is ours; the optimiser is torch's. ``fragments``/``delay``:
  Streaming DiLoCo (Douillard et al. 2025): the model synced in F parts in turn (1/F of the
  bytes per sync), each sync overlapped with τ inner steps (DiLoCo's class).

With ``SWARM_GROUPS`` (swarmd's ``--groups auto``) and more than one group, the ranks of a
group also all-reduce gradients every step (DDP over the group's subgroup: a region's cheap
links), so H-step syncs cross only the slow links (as torch's ``HierarchicalModelAverager``,
whose groups must be equal runs of consecutive ranks: latency groups are not). One group:
the plan is plain DDP, whatever the spec (nothing is slow to sync over).

Elastic restarts: ``state_dict``/``load_state_dict`` carry the outer state (the round's start,
the outer optimiser's momentum, the counts); a rank resuming continues from the round's start,
so a crash loses at most the inner steps of one round, never an outer step.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import compress
from .env import Layout, layout

MAX_EVERY = 1_000_000
# The outer step's defaults. The paper's are lr 0.7, momentum 0.9, for rounds of hundreds of steps
# (H = 500). Over rounds of 4-16 steps momentum 0.9 overshoots: the digits demo on 3 ranks, 15
# epochs, 3 seeds, reached 0.944-0.958 with it at H = 8 and 16 (0.70 at H = 4) against DDP's
# 0.960-0.962, and 0.958-0.971 with 0.5 at H = 4, 8 and 16 (int8 too). Pass 0.9 for long rounds.
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.5
MIX = 0.5  # Streaming DiLoCo's merge of an overlapped fragment: local = MIX local + (1 - MIX) global
_SPEC = re.compile(r"(ddp)|(local|diloco):([1-9]\d{0,6})")


@dataclass(frozen=True, slots=True)
class Spec:
    kind: str  # "ddp", "local" or "diloco"
    every: int = 1  # H: inner steps between syncs across groups


def parse(text: str) -> Spec:
    """``ddp``, ``local:H`` or ``diloco:H`` (1 <= H <= 1,000,000)."""
    m = _SPEC.fullmatch(text or "")
    if m is None or (m.group(3) and int(m.group(3)) > MAX_EVERY):
        raise ValueError(f"sync {text[:40]!r}: expected ddp, local:H or diloco:H with 1 <= H <= {MAX_EVERY}")
    return Spec("ddp") if m.group(1) else Spec(m.group(2), int(m.group(3)))


class DiLoCo:
    """The outer loop: call ``step()`` after each inner optimiser step.

    ``fragments`` F > 1 is Streaming DiLoCo (Douillard et al. 2025): the parameters are cut
    into F runs of about equal size, and fragment p syncs at steps (p + 1) H / F of each round
    of H, so each sync sends 1/F of the model and the link's peak falls F times. ``delay`` τ
    > 0 overlaps the sync with compute: the fragment's average is started at its step and
    waited for τ steps later (the inner steps run meanwhile), and the fragment then takes the
    outer step and mixes: local = MIX local + (1 - MIX) global (the paper's merge, 0.5)."""

    def __init__(self, params: list[nn.Parameter], *, every: int, outer_lr: float = OUTER_LR,
                 outer_momentum: float = OUTER_MOMENTUM, compression: str = "fp16",
                 group: dist.ProcessGroup | None = None, fragments: int = 1, delay: int = 0) -> None:
        if every < 1:
            raise ValueError("every must be at least 1")
        if not 0 < outer_lr <= 10 or not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_lr {outer_lr!r}, outer_momentum {outer_momentum!r}: need 0 < lr <= 10 and "
                             "0 <= momentum < 1")
        check_streaming(every, fragments, delay)
        self.params = [p for p in params if p.requires_grad]
        self.every, self.compression, self.group = every, compress.check_kind(compression), group
        self.delay = delay
        # the round's start, the same on every rank: rank 0's (as DDP does at construction)
        self.start = [p.detach().clone() for p in self.params]
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            for t in self.start:
                dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        self._restart_round()
        self.outer = torch.optim.SGD(self.start, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
        self.fragments = split(self.params, min(fragments, max(1, len(self.params))))
        # fragment p's turn within each round of H (the last at H, where a round without fragments syncs)
        self.turns = [(p + 1) * every // len(self.fragments) % every for p in range(len(self.fragments))]
        self._pending: dict[int, tuple[int, compress.Pending, list[torch.Tensor]]] = {}  # p -> (due, sync, grads)
        self._clean_at: list[int | None] = [0] * len(self.fragments)  # the step fragment p was at its start
        self.steps = 0  # inner steps taken
        self.rounds = 0  # outer steps taken (a fragment's counts 1/F)
        self.syncs = 0  # fragment syncs completed
        self.sent = 0  # bytes this rank sent for them

    def _restart_round(self, indices: list[int] | None = None) -> None:
        with torch.no_grad():
            for i in range(len(self.params)) if indices is None else indices:
                self.params[i].copy_(self.start[i])

    def step(self) -> bool:
        """Count an inner step; take the outer step of the fragments whose turn (or whose
        overlapped sync's end) it is. True when one was taken."""
        self.steps += 1
        took = False
        for p, (due, _, _) in sorted(self._pending.items()):
            if self.steps >= due:
                self._land(p, mix=True)
                took = True
        for p, turn in enumerate(self.turns):
            if self.steps % self.every == turn:
                self._begin(p)
                if not self.delay:
                    self._land(p, mix=False)
                    took = True
        return took

    def _begin(self, p: int) -> None:
        with torch.no_grad():
            grads = [self.start[i] - self.params[i].detach() for i in self.fragments[p]]
        pending = compress.start_average(grads, self.compression, self.group)
        self.sent += pending.sent
        self._pending[p] = (self.steps + self.delay, pending, grads)

    def _land(self, p: int, *, mix: bool) -> None:
        """Fragment p's averaged outer gradient in: the outer step moves its start, and its
        parameters go there (mixed with where they went meanwhile, for an overlapped sync)."""
        _, pending, grads = self._pending.pop(p)
        pending.wait()
        indices = self.fragments[p]
        for i, g in zip(indices, grads):
            self.start[i].grad = g
        self.outer.step()  # only tensors with a gradient move (and only their momentum)
        self.outer.zero_grad(set_to_none=True)
        if mix:
            with torch.no_grad():
                for i in indices:
                    self.params[i].mul_(MIX).add_(self.start[i], alpha=1 - MIX)
        else:
            self._restart_round(indices)
        self._clean_at[p] = None if mix else self.steps
        self.syncs += 1
        if self.syncs % len(self.fragments) == 0:
            self.rounds += 1

    def finish(self) -> bool:
        """The outer step for a round cut short (training ends mid-round, or an overlapped sync
        in flight): every rank leaves with the one model. True when there was one to take."""
        if len(self.fragments) == 1 and not self.delay:
            if self.steps % self.every == 0:
                return False
            self.steps += self.every - self.steps % self.every - 1
            return self.step()
        for p in sorted(self._pending):
            self._land(p, mix=True)
        moved = [p for p, at in enumerate(self._clean_at) if at != self.steps]  # the same on every rank
        for p in moved:  # once more, at once: one model
            self._begin(p)
            self._land(p, mix=False)
        return bool(moved)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "rounds": self.rounds, "start": [s.detach().clone() for s in self.start],
                "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The outer state a checkpoint carries: every fragment restarts from its start (a sync
        in flight then had not moved it: its round's inner steps are lost, no outer step)."""
        start = state["start"]
        if len(start) != len(self.start) or any(a.shape != b.shape for a, b in zip(start, self.start)):
            raise ValueError("the checkpoint's DiLoCo state is for another model")
        with torch.no_grad():
            for s, saved in zip(self.start, start):
                s.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        self.steps, self.rounds = int(state["steps"]), int(state["rounds"])
        self.steps -= self.steps % self.every  # the round the checkpoint was taken in starts again
        self._pending.clear()
        self._clean_at = [self.steps] * len(self.fragments)
        self._restart_round()


def check_streaming(every: int, fragments: int, delay: int) -> None:
    """Streaming DiLoCo's values: 1 <= fragments <= H, and each sync lands before its fragment's
    next turn (0 <= delay < H / fragments)."""
    if not (isinstance(fragments, int) and isinstance(delay, int) and 1 <= fragments <= every
            and 0 <= delay < every // fragments):
        raise ValueError(f"fragments {fragments!r}, delay {delay!r}: need whole numbers, 1 <= fragments <= H "
                         f"({every}) and 0 <= delay < H / fragments")


def split(params: list[nn.Parameter], n: int) -> list[list[int]]:
    """Indices of ``params`` in ``n`` runs of consecutive tensors of about equal size, each at
    least one tensor (at most one run per tensor): Streaming DiLoCo's fragments."""
    sizes = [p.numel() for p in params]
    n = max(1, min(n, len(sizes)))
    before = [0]
    for size in sizes:
        before.append(before[-1] + size)
    cuts, lo = [0], 1
    for k in range(1, n):
        i = lo
        target = k * before[-1] / n
        while i < len(sizes) - (n - k) and before[i] < target:
            i += 1
        if i > lo and target - before[i - 1] < before[i] - target:  # the nearer boundary
            i -= 1
        cuts.append(i)
        lo = i + 1
    cuts.append(len(sizes))
    return [list(range(a, b)) for a, b in zip(cuts, cuts[1:])]


@dataclass
class Plan:
    """What ``plan`` built: wrap the model with ``wrap``, call ``step`` after each optimiser step.

    ``mode``: ``ddp`` (every step over all ranks: the spec says so, or the swarm found all the
    hosts near each other), ``flat`` (no per-step sync; local or DiLoCo across all ranks) or
    ``hierarchical`` (DDP inside this rank's group every step, ``inner``; local or DiLoCo across
    all every H)."""

    spec: Spec
    layout: Layout
    mode: str
    inner: dist.ProcessGroup | None = None
    compression: str = "fp16"
    outer_lr: float = OUTER_LR
    outer_momentum: float = OUTER_MOMENTUM
    fragments: int = 1  # Streaming DiLoCo: the model synced in this many parts, in turn
    delay: int = 0  # ... each part's sync overlapped with this many inner steps
    diloco: DiLoCo | None = None
    syncs: int = 0
    _averager: Any = None
    _params: list[nn.Parameter] = field(default_factory=list)

    @property
    def rounds(self) -> int | None:
        """DiLoCo's outer steps since the job began (a checkpoint's carry on), else None."""
        return self.diloco.rounds if self.diloco is not None else None

    def describe(self) -> str:
        groups = " | ".join(",".join(map(str, g)) for g in self.layout.groups)
        if self.mode == "ddp":
            return f"ddp every step over all ranks (node groups {groups})"
        how = "parameter averaging" if self.spec.kind == "local" else f"DiLoCo outer step ({self.compression})"
        if self.spec.kind == "diloco" and (self.fragments > 1 or self.delay):
            how = f"streaming {how[:-1]}, {self.fragments} fragments in turn, each overlapped with {self.delay} steps)"
        inside = "ddp every step inside each group, " if self.mode == "hierarchical" else ""
        return f"{inside}{how} every {self.spec.every} steps over all ranks (node groups {groups})"

    def wrap(self, model: nn.Module, **ddp: Any) -> nn.Module:
        """The module for the forward pass: DDP over what syncs every step, or the model itself.
        Averaging or DiLoCo binds to the model's parameters here."""
        if self.mode == "ddp":
            return nn.parallel.DistributedDataParallel(model, **ddp)
        wrapped: nn.Module = model
        if self.mode == "hierarchical":
            wrapped = nn.parallel.DistributedDataParallel(model, process_group=self.inner, **ddp)
        self._params = [p for p in model.parameters() if p.requires_grad]  # a frozen base never moves
        if self.spec.kind == "local":
            from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

            self._averager = PeriodicModelAverager(period=self.spec.every, warmup_steps=0)
        else:
            self.diloco = DiLoCo(self._params, every=self.spec.every, outer_lr=self.outer_lr,
                                 outer_momentum=self.outer_momentum, compression=self.compression,
                                 fragments=self.fragments, delay=self.delay)
        return wrapped

    def step(self) -> bool:
        """After each optimiser step: whether a sync across groups happened."""
        if self._averager is not None:
            # torch's rule: it averages when its step count (from 0) is a multiple of the period
            synced = self._averager.step % self.spec.every == 0
            self._averager.average_parameters(self._params)
        elif self.diloco is not None:
            synced = self.diloco.step()
        else:
            return False
        self.syncs += synced
        return synced

    def finish(self) -> None:
        """At the end of training: one model on every rank (the last round's outer step, or one
        more averaging), whatever step training stopped at. Every rank calls it."""
        if self.diloco is not None:
            self.syncs += self.diloco.finish()
        elif self._averager is not None and self._averager.step % self.spec.every != 1 % self.spec.every:
            from torch.distributed.algorithms.model_averaging.utils import average_parameters

            average_parameters(iter(self._params), self._averager.process_group)
            self.syncs += 1

    def state_dict(self) -> dict[str, Any]:
        return {"diloco": self.diloco.state_dict() if self.diloco is not None else None,
                "averager_step": self._averager.step if self._averager is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.diloco is not None and state.get("diloco") is not None:
            self.diloco.load_state_dict(state["diloco"])
        if self._averager is not None and state.get("averager_step") is not None:
            self._averager.step = int(state["averager_step"])


def plan(spec: str, *, compression: str = "fp16", outer_lr: float = OUTER_LR, outer_momentum: float = OUTER_MOMENTUM,
         fragments: int = 1, delay: int = 0, env: Mapping[str, str] | None = None) -> Plan:
    """The sync plan for ``spec`` in this job. Every rank calls it, at the same point: building
    the groups' subgroups is a collective. ``fragments`` and ``delay``: Streaming DiLoCo
    (DiLoCo's class), for ``diloco:H`` only."""
    parsed = parse(spec)
    if (fragments != 1 or delay != 0) and parsed.kind != "diloco":
        raise ValueError(f"fragments and delay are Streaming DiLoCo's: the sync {spec!r} is not diloco:H")
    check_streaming(parsed.every, fragments, delay)  # before the collectives: a clear error in every rank
    compress.check_kind(compression)
    env = os.environ if env is None else env
    where = layout(env)
    grouped = bool(env.get("SWARM_GROUPS"))
    if parsed.kind == "ddp" or (grouped and len(where.groups) == 1):
        mode, inner = "ddp", None
    elif grouped:
        mode = "hierarchical"
        inner, _ = dist.new_subgroups_by_enumeration([where.ranks(i) for i in range(len(where.groups))])
    else:
        mode, inner = "flat", None
    return Plan(spec=parsed, layout=where, mode=mode, inner=inner, compression=compression, outer_lr=outer_lr,
                outer_momentum=outer_momentum, fragments=fragments, delay=delay)
