"""Checkpoints: rules.py (which files of a rank's checkpoint directory are checkpoints, what
to keep, where a copy goes; sans-IO) and cache.py (a host's copies of one (coordinator,
job)'s checkpoints, by content). Both sides stand on it; the coordinator's hub is
compute/coordinator/hub.py, the transfers are ops of the job protocol (host/service.py,
coordinator/hosts.py).
"""
