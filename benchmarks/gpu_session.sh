#!/usr/bin/env bash
# One session's measurements on the one-GPU machine (one H200, 16 CPU cores), in few calls
# because device time is scarce:
#   bash benchmarks/gpu_session.sh PART OUTDIR
#   PART cpu16a, cpu16b: the multi-rank CPU benchmarks (4-8 gloo ranks, 2 threads each), where transfers
#               really run beside compute (2 shared cores cannot show that)
#   PART gpu_a: GPU tests, the TP layer benchmark (no-regression check) and host cost per call
#   PART gpu_b: fixed costs at world size 1 (EP, CP), the LM-head probe, the demo on CUDA, the CPU
#               suite under the image's torch 2.11
# Each step has its own time limit (gpu_env.sh's `step`), so a call always reaches its end and
# packs what it got into OUTDIR/<PART>.tgz (results/, logs/).
set -uo pipefail
part=${1:?part cpu16a, cpu16b, gpu_a or gpu_b}; out=${2:?output folder}
source "$(dirname "$0")/gpu_env.sh"
mkdir -p "$out/logs" "$out/results"
r="$out/results"
# layers_ab LIMIT: the TP layer rows of the source in OLD_SRC and of this checkout, alternated
# twice in one call (old, new, old, new), so a no-regression check compares like with like.
layers_ab() {
  for i in 1 2; do
    step layers_old$i "$1" env PYTHONPATH="${OLD_SRC:?OLD_SRC: the old src folder}" CUDA_DEVICE_MAX_CONNECTIONS=1 \
        python3 benchmarks/tp_overlap.py --device cuda --shape-tp 8 --layers-only --out "$r/old$i"
    step layers_new$i "$1" env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/tp_overlap.py --device cuda \
        --shape-tp 8 --layers-only --out "$r/new$i"
  done
}
# ep_cuda_ab: the MoE layer of the source in OLD_SRC and of this checkout at world size 1, alternated
# twice in one call, as layers_ab does for the TP layers.
ep_cuda_ab() {
  for i in 1 2; do
    step ep_cuda_old$i 70 env PYTHONPATH="${OLD_SRC:?OLD_SRC: the old src folder}" python3 benchmarks/ep_overlap.py \
        --device cuda --world 1 --out "$r/old$i"
    step ep_cuda_new$i 70 python3 benchmarks/ep_overlap.py --device cuda --world 1 --out "$r/new$i"
  done
}
# ep_checks: the MoE's GPU tests (host syncs, grouped GEMMs) and the EP suite under this torch.
ep_checks() {
  step pytest_ep 150 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_moe_host_syncs_cuda.py \
      tests/gpu/test_grouped_experts_cuda.py tests/expert_parallel
}
case "$part" in
cpu16a)
  step agreement_ws8 30 python3 benchmarks/agreement_cost.py --world 8 --out "$r"
  step pp_ws4 100 python3 benchmarks/pp_overlap.py --world 4 --threads 4 --steps 30 --out "$r"
  step pp_ws8 100 python3 benchmarks/pp_overlap.py --world 8 --threads 2 --steps 30 --out "$r"
  step ep_ws4 80 python3 benchmarks/ep_overlap.py --world 4 --threads 2 --out "$r"
  step ep_ws8 90 python3 benchmarks/ep_overlap.py --world 8 --threads 2 --tokens 4096 --out "$r"
  ;;
cpu16b)
  step cp_ws4 60 python3 benchmarks/cp_overlap.py --world 4 --threads 2 --out "$r"
  step cp_ws8 60 python3 benchmarks/cp_overlap.py --world 8 --threads 1 --out "$r"
  step tp_agreement_ws4 40 python3 benchmarks/tp_agreement_cost.py --world 4 --threads 2 --out "$r"
  step fsdp_ws4 120 python3 benchmarks/fsdp_overlap.py --world 4 --threads 4 --out "$r"
  step fsdp_ws8 120 python3 benchmarks/fsdp_overlap.py --world 8 --threads 2 --out "$r"
  ;;
gpu_a)
  step doctor 30 python3 -m overlapkit doctor
  step pytest_gpu 150 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/context_parallel/test_cp_cuda.py
  step tp_overlap 190 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/tp_overlap.py --device cuda --shape-tp 8 --out "$r"
  step tp_host_cost 160 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/tp_host_cost.py --device cuda --world 1 --shape-tp 8 --no-compile --out "$r"
  ;;
gpu_b)
  step lm_head_probe 60 python3 benchmarks/lm_head_probe.py --device cuda --out "$r"
  step ep_cuda 60 python3 benchmarks/ep_overlap.py --device cuda --world 1 --out "$r"
  step cp_cuda 90 python3 benchmarks/cp_overlap.py --device cuda --world 1 --out "$r"
  step demo_cuda 45 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 -m overlapkit demo --tp 1 --dp 1 --device cuda \
      --overlap pipelined --plot "$r/demo_cuda_timeline.png"
  step cuda_graphs 70 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_graphs.py
  step tp_host_cost_70b 90 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/tp_host_cost.py --device cuda --world 1 \
      --shape-tp 8 --no-compile --models llama3-70b --out "$r/host70b"
  # The whole CPU suite on the image's torch (2.11): the code must run on 2.11 and 2.13.
  step pytest_cpu_torch211 150 python3 -m pytest -q -p no:cacheprovider tests/test_groups.py tests/test_agreement.py \
      tests/tensor_parallel tests/pipeline_parallel tests/data_parallel
  ;;
gpu_c)
  # After the host-cost work: GPU tests (a captured demo step with the real loss), the optimizer
  # checkpoint and param-group tests under torch 2.11, the no-regression layer rows, host cost
  # of 8B then 70B in one process (the capture fault), the demo on CUDA with foreach kernels.
  step pytest_gpu 150 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/test_zero_dcp.py tests/test_optim.py
  step tp_overlap_layers 150 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/tp_overlap.py --device cuda \
      --shape-tp 8 --layers-only --out "$r"
  step tp_host_cost 200 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/tp_host_cost.py --device cuda --world 1 \
      --shape-tp 8 --no-compile --out "$r"
  step demo_cuda 45 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 -m overlapkit demo --tp 1 --dp 1 --device cuda \
      --overlap bulk --steps 3
  ;;
gpu_d)
  # ZeRO-3 on 8 gloo ranks (auto's trials), then the layer rows A/B on one machine: the src in
  # OLD_SRC (the commit before DTensor parameters) and this checkout's, alternated twice, so the
  # no-regression check compares like with like rather than runs on different days and hosts.
  step fsdp_ws8 260 python3 benchmarks/fsdp_overlap.py --world 8 --threads 2 --budget-s 100 --out "$r"
  layers_ab 90
  ;;
gpu_e)
  # The final TP code: capture and replay (every mode, a whole demo step with its real loss), then
  # host cost with the compiled variants and the chunk-loop ("pipelined x8") variant.
  step cuda_graphs 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_graphs.py
  step tp_host_cost 420 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/tp_host_cost.py --device cuda --world 1 \
      --shape-tp 8 --out "$r"
  ;;
gpu_f)
  # The session's last checks: the fused fp32 wgrad accumulation (and capture with it), ZeRO-3's
  # auto against its twin at 8 ranks, the layer rows A/B (OLD_SRC as in gpu_d, the harness now
  # setting gradients to None), where the chunk loop's device time goes, host cost without compile.
  step pytest_gpu 120 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_chunked_wgrad.py \
      tests/gpu/test_cuda_graphs.py tests/gpu/test_nccl_pipelined.py
  step fsdp_ws8 160 python3 benchmarks/fsdp_overlap.py --world 8 --threads 2 --budget-s 80 --steps 30 \
      --variants fsdp2,1,2,auto --out "$r"
  layers_ab 70
  step chunk_profile 60 python3 benchmarks/tp_chunk_profile.py --device cuda --world 1 --shape-tp 8 --out "$r"
  step tp_host_cost 90 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/tp_host_cost.py --device cuda --world 1 \
      --shape-tp 8 --no-compile --tag fused_wgrad --out "$r"
  ;;
gpu_g)
  # After the ops moved to low-level Library ops (compiled host cost) and the pipelined column
  # backward to Megatron's order: GPU tests, the compile tests under torch 2.11, host cost with
  # the compiled and chunk-loop variants.
  step pytest_gpu 120 python3 -m pytest -q -p no:cacheprovider tests/gpu
  step compile_torch211 90 python3 -m pytest -q -p no:cacheprovider tests/tensor_parallel/test_compile.py \
      tests/tensor_parallel/test_bulk_overlap.py
  step tp_host_cost 360 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/tp_host_cost.py --device cuda --world 1 \
      --shape-tp 8 --out "$r"
  ;;
gpu_h)
  # The no-regression rows A/B (OLD_SRC as in gpu_d; the new source with the no-grad forward
  # path), then where the chunk loop's device time goes now.
  layers_ab 75
  step chunk_profile 60 python3 benchmarks/tp_chunk_profile.py --device cuda --world 1 --shape-tp 8 --out "$r"
  step pytest_gpu 200 python3 -m pytest -v --durations=8 -p no:cacheprovider tests/gpu
  ;;
gpu_i)
  # x + x against x + y (the cost model's bandwidth calibration), the compile tests under torch
  # 2.11, host cost with its variants taking turns and PyTorch's DTensor TP compiled beside ours.
  step hbm_add 60 python3 benchmarks/hbm_add_probe.py --out "$r"
  step compile_torch211 170 python3 -m pytest -v --durations=5 -p no:cacheprovider \
      tests/tensor_parallel/test_compile.py tests/tensor_parallel/test_bulk_overlap.py
  step tp_host_cost 330 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/tp_host_cost.py --device cuda --world 1 \
      --shape-tp 8 --reps 40 --out "$r"
  ;;
gpu_j)
  # The session's final TP code: GPU tests, host cost (after the one-rank gather copy and the
  # chunk-loop host cuts), where the chunk loop's device time goes, the whole TP benchmark.
  step pytest_gpu 200 python3 -m pytest -v --durations=5 -p no:cacheprovider tests/gpu
  step tp_host_cost 200 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/tp_host_cost.py --device cuda --world 1 \
      --shape-tp 8 --reps 40 --out "$r"
  step chunk_profile 60 python3 benchmarks/tp_chunk_profile.py --device cuda --world 1 --shape-tp 8 --out "$r"
  step tp_overlap 200 env CUDA_DEVICE_MAX_CONNECTIONS=1 python3 benchmarks/tp_overlap.py --device cuda --shape-tp 8 --out "$r"
  ;;
gpu_k)
  # Where the none layer step leaves the GPU idle, old source (OLD_SRC) then this one. (Its first
  # call also re-measured the GEMM curve with bench gemm, whose x + y row is new.)
  step gaps_old 90 env PYTHONPATH="${OLD_SRC:?OLD_SRC: the old src folder}" python3 benchmarks/tp_step_gaps.py \
      --device cuda --world 1 --shape-tp 8 --tag old --out "$r"
  step gaps_new 90 python3 benchmarks/tp_step_gaps.py --device cuda --world 1 --shape-tp 8 --tag new --out "$r"
  ;;
ep_ab)
  # The experts' grouped GEMMs (torch._grouped_mm) against the per-expert loop before them (OLD_SRC),
  # alternated on the GPU, once on the 16 cores; and the grouped path's checks on this torch.
  step pytest_grouped 120 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_grouped_experts_cuda.py \
      tests/expert_parallel/test_grouped_experts.py
  ep_cuda_ab
  step ep_ws4_old 90 env PYTHONPATH="$OLD_SRC" python3 benchmarks/ep_overlap.py --world 4 --threads 2 --out "$r/old_ws4"
  step ep_ws4_new 90 python3 benchmarks/ep_overlap.py --world 4 --threads 2 --out "$r/new_ws4"
  ;;
ep_syncs)
  # The MoE's host syncs (one per forward, none in backward), the EP tests on this torch, and the layer
  # against the per-expert loop before the grouped GEMMs (OLD_SRC), alternated.
  ep_checks
  ep_cuda_ab
  ;;
ep_probe)
  # The MoE sync check again (its failure names each syncing call site), and grouped vs loop per GEMM pass.
  # (This call also ran a one-off diagnostic that re-ran the forward piece by piece; removed since.)
  step pytest_syncs 90 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_moe_host_syncs_cuda.py \
      tests/gpu/test_grouped_experts_cuda.py
  step ep_probe_cuda 90 python3 benchmarks/ep_grouped_probe.py --device cuda --out "$r"
  step ep_probe_cpu 90 env OMP_NUM_THREADS=4 python3 benchmarks/ep_grouped_probe.py --device cpu --out "$r"
  ;;
ep_final)
  # The finished EP changes: the sync check, the EP tests on this torch, and the layer old/new alternated
  # (OLD_SRC: before the grouped GEMMs), whose last new run is the engine's CUDA result.
  ep_checks
  ep_cuda_ab
  ;;
cp_probe)
  # Which attention kernel a ring block should call (SDPA backends and the aten ops with their lse).
  step cp_kernel_probe 120 python3 benchmarks/cp_kernel_probe.py --out "$r"
  ;;
cp_cudnn)
  # The ring's blocks on cuDNN attention: the merge checks on this GPU, then the world-size-1 fixed cost
  # against the source before it (OLD_SRC: flash blocks) and SDPA / torch CP, old then new.
  step pytest_cp 120 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_cp_cudnn_blocks.py \
      tests/context_parallel/test_cp_cuda.py
  step cp_cuda_old 150 env PYTHONPATH="${OLD_SRC:?OLD_SRC: the old src folder}" python3 benchmarks/cp_overlap.py \
      --device cuda --world 1 --out "$r/old"
  step cp_cuda_new 150 python3 benchmarks/cp_overlap.py --device cuda --world 1 --out "$r/new"
  ;;
ep_profile)
  # Where one MoE forward's time goes, host and device.
  step ep_profile 120 python3 benchmarks/ep_profile.py --out "$r"
  ;;
cpu16_tp)
  # The pipelined column backward before (MID_SRC: chunked dgrad+RS and chunk-summed wgrad) and
  # after (Megatron's order over p2p), gloo ranks on the 16 cores, where transfers run beside compute.
  for run in 4a 4b 8a; do
    w=${run%?}; t=$((16 / w - 1))
    step tp_mid_ws$run 35 env PYTHONPATH="${MID_SRC:?MID_SRC: the earlier src folder}" OMP_NUM_THREADS=$t \
        python3 benchmarks/tp_overlap.py --device cpu --world $w --layers-only --reps 20 --out "$r/mid_ws$run"
    step tp_new_ws$run 35 env OMP_NUM_THREADS=$t python3 benchmarks/tp_overlap.py --device cpu --world $w \
        --layers-only --reps 20 --out "$r/new_ws$run"
  done
  ;;
user16)
  # The 16 cores, gloo: the benchmark of record (HF Llama through parallelize beside torch's TP+SP,
  # tp 4, tp 8, dp 2 x tp 2), the zero-bubble schedules at pp 4 and 3, the critical path of a run
  # with a straggler, and the cost model calibrated on one traced layout predicting four others.
  step user_tp4 100 python3 benchmarks/user_step.py --world 4 --preset cpu16 --threads 3 --rounds 4 --warmup 1 --out "$r"
  step user_tp8 100 python3 benchmarks/user_step.py --world 8 --preset cpu16 --threads 2 --rounds 4 --warmup 1 --out "$r"
  step user_dp2tp2 90 python3 benchmarks/user_step.py --world 4 --dp 2 --preset cpu16 --seq 256 --threads 3 --rounds 4 \
      --warmup 1 --out "$r"
  step pp_zb_ws4 60 python3 benchmarks/pp_zero_bubble.py --world 4 --threads 4 --steps 20 --out "$r"
  step pp_zb_ws3 50 python3 benchmarks/pp_zero_bubble.py --world 3 --threads 5 --steps 20 --ep 0 --out "$r"
  step straggler 50 python3 benchmarks/straggler_path.py --world 16 --straggler 5 --sleep-ms 30 --out "$r"
  step calib_gpt 70 python3 benchmarks/calibrate_validation.py --device cpu --out "$r"
  ;;
userh200)
  # One H200: a smoke run of the user's path on CUDA, then the benchmark of record at world size 1
  # in bf16 (the 1.1 B config), eager then compiled; the calibrated cost model across micro-batch
  # sizes; the GPU tests of the TP layers (NCCL, CUDA graphs) after the layout change.
  step user_smoke 40 python3 benchmarks/user_step.py --device cuda --world 1 --rounds 1 --warmup 1 --out "$r/smoke"
  if [ -f "$r/smoke/user_step_cuda_tiny_ws1_tp1_eager.json" ]; then
  step user_eager 110 python3 benchmarks/user_step.py --device cuda --world 1 --preset 1b --out "$r"
  step user_compiled 280 python3 benchmarks/user_step.py --device cuda --world 1 --preset 1b --set compiled \
      --rounds 6 --variants plain_compiled,ok_none_compiled,ok_bulk_compiled,ok_pipelined_compiled,ok_auto_compiled \
      --out "$r"
  else echo "=== the smoke run failed: the 1.1 B runs are skipped"; fi
  step calib_cuda 45 python3 benchmarks/calibrate_validation.py --device cuda --out "$r"
  step pytest_gpu 60 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_nccl_layers.py tests/gpu/test_cuda_graphs.py
  ;;
final)
  # The last call of the session: the new MoE/ring CUDA paths' tests; the user's path on the 16 cores
  # (tp 4, tp 8, dp 2 x tp 2) and one rank (the tiny config); EP and CP auto/fixed/none at world size 1
  # on the H200 and 4 gloo ranks; the zero-bubble schedules at pp 4. Every step bounded.
  step pytest_cuda 80 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_moe_host_syncs_cuda.py \
      tests/gpu/test_grouped_experts_cuda.py tests/expert_parallel/test_moe_one_rank.py tests/context_parallel/test_cp_cuda.py
  step user_tp4 70 python3 benchmarks/user_step.py --world 4 --preset cpu16 --threads 3 --rounds 6 --warmup 1 \
      --budget-s 35 --out "$r"
  step user_tp8 70 python3 benchmarks/user_step.py --world 8 --preset cpu16 --threads 2 --rounds 6 --warmup 1 \
      --budget-s 35 --out "$r"
  step user_dp2tp2 50 python3 benchmarks/user_step.py --world 4 --dp 2 --preset cpu16 --seq 256 --threads 3 \
      --rounds 6 --warmup 1 --budget-s 20 --out "$r"
  step user_tiny 30 python3 benchmarks/user_step.py --world 1 --threads 2 --rounds 8 --budget-s 12 --out "$r"
  step ep_cuda_ws1 55 python3 benchmarks/ep_overlap.py --device cuda --world 1 --out "$r"
  step cp_cuda_ws1 45 python3 benchmarks/cp_overlap.py --device cuda --world 1 --rounds 6 --out "$r"
  step ep_cpu_ws4 55 python3 benchmarks/ep_overlap.py --world 4 --threads 3 --out "$r"
  step cp_cpu_ws4 45 python3 benchmarks/cp_overlap.py --world 4 --threads 3 --out "$r"
  step pp_zb_ws4 50 python3 benchmarks/pp_zero_bubble.py --world 4 --threads 4 --steps 12 --out "$r"
  ;;
base)
  # A new session's first call: CP at 4 ranks on all 16 cores alone (3 and 2 threads a rank: is the exposed
  # K/V of the pinned 13-core run a shortage of cores?), then the user's path after the layout change, in two
  # lanes: the H200 1.1 B eager rows on cores 0-2, the 16-core tp 4 rows on cores 3-15.
  A=(env); B=(env)
  if command -v taskset > /dev/null; then A=(taskset -c 0-2); B=(taskset -c 3-15); fi
  g="$r/h200" c="$r/cpu16"; mkdir -p "$g" "$c/t3" "$c/t2"
  step cp_ws4_t3 45 python3 benchmarks/cp_overlap.py --world 4 --threads 3 --out "$c/t3"
  step cp_ws4_t2 45 python3 benchmarks/cp_overlap.py --world 4 --threads 2 --out "$c/t2"
  (
    step user_smoke 40 "${A[@]}" python3 benchmarks/user_step.py --device cuda --world 1 --rounds 1 --warmup 1 --out "$g/smoke"
    step user_eager 110 "${A[@]}" python3 benchmarks/user_step.py --device cuda --world 1 --preset 1b --out "$g"
  ) > "$out/logs/lane_a.txt" 2>&1 &
  lane_a=$!
  step user_tp4 120 "${B[@]}" python3 benchmarks/user_step.py --world 4 --preset cpu16 --threads 3 --rounds 4 --warmup 1 \
      --budget-s 35 --out "$c"
  wait "$lane_a"; cat "$out/logs/lane_a.txt"
  ;;
epcp2)
  # After the MoE host-cost and CP all-gather work: their GPU tests and world-size-1 tables on the H200
  # (MoE vs the dense MLP on the exact, padded and auto paths, ops a call; ring vs all-gather blocks), then,
  # alone on all 16 cores one after another, CP at 4 ranks (3 and 2 threads), PP at 4 beside torch's
  # schedules with split_backward, EP at 4 ranks.
  g="$r/h200" c="$r/cpu16"; mkdir -p "$g" "$c/t3" "$c/t2"
  step pytest_cuda 80 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_host_syncs_cuda.py \
      tests/gpu/test_grouped_experts_cuda.py tests/expert_parallel/test_moe_one_rank.py tests/context_parallel/test_cp_cuda.py
  step ep_cuda_ws1 60 python3 benchmarks/ep_overlap.py --device cuda --world 1 --steps 6 --out "$g"
  step ep_host_cuda 45 python3 benchmarks/ep_host_cost.py --device cuda --out "$g"
  step cp_cuda_ws1 60 python3 benchmarks/cp_overlap.py --device cuda --world 1 --rounds 6 --out "$g"
  step cp_ws4_t3 60 python3 benchmarks/cp_overlap.py --world 4 --threads 3 --out "$c/t3"
  step cp_ws4_t2 55 python3 benchmarks/cp_overlap.py --world 4 --threads 2 --out "$c/t2"
  step pp_ws4 90 python3 benchmarks/pp_overlap.py --world 4 --threads 3 --schedules 1f1b,interleaved \
      --steps 16 --warmup 2 --recorded 1 --out "$c"
  step ep_ws4 60 python3 benchmarks/ep_overlap.py --world 4 --threads 3 --out "$c"
  ;;
dpz)
  # After DataParallel's bucket_mb="auto" and ZeRO-3's paired trials: DP at 4 ranks and ZeRO-3 at 8 beside
  # DDP / FSDP2, and the user's path at tp 4 (more rounds), each alone on the 16 cores; then on the H200
  # DataParallel's NCCL test and its world-size-1 step, and the MoE's fixed cost with the CUDA-graph row.
  g="$r/h200" c="$r/cpu16"; mkdir -p "$g" "$c"
  step dp_ws4 95 python3 benchmarks/dp_overlap.py --world 4 --threads 3 --budget-s 60 --out "$c"
  step fsdp_ws8 90 python3 benchmarks/fsdp_overlap.py --world 8 --threads 1 --variants fsdp2,1,2,auto --total-s 70 \
      --budget-s 60 --steps 40 --warmup 1 --recorded 0 --out "$c"
  step user_tp4 150 python3 benchmarks/user_step.py --world 4 --preset cpu16 --threads 3 --rounds 6 --warmup 1 \
      --budget-s 70 --out "$c"
  step pytest_dp_cuda 40 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_nccl_data_parallel.py
  step ep_cuda_ws1 70 python3 benchmarks/ep_overlap.py --device cuda --world 1 --steps 6 --out "$g"
  step dp_cuda_ws1 60 python3 benchmarks/dp_overlap.py --device cuda --steps 30 --budget-s 30 --out "$g"
  ;;
final2)
  # The session's last call: the changed engines' CPU tests under the image's torch (2.11), the GPU tests,
  # ZeRO-3 at 8 ranks with auto decided without trials beside its pinned twin (whose cost is the gap?),
  # and the user's path at tp 8 on the 16 cores (the row not measured before).
  g="$r/h200" c="$r/cpu16"; mkdir -p "$g" "$c"
  step pytest_cpu_torch211 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_tuning.py \
      tests/data_parallel/test_dp_bucket_auto.py tests/data_parallel/test_dp_buckets.py \
      tests/pipeline_parallel/test_pp_split_backward.py tests/context_parallel tests/expert_parallel/test_op_count.py \
      tests/expert_parallel/test_moe_one_rank.py
  step pytest_gpu 100 python3 -m pytest -q -p no:cacheprovider tests/gpu
  step fsdp_ws8 90 python3 benchmarks/fsdp_overlap.py --world 8 --threads 1 --variants fsdp2,1,auto,auto_trials --total-s 75 \
      --budget-s 60 --steps 40 --warmup 1 --recorded 0 --out "$c"
  step user_tp8 110 python3 benchmarks/user_step.py --world 8 --preset cpu16 --threads 2 --rounds 4 --warmup 1 \
      --budget-s 50 --out "$c"
  ;;
last)
  # The session's one call, in two lanes at once so it fits: lane A (cores 0-2) the GPU — the new MoE/ring
  # CUDA tests and DataParallel's, the compiled step's kernels beside the compiled plain model's, EP and CP
  # auto/fixed/none and DP's host cost at world size 1; lane B (cores 3-15) the gloo runs — the user's path at
  # tp 4 and one rank, EP and CP at 4 ranks, ZeRO-3 at 8, DP and PP at 4 beside their PyTorch peers. Every step
  # bounded; the lanes never share a core; results in $r/h200 and $r/cpu16 (no committed file overwritten).
  A=(env); B=(env)  # `timeout` runs a command, not a shell function: the pinning is a command prefix
  if command -v taskset > /dev/null; then A=(taskset -c 0-2); B=(taskset -c 3-15); fi
  g="$r/h200" c="$r/cpu16"; mkdir -p "$g" "$c"
  (
    step pytest_cuda 70 "${A[@]}" python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_moe_host_syncs_cuda.py \
        tests/gpu/test_grouped_experts_cuda.py tests/expert_parallel/test_moe_one_rank.py \
        tests/context_parallel/test_cp_cuda.py tests/gpu/test_nccl_data_parallel.py
    step compiled_profile 100 "${A[@]}" python3 benchmarks/compiled_step_profile.py --device cuda --layers 4 --out "$g"
    step ep_cuda_ws1 55 "${A[@]}" python3 benchmarks/ep_overlap.py --device cuda --world 1 --out "$g"
    step cp_cuda_ws1 45 "${A[@]}" python3 benchmarks/cp_overlap.py --device cuda --world 1 --rounds 6 --out "$g"
    step dp_host_cuda_ws1 45 "${A[@]}" python3 benchmarks/dp_host_cost.py --device cuda --world 1 --budget-s 12 --out "$g"
    step dp_cuda_ws1 60 "${A[@]}" python3 benchmarks/dp_overlap.py --device cuda --steps 30 --budget-s 15 --out "$g"
  ) > "$out/logs/lane_a.txt" 2>&1 &
  lane_a=$!
  step user_tp4 75 "${B[@]}" python3 benchmarks/user_step.py --world 4 --preset cpu16 --threads 3 --rounds 6 --warmup 1 \
      --budget-s 35 --out "$c"
  step ep_cpu_ws4 55 "${B[@]}" python3 benchmarks/ep_overlap.py --world 4 --threads 3 --out "$c"
  step cp_cpu_ws4 45 "${B[@]}" python3 benchmarks/cp_overlap.py --world 4 --threads 3 --out "$c"
  step fsdp_cpu_ws8 80 "${B[@]}" python3 benchmarks/fsdp_overlap.py --world 8 --threads 1 --variants fsdp2,1,2,auto \
      --budget-s 16 --steps 12 --warmup 1 --recorded 0 --out "$c"
  step dp_cpu_ws4 60 "${B[@]}" python3 benchmarks/dp_overlap.py --world 4 --threads 3 --budget-s 30 --steps 60 \
      --recorded 1 --out "$c"
  step pp_cpu_ws4 60 "${B[@]}" python3 benchmarks/pp_overlap.py --world 4 --threads 3 --schedules 1f1b,interleaved \
      --steps 40 --warmup 2 --recorded 1 --out "$c"
  step user_tiny 25 "${B[@]}" python3 benchmarks/user_step.py --world 1 --threads 2 --rounds 8 --budget-s 12 --out "$c"
  wait "$lane_a"; cat "$out/logs/lane_a.txt"
  ;;
last2)
  # What the first call's limits cut short: the user's path at tp 4 (fewer rounds), PP at 4 ranks (fewer
  # steps), the one-rank user's path and DP's host cost on the GPU (fixed: NCCL reduces device tensors only).
  A=(env); B=(env)
  if command -v taskset > /dev/null; then A=(taskset -c 0-2); B=(taskset -c 3-15); fi
  g="$r/h200" c="$r/cpu16"; mkdir -p "$g" "$c"
  (
    step user_tiny 45 "${A[@]}" python3 benchmarks/user_step.py --world 1 --threads 2 --rounds 6 --warmup 1 \
        --budget-s 10 --out "$c"
    step dp_host_cuda_ws1 45 "${A[@]}" python3 benchmarks/dp_host_cost.py --device cuda --world 1 --budget-s 10 --out "$g"
  ) > "$out/logs/lane_a.txt" 2>&1 &
  lane_a=$!
  step user_tp4 110 "${B[@]}" python3 benchmarks/user_step.py --world 4 --preset cpu16 --threads 3 --rounds 4 --warmup 1 \
      --budget-s 30 --out "$c"
  step pp_cpu_ws4 60 "${B[@]}" python3 benchmarks/pp_overlap.py --world 4 --threads 3 --schedules 1f1b,interleaved \
      --steps 16 --warmup 2 --recorded 1 --out "$c"
  wait "$lane_a"; cat "$out/logs/lane_a.txt"
  ;;
*) echo "unknown part $part"; exit 2 ;;
esac
tar czf "$out/$part.tgz" -C "$out" results logs && rm -rf "$out/results" "$out/logs"
