"""A rank's environment: torchrun's contract (checked against a real torchrun), GPUs, who wins."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from swarmd.compute.host.executor import free_port
from swarmd.compute.torchenv import NodeRole, rank_env, resolve_argv

BASE = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/home/job"}


def role(**changes) -> NodeRole:
    fields = dict(job_id="j1", node_rank=1, nnodes=2, procs_per_node=2, master_addr="10.7.0.1",
                  master_port=29400, ifname="swarm0", gpus=(2, 3), node_ips=("10.7.0.1", "10.7.0.2"),
                  checkpoint_dir="/var/lib/swarmd/jobs/j1/checkpoints")
    return NodeRole(**(fields | changes))


@pytest.mark.parametrize(("node_rank", "local_rank", "rank"), [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)])
def test_two_nodes_of_two_ranks_get_torchruns_contract(node_rank, local_rank, rank):
    env = rank_env(role(node_rank=node_rank, restart_count=1), local_rank, {}, BASE)
    assert env == BASE | {
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": str(node_rank), "NODE_RANK": str(node_rank), "GROUP_WORLD_SIZE": "2",
        "ROLE_NAME": "default", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.7.0.1", "MASTER_PORT": "29400",
        "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "j1",
        "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
        "GLOO_SOCKET_IFNAME": "swarm0", "NCCL_SOCKET_IFNAME": "swarm0",
        "CUDA_VISIBLE_DEVICES": "2,3",
        "SWARM_JOB_ID": "j1", "SWARM_NODE_IPS": "10.7.0.1,10.7.0.2",
        "SWARM_CHECKPOINT_DIR": "/var/lib/swarmd/jobs/j1/checkpoints",
    }


def test_names_and_values_match_what_torchrun_gives_its_workers(tmp_path):
    """Run the real torchrun on one node of two ranks and compare with ours, name by name."""
    (tmp_path / "dump.py").write_text(
        "import json, os\n"
        "with open(f\"env{os.environ['LOCAL_RANK']}.json\", 'w') as f:\n"
        "    json.dump(dict(os.environ), f)\n")
    port = free_port("127.0.0.1")
    parent = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                    "--master-addr", "127.0.0.1", "--master-port", str(port), "--rdzv-id", "j1", "dump.py"],
                   cwd=tmp_path, env=parent, check=True, capture_output=True, timeout=120)
    ours_only = {"NODE_RANK", "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES"}
    # the agent's own bookkeeping, and its store: no agent hosts one here, so rank 0 does
    theirs_only = {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "LC_CTYPE"}
    differ = {"TORCHELASTIC_USE_AGENT_STORE"}
    one_node = role(node_rank=0, nnodes=1, master_addr="127.0.0.1", master_port=port, ifname=None, gpus=())
    for local_rank in (0, 1):
        theirs = json.loads((tmp_path / f"env{local_rank}.json").read_text())
        ours = rank_env(one_node, local_rank, {}, parent)
        contract = {k for k in ours if not k.startswith("SWARM_")} - ours_only
        assert contract == set(theirs) - theirs_only
        assert {k: ours[k] for k in contract - differ} == {k: theirs[k] for k in contract - differ}


def test_the_contract_wins_over_the_user_who_wins_over_the_base():
    user = {"RANK": "7", "MASTER_PORT": "1", "CUDA_VISIBLE_DEVICES": "0", "HOME": "/elsewhere", "DATA": "/d"}
    env = rank_env(role(), 0, user, BASE)
    assert (env["RANK"], env["MASTER_PORT"], env["CUDA_VISIBLE_DEVICES"]) == ("2", "29400", "2,3")
    assert env["HOME"] == "/elsewhere" and env["DATA"] == "/d" and env["PATH"] == BASE["PATH"]


def test_the_user_tunes_what_torchrun_takes_from_its_caller():
    env = rank_env(role(), 0, {"OMP_NUM_THREADS": "8", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, BASE)
    assert env["OMP_NUM_THREADS"] == "8" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_one_rank_a_node_keeps_every_core_as_under_torchrun():
    assert "OMP_NUM_THREADS" not in rank_env(role(procs_per_node=1), 0, {}, BASE)


def test_a_cpu_job_sees_no_gpu_and_every_rank_sees_its_nodes_gpus():
    assert rank_env(role(gpus=()), 0, {}, {"CUDA_VISIBLE_DEVICES": "0,1"})["CUDA_VISIBLE_DEVICES"] == ""
    eight = role(procs_per_node=8, gpus=tuple(range(8)))
    assert {rank_env(eight, i, {}, BASE)["CUDA_VISIBLE_DEVICES"] for i in range(8)} == {"0,1,2,3,4,5,6,7"}


def test_without_a_mesh_interface_gloo_and_nccl_choose_their_own():
    env = rank_env(role(ifname=None), 0, {"NCCL_SOCKET_IFNAME": "ib0"}, BASE)
    assert "GLOO_SOCKET_IFNAME" not in env and env["NCCL_SOCKET_IFNAME"] == "ib0"


@pytest.mark.parametrize(("cmd", "python", "argv"), [
    (["python", "train.py", "--lr", "0.1"], None, [sys.executable, "train.py", "--lr", "0.1"]),
    (["python3", "-m", "pkg"], "/opt/py/bin/python", ["/opt/py/bin/python", "-m", "pkg"]),
    (["./run.sh", "python"], None, ["./run.sh", "python"]),
    (["/usr/bin/python3", "x.py"], None, ["/usr/bin/python3", "x.py"]),
    ([], None, []),
])
def test_a_leading_python_is_the_jobs_interpreter(cmd, python, argv):
    assert resolve_argv(cmd, python) == argv


def test_a_restart_sets_the_contract_afresh_for_the_new_attempt():
    """After a host was lost the job runs again on fewer nodes, with a new rendezvous: every
    variable a script reads is the new attempt's, whatever the user's env says."""
    first = rank_env(role(node_rank=1, nnodes=3, node_ips=("10.7.0.1", "10.7.0.2", "10.7.0.3")), 0,
                     {"TORCHELASTIC_RESTART_COUNT": "7"}, BASE)
    again = rank_env(role(node_rank=1, nnodes=2, master_addr="10.7.0.2", master_port=29511,
                          node_ips=("10.7.0.2", "10.7.0.3"), restart_count=1), 0,
                     {"TORCHELASTIC_RESTART_COUNT": "7"}, BASE)
    assert (first["TORCHELASTIC_RESTART_COUNT"], again["TORCHELASTIC_RESTART_COUNT"]) == ("0", "1")
    assert (first["WORLD_SIZE"], again["WORLD_SIZE"]) == ("6", "4")
    assert (again["RANK"], again["GROUP_WORLD_SIZE"], again["MASTER_ADDR"], again["MASTER_PORT"]) == \
        ("2", "2", "10.7.0.2", "29511")
    assert again["SWARM_NODE_IPS"] == "10.7.0.2,10.7.0.3"
    assert rank_env(role(max_restarts=3), 0, {}, BASE)["TORCHELASTIC_MAX_RESTARTS"] == "3"
    assert again["SWARM_CHECKPOINT_DIR"] == first["SWARM_CHECKPOINT_DIR"]  # the same place on a host


def test_a_grouped_job_tells_its_ranks_the_groups_and_an_ungrouped_one_says_nothing():
    env = rank_env(role(groups=((0,), (1,))), 0, {}, BASE)
    assert env["SWARM_GROUPS"] == "0;1"
    assert "SWARM_GROUPS" not in rank_env(role(), 0, {}, BASE)
    assert rank_env(role(groups=((0,), (1,))), 0, {"SWARM_GROUPS": "0,1"}, BASE)["SWARM_GROUPS"] == "0;1", \
        "the contract wins over the user's env"
