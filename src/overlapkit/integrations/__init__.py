"""Where users already train: Hugging Face Trainer (and TRL's trainers), accelerate, torchtitan,
each running overlapkit's engines so their communication hides behind computation.

Names load on first use (PEP 562): transformers, accelerate and torchtitan are imported only by
the integration asked for.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "OverlapTrainer": "hf_trainer", "OverlapTrainerMixin": "hf_trainer",
    "prepare_model": "accelerator", "use_data_mesh": "accelerator", "data_mesh": "accelerator",
    "save_training_state": "checkpoint", "load_training_state": "checkpoint",
    "OverlapReportCallback": "report", "overlap_metrics": "report",
    "OverlapSFTTrainer": "trl_sft", "install_vocab_parallel_head": "trl_sft",
    "parallelize_llama3": "torchtitan", "parallelize_transformer": "torchtitan", "with_overlapkit": "torchtitan",
}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'overlapkit.integrations' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
