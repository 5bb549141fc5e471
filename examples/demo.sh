#!/usr/bin/env bash
# `make demo`: a 3-host lab on an emulated WAN (real daemons, real WireGuard mesh), then a
# DistributedDataParallel training job across the three through `swarmctl jobs run`.
set -euo pipefail
bin=${BIN:-.venv/bin}
lab=demo
if [ "$(id -u)" != 0 ]; then
  echo "make demo builds network namespaces and WireGuard interfaces: run it as root" >&2
  exit 1
fi
trap '"$bin/swarm-sim" lab down --name $lab >/dev/null 2>&1 || true' EXIT
"$bin/swarm-sim" lab down --name $lab >/dev/null 2>&1 || true

echo "$ swarm-sim lab up --name $lab --hosts 3 --countries DE,FR,PL"
"$bin/swarm-sim" lab up --name $lab --hosts 3 --countries DE,FR,PL
export SWARMD_SOCKET
SWARMD_SOCKET=$("$bin/python" -c "from sim.netlab.state import LabState; print(LabState.load('$lab').host('h1').socket)")

echo
echo "$ swarmctl peers        # as seen from h1"
"$bin/swarmctl" peers
echo
# TORCH_CPP_LOG_LEVEL: quiets c10d's warning that overlay addresses have no reverse DNS name
echo "$ swarmctl jobs run --nodes 3 --name digits --workdir examples --env TORCH_CPP_LOG_LEVEL=ERROR -- python ddp_digits.py"
"$bin/swarmctl" jobs run --nodes 3 --name digits --workdir examples --env TORCH_CPP_LOG_LEVEL=ERROR -- python ddp_digits.py
echo
echo "$ swarmctl jobs ls"
"$bin/swarmctl" jobs ls
