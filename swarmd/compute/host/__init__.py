"""A host's side of jobs: what runs a member's share of a job on this machine.

service.py (the job protocol's handler: a coordinator's requests, checked, then answered),
worker.py (the host's jobs: reservations, starts, events, checkpoints, stops), executor.py
(one job's ranks as processes), rayhost.py + raynode.py (a host's part in a Ray job), and
sandbox/ (a uid, a cgroup, namespaces and a firewall per job; the reaper). It never imports
the coordinator's side (compute/coordinator/): a contract in pyproject's [tool.importlinter].
"""
