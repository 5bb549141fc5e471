"""Gossip's libp2p protocols, and the one large frame they allow.

Each request's first frame is read with p2p.streams' small limit (``MAX_SMALL_FRAME``: a
certificate); only a sync's views, after both certificates were checked, may be as large as
``MAX_SYNC_FRAME`` (every record of a large swarm).
"""

PROBE_PROTOCOL = "/swarmd/probe/1.0.0"  # probes.py: an indirect probe through a helper member
SYNC_PROTOCOL = "/swarmd/sync/3.0.0"  # sync.py; 2: certificates first, views only to members; 3: digests first
JOIN_PROTOCOL = "/swarmd/join/1.0.0"  # join.py and admission.py: joins and renewals, on the owner
MAX_SYNC_FRAME = 16 * 1024 * 1024

# What the membership receives, by kind (state.Traffic; the simulator counts the same, sim.swarm):
# probes (ping echoes, pings, indirect probes and their acks), gossip (the first copy of a record
# or rumor), duplicates (every further copy the mesh delivers), ihave (lazy gossip of message
# ids) and syncs (every frame of a push-pull, both sides).
KINDS = ("probes", "gossip", "duplicates", "ihave", "syncs")
