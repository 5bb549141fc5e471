"""The job sandbox: a job's ranks get what the job reserved on this host and nothing else
of the machine (issue 12). Parts: a uid of their own (uids.py), a cgroup (cgroups.py), a
mount and pid namespace (mounts.py), an egress firewall (firewall.py); box.py puts them
together for the worker. reaper.py is the fence: a process per job that kills its ranks
when the daemon dies (issue 13)."""
