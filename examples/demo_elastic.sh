#!/usr/bin/env bash
# `make demo-elastic`: an elastic job outlives one of its hosts. A 4-host lab on an emulated
# WAN, a 3-node DDP job allowed two restarts; once a checkpoint of it is held by two hosts,
# one host of the job (never h1, whose daemon coordinates the job) is powered off without a
# word (`lab crash`). The job restarts on the survivors and the spare host and resumes from
# that checkpoint.
set -euo pipefail
bin=${BIN:-.venv/bin}
lab=demo-elastic
if [ "$(id -u)" != 0 ]; then
  echo "make demo-elastic builds network namespaces and WireGuard interfaces: run it as root" >&2
  exit 1
fi
crasher=
trap '[ -n "$crasher" ] && kill "$crasher" 2>/dev/null; "$bin/swarm-sim" lab down --name $lab >/dev/null 2>&1 || true' EXIT
"$bin/swarm-sim" lab down --name $lab >/dev/null 2>&1 || true

echo "$ swarm-sim lab up --name $lab --hosts 4 --countries DE,FR,PL,NL"
"$bin/swarm-sim" lab up --name $lab --hosts 4 --countries DE,FR,PL,NL
export SWARMD_SOCKET
SWARMD_SOCKET=$("$bin/python" -c "from sim.netlab.state import LabState; print(LabState.load('$lab').host('h1').socket)")

# The newest job named digits, once it runs ("" before).
running_job() {
  "$bin/swarmctl" jobs ls --json | "$bin/python" -c '
import json, sys
jobs = [j for j in json.load(sys.stdin)["jobs"] if j["name"] == "digits"]
print(jobs[0]["id"] if jobs and jobs[0]["state"] == "running" else "")'
}

# A host of job $1 other than h1, once a checkpoint of the job is held by two hosts ("" before).
victim() {
  "$bin/swarmctl" jobs show "$1" --json | "$bin/python" -c '
import json, sys
from sim.netlab.state import LabState
job = json.load(sys.stdin)
hosts = {h.peer_id: h.name for h in LabState.load(sys.argv[1]).hosts}
if job["state"] == "running" and any(len(c["holders"]) >= 2 for c in job["checkpoints"]):
    print(next(hosts[p] for p in job["nodes"] if hosts[p] != "h1"))' $lab
}

crash_a_host() {
  local job="" host=""
  until [ -n "$job" ]; do sleep 0.5; job=$(running_job) || job=""; done
  until [ -n "$host" ]; do sleep 0.5; host=$(victim "$job") || host=""; done
  echo "$ swarm-sim lab crash $host   # a silent power-off of a host of the job (not the coordinator h1)"
  "$bin/swarm-sim" lab crash --name $lab "$host"
}

echo
# TORCH_CPP_LOG_LEVEL: quiets c10d's warning that overlay addresses have no reverse DNS name
echo "$ swarmctl jobs run --nodes 3 --max-restarts 2 --name digits --workdir examples --env TORCH_CPP_LOG_LEVEL=ERROR -- python ddp_digits.py --epochs 20 --min-epoch-s 1"
crash_a_host &
crasher=$!
rc=0
"$bin/swarmctl" jobs run --nodes 3 --max-restarts 2 --name digits --workdir examples --env TORCH_CPP_LOG_LEVEL=ERROR \
  -- python ddp_digits.py --epochs 20 --min-epoch-s 1 || rc=$?
kill "$crasher" 2>/dev/null || true  # still waiting only if the job ended before a checkpoint was replicated
wait "$crasher" 2>/dev/null || true
crasher=
job=$("$bin/swarmctl" jobs ls --json | "$bin/python" -c 'import json, sys; print(json.load(sys.stdin)["jobs"][0]["id"])')
echo
echo "$ swarmctl jobs show $job"
"$bin/swarmctl" jobs show "$job"
exit $rc
