#!/usr/bin/env bash
# Everything overlapkit measures on a one-GPU machine, in one call (device time is scarce).
#   bash benchmarks/gpu_one.sh PART OUTDIR      PART: a (tests, demo, TP, profile) | b (DP, GEMM curve) | c (re-runs after fixes)
# Each step has its own time limit (gpu_env.sh's `step`) so the script always reaches the end
# and packs what it got into OUTDIR/gpu_<PART>.tgz (results/, logs).
set -uo pipefail
part=${1:?part a or b}; out=${2:?output folder}
source "$(dirname "$0")/gpu_env.sh"
mkdir -p "$out/logs" "$out/results"
if [ "$part" = a ]; then
  step doctor 60 python3 -m overlapkit doctor
  step pytest_gpu 200 python3 -m pytest -q tests/gpu
  step demo_cuda 90 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 -m overlapkit demo --tp 1 --dp 1 --device cuda \
      --overlap pipelined --plot "$out/results/demo_cuda_timeline.png"
  step tp_overlap 200 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/tp_overlap.py --device cuda --shape-tp 8 \
      --out "$out/results"
  step profile_step 90 python3 benchmarks/profile_step.py --device cuda --out "$out/results"
elif [ "$part" = b ]; then
  step dp_overlap 200 python3 benchmarks/dp_overlap.py --device cuda --out "$out/results"
  step bench_gemm 240 python3 -m overlapkit bench gemm --out "$out/results/h200_measured.json"
else
  step tp_overlap 200 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/tp_overlap.py --device cuda --shape-tp 8 \
      --out "$out/results"
  step dp_overhead_probe 150 python3 benchmarks/dp_overhead_probe.py --device cuda --out "$out/results"
  step dp_overlap 200 python3 benchmarks/dp_overlap.py --device cuda --out "$out/results"
  step demo_auto 90 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 -m overlapkit demo --tp 1 --dp 1 --device cuda \
      --overlap auto --plot "" --trace "$out/results/demo_trace"
  step analyze_demo 60 python3 -m overlapkit analyze "$out/results/demo_trace/rank0.json" --plot "$out/results/demo_cuda_trace.png"
  rm -rf "$out/results/demo_trace"
fi
tar czf "$out/gpu_$part.tgz" -C "$out" results logs && rm -rf "$out/results" "$out/logs"
