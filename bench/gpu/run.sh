#!/usr/bin/env bash
# The GPU check on the lent machine: `bash bench/gpu/run.sh`, with .gpu/ carried (prepare.py made
# it): its wheels into /tmp/site, then python3 -m bench.gpu, which writes its table and JSON to $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -d .gpu/wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/wheels/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -d .gpu/lib ]; then export LD_LIBRARY_PATH=$PWD/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi
export PYTHONUNBUFFERED=1
exec python3 -m bench.gpu --out "${OUT:-.bench/gpu}" "$@"
