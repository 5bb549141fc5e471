#!/usr/bin/env bash
# `make demo` until jobs land: start a swarmd, ask it for its status, stop it.
set -euo pipefail
bin=${BIN:-.venv/bin}
dir=$(mktemp -d /tmp/swarmd-demo.XXXXXX)
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$dir"' EXIT
touch "$dir/swarmd.toml"
"$bin/swarmd" --config "$dir/swarmd.toml" --state-dir "$dir/state" --socket "$dir/swarmd.sock" \
  --listen /ip4/127.0.0.1/tcp/0 --metrics-addr 127.0.0.1:0 --log-format console 2>"$dir/swarmd.log" &
pid=$!
export SWARMD_SOCKET="$dir/swarmd.sock"
for _ in $(seq 150); do
  "$bin/swarmctl" --timeout 1 status --json >/dev/null 2>&1 && break
  kill -0 "$pid" 2>/dev/null || { cat "$dir/swarmd.log"; exit 1; }
  sleep 0.1
done
echo "$ swarmctl status"
"$bin/swarmctl" status
echo
echo "$ swarmctl version"
"$bin/swarmctl" version
kill -TERM "$pid"
wait "$pid"
echo
echo "swarmd stopped cleanly; its log:"
cat "$dir/swarmd.log"
