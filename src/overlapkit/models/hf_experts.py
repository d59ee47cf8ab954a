"""A transformers MoE model's experts split over the expert-parallel ranks, from its own `base_model_ep_plan`: the tokens' all-to-alls hidden behind other chunks' expert GEMMs.

Every module the plan marks "ep_dispatch_experts" (`layers.*.mlp.experts`: stacked `gate_up_proj` /
`down_proj` [num_experts, ...], and their biases where the family has them) keeps its place, its
parameter names and its own arithmetic; what changes:

- its stacked parameters become DTensors `Shard(0)` on a 1-D "ep" mesh: each rank holds
  num_experts / ep whole experts, and DCP, `full_tensor()` and `save_pretrained` see the whole;
- its forward (called by the model's MoE block with the model's own router choices, top-k weights
  and normalisation, so the router and its aux loss are untouched) sends every (token, choice) row
  to the rank holding its expert through overlapkit's chunked dispatch/combine
  (expert_parallel/routed.py, `chunks="auto"`), and runs the module's own forward there on its local
  experts (each row once, with weight 1: the same arithmetic, whichever experts implementation the
  config picks). The routing weights are applied after the combine, in a fixed order.

The EP group is the one `overlapkit.init(ep=...)` carved out of dp (ranks holding different tokens),
found from the mesh handed to `parallelize`. Each expert's gradient then holds the contributions of
every token of its EP group; `DataParallel` (data_parallel/expert_grads.py) or
`expert_parallel.average_data_parallel_grads` finishes the data-parallel average over each expert's copies.
"""

from __future__ import annotations

from fnmatch import fnmatch

import torch
from torch import nn

from ..expert_parallel.routed import DispatchCombine
from ..expert_parallel.two_batch import MicroBatchWorker, TwoBatch, split_sequences
from ..runtime.agreement import agree
from ..runtime.groups import expert_group_of
from ..tensor_parallel.mappings import copy_to_tp
from ..tensor_parallel.region import split_here

EP_DISPATCH = "ep_dispatch_experts"
"""The transformers ep_plan style of a module whose tokens are dispatched to its experts."""
EXPERTS_STYLES = (EP_DISPATCH, "moe_tp_experts")
"""The styles transformers releases give that module in their ep_plan (5.25: ep_dispatch_experts; 5.17:
moe_tp_experts, also in its tp_plan, where it shards each expert's GEMMs over TP)."""
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Config fields that hold a family's number of routed experts (the first one that matches is named in errors)."""


def hf_ep_plan(model: nn.Module) -> dict[str, str]:
    """The model's own expert-parallel plan, module/parameter path -> transformers style ({} when it has none)."""
    plan = getattr(model, "ep_plan", None)
    if plan is None:
        config = getattr(model, "config", None)
        base = getattr(config, "base_model_ep_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
        plan = {prefix + k: v for k, v in base.items()}
    return dict(plan or {})


def _matches(pattern: str, path: str) -> bool:
    tokens, parts = pattern.split("."), path.split(".")
    return len(tokens) == len(parts) and all(fnmatch(p, t) for p, t in zip(parts, tokens))


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Path -> module of every experts module the model's ep_plan dispatches tokens to."""
    patterns = [k for k, v in hf_ep_plan(model).items() if v in EXPERTS_STYLES]
    return {path: m for path, m in model.named_modules() if path and any(_matches(p, path) for p in patterns)}


def _count_field(model: nn.Module, n: int) -> str:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    aliases = getattr(text, "attribute_map", {}) or {}
    for name in EXPERT_COUNT_FIELDS:
        if getattr(text, name, None) == n:
            return f"{type(text).__name__}.{aliases.get(name, name)}"
    return f"{type(model).__name__} experts.num_experts"


def shard_experts(model: nn.Module, mesh, *, chunks: int | str = "auto") -> dict[str, nn.Module]:
    """Split the experts of `model` over the expert-parallel group that came with `mesh`; return them by path.

    `mesh`: what `parallelize` was given (a ParallelGroups, or the DeviceMesh `overlapkit.init` built).
    Nothing happens where ep is 1, or where the model's experts are split already (overlapkit's MoE). ValueError naming the field for ep > 1 on a model without
    experts, or an ep that does not divide the experts. Collective over the EP group (one store
    round trip comparing the model and sizes, so ranks that differ fail together).
    """
    group, ep = expert_group_of(mesh)
    if ep == 1 or group is None:
        return {}
    modules = expert_modules(model)
    if not modules and any(getattr(p, "expert_parallel", False) for p in model.parameters()):
        return {}  # split over EP already (overlapkit's own MoE layers)
    cls = type(model).__name__
    problem = None
    if not modules:
        problem = (f"ParallelSizes.ep={ep} but {cls} has no experts to split (its config's base_model_ep_plan names "
                   f"no {EP_DISPATCH!r} module); use ep=1")
    counts = sorted({int(getattr(m, "num_experts", 0)) for m in modules.values()})
    if problem is None and (len(counts) != 1 or counts[0] < 1):
        problem = f"{cls}: its experts modules do not all say one num_experts ({counts})"
    if problem is None and counts[0] % ep:
        problem = (f"{_count_field(model, counts[0])}={counts[0]} is not divisible by the expert-parallel size "
                   f"ParallelSizes.ep={ep} (each EP rank holds num_experts / ep whole experts)")
    agree(group, "parallelize experts", model=cls, ep=ep, experts=len(modules), num_experts=counts,
          problem=problem)
    if problem is not None:
        raise ValueError(f"parallelize: {problem}")
    ep_mesh = _ep_mesh(group)
    worker = MicroBatchWorker()  # micro-batch B's thread, shared by the blocks: they run one after another
    for path, module in modules.items():
        _shard_module(module, counts[0], group, ep_mesh, chunks, path)
        block = model.get_submodule(path.rpartition(".")[0])
        if block is not module and "forward" not in block.__dict__:
            block.forward = _TwoBatchBlock(block, module, worker)
    return modules


def inference_micro_batches(model: nn.Module, n: int) -> None:
    """How many micro-batches the MoE blocks of `model` (its experts split by `parallelize`) cut a forward
    without gradients into: 2 (the default: one's all-to-alls hide behind the other's compute) or 1 (the
    whole batch at once, chunked as in training). Every EP rank must set the same."""
    if n not in (1, 2):
        raise ValueError(f"inference_micro_batches: n must be 1 or 2, got {n!r}")
    for m in model.modules():
        wrapper = m.__dict__.get("forward")
        if isinstance(wrapper, _TwoBatchBlock):
            wrapper.micro_batches = n


def _ep_mesh(group):
    from torch.distributed.device_mesh import DeviceMesh

    import torch.distributed as dist

    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    return DeviceMesh.from_group(group, device, mesh_dim_names=("ep",))


def _shard_module(module: nn.Module, num_experts: int, group, ep_mesh, chunks, path: str) -> None:
    from torch.distributed.tensor import DTensor, Shard

    router = DispatchCombine(num_experts, group, chunks=chunks, name=path)
    names = []
    for pname, p in list(module._parameters.items()):
        if p is None or p.dim() == 0 or p.shape[0] != num_experts:
            raise ValueError(f"parallelize: {path}.{pname} has shape {tuple(p.shape) if p is not None else None}, "
                             f"not stacked over the {num_experts} experts; this experts module cannot be split")
        local = p.detach()[router.local_experts].clone()
        sharded = nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=p.shape,
                                                  stride=local.new_empty(p.shape).stride()),
                               requires_grad=p.requires_grad)
        sharded.expert_parallel = True  # held by one EP rank: a data-parallel average over EP would mix experts
        module._parameters[pname] = sharded
        names.append(pname)
    module.__dict__["_overlapkit_experts"] = (router, tuple(names))
    module.forward = _RoutedForward(module)


def sum_expert_grads_over(module: nn.Module, group, name: str) -> bool:
    """Sum the gradients of an experts module split over ep over the TP `group` too (each TP rank routes
    its slice of the sequence under sequence parallelism); False, doing nothing, for a module not split."""
    if "_overlapkit_experts" not in module.__dict__:
        return False
    module.__dict__["_overlapkit_tp_sum"] = (group, name)
    return True


def run_local_experts(module: nn.Module, rows: torch.Tensor, expert: torch.Tensor, weights: dict,
                      num_local: int) -> torch.Tensor:
    """The experts module's own forward on `rows` whose local expert ids are `expert` [rows], with the
    stacked parameters replaced by `weights` (name -> this rank's [num_local, ...] tensors): each row
    once, with routing weight 1, so the family's arithmetic (its activation, gate/up layout, biases,
    clamps) is the model's own, whichever experts implementation its config picks."""
    view = object.__new__(type(module))
    view.__dict__.update(module.__dict__)
    view.__dict__.pop("forward", None)
    view.__dict__["_parameters"] = {**module._parameters, **weights}
    view.__dict__["num_experts"] = num_local
    return type(module).forward(view, rows, expert.unsqueeze(1), rows.new_ones((rows.shape[0], 1)))


class _RoutedForward:
    """The experts module's forward under EP: the model's (hidden_states, top_k_index, top_k_weights) call."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        if args or kwargs:
            raise TypeError(f"{type(self.module).__name__} under expert parallelism takes (hidden_states, "
                            f"top_k_index, top_k_weights), got {len(args)} more positional and {sorted(kwargs)}")
        router, names = self.module.__dict__["_overlapkit_experts"]
        weights = [self.module._parameters[n].to_local() for n in names]
        tp_sum = self.module.__dict__.get("_overlapkit_tp_sum")
        if tp_sum is not None and split_here(self.module):  # this TP rank routed its slice of the sequence
            weights = [copy_to_tp(w, tp_sum[0], f"{tp_sum[1]}.{n}") for w, n in zip(weights, names)]
        return router(hidden_states, top_k_index, top_k_weights, self._run_local, weights)

    def _run_local(self, rows: torch.Tensor, groups, weights) -> torch.Tensor:
        router, names = self.module.__dict__["_overlapkit_experts"]
        return run_local_experts(self.module, rows, groups.expert, dict(zip(names, weights)), router.num_local)

    def __deepcopy__(self, memo):  # a deep copy of the model gets a forward bound to its own copy of the module
        return _RoutedForward(memo.get(id(self.module), self.module))


class _TwoBatchBlock:
    """The MoE block's forward under EP: in a forward without gradients, its own forward on two micro-batches of
    sequences taking turns (expert_parallel/two_batch.py), their outputs concatenated back in batch order."""

    def __init__(self, block: nn.Module, experts: nn.Module, worker: MicroBatchWorker, micro_batches: int = 2) -> None:
        self.block, self.experts, self.worker, self.micro_batches = block, experts, worker, micro_batches

    def __call__(self, hidden_states, *args, **kwargs):
        own = type(self.block).forward
        if (self.micro_batches < 2 or args or kwargs or torch.is_grad_enabled() or not torch.is_tensor(hidden_states)
                or hidden_states.dim() != 3 or hidden_states.shape[0] == 0 or _thread_bound(hidden_states)):
            return own(self.block, hidden_states, *args, **kwargs)
        router = self.experts.__dict__["_overlapkit_experts"][0]
        a = split_sequences(hidden_states.shape[0])
        first, second = hidden_states[:a], hidden_states[a:]
        capture = _OutputCapture()

        def run_second():
            capture.divert()
            if second.shape[0]:
                return own(self.block, second)
            self.experts(*turns.empty_args)  # an empty B still takes its turns: a peer's B holds tokens
            return None

        turns = TwoBatch(run_second, second.shape[0] * second.shape[1], self.worker, f"{router.name}.infer")
        router.two_batch = turns
        try:
            out_a = own(self.block, first)
            out_b = turns.finish()
        except BaseException:
            turns.abort()
            raise
        finally:
            router.two_batch = None
        capture.merge()
        if out_b is None:
            return out_a
        if torch.is_tensor(out_a):
            return torch.cat([out_a, out_b])
        return type(out_a)(torch.cat([x, y]) if torch.is_tensor(x) else x for x, y in zip(out_a, out_b))

    def __deepcopy__(self, memo):  # a deep copy of the model gets a forward bound to its own copies
        if id(self.worker) not in memo:  # the copied model's blocks share one new worker
            memo[id(self.worker)] = MicroBatchWorker()
        return _TwoBatchBlock(memo.get(id(self.block), self.block), memo.get(id(self.experts), self.experts),
                              memo[id(self.worker)], self.micro_batches)


def _thread_bound(x: torch.Tensor) -> bool:
    """State a second thread would not inherit: autocast, a CUDA graph being captured (the plan's host sync
    could not run in one anyway), torch.compile tracing (turns between threads cannot be traced). Then the
    block runs one micro-batch."""
    if torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type):
        return True
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


class _OutputCapture:
    """transformers records outputs (router logits) into a collector held by a ContextVar: micro-batch B records
    into a collector of its own, merged after the block into the entries A recorded (A's rows, then B's: batch
    order), so the model returns one entry per layer, as for one batch."""

    def __init__(self) -> None:
        try:
            from transformers.utils import output_capturing

            self.var = output_capturing._active_collector
        except (ImportError, AttributeError):
            self.var = None
        self.outer = self.var.get() if self.var is not None else None
        lists = {k: v for k, v in (self.outer or {}).items() if isinstance(v, list)}
        self.before = {k: len(v) for k, v in lists.items()}
        self.apart = {k: ([] if k in lists else v) for k, v in (self.outer or {}).items()}

    def divert(self) -> None:
        """In B's thread (a copy of A's context): record into B's own collector."""
        if self.outer is not None:
            self.var.set(self.apart)

    def merge(self) -> None:
        for key, n in self.before.items():
            mine, theirs = self.outer[key][n:], self.apart[key]
            if not theirs:  # this rank's B was empty: A's entries hold every token
                continue
            if len(mine) != len(theirs):
                raise RuntimeError(f"micro-batches recorded {len(mine)} and {len(theirs)} {key!r} entries in one block")
            self.outer[key][n:] = [torch.cat([x, y]) if torch.is_tensor(x) else x for x, y in zip(mine, theirs)]
