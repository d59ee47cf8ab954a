"""The overlapkit names the benchmarks need that no package exports: the one place a script reaches
below `overlapkit`'s and its packages' `__init__`s.

Scripts take these from here (`from _lib.unexported import spawn`), never from the modules themselves,
so a module that moves breaks this table only, and each group below says which scripts use it. A name
its package's `__init__` comes to export leaves the table; tests/test_benchmarks_smoke.py fails on an
overlapkit import below the public names anywhere else in benchmarks/. No entry is an underscore name.
Names load on first use (PEP 562): a script pays only for the modules it asks for.
"""

from __future__ import annotations

import importlib

WHERE = {
    # Ranks: spawn and its failure type (every multi-rank script, through common.run_ranks;
    # calibrate_validation), a rank's progress line (fsdp_overlap, user_step), the teardown and a free
    # port (teardown_repeat).
    "spawn": "overlapkit.launch", "RankFailed": "overlapkit.launch", "progress": "overlapkit.launch",
    "shutdown": "overlapkit.launch", "free_port": "overlapkit.launch",
    # The communication layer the engines use (its spans carry a kind): tp_overlap, tp_host_cost,
    # profile_step, cp_overlap (the hop alone, the sends-joined ring), teardown_repeat.
    "comm": "overlapkit.runtime",
    # A transformers MoE model's experts over ep, driven by the MoE rows of user_step (_lib/hf_moe.py).
    # MoE decode as one or two micro-batches, and the serving steps read from the recorder (probes/moe_decode).
    "inference_micro_batches": "overlapkit.models.hf_experts", "by_kind": "overlapkit.timeline.serving",
    "recorded_steps": "overlapkit.timeline.serving",
    "expert_modules": "overlapkit.models.hf_experts", "run_local_experts": "overlapkit.models.hf_experts",
    # Cross-rank agreement timed by itself: agreement_cost, tp_agreement_cost.
    "Agreement": "overlapkit.runtime.agreement", "agree": "overlapkit.runtime.agreement",
    # The timeline's step measures and span arithmetic: dp_overlap, fsdp_overlap, ep_overlap, cp_overlap
    # (measure, load_imbalance), cp_waits and pp_zero_bubble (intervals), straggler_path (whatif),
    # profile_step (compare_spans).
    "measure": "overlapkit.timeline.report", "load_imbalance": "overlapkit.timeline.report",
    "intervals": "overlapkit.runtime", "whatif": "overlapkit.timeline",
    "compare_spans": "overlapkit.timeline.agree",
    # The pipelined TP kernels (tensor_parallel's docstring names them, its __init__ does not export
    # them): tp_overlap, profile_step.
    "all_gather_matmul": "overlapkit.tensor_parallel.pipelined",
    "matmul_reduce_scatter": "overlapkit.tensor_parallel.pipelined",
    # A module's parameters as replicated DTensors computing on local views: replicated_params_probe.
    "replicate_module": "overlapkit.tensor_parallel.replicated",
    # One chunk's expert GEMMs and the devices the grouped path runs on: ep_grouped_probe (GROUPED_DEVICES also
    # ep_host_cost, moe_vs_grouped_moe).
    "Groups": "overlapkit.expert_parallel.experts", "experts_forward": "overlapkit.expert_parallel.experts",
    "experts_backward": "overlapkit.expert_parallel.experts", "GROUPED_DEVICES": "overlapkit.expert_parallel.experts",
    # A chunk forward as split_backward's F runs it, beside the plain one: pp_step_cost.
    "LinearRouter": "overlapkit.pipeline_parallel.wgrad", "split_linears": "overlapkit.pipeline_parallel.wgrad",
    "WeightGradStore": "overlapkit.pipeline_parallel.wgrad",
    # The demo's rank body: teardown_repeat.
    "DemoConfig": "overlapkit.demos.gpt", "run_rank": "overlapkit.demos.gpt",
    # The calibrated cost model (what `overlapkit plan --calibrate` runs): calibrate_validation.
    "fit": "overlapkit.costmodel.calibrate", "predict_calibrated": "overlapkit.costmodel.calibrate",
    "terms": "overlapkit.costmodel.calibrate", "Measured": "overlapkit.costmodel.calibrate",
    "read_measured": "overlapkit.plan_tools",
    # The cost model's parts priced one by one against measurements: model_vs_measured, model_vs_published,
    # fsdp_overlap (prefetch_wall_ms), user_step (step_flops, from_hf_config).
    "prefetch_wall_ms": "overlapkit.costmodel.fsdp", "step_flops": "overlapkit.costmodel.flops",
    "from_hf_config": "overlapkit.costmodel.hf", "p2p_ms": "overlapkit.costmodel.step",
    "hardware": "overlapkit.costmodel", "POWER_LIMIT_CLOCK": "overlapkit.costmodel.hardware",
    "SUSTAINED_CLOCK": "overlapkit.costmodel.hardware",
    "FITTED_HIDDEN": "overlapkit.costmodel.calibration", "HELD_OUT_ATTENTION_TP": "overlapkit.costmodel.calibration",
    "add_probe": "overlapkit.costmodel.calibration", "fit_curves": "overlapkit.costmodel.calibration",
    "split_gemm": "overlapkit.costmodel.calibration", "with_add_probe": "overlapkit.costmodel.calibration",
    "bucket_sizes": "overlapkit.costmodel.overlap", "buckets_ms": "overlapkit.costmodel.overlap",
    # The plan command line as a function (model_vs_published: each source priced through what a user runs),
    # and the CP and MoE schedules priced alone (model_vs_measured --ep-cp).
    "parse_plan_args": "overlapkit.costmodel.cli", "plan_inputs": "overlapkit.costmodel.cli",
    "plan_json": "overlapkit.costmodel.cli", "cp_pass_ms": "overlapkit.costmodel.overlap",
    "layered_ms": "overlapkit.costmodel.overlap",
    "Site": "overlapkit.costmodel.planner", "layer_gemms": "overlapkit.costmodel.transformer",
    # The data-parallel guards timed by themselves: reliability_cost.
    "ParamWatch": "overlapkit.data_parallel.watch", "guard": "overlapkit.data_parallel.zero_guard",
    "release": "overlapkit.data_parallel.zero_guard",
    # The entry checks timed by themselves and switched off beside a step (the loss's check is
    # patched in its module): reliability_cost --entry (_lib/entry_cost.py).
    "check_inputs": "overlapkit.runtime.entry", "Progress": "overlapkit.data_parallel.progress",
    "DIGEST_EVERY": "overlapkit.data_parallel.progress", "vocab": "overlapkit.tensor_parallel",
    # bucket_mb="auto"'s candidate caps and fine-bucket size, which dp_overlap times fixed beside it
    # (and scales to KiB under --smoke): dp_overlap.
    "bucket_auto": "overlapkit.data_parallel",
}
"""name -> the module that defines it (a module's own name: the module itself, as a submodule of that package)."""

__all__ = list(WHERE)


def __getattr__(name: str):
    if name not in WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(WHERE[name])
    if hasattr(module, name):
        return getattr(module, name)
    return importlib.import_module(f"{WHERE[name]}.{name}")  # a submodule (comm, intervals, whatif, hardware)
