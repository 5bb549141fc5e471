"""Membership: who is in the swarm, what each member offers, and who is alive.

What the rest of the daemon uses: ``service.Gossip`` (built by node.py; everyone else reads
the membership through its ``view()``, an immutable ``membership.View``), the record schema
(``wire``: ``Record``, ``MeshInfo``, ``JobSlots``), certificates and invites (``cert``),
this node's swarm on disk (``swarmstate``), and the control methods (``api``).

- Cores (sans-IO): membership.py (SWIM with Lifeguard), suspicion.py, syncmerge.py,
  wire.py, cert.py, revocation.py, owner.py.
- The driver: service.py builds the helpers and wires each with the few callables it needs
  of the others (state.py is what they share): loop.py, records.py, inbound.py, probes.py,
  sync.py, gate.py, peers.py, admission.py; join.py; pubsub.py; protocols.py.

Below: the p2p floor (host, framed streams, signed messages, limits, refusals) and wg/ (the
overlay addresses a certificate names). Above: mesh/, routing/, compute/.
"""
