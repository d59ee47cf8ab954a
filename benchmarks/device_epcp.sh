#!/usr/bin/env bash
# Expert and context parallelism on the GPU machine (one H200 and its 16 CPU cores), in one call of
# about five minutes: first the CUDA checks and the H200 world-size-1 runs, then the 16-core CPU runs
# (4 and 8 gloo ranks), each with its own time limit (gpu_env.sh's `step`), so one failing step never
# stops the rest.
#   bash benchmarks/device_epcp.sh
#   EPCP_SMOKE=1 bash benchmarks/device_epcp.sh     # the same steps at toy sizes (to check the script runs)
# Results (JSON + markdown) go to benchmarks/results/, logs to benchmarks/results/logs_h200/epcp/logs/;
# where the device tool sets $OUT, everything this call wrote is copied there too.
set -uo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results/logs_h200/epcp r=benchmarks/results
ep=() cp=()
if [ -n "${EPCP_SMOKE:-}" ]; then
  r=$(mktemp -d); out=$r; ep=(--tokens 64 --steps 2 --recorded 1); cp=(--seq-per-rank 64 --rounds 2 --recorded 1)
fi
source benchmarks/gpu_env.sh
mkdir -p "$out/logs"
start=$(mktemp)
nproc; python3 -c "import torch; print(torch.__version__, torch.cuda.is_available())"

# CUDA: the new MoE paths (exact counts, padded to a capacity) and the ring against their references,
# the host-sync count of each MoE path, MeasuredChoice's logic.
step pytest_cuda 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_host_syncs_cuda.py \
    tests/gpu/test_grouped_experts_cuda.py tests/gpu/test_cp_cudnn_blocks.py tests/expert_parallel/test_moe_one_rank.py \
    tests/context_parallel/test_cp_cuda.py tests/test_tuning.py
# H200, world size 1: the MoE's fixed cost over a dense MLP (target <= 2x, fwd and fwd+bwd), chunk counts,
# capacity exact vs padded; the ring's fixed cost vs SDPA and torch's context_parallel, auto's choice.
step ep_cuda_ws1 90 python3 benchmarks/ep_overlap.py --device cuda --world 1 "${ep[@]}" --out "$r"
step ep_profile 45 python3 benchmarks/ep_profile.py --out "$r"   # where a forward's host and device time go now
step cp_cuda_ws1 90 python3 benchmarks/cp_overlap.py --device cuda --world 1 --rounds 8 "${cp[@]}" --out "$r"

# 16 CPU cores, gloo: the issue's configurations (4 ranks x 3 threads), then 8 ranks x 1 thread;
# EP also with 4x the expert work per token (ffn 2048), where a chunk's experts clearly outlast its transfer.
step ep_cpu_ws4 80 python3 benchmarks/ep_overlap.py --world 4 --threads 3 "${ep[@]}" --out "$r"
step ep_cpu_ws4_f2048 90 python3 benchmarks/ep_overlap.py --world 4 --threads 3 --ffn 2048 --steps 6 "${ep[@]}" --out "$r"
step ep_cpu_ws8 90 python3 benchmarks/ep_overlap.py --world 8 --threads 1 "${ep[@]}" --out "$r"
step cp_cpu_ws4 60 python3 benchmarks/cp_overlap.py --world 4 --threads 3 "${cp[@]}" --out "$r"
step cp_cpu_ws4_s1024 60 python3 benchmarks/cp_overlap.py --world 4 --threads 3 --seq-per-rank 1024 "${cp[@]}" --out "$r"
step cp_cpu_ws8 60 python3 benchmarks/cp_overlap.py --world 8 --threads 1 "${cp[@]}" --out "$r"

if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  find "$r" -newer "$start" -type f -print0 | xargs -0 -r cp --parents -t "$OUT"
  echo "copied $(find "$OUT" -type f | wc -l) files to \$OUT"
fi
rm -f "$start"
