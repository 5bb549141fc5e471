"""The p2p floor: what every subsystem's protocol between daemons stands on.

- transport.py ``Transport``, what gossip, routing and compute serve and open streams on
               (node.py makes the one; its header states what a stream here is)
- host.py      the libp2p host (Noise, yamux, mDNS), the addresses it announces, reconnects,
               a connection's remote address
- streams.py   framed request/response on a stream, and libp2p's ping as a probe
- transfer.py  chunked transfer on a stream: {data} frames then {end}, received with its limits
- signed.py    signed messages and peer ids (seal, unseal, verify; `short` for display)
- limits.py    per-key token buckets, a bounded "recently seen" set, streams per peer
- rejects.py   the node's one refusal counter, labelled by subsystem, logged once per (reason, peer)

Nothing here knows of swarms, certificates or members: that is the gossip floor's gate."""
