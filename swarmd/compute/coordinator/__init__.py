"""A coordinator's side of jobs: the member a job was submitted to, running its attempts.

coordinator.py (`Jobs`, the registry of the jobs this member coordinates), run.py (one job's
attempts, sans-IO), gang.py (hold every chosen host or none, sans-IO), placement.py (which
hosts), hosts.py (the `Host` protocol: `LocalHost` over this member's own worker, `RemoteHost`
over the job protocol), hub.py (a job's checkpoints kept on its coordinator), store.py
(SQLite records and output logs) and gc.py (what finished jobs leave, and for how long). It
stands above the host's side (compute/host/): its own host is driven in process (LocalHost,
orphans at start, the hub's cache in `Worker.hubs`), never the other way round.
"""
