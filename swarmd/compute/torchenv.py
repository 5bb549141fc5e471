"""The environment a rank starts with: torchrun's contract, so a script that works under
`torchrun` works unchanged (names and values as torch/distributed/elastic sets them).

Rules:
- The contract wins over the user's `env`: a job that sets RANK would break its own gang.
- Ranks start from a small clean environment (PATH, LANG, HOME), not the daemon's.
- GPUs given to a node are split evenly among its ranks (CUDA_VISIBLE_DEVICES); a node
  with none sets it empty, so a CPU job never grabs a GPU that belongs to another job.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeRole:
    job_id: str
    node_rank: int
    nnodes: int
    procs_per_node: int
    master_addr: str
    master_port: int
    ifname: str | None  # the mesh interface, for gloo and NCCL
    gpus: tuple[int, ...]  # GPU indices given to this node's ranks
    node_ips: tuple[str, ...]  # every node's address, in node-rank order
    checkpoint_dir: str
    restart_count: int = 0


def rank_env(role: NodeRole, local_rank: int, user_env: Mapping[str, str],
             base_env: Mapping[str, str]) -> dict[str, str]:
    world = role.nnodes * role.procs_per_node
    rank = role.node_rank * role.procs_per_node + local_rank
    env = {**base_env, "OMP_NUM_THREADS": "1", **user_env}
    env |= {
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(role.procs_per_node), "GROUP_RANK": str(role.node_rank),
        "NODE_RANK": str(role.node_rank), "GROUP_WORLD_SIZE": str(role.nnodes),
        "ROLE_NAME": "default", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": role.master_addr, "MASTER_PORT": str(role.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(role.restart_count), "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": role.job_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
        "PYTHONUNBUFFERED": "1",
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_share(role.gpus, role.procs_per_node, local_rank))),
        "SWARM_JOB_ID": role.job_id, "SWARM_NODE_IPS": ",".join(role.node_ips),
        "SWARM_CHECKPOINT_DIR": role.checkpoint_dir,
    }
    if role.ifname:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = role.ifname
    return env


def gpu_share(gpus: Sequence[int], procs: int, local_rank: int) -> tuple[int, ...]:
    """This rank's GPUs: an even split, or every rank sees all when there are fewer GPUs
    than ranks (they share, as under torchrun with one device)."""
    if not gpus:
        return ()
    if len(gpus) < procs:
        return tuple(gpus)
    per = len(gpus) // procs
    return tuple(gpus[local_rank * per:(local_rank + 1) * per])


def resolve_argv(cmd: Sequence[str], python: str | None) -> list[str]:
    """A leading `python`/`python3` is the interpreter swarmd runs in (it has torch), or the
    one the job spec names."""
    argv = list(cmd)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = python or sys.executable
    return argv
