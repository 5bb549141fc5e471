"""The p2p floor: what every subsystem's protocol between daemons stands on.

- host.py     the libp2p host (Noise, yamux, mDNS), the addresses it announces, reconnects
- streams.py  framed request/response on a stream, and libp2p's ping as a probe
- transfer.py chunked transfer on a stream: {data} frames then {end}, received with its limits
- signed.py   signed messages and peer ids (seal, unseal, verify; `short` for display)
- limits.py   per-peer token buckets and a bounded "recently seen" set
- rejects.py  the node's one refusal counter, labelled by subsystem, logged once per (reason, peer)

What a stream here is (every protocol of gossip, routing and compute relies on exactly this):
reliable and ordered (yamux over TCP), its remote peer the one Noise authenticated
(`stream.muxed_conn.peer_id`: never a claim inside a frame); a frame is a 4-byte length and
msgpack (rpc/framing.py), its length checked against the reader's limit before its body is
read and its body decoded within an object budget; a peer that stops reading or sending is
the caller's to time out. Nothing here knows of swarms, certificates or members: that is
the gossip floor's gate."""
