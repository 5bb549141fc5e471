"""Real daemons on an emulated wide-area network: namespaces, vde2 links, a state file."""

from .lab import Lab, LabError
from .topology import Host, Link, plan

__all__ = ["Host", "Lab", "LabError", "Link", "plan"]
