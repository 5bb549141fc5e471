"""What the project ships for driver tests: an in-memory libp2p network (net.py)."""

from .net import FakeHost, FakeNet, Faults, NetStream

__all__ = ["FakeHost", "FakeNet", "Faults", "NetStream"]
