"""What the project ships for driver tests: an in-memory libp2p network (net.py), a host whose
peers are far away (hosts.py) and the WireGuard mesh from tables (mesh.py)."""

from .hosts import EchoStream, SlowHost
from .mesh import FakeMesh
from .net import FakeHost, FakeNet, Faults, NetStream

__all__ = ["EchoStream", "FakeHost", "FakeMesh", "FakeNet", "Faults", "NetStream", "SlowHost"]
