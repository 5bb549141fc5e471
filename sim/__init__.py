"""swarm-sim: try a swarm before deploying it.

``sim.netlab`` runs real swarmd daemons in network namespaces joined by emulated
wide-area links (`swarm-sim lab …`); the discrete-event simulator at scale comes later.
"""
