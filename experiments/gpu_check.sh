#!/usr/bin/env bash
# make gpu-check [STEPS="..."]: the CUDA tests and the GPU experiments of issue 13, on an offline
# GPU machine (Python 3.12 + torch, torchvision, numpy, psutil, nvidia-ml-py; no network).
#
# A lent machine gets a copy of the working tree whose .git may lag it (seen on an H200): commit,
# carry the clean checkout and set BLOCKFLOW_SOURCE_COMMIT=<its commit>, which every result records.
#
# Before, on a machine with network:  make gpu-wheels   (fills .whl/: pyzmq, CherryPy, pytest,
# matplotlib, transformers), then carry .whl/ along. See /work/shared/gpu/README.md.
#
# Every step runs under its own time limit (STEP_LIMIT, 570 s: below the 10 minutes a command may
# take on a lent machine), so one long step cannot eat the others' time; run a few steps per
# command with STEPS="tests-ipc hop_overhead". Steps run in order of what matters most (the
# tests of the CUDA path, then the hop and pipeline goals). Seen on one H200 (2026-11-26, 16
# cores): tests-ipc 34 s, tests-manager 36 s, tests-pipeline 22 s, throughput 63 s; hop_overhead
# and pipeline_latency each took more than 100 s (cut there; about 150 s each is a fair guess),
# so a 15-minute lease (a start costs about 30 s) fits the tests, hop_overhead, pipeline_latency
# and throughput in one command, and energy, memory_model and batch_scaling in a second one.
# Seen on one H100 (2026-11-26, 16 cores, each run on a fresh machine whose start took about
# 30 s): tests-fastpath 53 s, tests-ipc 52 s, tests-manager 62 s, tests-pipeline 39 s,
# tests-groups 37 s, memory_model 32-38 s, pipeline_latency 39-51 s, hop_overhead (batch 1)
# 44 s, batching 87 s, vram 60 s.
# Results and one log per step go to
# experiments/results/<machine label>/ (label from experiments/common.py, e.g.
# x86_64-16cpu-nvidia-h100-80gb-hbm3) and, where $OUT is set (the lent machine's output folder),
# into the archive $OUT/gpu_results.tgz as well. Exit status: 0 when every step passed, 1 when one
# failed or timed out (named at the end), 2 when this machine cannot run them (one line says why).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
STEP_LIMIT=${STEP_LIMIT:-570}
SITE=${GPU_SITE:-/tmp/blockflow-site}
ALL_STEPS="tests-fastpath tests-ipc tests-manager tests-pipeline tests-groups tests-cache block_cache pipeline_latency hop_overhead hop_budget groups transformers batching vram throughput energy memory_model batch_scaling utilization multi_gpu report"
STEPS=${*:-$ALL_STEPS}

die() { echo "gpu-check: $*" >&2; exit 2; }

for s in $STEPS; do
  case " $ALL_STEPS " in *" $s "*) ;; *) die "unknown step '$s'; steps are: $ALL_STEPS";; esac
done

# -- 1. a GPU, or one line saying why not ------------------------------------------------------
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU ' \
  || die "no NVIDIA GPU on this machine (nvidia-smi finds none); run make gpu-check on a GPU machine"
command -v "$PY" >/dev/null 2>&1 || die "$PY not found; set PYTHON=/path/to/python3.12"
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null) \
  || die "$PY cannot import torch; use the GPU machine's Python (PYTHON=...)"
[ "${GPUS:-0}" -ge 1 ] || die "torch sees no CUDA GPU (torch.cuda.is_available() is False) although nvidia-smi lists one; check the driver and CUDA_VISIBLE_DEVICES"

# -- 2. install: the carried wheels, and the project's import names ------------------------------
# blocks/, dispatcher/, manager/, tensormq/ install as blockflow.* (package-dir mapping). Python
# puts the working directory first on sys.path (and tests/conftest.py puts the repository root
# there), so an installed copy would be shadowed by ./blockflow; links inside ./blockflow give the
# same names to the code of this checkout instead. They are removed on exit.
LINKS=()
cleanup() { for l in "${LINKS[@]}"; do [ -L "$l" ] && rm -f "$l"; done; }
trap cleanup EXIT
for pkg in blocks dispatcher manager tensormq; do
  if [ ! -e "blockflow/$pkg" ]; then
    ln -s "../$pkg" "blockflow/$pkg" && LINKS+=("blockflow/$pkg")
  fi
done
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    >/dev/null 2>&1 || die "could not install the wheels in .whl/ into $SITE"
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import zmq, cherrypy, pytest, msgspec, prometheus_client, tqdm, blockflow.tensormq.cuda_ipc, blockflow.blocks.process' 2>/dev/null \
  || die "pyzmq, CherryPy, pytest, msgspec, prometheus_client or tqdm is missing: run 'make gpu-wheels' on a machine with network and carry .whl/"

LABEL=$("$PY" -c 'from experiments.common import machine_label; print(machine_label())') || die "experiments/common.py failed"
RES=experiments/results/$LABEL
LOGS=$RES/gpu_check
mkdir -p "$LOGS"
echo "gpu-check: $GPUS GPU(s), results in $RES, steps: $STEPS"
"$PY" - "$LOGS/env.json" <<'EOF'
import json, os, subprocess, sys
import torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nvidia_smi": subprocess.run("nvidia-smi --query-gpu=driver_version,memory.total,power.limit "
                                     "--format=csv,noheader", shell=True, capture_output=True, text=True).stdout.strip(),
        "python": sys.version.split()[0], "cpus": os.cpu_count(),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
json.dump(info, open(sys.argv[1], "w"), indent=1)
EOF

# A lent machine returns few files from $OUT, none deeper than two folders: one archive of the
# results and logs, rewritten after every step, so a command cut off at its limit still returns
# every step that ended.
mirror() {
  if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
    tar czf "$OUT/gpu_results.tgz.part" "$RES" && mv "$OUT/gpu_results.tgz.part" "$OUT/gpu_results.tgz"
  fi
}

# -- 3. the steps ----------------------------------------------------------------------------------
FAILED=()
run_step() {
  local name=$1; shift
  local start rc took status
  echo "== $name (limit ${STEP_LIMIT}s): $*"
  start=$(date +%s)
  timeout -k 20 "$STEP_LIMIT" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  took=$(( $(date +%s) - start ))
  case $rc in
    0) status=passed ;;
    124|137) status="timed out after ${STEP_LIMIT}s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  tail -n 8 "$LOGS/$name.log" | sed 's/^/   | /'
  echo "   $name: $status in ${took}s (log $LOGS/$name.log)"
  printf '{"step": "%s", "status": "%s", "rc": %d, "seconds": %d, "at": "%s"}\n' \
    "$name" "$status" "$rc" "$took" "$(date -u +%FT%TZ)" >>"$LOGS/steps.jsonl"
  [ $rc -eq 0 ] || FAILED+=("$name")
  mirror
}

OUTARG=(--out "$RES")
for step in $STEPS; do
  case $step in
    tests-fastpath)  # issue 27: CUDA graphs vs eager, stream-ordered hand-overs
      run_step "$step" env NVIDIA_TF32_OVERRIDE=0 "$PY" -m pytest -q -rs -p no:cacheprovider \
        --junitxml="$LOGS/$step.xml" tests/cuda/test_gpu_fastpath.py ;;
    tests-ipc)  # tests/cuda/test_cuda_ipc.py without the manager path: two processes, one GPU
      run_step "$step" env NVIDIA_TF32_OVERRIDE=0 "$PY" -m pytest -q -rs -p no:cacheprovider \
        --junitxml="$LOGS/$step.xml" -k "not manager_path and not killed_under_load" tests/cuda/test_cuda_ipc.py ;;
    tests-manager)  # blockflow serve + POST /system/update with GPU blocks; kill -9 of a GPU producer or consumer
      run_step "$step" env NVIDIA_TF32_OVERRIDE=0 "$PY" -m pytest -q -rs -p no:cacheprovider \
        --junitxml="$LOGS/$step.xml" -k "manager_path or killed_under_load" tests/cuda/test_cuda_ipc.py ;;
    tests-pipeline)  # the data-plane promises with every block on the GPU
      run_step "$step" env NVIDIA_TF32_OVERRIDE=0 "$PY" -m pytest -q -rs -p no:cacheprovider -m cuda \
        --junitxml="$LOGS/$step.xml" tests/process/test_dataplane.py ;;
    tests-groups)  # issue 28: blocks sharing one process on a GPU (issue 40: they hand over by reference)
      run_step "$step" env NVIDIA_TF32_OVERRIDE=0 "$PY" -m pytest -q -rs -p no:cacheprovider -m cuda \
        --junitxml="$LOGS/$step.xml" tests/process/test_groups.py \
        tests/cuda/test_cuda_ipc.py::test_a_slot_of_this_process_is_opened_without_ipc_and_refused_once_closed ;;
    tests-cache)  # issue 44: parked weights in pinned host memory, graphs re-captured after a swap-in
      run_step "$step" env NVIDIA_TF32_OVERRIDE=0 "$PY" -m pytest -q -rs -p no:cacheprovider -s \
        --junitxml="$LOGS/$step.xml" tests/cuda/test_block_cache_gpu.py ;;
    block_cache)  # issue 44: swap-in per block size on the GPU (goal: a 60 MB block <= 10 ms), hit cost, sequential/Zipf
      run_step "$step" "$PY" -m experiments.block_cache --device cuda --head-mb 4,64 --heads 5,8 --concurrency 1 \
        --n 100 --rounds 2 "${OUTARG[@]}" ;;
    pipeline_latency)  # 4-block ResNet50 vs monolithic; eq. 4.1 components per transport
      run_step "$step" "$PY" -m experiments.pipeline_latency --device cuda --n 300 --no-http "${OUTARG[@]}" ;;
    hop_overhead)  # goal: a handle-forwarding hop <= 0.10 ms median (HOP_BATCHES=1: half the time)
      run_step "$step" "$PY" -m experiments.hop_overhead --device cuda:0 --stages block1,block4 --budget 1 \
        --batches "${HOP_BATCHES:-1,32}" "${OUTARG[@]}" ;;
    groups)  # issue 40 item 4: ResNet50's 5 blocks in one process vs 5 processes vs full.pt as one CUDA graph (goal <= 1.3x)
      run_step "$step" "$PY" -m experiments.fused --series "one group" --device cuda --n 300 "${OUTARG[@]}" ;;
    transformers)  # issue 43: BERT in 3 blocks, a CUDA graph per bucket, vs the whole model eager (goal <= 1.2x);
      # needs transformers in .whl/ (make gpu-wheels), else its result says skipped
      run_step "$step" "$PY" -m experiments.transformers --device cuda --n 300 "${OUTARG[@]}" ;;
    hop_budget)  # issue 40 item 1: the per-hop budget on the GPU (add --profile DIR where py-spy is installed);
      # its shapes (the path's crossings as bare pyzmq processes, on all cores and on one) run on the
      # host's CPUs: 100 turns a round keep them to about 15 s of the lease
      run_step "$step" "$PY" -m experiments.hop_budget --device cuda:0 --rounds 5 --n 200 --shapes 100 "${OUTARG[@]}" ;;
    batching)  # issue 27 item 5: saturation unbatched vs dynamic batching (goal >= 3x)
      run_step "$step" "$PY" -m experiments.batching --device cuda --rates 400,800,1600,3200 --duration 4 \
        --rounds 2 --window 4 "${OUTARG[@]}" ;;
    vram)  # issue 27 item 6: what a block process's VRAM is made of; one shared process vs five
      run_step "$step" "$PY" -m experiments.vram --device cuda:0 "${OUTARG[@]}" ;;
    batch_scaling)
      run_step "$step" "$PY" -m experiments.batch_scaling --device cuda --n 20 "${OUTARG[@]}" ;;
    throughput)  # offered rates up to saturation of one GPU at batch 1
      run_step "$step" "$PY" -m experiments.throughput --device cuda --duration 6 \
        --rates 100,200,400,800 "${OUTARG[@]}" ;;
    utilization)
      run_step "$step" "$PY" -m experiments.utilization --device cuda --duration 20 "${OUTARG[@]}" ;;
    energy)  # mJ per inference from NVML's energy counter
      run_step "$step" "$PY" -m experiments.energy --batches 1,4,16,32 --n 100 "${OUTARG[@]}" ;;
    memory_model)  # RSS and VRAM per block process (thesis Fig. 4.14), the memory model
      run_step "$step" "$PY" -m experiments.memory_model --device cuda "${OUTARG[@]}" ;;
    multi_gpu)  # needs two GPUs; with one it records the skip and exits 0
      run_step "$step" "$PY" -m experiments.multi_gpu --duration 20 "${OUTARG[@]}" ;;
    report)  # thesis-vs-here tables of what this machine measured (copied back with the results)
      run_step "$step" bash -c "'$PY' -m experiments.report '$RES' > '$RES/report.md'" ;;
  esac
done

if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu-check: ${#FAILED[@]} step(s) did not pass: ${FAILED[*]} (logs in $LOGS)"
  exit 1
fi
echo "gpu-check: every step passed ($STEPS); results in $RES"
