"""The WireGuard mesh as a member of the swarm: the driver that keeps this node's interface
in step with the membership view. Above gossip (it reads the view and writes this node's
MeshInfo into its record), beside routing; the WireGuard floor below it (swarmd/wg/) knows
nothing of gossip."""

from .driver import Mesh, from_config

__all__ = ["Mesh", "from_config"]
