"""A decode step's one collective per row layer: the partial sums all-reduced, fused with the residual add and the norm.

In a decode step a row-parallel GEMM's all-reduce has nothing to hide behind: the next layer needs
its sum. What can shrink is everything around it. `all_reduce_add_norm` issues ONE collective on
the row layer's partial sums, then on the reduced rows adds the bias, adds the residual stream and
applies the following norm, so that the add and the norm never wait on a second pass or a second
collective (vLLM's fused all-reduce + RMSNorm). Which all-reduce runs (`reduce_partial`): on CUDA,
a message up to `InferenceConfig.one_shot_max_bytes` goes through a one-shot all-reduce over
symmetric memory (every rank reads every peer's buffer and sums, one kernel, no NCCL protocol
round), a larger one through NCCL; on gloo, the same op structure with gloo's all-reduce.

Exactness: the add and the norm are the very operations the unfused layer runs, in the same order
(sum over ranks, bias, residual + sum, the norm module's own forward), so on one process the result
equals `norm(residual + x)` bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..runtime import comm, recorder, state
from ..tensor_parallel.collectives import all_reduce_copy
from ..tensor_parallel.symm_mem import TransportUnavailable, check_available
from ..vocabulary import check_bool, check_choice, positive_int

PREFILLS = ("sequence_parallel", "two_batch", "decode")


@dataclass(frozen=True)
class InferenceConfig:
    """How the inference layout runs its collectives and steps."""

    one_shot_max_bytes: int = 512 * 1024
    """Largest all-reduce (bytes of one rank's partial sums) sent as a one-shot all-reduce over symmetric
    memory on CUDA; above it NCCL's ring/tree wins. 512 KiB is where the serving stacks switch from one-shot
    to two-shot or NCCL on 8 NVLink GPUs (a decode step of batch 32 at hidden 8192 in bf16 is 512 KiB)."""
    symm_mem: bool = True
    """Use symmetric memory for the small all-reduces where the group allows it (CUDA, NCCL, one node);
    where it does not, the reason is kept (`one_shot_unavailable`) and NCCL runs instead."""

    prefill: str = "sequence_parallel"
    """How a prompt runs. "sequence_parallel": split over the TP ranks along the sequence, through the
    training layers' pipelined all-gather+GEMM / GEMM+reduce-scatter (a prompt that does not split runs as
    "decode"). "two_batch": the decode layout with the batch cut in two, one half's all-reduce in flight
    while the other half computes (a prompt of one sequence, or a KV cache that is not HF's dynamic one
    or already holds tokens, runs as "sequence_parallel"). "decode": the decode layout, one batch."""

    def __post_init__(self) -> None:
        positive_int(self.one_shot_max_bytes, "InferenceConfig.one_shot_max_bytes", minimum=0)
        check_bool(self.symm_mem, "InferenceConfig.symm_mem")
        check_choice(self.prefill, PREFILLS, "InferenceConfig.prefill")


_one_shot_verdicts: dict[str, str] = state.capability_dict("inference.one_shot_per_group")
"""Group name -> '' (one-shot usable) or why not, decided on the first small all-reduce."""
_one_shot_buffers: dict[tuple, list] = state.cache_dict("inference.one_shot_buffers")
"""(group name, dtype, numel, device) -> [the two symmetric buffers the partial sums are staged in, the last used]."""


def one_shot_unavailable(group, device: torch.device) -> str:
    """Why the one-shot all-reduce cannot run on this group and device ('' when it can)."""
    key = group.group_name
    if key not in _one_shot_verdicts:
        try:
            check_available(group, device)
            if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce"):
                raise TransportUnavailable(f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce")
            _one_shot_verdicts[key] = ""
        except TransportUnavailable as e:
            _one_shot_verdicts[key] = str(e)
    return _one_shot_verdicts[key]


def _symmetric_buffer(x: torch.Tensor, group) -> torch.Tensor:
    """One of this shape's two symmetric buffers, in turn. Two, because the one-shot kernel waits for every
    peer at its start, not at its end: a rank may write its next partial sums while a slower peer still
    reads the previous ones. With two buffers in turn, a buffer is written again only after its rank
    passed the next all-reduce's start, which every peer reaches only after its previous read is done."""
    import torch.distributed._symmetric_memory as sm

    key = (group.group_name, x.dtype, x.numel(), x.device)
    held = _one_shot_buffers.get(key)
    if held is None:
        enable = getattr(sm, "enable_symm_mem_for_group", None)
        if enable is not None:  # torch releases that want a group registered first
            enable(group.group_name)
        bufs = [sm.empty(x.numel(), dtype=x.dtype, device=x.device) for _ in range(2)]
        for buf in bufs:
            sm.rendezvous(buf, group.group_name)
        held = _one_shot_buffers[key] = [bufs, 0]
    held[1] ^= 1
    return held[0][held[1]]


def _one_shot(x: torch.Tensor, group, name: str) -> torch.Tensor:
    """Sum of x over the group by one kernel reading every peer's symmetric buffer."""
    buf = _symmetric_buffer(x, group)
    rec = recorder.active()
    stamp = rec.comm_issued("tp_all_reduce", name, x.numel() * x.element_size(), comm.group_size(group)) \
        if rec is not None else None
    with recorder.comm_range("tp_all_reduce", name):
        buf.copy_(x.reshape(-1))
        out = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group.group_name)
    if stamp is not None:
        rec.comm_done(stamp)
    return out.view_as(x)


def reduce_partial(x: torch.Tensor, group, name: str, config: InferenceConfig | None = None) -> torch.Tensor:
    """The sum of the row layer's partial sums `x` over `group`: one-shot over symmetric memory for a small
    message on CUDA, else the group's own all-reduce (NCCL, gloo); x itself on one rank."""
    if comm.group_size(group) == 1:
        return x
    if _takes_one_shot(x, group, config or InferenceConfig()):
        return _one_shot(x.contiguous(), group, name)
    return all_reduce_copy(x, group, name)


def _takes_one_shot(x: torch.Tensor, group, config: InferenceConfig) -> bool:
    """Whether `x`'s all-reduce goes through the one-shot kernel over symmetric memory (small, CUDA, allowed)."""
    small = x.numel() * x.element_size() <= config.one_shot_max_bytes
    return config.symm_mem and small and x.is_cuda and not one_shot_unavailable(group, x.device)


class InFlight:
    """A row layer's partial sums on their way to being summed over the group (`start_reduce`); `wait()`
    returns the sum. What runs between the two hides the transfer."""

    def __init__(self, x: torch.Tensor, handle=None) -> None:
        self._x, self._handle = x, handle

    def wait(self) -> torch.Tensor:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        return self._x


def start_reduce(x: torch.Tensor, group, name: str, config: InferenceConfig | None = None) -> InFlight:
    """`reduce_partial` left in flight where the transport allows it (NCCL, gloo): the one-shot kernel over
    symmetric memory and a compiled graph's op run at once (they are single kernels on the stream)."""
    config = config or InferenceConfig()
    if comm.group_size(group) == 1 or torch.compiler.is_compiling() or _takes_one_shot(x, group, config):
        return InFlight(reduce_partial(x, group, name, config))
    out = x.contiguous().clone()
    return InFlight(out, comm.all_reduce(out, group, kind="tp_all_reduce", name=name, async_op=True))


def add_norm(y: torch.Tensor, residual: torch.Tensor, norm: nn.Module | None, *, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(norm(h), h) with h = residual + y (+ bias first): the reduced rows' elementwise tail, in the unfused
    layer's order. `out`: where h is written (a view of a larger batch's buffer)."""
    if bias is not None:
        y = y + bias
    h = torch.add(residual, y, out=out) if out is not None else residual + y
    return (norm(h) if norm is not None else None), h


def all_reduce_add_norm(partial: torch.Tensor, residual: torch.Tensor, norm: nn.Module | None, group, *,
                        bias: torch.Tensor | None = None, name: str = "",
                        config: InferenceConfig | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(norm(h), h) with h = residual + (the sum of `partial` over `group`) + bias: one collective, then
    the add and the norm on the reduced rows. `norm=None` returns (None, h) (a layer whose next norm is
    not known). The norm is the model's own module, so its formula (RMSNorm, LayerNorm, 1 + weight)
    is whatever the model computes."""
    return add_norm(reduce_partial(partial, group, name, config), residual, norm, bias=bias)

