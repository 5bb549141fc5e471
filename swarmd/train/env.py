"""What a rank reads of the swarm from its environment, checked (a malformed value is a clear
error in the rank, never a hang in a collective that half the ranks skipped).

- ``SWARM_GROUPS``: the job's nodes in groups by latency (swarmd's ``--groups auto``:
  compute/groups.py), node ranks separated by ``,`` within a group and ``;`` between groups,
  e.g. ``0,1,2;3,4,5``. Every node rank from 0 to ``GROUP_WORLD_SIZE`` - 1 exactly once.
  Unset: one group of all.
- ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``LOCAL_WORLD_SIZE``: torchrun's (compute/torchenv.py
  sets them as torchrun does): this node's rank, the nodes, the ranks per node.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

MAX_TEXT = 65536
_GROUPS = re.compile(r"\d+(,\d+)*(;\d+(,\d+)*)*")


class EnvError(ValueError):
    """A variable the swarm sets is missing or malformed; the message names it."""


@dataclass(frozen=True, slots=True)
class Layout:
    node_rank: int
    nodes: int
    per_node: int
    groups: tuple[tuple[int, ...], ...]  # node ranks per group

    @property
    def group(self) -> int:
        """The index of this node's group."""
        return next(i for i, g in enumerate(self.groups) if self.node_rank in g)

    def ranks(self, group: int) -> list[int]:
        """The global ranks of a group's nodes (torchrun numbers a node's ranks consecutively)."""
        return [n * self.per_node + local for n in self.groups[group] for local in range(self.per_node)]


def _int(env: Mapping[str, str], name: str, default: int | None, least: int) -> int:
    text = env.get(name)
    if text is None:
        if default is None:
            raise EnvError(f"{name} is not set (swarmd and torchrun set it for every rank)")
        return default
    if not text.isdigit() or len(text) > 9 or int(text) < least:
        raise EnvError(f"{name}={text[:40]!r}: expected a whole number >= {least}")
    return int(text)


def parse_groups(text: str, nodes: int) -> tuple[tuple[int, ...], ...]:
    """``SWARM_GROUPS``'s value, checked against the job's ``nodes``."""
    if len(text) > MAX_TEXT or not _GROUPS.fullmatch(text):
        raise EnvError(f"SWARM_GROUPS={text[:60]!r}: expected node ranks like '0,1,2;3,4,5'")
    groups = tuple(tuple(int(x) for x in part.split(",")) for part in text.split(";"))
    seen = [n for g in groups for n in g]
    if sorted(seen) != list(range(nodes)):
        raise EnvError(f"SWARM_GROUPS={text[:60]!r}: must name each node rank 0..{nodes - 1} exactly once")
    return groups


def layout(env: Mapping[str, str] | None = None) -> Layout:
    """This rank's place in the job, from ``env`` (the process environment by default)."""
    env = os.environ if env is None else env
    nodes = _int(env, "GROUP_WORLD_SIZE", 1, 1)
    node_rank = _int(env, "GROUP_RANK", 0, 0)
    if node_rank >= nodes:
        raise EnvError(f"GROUP_RANK={node_rank} is not below GROUP_WORLD_SIZE={nodes}")
    per_node = _int(env, "LOCAL_WORLD_SIZE", 1, 1)
    text = env.get("SWARM_GROUPS")
    groups = (tuple(range(nodes)),) if not text else parse_groups(text, nodes)
    return Layout(node_rank=node_rank, nodes=nodes, per_node=per_node, groups=groups)
