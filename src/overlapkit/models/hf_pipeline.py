"""`pipeline(model, mesh)`: a Hugging Face causal LM trained in pipeline stages cut from its
`base_model_pp_plan`, each stage's sends and receives hidden under other micro-batches' compute
(every schedule of `pipeline_parallel`), with tensor parallelism inside each stage and data
parallelism across stage replicas when the mesh has those dims.

The loss is the model's own `labels=` loss (`model.loss_function`: shifted by one, the mean over
the tokens whose label is not -100), computed per micro-batch as its sum over the whole step's
count of such tokens, so that the step's loss and gradients are those of the whole batch in one
process whatever the micro-batches hold.
"""

from __future__ import annotations

from torch import nn

from ..data_parallel import DataParallel
from ..pipeline_parallel import PipelineConfig, PipelineEngine, chunks_of, placement
from ..pipeline_parallel.stages import StageLayout, balanced_counts, split_layers
from ..runtime import comm
from ..runtime.comm import group_rank, group_size
from ..runtime.groups import ParallelGroups, group_timeout_s, resolve_group
from .hf_ring_attention import dim_size
from .hf_stages import HFStage, StepShape, check_cut_matches, pp_parts

BALANCES = ("even", "cost")
"""How layers are spread over the chunks: an even count, or the cost model's per-layer and head times."""


class HFPipeline(nn.Module):
    """This pipeline rank's part of a causal LM: its chunks, the engine that runs them, and `step`.

    Holds the model's modules under the model's own names ("model.layers.3.mlp..."), only those of
    this rank's chunks, so `parameters()`, `named_parameters()`, `state_dict()` and `zero_grad()`
    are this rank's share. Train with `loss = pipe.step(input_ids, labels)`, then the optimizer.
    """

    def __init__(self, model: nn.Module, stages: list[nn.Module], group, config: PipelineConfig, layout: StageLayout,
                 shape: StepShape) -> None:
        super().__init__()
        self.config, self.layout = model.config, layout
        self.shape, self.loss_function, self._m = shape, model.loss_function, config.microbatches
        """`shape`: the step's sequence length every chunk reads (set by `step`; set it by hand to run the
        chunks under another schedule). `loss_function`: the model's labels= loss (vocabulary-parallel
        under tensor parallelism)."""
        parts = stages[0].module.parts if isinstance(stages[0], DataParallel) else stages[0].parts
        self.add_module(parts.prefix, getattr(model, parts.prefix))
        if any(_stage(s).last for s in stages):
            self.add_module(parts.head, getattr(model, parts.head))
        self.__dict__["stages"] = list(stages)  # not children: their modules are this one's already
        self._num_items = 0
        self._tied = None
        self.engine = PipelineEngine(stages, group, config, self._loss)
        """The engine running this rank's chunks (its `timings` under a timeline recorder)."""

    @property
    def chunks(self) -> list[nn.Module]:
        """This rank's chunks in local order (HFStage, or DataParallel around one)."""
        return self.__dict__["stages"]

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline runs forward and backward together: call pipe.step(input_ids, labels), "
                           "which returns the loss with the gradients already in .grad")

    def step(self, input_ids, labels=None):
        """Forward and backward of every micro-batch of `input_ids` [batch, seq] (the same batch on every
        rank of the pipeline); returns the model's `labels=` loss of the whole batch (on every pipeline
        rank). `labels` default to `input_ids` (the model shifts them); -100 marks a token not scored."""
        labels = input_ids if labels is None else labels
        if tuple(labels.shape) != tuple(input_ids.shape):
            raise ValueError(f"pipeline step: labels {tuple(labels.shape)} and input_ids {tuple(input_ids.shape)} "
                             "differ in shape")
        # The model's loss scores token t by label t+1: every row's last label scores nothing.
        self._num_items = int((labels[..., 1:] != -100).sum())
        self.shape.seq_len = int(input_ids.shape[1])
        try:
            loss = self.engine.step(input_ids, labels)
        finally:
            self.shape.seq_len = 0
        if self._tied is not None:
            grad = self._tied[0].grad
            grad = grad.to_local() if hasattr(grad, "to_local") else grad
            comm.all_reduce(grad, self._tied[1], kind="pp_send", name="tied embedding grad", async_op=False)
        return loss

    def tie_over(self, weight, group) -> None:
        """Sum `weight`'s gradient over `group` after every step: the input embeddings' weight that the
        head shares, held by the first and the last pipeline rank."""
        self._tied = (weight, group)

    def _loss(self, logits, labels):
        # This micro-batch's token losses summed over the step's count; the engine divides by m.
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                             num_items_in_batch=self._num_items)
        return loss * self._m


def _stage(chunk):
    return chunk.module if isinstance(chunk, DataParallel) else chunk


def _dim(mesh, name: str):
    """(group, size) of a mesh dim; (None, 1) when the mesh lacks it (a bare ProcessGroup is the pp group)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, (ParallelGroups, DeviceMesh)):
        size = dim_size(mesh, name)
        return (resolve_group(mesh, name) if size > 1 or name == "pp" else None), size
    if name == "pp":
        group = resolve_group(mesh, "pp")
        return group, group_size(group)
    return None, 1


def pipeline(model: nn.Module, mesh, *, schedule: str = "1f1b", microbatches: int = 4, virtual_stages: int | None = None,
             balance: str = "even", layer_counts=None, check: bool = True, **engine_options) -> HFPipeline:
    """Cut a transformers causal LM into pipeline stages from its `base_model_pp_plan`; return this rank's
    `HFPipeline`.

    `mesh`: a ParallelGroups (overlapkit.init(pp=, dp=, tp=)) or a DeviceMesh with a "pp" dim, or a
    pipeline ProcessGroup. With a "tp" dim of size > 1 the model is parallelized on it first (unless
    it already is); with a "dp" dim of size > 1 each chunk is wrapped in DataParallel over it.
    `schedule`: any of pipeline_parallel.SCHEDULES; `virtual_stages` defaults to 2 for the interleaved
    and V schedules. `balance`: "even" layer counts, or "cost" (the cost model's per-layer time against
    the embeddings' and the head's); `layer_counts` gives them by hand. `check`: run the whole model and
    the cut once on a small probe and refuse a model whose forward the cut does not reproduce.
    Other keywords go to PipelineConfig (overlap_p2p, split_backward, costs, ...).
    Collective over the whole mesh.
    """
    pp_group, pp = _dim(mesh, "pp")
    dp_group, dp = _dim(mesh, "dp")
    tp_group, tp = _dim(mesh, "tp")
    if _dim(mesh, "cp")[1] > 1:
        raise ValueError("pipeline: the mesh has a cp dim of size > 1; pipeline stages with context parallelism "
                         "inside are not supported (use cp without pp, or pp without cp)")
    if balance not in BALANCES:
        raise ValueError(f"pipeline: balance={balance!r} is not one of {BALANCES}")
    v = virtual_stages if virtual_stages is not None else (1 if schedule in ("gpipe", "1f1b", "zb1p") else 2)
    config = PipelineConfig(schedule=schedule, microbatches=microbatches, virtual_stages=v,
                            broadcast_loss=engine_options.pop("broadcast_loss", True), **engine_options)
    parts = pp_parts(model)
    if tp > 1 and not any(hasattr(p, "device_mesh") for p in model.parameters()):
        from .parallelize import parallelize
        parallelize(model, mesh)
    style = placement(schedule)
    n_chunks = pp * v
    n_layers = len(getattr(getattr(model, parts.prefix), parts.layers))
    if layer_counts is None and balance == "cost":
        layer_ms, head_ms = layer_and_head_ms(model, tp)
        layer_counts = balanced_counts(n_layers, n_chunks, layer_ms, 0.0, head_ms)
    counts = split_layers(n_layers, pp, v, layer_counts)
    layout = StageLayout(pp=pp, virtual_stages=v, counts=counts, first_extra=" + ".join(parts.before),
                         last_extra=" + ".join((*parts.after, parts.head)), style=style)
    tied, tied_group = _tied_ends(model, parts, layout, mesh, pp_group)
    shape = StepShape()
    stages = [HFStage(model, parts, layout.layers_of(c), c == 0, c == n_chunks - 1, shape) for c in range(n_chunks)]
    if check:
        check_cut_matches(model, stages, shape, tokens=4 * tp * 2)
    rank = group_rank(pp_group)
    mine = []
    for c in chunks_of(rank, pp, v, style):
        stage = stages[c]
        stage.pipeline_chunk = c
        mine.append(DataParallel(stage, dp_group) if dp > 1 else stage)
    _prune(model, parts, [_stage(c) for c in mine])
    pipe = HFPipeline(model, mine, pp_group, config, layout, shape)
    if tied_group is not None:
        pipe.tie_over(tied, tied_group)
    return pipe


def _prune(model: nn.Module, parts, held: list[HFStage]) -> None:
    """Drop from the model what no chunk of this rank holds, so that its memory is freed."""
    base = getattr(model, parts.prefix)
    keep = {i for s in held for i in s._layer_ids}
    layers = getattr(base, parts.layers)
    setattr(base, parts.layers, nn.ModuleDict({str(i): layers[i] for i in range(len(layers)) if i in keep}))
    if not any(s.first for s in held):
        for name in parts.before:
            setattr(base, name, None)
    if not any(s.last for s in held):
        for name in parts.after:
            setattr(base, name, None)
        setattr(model, parts.head, None)


def _tied_ends(model: nn.Module, parts, layout: StageLayout, mesh, pp_group):
    """(the tied parameter, the group of the two pipeline ranks holding the embeddings and the head) when
    the head shares the input embeddings' weight and the two ends sit on different ranks; else (None, None).

    Each end computes only its use's gradient; summing them over the two ranks gives both copies the
    whole gradient, so they stay equal under any optimizer (Megatron's embedding group). Collective over
    the world: every rank creates every pipeline's pair, in the same order."""
    import datetime

    import torch.distributed as dist

    head = getattr(model, parts.head)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(head, "weight", None)
    if emb is None or weight is None or weight is not getattr(emb, "weight", None):
        return None, None
    first, last = layout.rank_of(0), layout.rank_of(layout.n_chunks - 1)
    if first == last:
        return None, None
    timeout = datetime.timedelta(seconds=group_timeout_s(pp_group))
    mine = None
    for ranks in _pipelines(mesh, pp_group):
        pair = dist.new_group([ranks[first], ranks[last]], timeout=timeout)
        if dist.get_rank() in (ranks[first], ranks[last]):
            mine = pair
    return weight, mine


def _pipelines(mesh, pp_group) -> list[list[int]]:
    """The global ranks of every pipeline of the mesh, each in pipeline order."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    device_mesh = mesh.mesh if isinstance(mesh, ParallelGroups) else mesh
    if isinstance(device_mesh, DeviceMesh):
        names = tuple(device_mesh.mesh_dim_names or ())
        t = device_mesh.mesh.movedim(names.index("pp"), -1)
        return t.reshape(-1, t.shape[-1]).tolist()
    return [dist.get_process_group_ranks(pp_group)]


def layer_and_head_ms(model: nn.Module, tp: int, seq_len: int = 4096) -> tuple[float, float]:
    """(one decoder layer's, the head and loss's) forward + backward time as the cost model predicts them."""
    from ..costmodel.hardware import load_hardware
    from ..costmodel.hf import from_hf_config
    from ..costmodel.parallel import ParallelConfig
    from ..costmodel.step import predict

    report = predict(from_hf_config(model.config.to_dict(), seq_len=seq_len),
                     ParallelConfig(tp=tp, micro_batch=1, global_batch=1), load_hardware("h100-sxm"))
    return (report.layer_fwd.wall_ms + report.layer_bwd.wall_ms, report.head_fwd.wall_ms + report.head_bwd.wall_ms)
