"""What a host accepts as a node's role from a peer: the coordinator's own role round-trips,
and numbers out of range or addresses that are not IPs are refused naming the field."""

from __future__ import annotations

import pytest

from swarmd.compute.service import _role, role_to_wire
from swarmd.compute.torchenv import NodeRole

ROLE = NodeRole(job_id="0123456789ab", node_rank=1, nnodes=2, procs_per_node=2, master_addr="10.211.0.1",
                master_port=29500, ifname=None, gpus=(), node_ips=("10.211.0.1", "10.211.0.2"), checkpoint_dir="")


def test_the_coordinators_role_round_trips():
    assert _role(role_to_wire(ROLE)) == ROLE


@pytest.mark.parametrize("change, field", [
    ({"procs_per_node": 100_000}, "role.procs_per_node"),
    ({"procs_per_node": True}, "role.procs_per_node"),
    ({"node_rank": 2}, "role.node_rank"),
    ({"nnodes": 0}, "role.nnodes"),
    ({"master_port": 70000}, "role.master_port"),
    ({"master_addr": "rank0.example; rm -rf /"}, "role.master_addr"),
    ({"node_ips": ["10.211.0.1"]}, "role.node_ips"),
    ({"node_ips": ["10.211.0.1", "nope"]}, "role.node_ips"),
    ({"job_id": ""}, "role.job_id"),
    ({"job_id": "../x"}, "role.job_id"),
])
def test_a_peers_role_out_of_range_is_refused(change, field):
    with pytest.raises(ValueError, match=field):
        _role(role_to_wire(ROLE) | change)
