"""The gossipsub model: the mesh reaches everyone, holes are filled by lazy gossip, cuts hold."""

import random

import numpy as np
import pytest

from sim.gossipsub import D, D_HIGH, Mesh, disseminate, spread
from sim.network import CRASHED, Latency, Network


def test_one_record_reaches_every_node_in_a_few_hops():
    lat = Latency.countries(["DE", "US", "JP", "BR", "IN"] * 60)
    a = disseminate(lat, source=0, seed=2)
    assert np.isfinite(a).all() and a[0] == 0.0
    assert a.max() < 1.0  # a handful of hops of at most ~0.2 s one-way (the data's paths may beat the direct one)
    hops = disseminate(Latency.uniform(300, 20.0), seed=2) / 0.01
    assert hops.min() == 0 and 1 <= sorted(hops)[1] and hops.max() <= 8  # whole hops: log_5(300) ~ 4
    assert np.allclose(hops, np.round(hops))


def test_the_mesh_has_degree_d_to_d_high_and_is_symmetric():
    net = Network(Latency.uniform(200, 20.0))
    mesh = Mesh(net, random.Random(1))
    mesh.form(list(range(200)))
    assert all(D <= len(p) <= D_HIGH for p in mesh.peers)
    assert all(v in mesh.peers[u] for v in range(200) for u in mesh.peers[v])


def test_same_seed_same_arrivals():
    lat = Latency.uniform(300, 30.0)
    a = disseminate(lat, loss=0.05, jitter_ms=3.0, seed=5)
    b = disseminate(lat, loss=0.05, jitter_ms=3.0, seed=5)
    assert a.tolist() == b.tolist()
    assert a.tolist() != disseminate(lat, loss=0.05, jitter_ms=3.0, seed=6).tolist()


def test_loss_delays_some_arrivals_but_reaches_everyone():
    lat = Latency.uniform(300, 30.0)
    clean = disseminate(lat, seed=1)
    lossy = disseminate(lat, loss=0.3, seed=1)
    assert np.isfinite(lossy).all()
    assert lossy.mean() > clean.mean()  # the mesh routes around most lost attempts, not all


def test_crashed_mesh_peers_leave_holes_that_lazy_gossip_fills():
    n = 300
    net = Network(Latency.uniform(n, 20.0))
    mesh = Mesh(net, random.Random(1))
    mesh.form(list(range(n)))
    victim = 7
    for u in mesh.peers[victim]:  # every mesh peer of the victim crashes: the mesh cannot reach it
        net.set_power(u, CRASHED)
    a = spread(mesh, 0, 0.0, np.random.default_rng(1))
    crashed = [u for u in range(n) if not net.up[u]]
    assert not np.isfinite(a[crashed]).any()
    assert np.isfinite(np.delete(a, crashed)).all()
    # by IHAVE/IWANT: at a sender's heartbeat, then IHAVE, IWANT and the message (three one-way delays)
    assert a[victim] >= 3 * 0.01


def test_nothing_crosses_a_cut():
    n = 100
    net = Network(Latency.uniform(n, 20.0))
    mesh = Mesh(net, random.Random(1))
    mesh.form(list(range(n)))
    net.partition(range(50), range(50, n))
    a = spread(mesh, 0, 0.0, np.random.default_rng(1))
    assert np.isfinite(a[:50]).all() and not np.isfinite(a[50:]).any()


@pytest.mark.parametrize("n", [1, 2])
def test_tiny_swarms(n):
    a = disseminate(Latency.uniform(n, 10.0))
    assert np.isfinite(a).all()
