"""One small job per engine, perturbed on one rank after its first step, and what it must compute then.

Every case is a class with `step()` (this rank's numbers after one step), `perturb(kind)` (the
change, applied on this rank only) and `expected(kind, who)`: the numbers a single process gets
for the same job with rank `who` perturbed the same way, or None where no single-process job
means the same (the ranks no longer run one model: the only right outcome is an error on every
rank). A case runs on its own fresh group (`group`), so a case that breaks its group's
connections leaves the next one a working group.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

KINDS = ("dtype", "autocast", "width", "new parameter", "requires_grad")
BF16_TOL = 3e-2
"""What bf16 autocast on one rank may move a result by (bytes read as another dtype move it by O(1))."""


def add_extra(module: nn.Module, width: int, value: float = 0.5) -> None:
    """A parameter added after wrapping, used in forward: `extra` is added to `module`'s output."""
    module.extra = nn.Parameter(torch.full((width,), value))
    module.register_forward_hook(lambda m, _i, out: out + m.extra)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class Case:
    tol = 1e-5

    def __init__(self, group, knob) -> None:
        self.group, self.knob = group, knob
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.autocast, self.dtype = False, torch.float32

    def perturb(self, kind: str) -> None:
        raise NotImplementedError

    def expected(self, kind: str, who: int) -> dict | None:
        raise NotImplementedError

    def ac(self):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast)


# -- data parallel: DataParallel, ShardedOptimizer, fully_shard ------------------------------

class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(5, 6)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return self.out(h)


class DataCase(Case):
    """Each rank its 4 rows of one batch; SGD. The changed rank's math is its own only under autocast."""

    engine = "dp"

    def __init__(self, group, knob) -> None:
        super().__init__(group, knob)
        from overlapkit.data_parallel import DataParallel, ShardedOptimizer, fully_shard
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(4 * self.world, 5, generator=g), torch.randn(4 * self.world, 3, generator=g)
        self.net = Net()
        self.ref = copy.deepcopy(self.net)
        if self.engine == "fsdp":
            self.model = fully_shard(self.net, group, prefetch=knob)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        else:
            self.model = DataParallel(self.net, group)
            self.opt = (ShardedOptimizer(self.model, torch.optim.SGD, group, lr=0.1, overlap_param_gather=bool(knob))
                        if self.engine == "zero" else torch.optim.SGD(self.model.parameters(), lr=0.1))
        self._ref_step(None)

    def rows(self, t, r):
        return t[4 * r:4 * r + 4]

    def step(self) -> dict:
        self.opt.zero_grad()
        with self.ac():
            loss = F.mse_loss(self.model(self.rows(self.x, self.rank).to(self.dtype)),
                              self.rows(self.y, self.rank).to(self.dtype))
        loss.backward()
        self.opt.step()
        if hasattr(self.opt, "finish_param_gather"):
            self.opt.finish_param_gather()
        # This rank's shard only (FSDP2's Shard(0), torch.chunk's split): no collective after the step,
        # so a rank that returned while another raised is seen returning, not waiting.
        return {n: local(p).detach().clone() for n, p in self.net.named_parameters()}

    def _mine(self, full: torch.Tensor) -> torch.Tensor:
        if self.engine != "fsdp":
            return full
        parts = torch.chunk(full, self.world, dim=0)
        return parts[self.rank] if self.rank < len(parts) else full[:0]

    def _ref_step(self, autocast_rank) -> dict:
        # The mean over ranks of each rank's own gradient (under its own autocast), then SGD.
        grads = []
        for r in range(self.world):
            self.ref.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=r == autocast_rank):
                F.mse_loss(self.ref(self.rows(self.x, r)), self.rows(self.y, r)).backward()
            grads.append([p.grad.clone() for p in self.ref.parameters()])
        with torch.no_grad():
            for i, p in enumerate(self.ref.parameters()):
                p -= 0.1 * sum(g[i] for g in grads) / self.world
        return {n: self._mine(p.detach().clone()) for n, p in self.ref.named_parameters()}

    def perturb(self, kind: str) -> None:
        if kind == "dtype":
            self.net.double()
            self.dtype = torch.float64
        elif kind == "autocast":
            self.autocast = True
        elif kind == "width":
            torch.manual_seed(2)
            self.net.blocks[1] = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 6))
        elif kind == "new parameter":
            add_extra(self.net.out, 3)
        elif kind == "requires_grad":
            self.net.blocks[1].weight.requires_grad_(False)

    def expected(self, kind: str, who: int) -> dict | None:
        if kind != "autocast":
            return None  # another model on one rank: the averaged gradient belongs to no model
        return self._ref_step(who)


class ZeroCase(DataCase):
    engine = "zero"


class FsdpCase(DataCase):
    engine = "fsdp"


# -- tensor parallel: a column- then row-parallel MLP ----------------------------------------

class TpCase(Case):
    """x [4, 6] (replicated) -> ColumnParallelLinear(6, 8) -> tanh -> RowParallelLinear(8, 6)."""

    def __init__(self, group, knob) -> None:
        super().__init__(group, knob)
        from overlapkit.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        torch.manual_seed(0)
        self.full = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))
        self.col = ColumnParallelLinear(6, 8, group, overlap=knob)
        self.row = RowParallelLinear(8, 6, group, overlap=knob)
        self.col.load_state_dict(self.full[0].state_dict())
        self.row.load_state_dict(self.full[2].state_dict())
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
        self.width = 6

    def _numbers(self, out, x, col, row) -> dict:
        got = {"out": out.detach().clone(), "x.grad": x.grad.clone()}
        for name, p in (("col.weight", col.weight), ("col.bias", col.bias), ("row.weight", row.weight),
                        ("row.bias", row.bias)):
            if p.grad is not None:
                got[name] = local(p.grad).clone()
        return got

    def step(self) -> dict:
        x = torch.randn(4, self.width) if self.width != 6 else self.x.clone()
        x = x.to(self.dtype).requires_grad_()
        for p in (*self.col.parameters(), *self.row.parameters()):
            p.grad = None
        with self.ac():
            out = self.row(torch.tanh(self.col(x)))
            F.mse_loss(out.float(), self.y).backward()
        return self._numbers(out, x, self.col, self.row)

    def perturb(self, kind: str) -> None:
        if kind == "dtype":
            self.col.double()
            self.row.double()
            self.dtype = torch.float64
        elif kind == "autocast":
            self.autocast = True
        elif kind == "width":
            self.width = 8
        elif kind == "new parameter":
            add_extra(self.col, 8 // self.world)
        elif kind == "requires_grad":
            self.col.weight.requires_grad_(False)

    def expected(self, kind: str, who: int) -> dict | None:
        if kind == "width":
            return None
        ref = copy.deepcopy(self.full)
        x = self.x.clone().requires_grad_()
        h = ref[0](x)
        per = 8 // self.world
        if kind == "new parameter":  # the single process: the same extra on the columns rank `who` holds
            extra = torch.zeros(8)
            extra[who * per:(who + 1) * per] = 0.5
            h = h + extra
        out = ref[2](torch.tanh(h))
        F.mse_loss(out, self.y).backward()
        mine = slice(self.rank * per, (self.rank + 1) * per)
        want = {"out": out, "x.grad": x.grad, "col.weight": ref[0].weight.grad[mine], "col.bias": ref[0].bias.grad[mine],
                "row.weight": ref[2].weight.grad[:, mine], "row.bias": ref[2].bias.grad}
        if kind == "autocast":
            self.tol = BF16_TOL
        return want


# -- expert parallel: one MoE layer ----------------------------------------------------------

class EpCase(Case):
    """Each rank 6 tokens of width 6 through a top-1 MoE of 2 experts (one a rank)."""

    def __init__(self, group, knob) -> None:
        super().__init__(group, knob)
        from overlapkit.expert_parallel import MoE
        gen = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        self.moe = MoE(6, 8, 2 * self.world, top_k=1, mesh_or_group=group, chunks=knob, generator=gen)
        self.full = [t.clone() for t in _full_experts(self.world)]
        self.gate = self.moe.router.gate.weight.detach().clone()
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(6 * self.world, 6, generator=g), torch.randn(6 * self.world, 6, generator=g)
        self.width = 6

    def step(self) -> dict:
        r = self.rank
        x = self.x[6 * r:6 * r + 6]
        if self.width != 6:
            x = torch.randn(6, self.width)
        x = x.to(self.dtype).clone().requires_grad_()
        for p in self.moe.parameters():
            p.grad = None
        with self.ac():
            out = self.moe(x)
            F.mse_loss(out.float(), self.y[6 * r:6 * r + 6], reduction="sum").backward()
        got = {"out": out.detach().clone(), "x.grad": x.grad.clone()}
        for n in ("w1", "b1", "w2", "b2"):
            p = getattr(self.moe.experts, n)
            if p.grad is not None:
                got[n] = p.grad.clone()
        return got

    def perturb(self, kind: str) -> None:
        if kind == "dtype":
            self.moe.double()
            self.dtype = torch.float64
        elif kind == "autocast":
            self.autocast = True
        elif kind == "width":
            self.width = 8
        elif kind == "new parameter":
            add_extra(self.moe, 6)
        elif kind == "requires_grad":
            self.moe.experts.w1.requires_grad_(False)

    def expected(self, kind: str, who: int) -> dict | None:
        if kind == "width":
            return None
        import sys
        sys.path.insert(0, __file__.rsplit("/reliability/", 1)[0] + "/expert_parallel")
        from reference import reference_moe
        w1, b1, w2, b2 = (t.clone().requires_grad_() for t in self.full)
        x = self.x.clone().requires_grad_()
        out, _, _ = reference_moe(x, self.gate, w1, b1, w2, b2, 1)
        if kind == "new parameter":
            out = out + torch.cat([torch.full((6, 6), 0.5 if r == who else 0.0) for r in range(self.world)])
        F.mse_loss(out, self.y, reduction="sum").backward()
        r = self.rank
        mine = slice(2 * r, 2 * r + 2)
        if kind == "autocast":
            self.tol = BF16_TOL
        return {"out": out[6 * r:6 * r + 6], "x.grad": x.grad[6 * r:6 * r + 6], "w1": w1.grad[mine],
                "b1": b1.grad[mine], "w2": w2.grad[mine], "b2": b2.grad[mine]}


def _full_experts(world: int):
    from overlapkit.expert_parallel import init_full_experts
    return init_full_experts(2 * world, 6, 8, torch.Generator().manual_seed(0))


# -- context parallel: ring attention --------------------------------------------------------

class CpCase(Case):
    """Causal ring attention over 8 tokens a rank (zigzag), 2 heads of 4; loss <out, dout>."""

    def __init__(self, group, knob) -> None:
        super().__init__(group, knob)
        from overlapkit.context_parallel import ContextParallelConfig, RingAttention
        self.attn = RingAttention(group, ContextParallelConfig(overlap=knob))
        g = torch.Generator().manual_seed(0)
        s = 8 * self.world
        self.q, self.k, self.v, self.dout = (torch.randn(1, 2, s, 4, generator=g) for _ in range(4))
        self.seq, self.q_grad = s, True

    def _mine(self, t):
        from overlapkit.context_parallel import shard
        return shard(t, 2, self.rank, self.world, "zigzag")

    def step(self) -> dict:
        seq = self.seq
        q, k, v = (self._mine(t) for t in (self.q, self.k, self.v))
        if seq != 8 * self.world:
            q, k, v = (torch.randn(1, 2, seq // self.world, 4) for _ in range(3))
        q = q.to(self.dtype).requires_grad_(self.q_grad)
        k, v = (t.to(self.dtype).requires_grad_() for t in (k, v))
        with self.ac():
            out = self.attn(q, k, v)
        (out.float() * self._mine(self.dout)[..., :out.shape[2], :]).sum().backward()
        got = {"out": out.detach().clone(), "k.grad": k.grad.clone(), "v.grad": v.grad.clone()}
        if q.grad is not None:
            got["q.grad"] = q.grad.clone()
        return got

    def perturb(self, kind: str) -> None:
        if kind == "dtype":
            self.dtype = torch.float64
        elif kind == "autocast":
            self.autocast = True
        elif kind == "width":
            self.seq = 12 * self.world
        elif kind == "new parameter":
            add_extra(self.attn, 4)
        elif kind == "requires_grad":
            self.q_grad = False

    def expected(self, kind: str, who: int) -> dict | None:
        if kind == "width":
            return None
        from overlapkit.context_parallel import positions
        q, k, v = (t.clone().requires_grad_() for t in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if kind == "new parameter":
            bump = torch.zeros(self.seq, 1)
            bump[positions(self.seq, who, self.world, "zigzag")] = 0.5
            out = out + bump
        (out * self.dout).sum().backward()
        if kind == "autocast":
            self.tol = BF16_TOL
        return {"out": self._mine(out), "q.grad": self._mine(q.grad), "k.grad": self._mine(k.grad),
                "v.grad": self._mine(v.grad)}


# -- pipeline parallel: two stages -----------------------------------------------------------

WIDTHS = [4, 6, 5, 6, 3]


class PpCase(Case):
    """Layers 0-1 on rank 0, 2-3 on rank 1, 2 micro-batches; the loss broadcast to both."""

    def __init__(self, group, knob) -> None:
        super().__init__(group, knob)
        from overlapkit.pipeline_parallel import PipelineConfig, PipelineEngine, sequential_chunks
        torch.manual_seed(0)
        self.ref = nn.Sequential(*[nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(WIDTHS, WIDTHS[1:])])
        self.chunks, _ = sequential_chunks(copy.deepcopy(self.ref), self.world, self.rank)
        self.engine = PipelineEngine(self.chunks, group, PipelineConfig(knob, 2, broadcast_loss=True), _mse)
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(4, WIDTHS[0], generator=g), torch.randn(4, WIDTHS[-1], generator=g)

    def layer(self, i: int):
        return getattr(self.chunks[0], str(i), None)

    def step(self) -> dict:
        for p in self.chunks[0].parameters():
            p.grad = None
        with self.ac():
            loss = self.engine.step(self.x.to(self.dtype), self.y.to(self.dtype))
        got = {"loss": loss.detach().clone()}
        got.update({n: p.grad.clone() for n, p in self.chunks[0].named_parameters() if p.grad is not None})
        return got

    def perturb(self, kind: str) -> None:
        last = max(int(n) for n, _ in self.chunks[0].named_children())
        if kind == "dtype":
            self.chunks[0].double()
            self.dtype = torch.float64
        elif kind == "autocast":
            self.autocast = True
        elif kind == "width":
            torch.manual_seed(1)
            i = last if self.rank == 0 else last - 1
            lin = self.layer(i)[0]
            self.layer(i)[0] = nn.Linear(lin.in_features + (0 if self.rank == 0 else 1), lin.out_features +
                                         (1 if self.rank == 0 else 0))
        elif kind == "new parameter":
            add_extra(self.layer(last)[0], WIDTHS[last + 1])
        elif kind == "requires_grad":
            self.layer(last)[0].weight.requires_grad_(False)

    def expected(self, kind: str, who: int) -> dict | None:
        if kind in ("width",):
            return None
        ref = copy.deepcopy(self.ref)
        owned = list(range(2 * who, 2 * who + 2))
        if kind == "new parameter":
            add_extra(ref[owned[-1]][0], WIDTHS[owned[-1] + 1])
        if kind == "requires_grad":
            ref[owned[-1]][0].weight.requires_grad_(False)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "autocast"):
            loss = sum(_mse(ref(a), b) / 2 for a, b in zip(self.x.chunk(2), self.y.chunk(2)))
        loss.backward()
        if kind == "autocast":
            self.tol = BF16_TOL
        names = dict(ref.named_parameters())
        want = {"loss": loss}
        for n, _ in self.chunks[0].named_parameters():
            if names[n].grad is not None:
                want[n] = names[n].grad
        return want


def _mse(out, t):
    return ((out.float() - t.float()) ** 2).mean()


CASES = {"tp": TpCase, "dp": DataCase, "zero": ZeroCase, "fsdp": FsdpCase, "ep": EpCase, "cp": CpCase, "pp": PpCase}
KNOBS = {"tp": ("none", "bulk"), "dp": (0,), "zero": (0, 1), "fsdp": (0, 1), "ep": (1, 2),
         "cp": ("none", "pipelined"), "pp": ("1f1b", "zb1p")}
"""What hypothesis may vary per engine besides the change: overlap mode, prefetch depth, chunks, schedule."""
