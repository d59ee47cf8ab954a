"""Dispatch -> any experts function -> combine, chunk-pipelined: chunk i+1's dispatch and chunk i-1's combine in flight while chunk i's experts run.

The MoE layer (moe.py) brings its own router and a hand-written expert MLP. A model that already
has both (a transformers MoE block: its router chose `top_k_index` and `top_k_weights`, its experts
module holds the stacked weights) keeps them: `DispatchCombine` takes the choices as they are, moves
every (token, choice) row to the EP rank that holds its expert through the same plan and schedule
as the MoE layer (dispatch.py: exact split sizes, `chunks` a count, "ranks" or "auto"), runs the
caller's `run(rows, groups, weights)` on the rows of this rank's experts, and brings the results
back, weighted and summed in a fixed order. `run` is differentiated by autograd chunk by chunk
(each chunk's graph kept from the forward), so backward runs the same pipeline: the gradients of
chunk i+1 travel while chunk i's expert backward runs.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..runtime import comm
from ..runtime.agreement import Agreement
from ..runtime.recorder import compute_span
from ..runtime.tuning import MeasuredChoice, timed
from .config import CHUNK_CANDIDATES, MoEConfig
from .dispatch import DispatchPlan, _slots, plan_dispatch, run_pipeline, token_grads
from .experts import Groups
from .moe import _WeightedSum

ExpertsFn = Callable[[torch.Tensor, Groups, Sequence[torch.Tensor]], torch.Tensor]
"""run(rows [n, hidden] grouped by local expert, their Groups, the local weights) -> [n, hidden]."""


class RoutedA2A(torch.autograd.Function):
    """x [tokens, hidden] -> [tokens * top_k, hidden], each (token, choice)'s expert output in its slot:
    gather, dispatch, `run`, combine, chunk-pipelined; backward the same on the slots' gradients, each
    chunk's `run` differentiated by autograd from the graph its forward kept."""

    @staticmethod
    def forward(ctx, x, plan: DispatchPlan, group, run: ExpertsFn, name: str, trial, *weights):
        leaves = [w.detach().requires_grad_(w.requires_grad) for w in weights]
        graphs: dict = {}
        width = x.shape[1]

        differentiable = any(ctx.needs_input_grad)  # no graph to keep under no_grad / inference_mode

        def compute(i, rows):
            if rows.shape[0] == 0:  # a chunk that received nothing
                return rows.new_empty((0, width))
            if not differentiable:
                with compute_span(f"{name}.fwd.experts[{i}]"):
                    return run(rows, plan.groups[i], leaves)
            with compute_span(f"{name}.fwd.experts[{i}]"), torch.enable_grad():
                xi = rows.detach().requires_grad_(True)
                y = run(xi, plan.groups[i], leaves)
            graphs[i] = (xi, y)
            return y.detach()

        y = run_pipeline(x.index_select(0, plan.row_token), plan, group, compute, f"{name}.fwd", width)
        ctx.plan, ctx.group, ctx.name, ctx.trial, ctx.tokens = plan, group, name, trial, x.shape[0]
        ctx.graphs, ctx.leaves = graphs, leaves
        return _slots(plan, y, plan.assignments)

    @staticmethod
    def backward(ctx, dslots):
        with timed(ctx.trial, "backward"):  # auto's trials time it; nothing once decided
            return RoutedA2A._backward(ctx, dslots)

    @staticmethod
    def _backward(ctx, dslots):
        plan, leaves = ctx.plan, ctx.leaves
        wanted = [i for i, w in enumerate(leaves) if w.requires_grad]
        grads: list = [None] * len(leaves)

        def compute(i, dy):
            graph = ctx.graphs.get(i)
            if graph is None or dy.shape[0] == 0:
                return dy.new_zeros((dy.shape[0], dslots.shape[1]))
            xi, y = graph
            with compute_span(f"{ctx.name}.bwd.experts[{i}]"):
                got = torch.autograd.grad(y, [xi, *(leaves[j] for j in wanted)], dy, allow_unused=True)
            for j, g in zip(wanted, got[1:]):
                if g is not None:
                    grads[j] = g if grads[j] is None else grads[j].add_(g)
            return got[0] if got[0] is not None else dy.new_zeros(xi.shape)

        drows = dslots.contiguous().index_select(0, plan.row_assignment)
        dx = run_pipeline(drows, plan, ctx.group, compute, f"{ctx.name}.bwd", dslots.shape[1])
        ctx.graphs = None
        for j in wanted:  # experts no row reached
            if grads[j] is None:
                grads[j] = torch.zeros_like(leaves[j])
        return (token_grads(plan, dx, ctx.tokens), None, None, None, None, None, *grads)


class DispatchCombine:
    """Route a model's own top-k choices to the EP ranks that hold the experts and combine the results.

    `num_experts` over all EP ranks (a multiple of the group's size; each rank holds
    `num_experts / ep` consecutive ones). Construction is local; every forward is collective over
    the EP group (every rank must call it the same number of times, forward and backward). The
    first call checks, across ranks, that width, dtype and top_k agree (a mismatch fails on every
    rank naming it, instead of gloo aborting mid-transfer).
    """

    def __init__(self, num_experts: int, group, *, chunks: int | str = "auto", name: str = "experts") -> None:
        self.group, self.name = group, name
        self.ep, self.ep_rank = comm.group_size(group), comm.group_rank(group)
        MoEConfig(hidden=1, ffn_hidden=1, num_experts=num_experts, chunks=chunks).check_parallel(self.ep)
        self.num_experts, self.num_local = num_experts, num_experts // self.ep
        self._agreement = Agreement(f"experts {name} input")
        self._constants: dict = {}
        self.chunk_choice = MeasuredChoice(CHUNK_CANDIDATES if chunks == "auto" else (chunks,), group,
                                           what=f"experts {name} chunks", kind="ep_dispatch")
        """The chunk count in force (`chunk_choice.decided`; None while auto's trials run) and why."""
        if chunks == "auto" and self.ep == 1:
            self.chunk_choice.decide_now(1, "one EP rank: nothing travels, so nothing to hide behind chunks")
        elif chunks != "auto":
            self.chunk_choice.reason = "fixed by the caller"
        self.two_batch = None
        """The turns of an inference block call running two micro-batches (two_batch.py), set by its caller for
        the call's duration; None: one batch, chunked as above."""

    @property
    def local_experts(self) -> slice:
        """The global expert ids this rank holds."""
        return slice(self.ep_rank * self.num_local, (self.ep_rank + 1) * self.num_local)

    def __call__(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, run: ExpertsFn,
                 weights: Sequence[torch.Tensor]) -> torch.Tensor:
        """x [tokens, hidden], the router's [tokens, top_k] choices and weights -> [tokens, hidden]:
        sum_j weights[:, j] * expert_{index[:, j]}(x), the experts run where they live."""
        self._agreement.check(self.group, width=x.shape[-1], dtype=x.dtype, top_k=top_k_index.shape[-1],
                              device=x.device.type, micro_batches=1 if self.two_batch is None else 2)
        if self.two_batch is not None:
            return self.two_batch.experts(self, x, top_k_index, top_k_weights, run, weights)
        chunks, trial = self.chunk_choice.decided, None
        if chunks is None:  # auto, still timing: this call runs one candidate
            trial = self.chunk_choice.trial(x.device)
            chunks = self.chunk_choice.decided if trial is None else trial.choice
            if trial is None:  # decided on this call: the other counts' constants would stay alive for nothing
                self._constants.clear()
        with timed(trial, "forward"):
            plan = plan_dispatch(top_k_index.long(), self.num_experts, chunks, None, self.group, self.name,
                                 cache=self._constants)
            slots = RoutedA2A.apply(x.contiguous(), plan, self.group, run, self.name, trial, *weights)
            tokens, k = top_k_index.shape
            return _WeightedSum.apply(slots.view(tokens, k, x.shape[-1]), top_k_weights.to(slots.dtype))
