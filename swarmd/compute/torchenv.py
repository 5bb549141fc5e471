"""The environment a rank starts with: torchrun's contract, so a script that works under
`torchrun` works unchanged. Names and values are those torch 2.x's elastic agent gives its
workers (torch/distributed/elastic/agent/server/local_elastic_agent.py, `_start_workers`,
and torch/distributed/run.py), plus NODE_RANK and SWARM_* for swarm-aware scripts
(SWARM_GROUPS: the nodes by latency group, when the job asked for groups).

Rules:
- The contract wins over the user's `env`, which wins over `base_env`: a job that set RANK
  would break its own gang, so its value is overridden, not trusted. The knobs torchrun
  itself takes from its caller's environment (OMP_NUM_THREADS,
  TORCH_NCCL_ASYNC_ERROR_HANDLING) are the user's to set.
- `base_env` is a small clean environment (PATH, LANG, HOME of the job user), never the
  daemon's: the caller builds it.
- Every rank of a node sees all the GPUs given to that node (CUDA_VISIBLE_DEVICES), as under
  torchrun, so `torch.cuda.set_device(LOCAL_RANK)` picks its own; a node with none sets it
  empty, so a CPU job never grabs a GPU that belongs to another job.
- TORCHELASTIC_USE_AGENT_STORE is "False": no agent hosts a store, rank 0 creates the
  TCPStore at MASTER_ADDR:MASTER_PORT (torch/distributed/rendezvous.py, env://).
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
    max_restarts: int = 0
    groups: tuple[tuple[int, ...], ...] = ()  # node ranks by latency group (compute/groups.py); (): none asked


def rank_env(role: NodeRole, local_rank: int, user_env: Mapping[str, str],
             base_env: Mapping[str, str]) -> dict[str, str]:
    world = role.nnodes * role.procs_per_node
    rank = role.node_rank * role.procs_per_node + local_rank
    defaults = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    if role.procs_per_node > 1:
        defaults["OMP_NUM_THREADS"] = "1"  # torchrun's guard against oversubscribed cores
    env = {**base_env, **defaults, **user_env}
    env |= {
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(role.procs_per_node), "GROUP_RANK": str(role.node_rank),
        "NODE_RANK": str(role.node_rank), "GROUP_WORLD_SIZE": str(role.nnodes),
        "ROLE_NAME": "default", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": role.master_addr, "MASTER_PORT": str(role.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(role.restart_count), "TORCHELASTIC_MAX_RESTARTS": str(role.max_restarts),
        "TORCHELASTIC_RUN_ID": role.job_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
        "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ",".join(map(str, role.gpus)),
        "SWARM_JOB_ID": role.job_id, "SWARM_NODE_IPS": ",".join(role.node_ips),
        "SWARM_CHECKPOINT_DIR": role.checkpoint_dir,
    }
    if role.groups:  # swarmd.train's format (train/env.py): "0,1,2;3,4,5"
        env["SWARM_GROUPS"] = ";".join(",".join(map(str, g)) for g in role.groups)
    if role.ifname:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = role.ifname
    return env


def resolve_argv(cmd: Sequence[str], python: str | None) -> list[str]:
    """A leading `python`/`python3` is the interpreter the job spec names, else the one
    swarmd runs in (it has torch)."""
    argv = list(cmd)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = python or sys.executable
    return argv
