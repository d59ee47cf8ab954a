"""An overlapkit model under accelerate: its gradient buckets all-reduce behind backward, not DDP's.

accelerate wraps every model it prepares on several CPU processes in torch's DDP, which cannot
take DTensor parameters; on GPUs its own tensor parallelism (`ParallelismConfig(tp_size=)`)
expects a model sharded by transformers and leaves the data-parallel reduction to FSDP. Here
the model is wrapped by overlapkit's `DataParallel` on the dp dim of the job's mesh and handed
to accelerate marked as already prepared, after accelerate has applied what it still owns
(autocast for mixed precision, torch.compile). The accelerator is given a (dp_replicate, tp)
DeviceMesh that its data loaders read: each dp rank draws its own batches and every TP rank of a
dp rank the same ones, accelerate's own sharding rule for tensor parallelism.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..data_parallel import DataParallel
from ..runtime.groups import ParallelGroups
from ..tensor_parallel.params import is_parallelized


def check_layout(groups: ParallelGroups, world_size: int) -> None:
    """ValueError unless `groups` lays the whole world out as dp x tp (pp, cp and ep of 1)."""
    if not isinstance(groups, ParallelGroups):
        raise TypeError(f"expected the ParallelGroups of overlapkit.init(tp=, dp=), got {type(groups).__name__}")
    sizes = groups.sizes
    others = {d: getattr(sizes, d) for d in ("pp", "cp", "ep") if getattr(sizes, d) != 1}
    if others:
        raise ValueError(f"the Trainer/accelerate integration runs tp x dp; the groups also have {others} "
                         "(pipeline, context and expert parallelism need their own loop)")
    if sizes.world_size != world_size:
        raise ValueError(f"the groups lay out {sizes.world_size} ranks (tp={sizes.tp} x dp={sizes.dp}) but "
                         f"accelerate runs {world_size} processes")


def data_mesh(groups: ParallelGroups):
    """The (dp_replicate, tp) DeviceMesh whose dims are the groups' dp and tp groups.

    accelerate's `prepare_data_loader` reads these two names: ranks that share a dp coordinate
    get the same batches. The layout is overlapkit's (tp fastest), so rank // tp is the dp rank.
    """
    from torch.distributed.device_mesh import DeviceMesh

    sizes = groups.sizes
    layout = torch.arange(sizes.world_size).reshape(sizes.dp, sizes.tp)
    return DeviceMesh.from_group([groups.dp, groups.tp], groups.mesh.device_type, mesh=layout,
                                 mesh_dim_names=("dp_replicate", "tp"))


def use_data_mesh(accelerator, groups: ParallelGroups) -> None:
    """Make `accelerator`'s data loaders give each dp rank its own batches, the same on every TP rank."""
    check_layout(groups, accelerator.num_processes)
    if getattr(accelerator, "parallelism_config", None) is not None:
        raise ValueError("the Accelerator has a ParallelismConfig: accelerate would lay out and wrap the model "
                         "itself; build it without one and let overlapkit.init(tp=, dp=) lay out the ranks")
    mesh = accelerator.state.device_mesh
    if mesh is not None and tuple(mesh.mesh_dim_names) == ("dp_replicate", "tp") \
            and tuple(mesh.shape) == (groups.sizes.dp, groups.sizes.tp):
        return
    accelerator.state.device_mesh = data_mesh(groups)


def prepare_model(accelerator, model: nn.Module, groups: ParallelGroups, **data_parallel) -> DataParallel:
    """`DataParallel(model, groups.dp)` for accelerate: ready for `accelerator.prepare(model, optimizer,
    dataloader)`, which then hands it back as it is.

    accelerate's `prepare_model(..., evaluation_mode=True)` first gives the model what accelerate
    owns besides wrapping (autocast for mixed precision, torch.compile; never DDP), so the plain
    model evaluates under the same precision; the DataParallel around it is marked prepared. The
    accelerator's data loaders split by dp (`use_data_mesh`). `data_parallel` goes to
    DataParallel (bucket_mb=, overlap=, ...). Collective over the world (DataParallel copies
    rank 0's weights over dp).
    """
    if groups.sizes.tp > 1 and accelerator.step_scheduler_with_optimizer and not accelerator.split_batches:
        # accelerate steps a prepared scheduler once per process, counting TP ranks that share a batch.
        warnings.warn(f"a scheduler passed to accelerator.prepare steps {accelerator.num_processes} times per "
                      f"optimizer step (one per process) while {groups.sizes.dp} batches are drawn: build the "
                      "Accelerator with step_scheduler_with_optimizer=False and step it once per optimizer step",
                      stacklevel=2)
    return wrap_data_parallel(accelerator, model, groups, **data_parallel)


def wrap_data_parallel(accelerator, model: nn.Module, groups: ParallelGroups, **data_parallel) -> DataParallel:
    """What `prepare_model` does, for a caller that steps its scheduler itself (the Trainer)."""
    if not is_parallelized(model):
        raise ValueError(f"{type(model).__name__} has no DTensor parameter: parallelize it first "
                         "(overlapkit.parallelize(model, groups.mesh))")
    use_data_mesh(accelerator, groups)
    model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    wrapped = DataParallel(model, groups.dp, **data_parallel)
    wrapped._is_accelerate_prepared = True
    return wrapped
