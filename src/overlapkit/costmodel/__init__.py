"""What overlap should hide: predicted compute, communication and exposed time of a step.

An analytic cost model (GEMM curves measured on H200, alpha-beta collectives) and a small
stream simulator predict, for a transformer on a cluster, how much of each collective the
GEMMs can hide, choose the TP overlap per GEMM, and say which switch to turn on next.

    from overlapkit.costmodel import plan, ParallelConfig, Overlap
    report = plan("llama3-70b", "h200-sxm", ParallelConfig(tp=8, dp=4, overlap=Overlap.all("auto")))
    report.to_dict()["step_time_s"]

    from overlapkit.costmodel import choose_tp_overlap
    choose_tp_overlap(8192, 8192, 1280, tp=8, dtype_bytes=2, hardware="h200-sxm")  # ('pipelined', 8)

    from overlapkit.costmodel import fsdp_prefetch_choice
    fsdp_prefetch_choice(5.0, 3.0, 1e8, 2e9)  # (1, 'depth 1: ...'): FSDP prefetch="auto"
"""

from ._validate import ConfigError
from .advice import Recommendation, plan, recommend
from .collectives import Collectives, Group, NcclTable, parse_nccl_tests
from .fsdp import fsdp_prefetch_choice
from .hardware import PRESETS, Hardware, Link, load_hardware, preset
from .planner import choose_tp_overlap, plan_site
from .step import StepReport, predict
from .transformer import MODEL_PRESETS, ModelConfig, Overlap, ParallelConfig, load_model

__all__ = [
    "ConfigError", "fsdp_prefetch_choice", "Recommendation", "plan", "recommend", "Collectives", "Group", "NcclTable",
    "parse_nccl_tests", "PRESETS", "Hardware", "Link", "load_hardware", "preset", "choose_tp_overlap",
    "plan_site", "StepReport", "predict", "MODEL_PRESETS", "ModelConfig", "Overlap", "ParallelConfig",
    "load_model",
]
