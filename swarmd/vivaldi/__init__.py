"""Vivaldi network coordinates, serf's ``coordinate`` package in Python: a leaf that the
record schema (gossip/wire.py) carries and routing fits and reads. Sans-IO: RTT samples in,
coordinates out."""

from .coordinates import DEFAULT, MAX_RTT, Client, Config, Coordinate, origin

__all__ = ["DEFAULT", "MAX_RTT", "Client", "Config", "Coordinate", "origin"]
