"""What each published source used that its cases leave open, with the reason: the one place
benchmarks/model_vs_published.py takes its per-source settings from (printed under its table)."""

SOURCE_SETTINGS = {
    "Narayanan21-T1": dict(
        settings=dict(dtype="fp16", attention="unfused", pp_scatter_gather=True, grad_bytes=2),
        per_case={**{c: dict(grad_accumulation="autograd") for c in ("1.7B", "3.6B", "7.5B", "18B")},
                  **{c: dict(grad_accumulation="hook") for c in ("39B", "76B", "145B", "310B", "530B", "1T")}},
        why="Megatron-LM of April 2021 (examples/sc21 CONFIG.sh: --fp16): attention materialized the scores "
            "(FusedScaleMaskSoftmax + dropout; flash attention came in 2022), pipeline sends used its "
            "scatter-gather optimization (on by default), and gradients were all-reduced in fp16: CONFIG.sh "
            "does not pass --accumulate-allreduce-grads-in-fp32, and without it Megatron's local DDP buffers "
            "take the parameter dtype (_get_buffer_type), as torch DDP does. run_table_1.sh runs 1.7B-18B with "
            "--DDP-impl torch (autograd accumulates micro-batch gradients in param.grad) and 39B-1T with local, "
            "whose backward hook adds every micro-batch's gradient into the buffer (main_grad.add_(grad): "
            "grad_accumulation=hook)."),
    "MegatronLM-README-H100": dict(
        settings=dict(grad_bytes=2, dp_in_drain=True), megatron_buckets=True, interleave=2,
        why="Megatron-Core r0.8 with --overlap-grad-reduce: each stage (each model chunk, interleaved) reduces "
            "when its last backward ends, inside the pipeline drain; DDP buckets of max(40M, 1M x dp) elements "
            "(distributed_data_parallel.py); flash attention (TE); micro-batch gradients accumulate inside the wgrad GEMM (gradient_accumulation_fusion, on unless --no-gradient-accumulation-fusion). Gradients reduced in bf16, although r0.8's "
            "arguments.py forces fp32 for bf16 runs: under fp32 the 32B row (TP8 DP48, 4 micro-batches) must move "
            "0.52 s of reduce-scatter + all-gather over 400 Gb/s per GPU with at most one micro-batch (~0.2 s) to "
            "hide it, more than its whole published step leaves beside three micro-batches of compute (fp32 "
            "results are printed beside). Interleaved with 2 virtual stages where the layers per stage divide "
            "(70B, 177B, 314B; 119B and 462B have 23 and 7): the strong-scaling 4608-GPU endpoint keeps 42% MFU "
            "at 12 micro-batches over 6 stages, which the 1F1B bubble (5/17 of the step) rules out."),
    "MegatronLM-README-H100-strong": dict(
        settings=dict(grad_bytes=2, dp_in_drain=True), megatron_buckets=True, interleave=2,
        why="the same Megatron-Core run as the weak-scaling table."),
    "Llama3-T4": dict(
        settings=dict(grad_bytes=4, dp_in_drain=True, first_stage_layers=7, last_stage_layers=7, vpp=2),
        model=dict(num_layers=126),
        why="the paper: 126 layers, one fewer on the first and the last stage (7 + 14x8 + 7), gradients "
            "reduce-scattered in fp32, DP communication overlapped with the pipeline, an interleaved schedule "
            "whose depth it does not give (vpp=2 here: the smallest interleaving)."),
    "MT-NLG-530B": dict(
        settings=dict(dtype="bf16", attention="unfused", pp_scatter_gather=True, grad_accumulation="autograd"),
        why="DeepSpeed pipeline engine + Megatron TP of 2021: bf16 mixed precision (the paper's Sec. 2.3, "
            "'mixed precision using 16-bit bfloat'; the BigScience notes on it say the same), unfused attention, "
            "activations partitioned over the TP ranks for the pipeline send (PipelineEngine is_pipe_partitioned), "
            "gradients in param.grad, accumulated by autograd over the micro-batches and reduced in the parameter "
            "dtype by ZeRO-1 at the step's end."),
    "Korthikanti22-T5": dict(
        settings=dict(dtype="bf16", attention="unfused", pp_scatter_gather=True),
        why="Megatron-LM of 2022 (the held-out set: korthikanti22.json): attention materialized the scores "
            "(FusedScaleMaskSoftmax + dropout), the TP backward collectives ran beside the weight-gradient GEMM "
            "(the async all-reduce, and under sequence parallelism the overlapped all-gather and reduce-scatter of "
            "LinearWithGradAccumulationAndAsyncCommunication: overlap tp=bulk in the cases), pipeline sends split "
            "over the TP ranks, micro-batch gradients accumulated in the wgrad GEMM; dp 1, so no gradient reduction."),
    "torchtitan-perf": dict(
        settings=dict(recompute="op", grad_bytes=4, zero3_prefetch=1, zero3_wrap=1, attention="flash2"),
        hardware="h100-sxm-500w",
        why="torchtitan Dec 2024: Grand Teton H100 at 500 W with HBM2e, per-op selective AC (every other "
            "matmul recomputed), FSDP2 with fp32 reduce dtype, one FSDP unit per block and its implicit "
            "one-ahead prefetch, PyTorch SDPA's flash backend (FlashAttention-2 kernels); 'eager' rows "
            "without torch.compile."),
}
