"""swarm-sim: try a swarm before deploying it.

``sim.netlab`` runs real swarmd daemons in network namespaces joined by emulated wide-area
links (`swarm-sim lab …`). The rest is the discrete-event simulator (`swarm-sim run`): the
daemon's unmodified membership core in every simulated node, on a modelled network
(``network``), gossipsub (``gossipsub``) and clock (``engine``), driven by ``swarm``;
``scenario``, ``runner``, ``metrics``, ``report`` and ``plots`` turn a TOML timeline into
report.json and PNGs.
"""
