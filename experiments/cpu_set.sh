#!/usr/bin/env bash
# The set of runs behind experiments/results/x86_64-2cpu/ (see experiments/README.md).
#
# Thesis settings where a 2-core CPU finishes them in minutes (offline_blocks 1000 inferences,
# rtt 10,000 messages, hop_overhead, utilization, memory_model); shorter series where the
# thesis's GPU settings would take hours here (batch 32 ResNet50 on 2 cores is ~2.5 s per
# request). Every shortened setting is recorded in the result's "settings". About an hour.
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

run offline_blocks                      # 1000 inferences per block and method (thesis)
run rtt                                 # 10,000 messages per kind and protocol (thesis)
run pipeline_latency --duration 60      # thesis: 120 s per series
run hop_overhead                        # 200 samples per size, batch 1 and 32
run batch_scaling --n 40                # thesis: 300 requests per batch size
run multiclient --duration 25           # thesis: 120 s per client count
run throughput --duration 25            # thesis: 60 s per offered rate
run utilization --duration 60           # thesis: 120 s per transport
run energy                              # GPU only: says so and exits 0 here
run memory_model
run multi_gpu                           # >= 2 GPUs only: says so and exits 0 here
