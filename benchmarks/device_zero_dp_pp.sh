#!/usr/bin/env bash
# ZeRO-3, data parallelism and the pipeline beside their PyTorch peers on the GPU machine (one H200 and
# its 16 CPU cores), each run under its own limit (gpu_env.sh's `step`; one failing never stops the rest),
# about five minutes in all:
#   ZeRO-3 auto vs its pinned twin vs prefetch 1 and 2 vs FSDP2's defaults (8 ranks x 1 thread);
#   DataParallel vs DDP (4 ranks x 3 threads; host cost at world size 1 on a core and on the H200);
#   1F1B and interleaved 1F1B vs torch's Schedule1F1B / ScheduleInterleaved1F1B (4 ranks x 3 threads).
#   bash benchmarks/device_zero_dp_pp.sh
#   ZDP_SMOKE=1 bash benchmarks/device_zero_dp_pp.sh   # 2 ranks, toy budgets (to check the script runs)
# 16-core results go to benchmarks/results/ as <bench>_cpu16_ws<N>.{json,md}, H200 ones as *_cuda*;
# logs to benchmarks/results/logs_h200/zero_dp_pp/logs/; where the device tool sets $OUT, everything
# this call wrote is copied there too.
set -uo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results/logs_h200/zero_dp_pp r=benchmarks/results
cpu=$(mktemp -d)  # CPU results land here first, then get their cpu16 names
w8=8 w4=4 t4=3 fsdp=(--budget-s 16 --steps 12 --warmup 1 --recorded 0) dp=(--budget-s 30 --steps 60 --recorded 1)
pp=(--steps 40 --warmup 2 --recorded 1) host=(--budget-s 12) k=1
if [ -n "${ZDP_SMOKE:-}" ]; then  # limits x6: a loaded 2-core machine starts processes slowly
  r=$(mktemp -d); out=$r; w8=2 w4=2 t4=1 k=6
  fsdp=(--budget-s 1 --steps 5 --warmup 1 --recorded 0) dp=(--budget-s 1 --steps 5 --warmup 1 --recorded 1)
  pp=(--steps 2 --warmup 1 --recorded 1) host=(--budget-s 1 --rounds 5 --warmup 2)
fi
source benchmarks/gpu_env.sh
mkdir -p "$out/logs"
start=$(mktemp)
nproc; python3 -c "import torch; print(torch.__version__, torch.cuda.is_available())"

# H200, world size 1: DataParallel's host cost per step beside DDP (target <= DDP's), on 512 small
# parameters and on the 168 M GPT; DataParallel's NCCL test (nothing is sent at world size 1).
step pytest_dp_cuda $((60 * k)) python3 -m pytest -q -p no:cacheprovider tests/gpu/test_nccl_data_parallel.py
step dp_host_cuda_ws1 $((45 * k)) python3 benchmarks/dp_host_cost.py --device cuda --world 1 "${host[@]}" --out "$r"
step dp_cuda_ws1 $((60 * k)) python3 benchmarks/dp_overlap.py --device cuda --steps 30 --budget-s 15 --out "$r"

# 16 CPU cores, gloo.
step fsdp_cpu_ws8 $((80 * k)) python3 benchmarks/fsdp_overlap.py --world "$w8" --threads 1 --variants fsdp2,1,2,auto \
    "${fsdp[@]}" --out "$cpu"
step dp_cpu_ws4 $((60 * k)) python3 benchmarks/dp_overlap.py --world "$w4" --threads "$t4" "${dp[@]}" --out "$cpu"
step dp_host_cpu_ws1 $((35 * k)) python3 benchmarks/dp_host_cost.py --world 1 --threads 1 "${host[@]}" --out "$cpu"
step pp_cpu_ws4 $((60 * k)) python3 benchmarks/pp_overlap.py --world "$w4" --threads "$t4" --schedules 1f1b,interleaved \
    "${pp[@]}" --out "$cpu"

for f in "$cpu"/*; do
  [ -e "$f" ] && mv "$f" "$r/$(basename "$f" | sed 's/_cpu_/_cpu16_/')"
done
rmdir "$cpu" 2>/dev/null
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  find "$r" -newer "$start" -type f -print0 | xargs -0 -r cp --parents -t "$OUT"
  echo "copied $(find "$OUT" -type f | wc -l) files to \$OUT"
fi
rm -f "$start"
