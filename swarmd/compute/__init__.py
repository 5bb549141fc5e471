"""Jobs: specs, placement, gang reservation, executing ranks, and their records.

By side: coordinator/ (the member a job was submitted to: its attempts, hosts, records),
host/ (a member running its share: the job protocol's handler, the worker, the sandbox),
checkpoints/ (their rules and a host's cache, below both). What both sides speak stays
here: messages, spec, ids, ports, events, ledger, output, forward, workdir, torchenv, trees;
api.py (the control API's jobs) and service.py (builds both sides) sit on top. The floors are
a contract in pyproject's [tool.importlinter] (compute-sides).
"""
