"""Path choice and relaying: which path each peer's traffic takes, direct or through a relay.

What the rest of the daemon uses: ``service.Routing`` (built by node.py: its record fields,
RTTs and ``rtt_function`` for placement, ``explain`` and ``status``), and the control method
``route`` (``api``).

- Cores (sans-IO): paths.py (the choice, with hysteresis), relay.py (the pairs this node
  forwards for), request.py (a relay request on the wire), nft.py (the relay's rules as
  text), readout.py (snapshots the rest of the daemon reads).
- The driver: service.py builds the helpers (sessions.py: our relayed paths; server.py: the
  relay's protocol; exchange.py: coordinates and legs from peers) and the kernel edges
  (forwarder.py, conntrack.py, icmp.py); each helper declares the narrow port it reads.

Below: gossip (the view, probes, the member check), vivaldi (coordinates), wg, p2p.
Beside: mesh/ (the WireGuard interface, whose endpoints routing moves).
"""
