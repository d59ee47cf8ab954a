#!/usr/bin/env bash
# The multi-GPU run, whole, in one call on a machine of 2, 4 or 8 GPUs of one host:
#   bash benchmarks/multi_gpu.sh OUTDIR
# 1. the GPU test suite over NCCL with one rank per GPU (every engine);
# 2. the TP overlap benchmark (Llama-3 8B/70B GEMMs and a whole TP+SP layer) at TP = 2, 4, 8,
#    as many as the GPUs allow: sequential, bulk, pipelined p2p / symm_mem, torch's fused ops;
# 3. the DP benchmark: DataParallel vs PyTorch DDP on a ~1 B parameter GPT, every GPU;
# 4. ZeRO-3 (ours vs FSDP2), EP (MoE all-to-all chunks, grouped expert GEMMs) and CP (our ring on
#    cuDNN blocks vs torch's context_parallel) over every GPU, where the transfers really move;
# 5. a profiler trace of TP+SP+DP training steps (the demo, TP=2 x DP=N/2), analyzed with
#    `overlapkit analyze`, with its picture.
# Results (JSON, tables, pictures, logs) are packed into OUTDIR/multi_gpu.tgz.
# NVLink multicast stays off (gpu_env.sh): it can take a shared host's GPUs down.
set -uo pipefail
out=${1:?output folder}
source "$(dirname "$0")/gpu_env.sh"
mkdir -p "$out/logs" "$out/results"
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "GPUs: $n"
nvidia-smi topo -m > "$out/logs/topology.txt" 2>&1
step doctor 60 python3 -m overlapkit doctor
step pytest_gpu 400 python3 -m pytest -q tests/gpu
for tp in 2 4 8; do
  [ "$tp" -le "$n" ] || continue
  step "tp_overlap_tp$tp" 300 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/tp_overlap.py --device cuda \
      --world "$tp" --out "$out/results"
done
step dp_overlap_1b 400 python3 benchmarks/dp_overlap.py --device cuda --preset cuda-1b --steps 20 --out "$out/results"
step fsdp_overlap 300 python3 benchmarks/fsdp_overlap.py --device cuda --world "$n" --out "$out/results"
step ep_overlap 200 python3 benchmarks/ep_overlap.py --device cuda --world "$n" --out "$out/results"
step cp_overlap 300 python3 benchmarks/cp_overlap.py --device cuda --world "$n" --out "$out/results"
if [ "$n" -ge 4 ]; then
  step demo_tp_dp 200 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 -m overlapkit demo --device cuda --tp 2 --dp $((n / 2)) \
      --overlap pipelined --plot "$out/results/demo_tp_dp_recorder.png" --trace "$out/traces"
  step analyze_tp_dp 120 python3 -m overlapkit analyze "$out"/traces/rank*.json --plot "$out/results/demo_tp_dp_trace.png" \
      --json
  cp "$out/logs/analyze_tp_dp.log" "$out/results/demo_tp_dp_analyze.json"
fi
tar czf "$out/multi_gpu.tgz" -C "$out" results logs && rm -rf "$out/results" "$out/logs" "$out/traces"
