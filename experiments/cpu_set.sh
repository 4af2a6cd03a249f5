#!/usr/bin/env bash
# The set of runs behind experiments/results/x86_64-2cpu/ (see experiments/README.md).
#
# Every script with its default settings, chosen so that the whole set fits in about 30 minutes
# on a 2-core machine (the same runs as `blockflow bench all`); where a default is shorter than
# the thesis's test, the script's docstring says so and the result's "settings" record it.
#
#   bash experiments/cpu_set.sh [OUT]      # OUT defaults to experiments/results/<machine>
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-}
out() { if [ -n "$OUT" ]; then echo --out "$OUT"; fi; }

run() {
    local name=$1; shift
    echo "== $name $*" >&2
    local t0=$SECONDS
    "$PY" -m "experiments.$name" $(out) "$@"
    echo "== $name took $((SECONDS - t0)) s" >&2
}

run offline_blocks
run rtt
run pipeline_latency
run hop_overhead
run batch_scaling
run multiclient
run throughput
run utilization
run energy                              # GPU only: says so and exits 0 here
run memory_model
run multi_gpu                           # >= 2 GPUs only: says so and exits 0 here
