#!/usr/bin/env bash
# Every measurement overlapkit makes on a device machine, one entry with parts:
#   bash benchmarks/device.sh PART [OUTDIR]        OUTDIR: $OUT where the device tool sets it, else /tmp/overlapkit_device
# PART
#   checks  doctor; the GPU tests (NCCL layers, CUDA graphs, the MoE and ring CUDA paths); the engines' CPU
#           tests under the image's torch (the code must run on 2.11 and 2.13)
#   h200    one GPU, world size 1: user_step (1.1 B, eager then compiled), tp_overlap (Llama-3 GEMMs at tp 8's
#           shapes), ep/cp/dp_overlap's fixed costs, the demo with its profiler trace and both pictures
#   cpu16   the 16 CPU cores, gloo (transfers really run beside compute): user_step at tp 4, tp 8, dp 2 x tp 2 and
#           one rank; dp_overlap, pp_overlap, ep_overlap, cp_overlap at 4 ranks; fsdp_overlap at 8
#   record  h200 and cpu16 in one call, in two lanes that never share a core (GPU lane on cores 0-2, gloo on 3-15)
#   compiled the compiled step, lanes as in record: one GPU at world size 1 (1.1 B, torch.compile's default mode and
#           reduce-overhead) beside compiled plain; the 16 cores at tp 4 (inductor on CPU) beside compiled PyTorch TP
#   users   the 16 cores: the user's path in its other shapes -- a transformers MoE at ep 4 and ep 2 x tp 2 beside
#           torchtitan-style EP, HF Llama in pipeline stages at pp 4 beside torch's schedules, the Trainer beside the
#           hand loop -- and the entry checks' share of a tp 4 step
#   serve   infer and calibrate1 in the GPU lane beside, on the other cores, infer's tp 2/4/8 and the fixed-cost
#           twins (ep 4 chunks="auto", ZeRO-3 auto at 8 ranks, PP 1F1B vs Schedule1F1B): one call's worth
#   final   in sequence: the GPU calibration alone on the machine, then on 16 cores our GPT's and HF Llama's
#           calibrations, repriceable here (FINAL_MODELS=gpt: ours alone, < 360 s; FINAL_MODELS=" ": the GPU alone)
#   short   next's first step of each lane (the GPU calibration, ZeRO-3 auto vs its twin), for under 300 s of device time
#   next    what the open issues still lack (GPU calibration, ZeRO-3 auto vs its twin and its probe, our GPT's calibrate16)
#   after   the two calibrations (GPU across micro-batches; the 13-core gloo job, GPT then HF Llama) in lanes (< 560 s)
#   closing serve's GPU lane beside, on the other cores, serving at tp 4 and the user's path at ep 4 and pp 4 (< 560 s)
#   infer1  infer_step on the GPU at world size 1 alone (the shortest call that measures issue 39's GPU row)
#   infer   serving: infer_step (generate()'s prefill tokens/s and decode ms/token, plain / DTensor TP / overlapkit)
#           on one GPU at world size 1 (batch 1, 8, 32; prompt 2048; 128 new tokens; CUDA graphs too) and on the
#           16 cores at tp 2, 4, 8, batch 8
#   multi   2, 4 or 8 GPUs of one host: the GPU tests over NCCL, tp_overlap at tp 2/4/8, dp_overlap (1 B GPT),
#           fsdp/ep/cp_overlap over every GPU, a TP x DP demo trace read by `overlapkit analyze`
#   gemm    this GPU's GEMM-efficiency curve for the cost model (`overlapkit bench gemm`)
#   probes  the probes' device runs (benchmarks/probes/): host cost per call, kernel and chunk profiles, the
#           LM-head and HBM probes, agreement cost, a straggler's path
#   calibrate16  the cost model calibrated on one traced layout of the 16 cores' gloo job and predicting four
#           others, each measured in the same call: overlapkit's GPT, then HF Llama through parallelize
#   calibrate1   the same on one GPU at world size 1, across micro-batch sizes
#   ab SCRIPT ARGS...   the source in OLD_SRC and this checkout's, alternated twice (old, new, old, new) in one
#           call, so a no-regression check compares like with like: e.g.
#           OLD_SRC=/tmp/old/src bash benchmarks/device.sh ab benchmarks/tp_overlap.py --device cuda --shape-tp 8 --layers-only
# Each step runs under its own time limit (`step`; a failing step is reported, never fatal), so a call always
# reaches its end; OUTDIR/PART.tgz holds results/<machine>/ (h200, cpu16, multi) and logs/ of every step finished
# so far (packed again after each). Results of the 16 cores are named *_cpu16_* as committed.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?"part: checks | h200 | cpu16 | users | users37 | infer | infer1 | serve | closing | next | short | final | after | record | compiled | multi | gemm | probes | calibrate16 | calibrate1 | ab SCRIPT ARGS..."}; shift
if [ "$part" = ab ]; then dest=${OUT:-/tmp/overlapkit_device}; else dest=${1:-${OUT:-/tmp/overlapkit_device}}; fi
# Results and logs are written in a work folder outside OUTDIR; OUTDIR only ever holds PART.tgz, packed again after
# every step, so a call cut at its limit (or a lane that runs long) still returns every step that finished.
out=$(mktemp -d /tmp/overlapkit_work.XXXXXX)
mkdir -p "$dest"

# NVLink multicast off (it can take a shared host's GPUs down); overlapkit from this checkout; the wheels of
# packages the GPU image may lack appended *after* the image's own site-packages, so the image's versions win.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  echo /tmp/site > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/zz_overlapkit_extra.pth"
fi
mkdir -p "$out/logs" "$out/results"
r="$out/results" g="$out/results/h200" c="$out/results/cpu16"
PIN=(env)  # a command prefix (`timeout` runs a command, not a shell function): taskset in the record lanes
TP=(env CUDA_DEVICE_MAX_CONNECTIONS=1)  # bulk TP overlap wants one hardware queue

# step NAME SECONDS COMMAND...: one measurement under its own limit, logged to $out/logs/NAME.log, its tail shown.
step() {
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T), limit ${limit}s)"
  timeout "$limit" "$@" > "$out/logs/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc"; tail -n 15 "$out/logs/$name.log"
  pack
}

# pack: what has finished so far into OUTDIR/PART.tgz, replaced whole (a temporary file, then a rename), one lane at
# a time. The scripts name a CPU result *_cpu_*; the committed 16-core tables are *_cpu16_*.
pack() {
  (
    command -v flock > /dev/null && flock 9
    if [ -d "$c" ]; then
      for f in "$c"/*_cpu_*; do [ -e "$f" ] && mv "$f" "$c/$(basename "$f" | sed 's/_cpu_/_cpu16_/')"; done
    fi
    tar czf "$dest/.$part.tgz.part" -C "$out" results logs && mv -f "$dest/.$part.tgz.part" "$dest/$part.tgz"
  ) 9> "$out/.pack.lock"
}

checks() {
  step doctor 60 python3 -m overlapkit doctor
  step pytest_gpu 200 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/context_parallel/test_cp_cuda.py \
      tests/expert_parallel/test_moe_one_rank.py
  step pytest_cpu_image_torch 300 python3 -m pytest -q -p no:cacheprovider tests/test_groups.py tests/test_agreement.py \
      tests/test_tuning.py tests/test_deprecations.py tests/tensor_parallel tests/pipeline_parallel tests/data_parallel
}

h200() {
  mkdir -p "$g"
  step user_smoke 40 "${PIN[@]}" python3 benchmarks/user_step.py --device cuda --world 1 --rounds 1 --warmup 1 \
      --out "$g/smoke"
  step user_eager 110 "${PIN[@]}" python3 benchmarks/user_step.py --device cuda --world 1 --preset 1b --out "$g"
  step user_compiled 280 "${PIN[@]}" python3 benchmarks/user_step.py --device cuda --world 1 --preset 1b --set compiled \
      --rounds 6 --variants plain_compiled,ok_none_compiled,ok_bulk_compiled,ok_pipelined_compiled,ok_auto_compiled \
      --out "$g"
  step tp_overlap 200 "${PIN[@]}" "${TP[@]}" python3 benchmarks/tp_overlap.py --device cuda --shape-tp 8 --out "$g"
  step ep_cuda_ws1 60 "${PIN[@]}" python3 benchmarks/ep_overlap.py --device cuda --world 1 --steps 6 --out "$g"
  step cp_cuda_ws1 60 "${PIN[@]}" python3 benchmarks/cp_overlap.py --device cuda --world 1 --rounds 6 --out "$g"
  step dp_cuda_ws1 60 "${PIN[@]}" python3 benchmarks/dp_overlap.py --device cuda --steps 30 --budget-s 15 --out "$g"
  step demo_cuda 90 "${PIN[@]}" "${TP[@]}" python3 -m overlapkit demo --tp 1 --dp 1 --device cuda --overlap auto \
      --plot "$g/demo_cuda_timeline.png" --trace "$out/demo_trace"
  step analyze_demo 60 "${PIN[@]}" python3 -m overlapkit analyze "$out/demo_trace/rank0.json" \
      --plot "$g/demo_cuda_trace.png"
  rm -rf "$out/demo_trace"
}

cpu16() {
  mkdir -p "$c"
  step user_tp4 110 "${PIN[@]}" python3 benchmarks/user_step.py --world 4 --preset cpu16 --threads 3 --rounds 6 \
      --warmup 1 --budget-s 35 --out "$c"
  step user_tp8 110 "${PIN[@]}" python3 benchmarks/user_step.py --world 8 --preset cpu16 --threads 2 --rounds 4 \
      --warmup 1 --budget-s 50 --out "$c"
  step user_dp2tp2 60 "${PIN[@]}" python3 benchmarks/user_step.py --world 4 --dp 2 --preset cpu16 --seq 256 \
      --threads 3 --rounds 6 --warmup 1 --budget-s 20 --out "$c"
  step user_tiny 30 "${PIN[@]}" python3 benchmarks/user_step.py --world 1 --threads 2 --rounds 8 --budget-s 12 --out "$c"
  step dp_ws4 95 "${PIN[@]}" python3 benchmarks/dp_overlap.py --world 4 --threads 3 --budget-s 60 --out "$c"
  pp_ws4
  step ep_ws4 60 "${PIN[@]}" python3 benchmarks/ep_overlap.py --world 4 --threads 3 --out "$c"
  step cp_ws4 45 "${PIN[@]}" python3 benchmarks/cp_overlap.py --world 4 --threads 3 --out "$c"
  step fsdp_ws8 90 "${PIN[@]}" python3 benchmarks/fsdp_overlap.py --world 8 --threads 1 --variants fsdp2,1,2,auto \
      --total-s 70 --budget-s 60 --steps 40 --warmup 1 --recorded 0 --out "$c"
}

users() {
  mkdir -p "$c"
  step moe_ep4 150 python3 benchmarks/user_step.py --moe --world 4 --ep 4 --preset cpu16 --threads 4 --out "$c"
  step moe_ep2tp2 150 python3 benchmarks/user_step.py --moe --world 4 --ep 2 --tp 2 --preset cpu16 --threads 4 --out "$c"
  step pp4 150 python3 benchmarks/user_step.py --pp --world 4 --threads 4 --preset cpu16 \
      --schedules 1f1b,interleaved-1f1b,zbv --out "$c"
  step trainer 150 python3 benchmarks/user_step.py --trainer --world 4 --tp 2 --dp 2 --preset cpu16 --threads 4 \
      --rounds 3 --warmup 2 --steps 6 --out "$c"
  step entry_tp4 100 env OVERLAPKIT_RANK_THREADS=4 python3 benchmarks/reliability_cost.py --entry --world 4 --hidden 1024 \
      --heads 16 --out "$c"
}

# next: what the open issues still lack, in two lanes, by priority (the call may be cut at its limit: every step
# that finished comes back). GPU lane: the GPU calibration after the host-queue model (each layout steps fused AdamW
# with clipping, as the model prices), the serving row at ws 1. gloo lane: ZeRO-3 auto vs its pinned twin with
# AdamW's foreach path in every variant (the single-tensor default let the variant first at each step count pay
# FakeTensor's propagation for the others: auto, ahead by its deciding steps, paid it every step), the twin probe
# likewise, then the 16 cores' calibration of our GPT (HF Llama's is in `calibrate16`).
next_gpu() {
  calibrate_cuda 170 40
  infer_gpu_row 200 3 plain,ok,ok_graphs
}
pp_ws4() {  # PP 1F1B and interleaved beside torch's schedules at pp 4
  step pp_ws4 90 "${PIN[@]}" python3 benchmarks/pp_overlap.py --world 4 --threads 3 --schedules 1f1b,interleaved \
      --steps 16 --warmup 2 --recorded 1 --out "$c"
}
fsdp_ws8_twin() {
  step fsdp_ws8 110 "${PIN[@]}" python3 benchmarks/fsdp_overlap.py --world 8 --threads 1 --variants fsdp2,1,2,auto \
      --total-s 95 --budget-s 70 --steps 40 --warmup 1 --recorded 0 --out "$c"
}
next_cpu() {
  mkdir -p "$c"
  fsdp_ws8_twin
  step fsdp_twin_phases 100 "${PIN[@]}" python3 benchmarks/probes/fsdp_twin_phases.py --world 8 --threads 1 \
      --rounds 16 --out "$c"
  step calibrate_cpu_gpt 250 "${PIN[@]}" python3 benchmarks/probes/calibrate_validation.py --device cpu --model gpt \
      --layout-limit 45 --out "$c"
}

# short: next's first step of each lane, for a call with under 300 s of device time left (the GPU calibration after
# the host-queue model, with AdamW; ZeRO-3 auto vs its twin at 8 ranks).
short_gpu() { calibrate_cuda 170 40; }
short_cpu() {
  mkdir -p "$c"
  fsdp_ws8_twin
}

# final: one call in sequence, no lanes, for issue 43 alone: the GPU calibration alone on the machine (the host's
# busy time was not flat beside the gloo lane in the two calls before, so the host-queue model has had no clean
# run), then on all 16 cores the calibration of our GPT and of HF Llama. Each result keeps what the trace reader
# gave every layout, so its rows can be priced again here as the model changes (`calibrate_validation.py --reprice`).
final() {
  calibrate_cuda 150 40
  mkdir -p "$c"
  local m
  for m in ${FINAL_MODELS:-gpt llama}; do
    step "calibrate_cpu_$m" 190 python3 benchmarks/probes/calibrate_validation.py --device cpu --model "$m" \
        --layout-limit 40 --out "$c"
  done
}

# users37: issue 37's two user steps still unmeasured, on all 16 cores, in under 260 s (MoE at ep 4; the HF Llama at
# pp 4 beside torch's schedules).
users37() {
  mkdir -p "$c"
  local t=${USERS_THREADS:-4}  # torch threads a rank: 4 on the whole 16 cores, 3 in the 13-core lane
  step moe_ep4 130 "${PIN[@]}" python3 benchmarks/user_step.py --moe --world 4 --ep 4 --preset cpu16 --threads "$t" \
      --out "$c"
  step pp4 120 "${PIN[@]}" python3 benchmarks/user_step.py --pp --world 4 --threads "$t" --preset cpu16 \
      --schedules 1f1b,interleaved-1f1b --steps 10 --warmup 2 --out "$c"
}

# Serving: generate()'s prefill and decode, plain / PyTorch's DTensor TP / overlapkit, on the GPU at world size 1
# (the fixed cost, CUDA graphs too) and on the 16 cores at tp 2, 4, 8 and batch 8; under 9 minutes in all.
# THREADS: torch threads a rank at tp 2/4/8 (the serve lane has 13 cores, so it passes fewer).
# The GPU's serving row (LIMIT ROUNDS [VARIANTS]) and the decode-graph tests (LIMIT): the parts below differ only in budget.
infer_gpu_row() {  # LIMIT ROUNDS [VARIANTS]
  mkdir -p "$g"
  step infer_gpu_ws1 "$1" "${PIN[@]}" python3 benchmarks/infer_step.py --device cuda --world 1 --preset 1b \
      --batch 1,8,32 --prompt 2048 --new 128 --rounds "$2" ${3:+--variants "$3"} --out "$g"
}
decode_graphs_tests() {
  step decode_graphs_gpu "$1" "${PIN[@]}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_graphs.py
}
infer_gpu() { decode_graphs_tests 60; infer_gpu_row 220 4; }
infer_cpu16() {
  mkdir -p "$c"
  local t2=${THREADS2:-8} t4=${THREADS4:-4} t8=${THREADS8:-2}
  step infer_tp2 90 "${PIN[@]}" python3 benchmarks/infer_step.py --world 2 --preset cpu16 --threads "$t2" --batch 8 \
      --prompt 512 --new 32 --rounds 2 --out "$c"
  step infer_tp4 90 "${PIN[@]}" python3 benchmarks/infer_step.py --world 4 --preset cpu16 --threads "$t4" --batch 8 \
      --prompt 512 --new 32 --rounds 2 --out "$c"
  step infer_tp8 100 "${PIN[@]}" python3 benchmarks/infer_step.py --world 8 --preset cpu16 --threads "$t8" --batch 8 \
      --prompt 512 --new 32 --rounds 2 --out "$c"
}
infer() { infer_gpu; infer_cpu16; }

# serve: the most one call holds, in two lanes as `record` runs them. GPU lane (cores 0-2): the decode-graph tests,
# infer_step at world size 1, the cost model calibrated across micro-batches. Gloo lane (cores 3-15, 13 cores):
# infer_step at tp 2/4/8, then the fixed-cost twins (MoE chunks="auto" vs its fixed twin at ep 4, ZeRO-3 auto vs
# its pinned twin at 8 ranks, PP 1F1B vs torch's Schedule1F1B at pp 4).
serve_gpu() { infer_gpu; calibrate1; }
closing_gpu() {  # by priority: a call cut short by the device time left keeps what ran first
  infer_gpu_row 170 2
  calibrate_cuda 120 35
  decode_graphs_tests 45
}
serve_cpu() {
  THREADS2=6 THREADS4=3 THREADS8=1 infer_cpu16
  step ep_ws4 60 "${PIN[@]}" python3 benchmarks/ep_overlap.py --world 4 --threads 3 --out "$c"
  fsdp_ws8_twin
  pp_ws4
}

multi() {
  local n tp m="$r/multi"
  mkdir -p "$m"
  n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  echo "GPUs: $n"
  nvidia-smi topo -m > "$out/logs/topology.txt" 2>&1
  step doctor 60 python3 -m overlapkit doctor
  step pytest_gpu 400 python3 -m pytest -q -p no:cacheprovider tests/gpu
  for tp in 2 4 8; do
    [ "$tp" -le "$n" ] || continue
    step "tp_overlap_tp$tp" 300 "${TP[@]}" python3 benchmarks/tp_overlap.py --device cuda --world "$tp" --out "$m"
  done
  step dp_overlap_1b 400 python3 benchmarks/dp_overlap.py --device cuda --preset cuda-1b --steps 20 --out "$m"
  step fsdp_overlap 300 python3 benchmarks/fsdp_overlap.py --device cuda --world "$n" --out "$m"
  step ep_overlap 200 python3 benchmarks/ep_overlap.py --device cuda --world "$n" --out "$m"
  step cp_overlap 300 python3 benchmarks/cp_overlap.py --device cuda --world "$n" --out "$m"
  if [ "$n" -ge 4 ]; then
    step demo_tp_dp 200 "${TP[@]}" python3 -m overlapkit demo --device cuda --tp 2 --dp $((n / 2)) \
        --overlap pipelined --plot "$m/demo_tp_dp_recorder.png" --trace "$out/traces"
    step analyze_tp_dp 120 python3 -m overlapkit analyze "$out"/traces/rank*.json --plot "$m/demo_tp_dp_trace.png" --json
    cp "$out/logs/analyze_tp_dp.log" "$m/demo_tp_dp_analyze.json"
    rm -rf "$out/traces"
  fi
}

probes() {
  mkdir -p "$g" "$c"
  step tp_host_cost 330 "${TP[@]}" python3 benchmarks/probes/tp_host_cost.py --device cuda --world 1 --shape-tp 8 \
      --reps 40 --out "$g"
  step tp_chunk_profile 60 python3 benchmarks/probes/tp_chunk_profile.py --device cuda --world 1 --shape-tp 8 --out "$g"
  step tp_step_gaps 90 python3 benchmarks/probes/tp_step_gaps.py --device cuda --world 1 --shape-tp 8 --out "$g"
  step compiled_step_profile 100 python3 benchmarks/probes/compiled_step_profile.py --device cuda --layers 4 --out "$g"
  step dp_host_cost 45 python3 benchmarks/probes/dp_host_cost.py --device cuda --world 1 --budget-s 12 --out "$g"
  step dp_overhead_probe 150 python3 benchmarks/probes/dp_overhead_probe.py --device cuda --out "$g"
  step ep_host_cost 45 python3 benchmarks/probes/ep_host_cost.py --device cuda --out "$g"
  step ep_profile 60 python3 benchmarks/probes/ep_profile.py --out "$g"
  step ep_grouped_probe 90 python3 benchmarks/probes/ep_grouped_probe.py --device cuda --out "$g"
  step cp_kernel_probe 120 python3 benchmarks/probes/cp_kernel_probe.py --out "$g"
  step lm_head_probe 60 python3 benchmarks/probes/lm_head_probe.py --device cuda --out "$g"
  step hbm_add_probe 60 python3 benchmarks/probes/hbm_add_probe.py --out "$g"
  step profile_step 90 python3 benchmarks/probes/profile_step.py --device cuda --out "$g"
  step pp_zero_bubble 60 python3 benchmarks/probes/pp_zero_bubble.py --world 4 --threads 4 --steps 20 --out "$c"
  step straggler 50 python3 benchmarks/probes/straggler_path.py --world 16 --straggler 5 --sleep-ms 30 --out "$c"
  step agreement_ws8 30 python3 benchmarks/probes/agreement_cost.py --world 8 --out "$c"
  step tp_agreement_ws4 40 python3 benchmarks/probes/tp_agreement_cost.py --world 4 --threads 2 --out "$c"
}

# closing: what one call holds once serve has run (under 560 s) -- the GPU lane as serve's (decode-graph
# tests, infer_step at world size 1, the GPU calibration); on the other 13 cores serving at tp 4 (the two-batch
# prefill beside the others), the user's path at ep 4 and pp 4, the ZeRO-3 twin probe.
closing_cpu() {
  mkdir -p "$c"
  step infer_tp4 120 "${PIN[@]}" python3 benchmarks/infer_step.py --world 4 --preset cpu16 --threads 3 --batch 8 \
      --prompt 512 --new 32 --rounds 2 --out "$c"
  step moe_ep4 140 "${PIN[@]}" python3 benchmarks/user_step.py --moe --world 4 --ep 4 --preset cpu16 --threads 3 \
      --out "$c"
  step pp4 150 "${PIN[@]}" python3 benchmarks/user_step.py --pp --world 4 --threads 3 --preset cpu16 \
      --schedules 1f1b,interleaved-1f1b --steps 12 --warmup 2 --out "$c"
  step fsdp_twin_phases 120 "${PIN[@]}" python3 benchmarks/probes/fsdp_twin_phases.py --world 8 --threads 1 \
      --rounds 30 --out "$c"
}

# Each layout in its own session under --layout-limit (a stalled one is killed and recorded as failed); the
# results are rewritten after every layout, so a step cut short keeps the rows it measured.
calibrate16() {
  mkdir -p "$c"
  step calibrate_cpu_gpt 280 python3 benchmarks/probes/calibrate_validation.py --device cpu --model gpt \
      --layout-limit 50 --out "$c"
  step calibrate_cpu_llama 280 python3 benchmarks/probes/calibrate_validation.py --device cpu --model llama \
      --layout-limit 50 --out "$c"
}

# after: the cost model's two calibrations once the launch-queue waits are set apart from the host's dispatch,
# in two lanes (under 560 s): the GPU across micro-batches, the 13 cores' gloo job (our GPT, then HF Llama).
after_gpu() { calibrate_cuda 200 40; }
after_cpu() {
  mkdir -p "$c"
  step calibrate_cpu_gpt 270 "${PIN[@]}" python3 benchmarks/probes/calibrate_validation.py --device cpu --model gpt \
      --layout-limit 50 --out "$c"
  step calibrate_cpu_llama 270 "${PIN[@]}" python3 benchmarks/probes/calibrate_validation.py --device cpu \
      --model llama --layout-limit 50 --out "$c"
}

calibrate_cuda() {  # LIMIT LAYOUT_LIMIT
  mkdir -p "$g"
  step calibrate_cuda "$1" "${PIN[@]}" python3 benchmarks/probes/calibrate_validation.py --device cuda \
      --layout-limit "$2" --out "$g"
}
calibrate1() { calibrate_cuda 270 70; }

# The compiled step beside the compiled plain model (one GPU, world size 1, as torch.compile's default and in
# CUDA graphs) and beside compiled PyTorch TP (the 16 cores at tp 4, inductor on CPU), in two lanes that never
# share a core, as `record` runs them.
compiled_gpu() {
  mkdir -p "$g"
  local v=plain_compiled,ok_none_compiled,ok_pipelined_compiled,ok_auto_compiled
  step user_compiled 280 "${PIN[@]}" python3 benchmarks/user_step.py --device cuda --world 1 --preset 1b --set compiled \
      --rounds 6 --variants "$v" --out "$g"
  step user_compiled_cudagraphs 280 "${PIN[@]}" python3 benchmarks/user_step.py --device cuda --world 1 --preset 1b \
      --set compiled --compile-mode reduce-overhead --rounds 6 --variants "$v" --out "$g"
}
compiled_cpu16() {
  mkdir -p "$c"
  step user_tp4_compiled 560 "${PIN[@]}" python3 benchmarks/user_step.py --world 4 --preset cpu16 --threads 3 \
      --set compiled --rounds 4 --warmup 1 --budget-s 60 \
      --variants torch_tp_compiled,ok_none_compiled,ok_pipelined_compiled,ok_auto_compiled --out "$c"
}

ab() {
  local script=${1:?"ab SCRIPT ARGS..."}; shift
  local name i; name=$(basename "$script" .py)
  for i in 1 2; do
    step "${name}_old$i" 300 env PYTHONPATH="${OLD_SRC:?OLD_SRC: the old src folder}" "${TP[@]}" python3 "$script" "$@" \
        --out "$r/old$i"
    step "${name}_new$i" 300 "${TP[@]}" python3 "$script" "$@" --out "$r/new$i"
  done
}

# lanes GPU_PART CPU_PART: both at once, on cores that never overlap (the GPU lane on 0-2, gloo on 3-15).
lanes() {
  local A=(env) B=(env) lane
  if command -v taskset > /dev/null; then A=(taskset -c 0-2) B=(taskset -c 3-15); fi
  ( PIN=("${A[@]}"); "$1" ) > "$out/logs/lane_gpu.txt" 2>&1 &
  lane=$!
  PIN=("${B[@]}"); "$2"
  wait "$lane"; cat "$out/logs/lane_gpu.txt"
}

case "$part" in
checks | h200 | cpu16 | users | users37 | infer | multi | probes | calibrate16 | calibrate1 | final) "$part" ;;
serve) lanes serve_gpu serve_cpu ;;
closing) lanes closing_gpu closing_cpu ;;
next) lanes next_gpu next_cpu ;;
short) lanes short_gpu short_cpu ;;
after) lanes after_gpu after_cpu ;;
infer1) infer_gpu_row 200 2 ;;
gemm) mkdir -p "$g"; step bench_gemm 240 python3 -m overlapkit bench gemm --out "$g/h200_measured.json" ;;
record) lanes h200 cpu16 ;;
compiled) lanes compiled_gpu compiled_cpu16 ;;
ab) ab "$@" ;;
*) echo "unknown part $part (checks | h200 | cpu16 | users | infer | infer1 | serve | closing | record | compiled | multi | gemm | probes | calibrate16 | calibrate1 | ab SCRIPT ARGS...)"; exit 2 ;;
esac
pack && rm -rf "$out"
