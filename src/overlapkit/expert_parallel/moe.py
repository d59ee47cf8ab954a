"""The MoE layer: route, dispatch to the experts' EP ranks, compute, combine — the all-to-alls hidden behind other chunks' experts.

`MoE(hidden, ffn_hidden, num_experts, top_k, mesh_or_group)` replaces an MLP. Its experts are
split over the expert-parallel group (num_experts / ep whole experts a rank), and optionally each
expert's MLP over a tensor-parallel group (`tp_group`, ranks that hold the same tokens). The
schedule lives in dispatch.py (exact split sizes) and padded.py (padded to a capacity: no host
sync), the expert arithmetic in experts.py. `overlap="auto"` (the default) times the chunk counts
on the layer's first calls and keeps the fastest; "pipelined" runs `chunks` chunks, "none" one (overlapkit.runtime.tuning); after that the layer runs
exactly as with that count fixed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from ..runtime import comm
from ..runtime.agreement import Agreement, RankMismatchError, agree
from ..runtime.groups import resolve_group
from ..runtime.tuning import MeasuredChoice, timed
from ..tensor_parallel.mappings import copy_to_tp, reduce_from_tp
from ..tensor_parallel.precision import autocast_dtype, autocast_off, cast
from .config import CHUNK_CANDIDATES, MoEConfig, chunks_for
from .dispatch import ExpertsA2A, plan_dispatch
from .experts import Experts, init_full_experts
from .padded import PaddedExpertsA2A, plan_padded, received_per_expert
from .router import Router


@dataclass(frozen=True)
class LoadStats:
    """What the router did with one rank's tokens in the last forward (plain ints, picklable)."""

    tokens: int
    """Tokens this rank routed."""
    sent_per_expert: list[int]
    """[num_experts] assignments of this rank's tokens each expert computed."""
    dropped_per_expert: list[int]
    """[num_experts] assignments of this rank's tokens dropped by the capacity factor (0 when dropless)."""
    received_per_expert: list[int]
    """[local experts] rows this rank's experts computed, from all EP ranks."""
    first_expert: int
    """Global id of this rank's first local expert."""

    @property
    def dropped(self) -> int:
        return sum(self.dropped_per_expert)


class _WeightedSum(torch.autograd.Function):
    """s [T, k, H], w [T, k] -> sum_j w[:, j] s[:, j], added in the order j = 0, 1, ...: one multiply and k-1
    fused multiply-adds over [T, H], where (s * w).sum(1) writes and reads a [T, k, H] product first."""

    @staticmethod
    def forward(ctx, s, w):
        ctx.save_for_backward(s, w)
        out = s[:, 0] * w[:, :1]
        for j in range(1, s.shape[1]):
            out.addcmul_(s[:, j], w[:, j:j + 1])
        return out

    @staticmethod
    def backward(ctx, g):
        s, w = ctx.saved_tensors
        g = g.unsqueeze(1)
        ds = g * w.unsqueeze(-1) if ctx.needs_input_grad[0] else None
        dw = (s * g).sum(-1) if ctx.needs_input_grad[1] else None
        return ds, dw


class MoE(nn.Module):
    """x [..., hidden] -> [..., hidden]: top-k mixture of expert MLPs, experts sharded over EP.

    Construction is collective over the EP group (a store-based agreement on the configuration,
    so that mismatched arguments fail on every rank naming them). After each forward,
    `aux_loss` holds the router's load-balancing loss (add `coef * aux_loss` to the loss) and
    `last_load` the token counts (what went where, what was dropped). Every rank of the EP
    group must run forward and backward the same number of times (the all-to-alls pair up).
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int = 1, mesh_or_group=None, *,
                 overlap: str | None = None, chunks: int | str | None = None, capacity_factor: float | None = None,
                 pad_to_capacity: bool | None = None, normalize_top_k: bool = True,
                 tp_group=None, name: str = "moe", generator: torch.Generator | None = None,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.group = resolve_group(mesh_or_group, "ep")
        self.tp_group = resolve_group(tp_group, "tp") if tp_group is not None else None
        ep, tp = comm.group_size(self.group), comm.group_size(self.tp_group)
        try:
            chunks, problem = chunks_for(overlap, chunks), None
        except ValueError as e:
            chunks, problem = repr((overlap, chunks)), str(e)
        fields = dict(problem=problem, hidden=hidden, ffn_hidden=ffn_hidden, num_experts=num_experts, top_k=top_k, chunks=chunks,
                      capacity_factor=capacity_factor, pad_to_capacity=pad_to_capacity,
                      normalize_top_k=normalize_top_k, ep=ep, tp=tp)
        # Compare before validating: a value bad on one rank only must fail on all of them.
        agree(self.group, f"MoE {name}", **fields)
        if self.tp_group is not None:
            agree(self.tp_group, f"MoE {name} (tensor-parallel group)", **fields)
        if problem is not None:
            raise ValueError(problem)
        self.config = MoEConfig(hidden=hidden, ffn_hidden=ffn_hidden, num_experts=num_experts, top_k=top_k,
                                chunks=chunks, capacity_factor=capacity_factor, pad_to_capacity=pad_to_capacity,
                                normalize_top_k=normalize_top_k)
        self.config.check_parallel(ep, tp)
        self.name, self.ep, self.tp = name, ep, tp
        self.ep_rank, self.tp_rank = comm.group_rank(self.group), comm.group_rank(self.tp_group)
        self.num_local = num_experts // ep
        self.router = Router(hidden, num_experts, top_k, normalize_top_k).to(device=device, dtype=dtype)
        self.experts = Experts(self.num_local, hidden, ffn_hidden // tp, add_output_bias=self.tp_rank == 0,
                               device=device, dtype=dtype)
        self.load_full(*init_full_experts(num_experts, hidden, ffn_hidden, generator))
        self._agreement = Agreement(f"MoE {name} input")
        self._tp_checked: set[tuple[int, ...]] = set()
        self._constants: dict = {}  # tensors of a shape alone (chunk keys, receive layouts), made once
        self.aux_loss: torch.Tensor | None = None
        self._load: tuple | None = None  # the last forward's counts, still on the device
        self._load_stats: LoadStats | None = None
        self.chunk_choice = MeasuredChoice(CHUNK_CANDIDATES if chunks == "auto" else (chunks,), self.group,
                                           what=f"MoE {name} chunks", kind="ep_dispatch")
        """The chunk count in force (`chunk_choice.decided`; None while auto's trials run) and why."""
        if chunks == "auto" and ep == 1:
            self.chunk_choice.decide_now(1, "one EP rank: nothing travels, so nothing to hide behind chunks")
        elif chunks != "auto":
            self.chunk_choice.reason = "fixed by the caller"

    @property
    def last_load(self) -> LoadStats | None:
        """What the router did in the last forward (None before the first). Read from the device on
        first access, so that a forward does not wait for its own kernels to hand them over."""
        if self._load_stats is None and self._load is not None:
            tokens, sent, dropped, received = self._load
            self._load_stats = LoadStats(tokens=tokens, sent_per_expert=sent.tolist(),
                                         dropped_per_expert=[0] * len(sent) if dropped is None else dropped.tolist(),
                                         received_per_expert=received.tolist(),
                                         first_expert=self.local_experts.start)
        return self._load_stats

    @property
    def local_experts(self) -> slice:
        """The global expert ids this rank holds."""
        return slice(self.ep_rank * self.num_local, (self.ep_rank + 1) * self.num_local)

    @property
    def local_ffn(self) -> slice:
        """The slice of each expert's inner width this TP rank holds."""
        per = self.config.ffn_hidden // self.tp
        return slice(self.tp_rank * per, (self.tp_rank + 1) * per)

    def load_full(self, w1, b1, w2, b2) -> None:
        """Take this rank's shard of full stacked expert weights ([E, F, H], [E, F], [E, H, F], [E, H])."""
        self.experts.load_full(w1, b1, w2, b2, self.local_experts, self.local_ffn)

    def shard_of(self, full: torch.Tensor, param: str) -> torch.Tensor:
        """This rank's slice of a full expert tensor named like the parameter (w1, b1, w2 or b2)."""
        rows = full[self.local_experts]
        if param in ("w1", "b1"):
            return rows[:, self.local_ffn]
        return rows[:, :, self.local_ffn] if param == "w2" else rows

    @property
    def chunks(self) -> int | str | None:
        """The chunks the layer runs with, a count or "ranks" (None while `chunks="auto"` still times candidates)."""
        return self.chunk_choice.decided

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        padded = cfg.padded(x.device.type)
        # Checked across ranks before any transfer: a wrong width or dtype on one rank fails on all. The
        # padded path also needs the same number of tokens everywhere (its split sizes come from it).
        # Autocast on one rank only would send rows of another dtype (gloo aborts on the size mismatch).
        cdt = autocast_dtype(x)
        self._agreement.check(self.group, width=x.shape[-1] if x.dim() else None, dtype=x.dtype, autocast=cdt,
                              weights=self.experts.w1.dtype,
                              device=x.device.type, tokens=x.numel() // max(x.shape[-1], 1) if padded else None)
        if x.dim() < 1 or x.shape[-1] != cfg.hidden:
            raise ValueError(f"MoE {self.name}: input's last dim must be hidden={cfg.hidden}, got shape {tuple(x.shape)}")
        x2 = x.reshape(-1, cfg.hidden)
        if self.tp_group is not None and tuple(x2.shape) not in self._tp_checked:
            self._check_replicated_over_tp(x2)
        chunks, trial = self.chunk_choice.decided, None
        if chunks is None:  # auto, still timing: this call runs one candidate
            trial = self.chunk_choice.trial(x.device)
            chunks = self.chunk_choice.decided if trial is None else trial.choice
            if trial is None:  # decided on this call: the other counts' constants would stay alive for nothing
                self._constants.clear()
        with timed(trial, "forward"):
            out = self._route_and_compute(x2, chunks, padded, trial, cdt)
        return out.view(x.shape)

    def _route_and_compute(self, x2: torch.Tensor, chunks, padded: bool, trial, cdt) -> torch.Tensor:
        cfg = self.config
        routing = self.router(x2)
        xin = x2
        if self.tp_group is not None:
            xin = copy_to_tp(x2, self.tp_group, f"{self.name}.experts_in")  # partial dx summed over TP
        e = self.experts
        weights, precision = (e.w1, e.b1, e.w2, e.b2), contextlib.nullcontext()
        if torch.is_autocast_enabled(x2.device.type):
            # What autocast would do for a linear, done once outside the expert functions (as the tensor-parallel
            # ones do): inputs and weights in its dtype, differentiably, and the functions run with autocast off,
            # every tensor in one dtype (and the grouped GEMMs, which take no part in autocast, usable).
            xin, weights, precision = cast(xin, cdt), [cast(w, cdt) for w in weights], autocast_off(x2, cdt)
        if padded:
            plan = plan_padded(routing.experts, cfg.num_experts, chunks, cfg.capacity(x2.shape[0]), self.group,
                               self.name, routing.counts)
            with precision:
                slots = PaddedExpertsA2A.apply(xin, *weights, plan, self.group, e.add_output_bias, self.name, trial)
            received = received_per_expert(plan, self.ep)
        else:
            plan = plan_dispatch(routing.experts, cfg.num_experts, chunks, cfg.capacity(x2.shape[0]), self.group,
                                 self.name, routing.counts, self._constants)
            with precision:
                slots = ExpertsA2A.apply(xin, *weights, plan, self.group, e.add_output_bias, self.name, trial)
            received = plan.received_per_expert
        if self.tp_group is not None:
            slots = reduce_from_tp(slots, self.tp_group, f"{self.name}.experts_out")  # partial sums over TP
        # Combine: every token's top_k slots (a dropped one holds 0) weighted and summed, in a fixed order
        # (each multiply-add computed in fp32 inside its kernel, rounded once). An index_add into the tokens would add with atomics: run-to-run
        # different sums in bf16, and refused under torch.use_deterministic_algorithms. (A batched GEMM
        # over the slots ran as a slow GEMV.)
        tokens, k = routing.weights.shape
        out = _WeightedSum.apply(slots.view(tokens, k, x2.shape[-1]), routing.weights.to(slots.dtype))
        # Plain attributes, set past nn.Module.__setattr__ (which looks each name up among parameters, buffers
        # and submodules first: three of those a call were a tenth of the layer's own Python time).
        self.__dict__.update(aux_loss=routing.aux_loss, _load_stats=None,
                             _load=(x2.shape[0], plan.sent_per_expert, plan.dropped_per_expert, received))
        return out

    def _check_replicated_over_tp(self, x2: torch.Tensor) -> None:
        # Sequence-parallel shards have equal shapes but different tokens; summing their experts'
        # partial outputs over TP would be silently wrong. A fingerprint per new shape catches it.
        try:
            agree(self.tp_group, f"MoE {self.name} input over TP", shape=tuple(x2.shape),
                  fingerprint=float(x2.detach().double().sum()))
        except RankMismatchError as e:
            raise RankMismatchError(f"{e}. A MoE with tp_group needs its TP ranks to hold the same tokens "
                                    "(tensor parallelism without sequence parallelism)") from None
        self._tp_checked.add(tuple(x2.shape))

    def extra_repr(self) -> str:
        c = self.config
        return (f"hidden={c.hidden}, ffn_hidden={c.ffn_hidden}, experts={c.num_experts} ({self.num_local} here), "
                f"top_k={c.top_k}, chunks={c.chunks}{'' if c.chunks != 'auto' else f' ({self.chunks})'}, "
                f"capacity_factor={c.capacity_factor}, ep={self.ep}, tp={self.tp}")
