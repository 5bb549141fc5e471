"""The `lab` fixture: a running netlab for a test, always torn down afterwards."""

from __future__ import annotations

import os
import uuid

import pytest

from sim.netlab import lab as labmod
from sim.netlab import topology


def pytest_collection_modifyitems(items):
    if os.geteuid() != 0:
        skip = pytest.mark.skip(reason="netlab needs root (network namespaces); CI runs as root")
        for item in items:
            if "netlab" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def lab():
    made: list[str] = []

    def make(hosts: int, rtt=20.0, *, countries=None, loss: float = 0.0, daemons: bool = True,
             mesh: bool = False) -> labmod.Lab:
        """A lab; its daemons build the WireGuard mesh only when asked (it is the mesh tests' subject,
        and five wireguard-go processes are load the membership timings need not carry)."""
        name = f"t{uuid.uuid4().hex[:6]}"
        made.append(name)
        if countries:
            table = topology.country_table()
            fn = topology.from_countries(table)
        elif callable(rtt):
            fn = rtt
        else:
            fn = topology.uniform(rtt)
        hosts_, links = topology.plan(hosts, fn, loss_pct=loss, countries=countries)
        return labmod.Lab.up(name, hosts_, links, daemons=daemons, mesh=mesh)

    yield make
    for name in made:
        labmod.down(name)
