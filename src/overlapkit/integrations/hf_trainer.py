"""Hugging Face `Trainer` (and TRL's trainers, which are Trainers) on an overlapkit model: the
gradient all-reduce hidden behind backward by overlapkit's buckets, the TP collectives behind
the GEMMs, and the overlap report logged beside the loss.

Why a small subclass (a mixin): the Trainer decides how a model is wrapped in `_wrap_model`
and `_prepare_for_training`, and accelerate wraps what it prepares in DDP (which cannot take
DTensor parameters) unless the model is sharded by transformers itself. No argument or
callback reaches that decision, and accelerate's `ParallelismConfig` is refused on CPU and
leaves the data-parallel reduction to FSDP. So the mixin overrides the few places that know
the model's layout, and leaves the loop — gradient accumulation, clipping, mixed precision,
the scheduler, logging, evaluation — to the Trainer:

- wrapping: `DataParallel(model, groups.dp)` (integrations/accelerator.py), never DDP;
- data: accelerate's loaders read a (dp_replicate, tp) mesh: each dp rank its own batches, every
  TP rank of a dp rank the same ones; `get_tp_size` tells the Trainer's token count the TP size;
- evaluation: predictions are gathered over dp only (TP ranks hold copies), logits made whole;
- checkpoints: model and optimizer through DCP (integrations/checkpoint.py), resumable at another
  tp x dp; `save_model` writes the whole tensors a plain `from_pretrained` loads;
- logs: exposed communication per kind from the recorded step before each log (report.py).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from transformers import Trainer

from ..runtime.groups import ParallelGroups
from ..tensor_parallel.params import is_parallelized
from .accelerator import check_layout, use_data_mesh, wrap_data_parallel
from .checkpoint import DCP_FOLDER, load_training_state, save_training_state
from .report import OverlapReportCallback

SCHEDULER_NAME = "scheduler.pt"
TRAINING_ARGS_NAME = "training_args.bin"


def _whole(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def gather_over(group, data):
    """All-gather every tensor of a nested structure over `group`, concatenated on dim 0 (scalars stacked)."""
    if isinstance(data, (list, tuple)):
        return type(data)(gather_over(group, d) for d in data)
    if isinstance(data, dict):
        return type(data)({k: gather_over(group, v) for k, v in data.items()})
    if not isinstance(data, torch.Tensor):
        return data
    data = _whole(data).contiguous()
    parts = [torch.empty_like(data) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, data, group=group)
    return torch.cat(parts) if data.dim() else torch.stack(parts)


class OverlapTrainerMixin:
    """Put before a `Trainer` class: `class MySFT(OverlapTrainerMixin, SFTTrainer)`.

    `groups`: what `overlapkit.init(tp=, dp=)` returned, over the whole world, the model already
    `overlapkit.parallelize`d on `groups.mesh`. `data_parallel`: keywords for overlapkit's
    DataParallel (bucket_mb=, overlap=, ...). `overlap_report_every`: record one optimizer step
    in this many for the logged overlap report (None: the step before each log; 0: never).
    """

    def __init__(self, *args, groups: ParallelGroups, data_parallel: dict | None = None,
                 overlap_report_every: int | None = None, **kwargs) -> None:
        check_layout(groups, groups.sizes.world_size)
        self.overlap_groups = groups
        self._data_parallel = dict(data_parallel or {})
        self._wrapped = None
        self.overlap_report = None if overlap_report_every == 0 else OverlapReportCallback(overlap_report_every)
        super().__init__(*args, **kwargs)
        if not is_parallelized(self.model):
            raise ValueError(f"{type(self).__name__}: {type(self.model).__name__} has no DTensor parameter: call "
                             "overlapkit.parallelize(model, groups.mesh) before building the trainer")
        if self.overlap_report is not None:
            self.add_callback(self.overlap_report)

    # -- layout ------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        use_data_mesh(self.accelerator, self.overlap_groups)
        # Evaluation gathers over dp: the TP ranks of a dp rank hold the same predictions.
        self.gather_function = self._gather_for_metrics

    def get_tp_size(self) -> int:
        """The TP size: the Trainer divides its all-rank token count by it (TP ranks share a batch)."""
        return self.overlap_groups.sizes.tp

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if not training:
            return model
        if self._wrapped is None:
            self._wrapped = wrap_data_parallel(self.accelerator, self.model, self.overlap_groups, **self._data_parallel)
        return self._wrapped

    # -- evaluation --------------------------------------------------------------------------
    def _gather_for_metrics(self, data, use_gather_object: bool = False):
        data = gather_over(self.overlap_groups.dp, data)
        state = self.accelerator.gradient_state
        # accelerate's rule: the last batch was padded with samples from the start; keep the real ones.
        if state.end_of_dataloader and state.remainder > 0:
            def cut(t):
                return t[:state.remainder] if isinstance(t, torch.Tensor) and t.dim() else t
            if isinstance(data, (list, tuple)):
                return type(data)(cut(d) for d in data)
            return cut(data)
        return data

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if isinstance(logits, (list, tuple)):
            logits = type(logits)(_whole(t) for t in logits)
        return loss, _whole(logits), labels

    # -- checkpoints -------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the whole model (every shard gathered; collective), loadable by a plain `from_pretrained`."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.model.save_pretrained(output_dir)  # parallelize() made it gather, rank 0 write, all wait
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_training_state(output_dir, self.model_wrapped, self.optimizer)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # The weights come back with the optimizer state (one DCP read) once the model is wrapped.
        if not os.path.isdir(os.path.join(resume_from_checkpoint, DCP_FOLDER)):
            raise FileNotFoundError(f"{resume_from_checkpoint} holds no {DCP_FOLDER}/: not a checkpoint of "
                                    f"{type(self).__name__}")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        load_training_state(checkpoint, self.model_wrapped, self.optimizer)
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    # -- logs --------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self.overlap_report is not None and "loss" in logs:
            logs = {**logs, **self.overlap_report.pop_metrics()}
        super().log(logs, *args, **kwargs)


class OverlapTrainer(OverlapTrainerMixin, Trainer):
    """`transformers.Trainer` on an overlapkit model: `OverlapTrainer(model=, args=, groups=, ...)`."""
