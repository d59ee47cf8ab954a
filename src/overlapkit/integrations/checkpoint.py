"""A Trainer checkpoint's model and optimizer state as a DCP checkpoint, resumable at another tp x dp.

Nothing here overlaps anything. transformers' Trainer saves the optimizer with one
`torch.save` on rank 0, which would keep rank 0's shards only; here every rank writes its
shards of the model and of the optimizer state through torch.distributed.checkpoint (the
names are the plain model's, the tensors DTensors that record their placements), so a job
with another tp x dp layout reads the whole tensors back and keeps its own shards.
"""

from __future__ import annotations

import os

from torch import nn

DCP_FOLDER = "overlapkit_dcp"
"""The sub-folder of a checkpoint directory that holds the DCP checkpoint."""


def _plain_optimizer(optimizer):
    # accelerate wraps the optimizer (AcceleratedOptimizer); DCP's state-dict helpers need the
    # torch optimizer whose param_groups hold the model's parameters.
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def save_training_state(directory: str, model: nn.Module, optimizer) -> str:
    """Write `model` and `optimizer` state under `directory`/overlapkit_dcp (collective: every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, _plain_optimizer(optimizer))
    path = os.path.join(directory, DCP_FOLDER)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return path


def load_training_state(directory: str, model: nn.Module, optimizer) -> None:
    """Read what `save_training_state` wrote into `model` and `optimizer`, at this job's layout (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = os.path.join(directory, DCP_FOLDER)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{directory} holds no {DCP_FOLDER}/: it was not saved through overlapkit's "
                                "Trainer integration (its optimizer state would be rank 0's shards only)")
    optimizer = _plain_optimizer(optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
