"""Replicated parameters between a column and a row layer: summed over TP, left whole, or refused naming them.

A synthetic block (no model family): a column layer, something with parameters, a row layer.
The rule reads the forward (plan_edges.py), so each case differs only in where its parameter
meets the activation: a scalar shared by every channel of the split dim (its gradient summed),
a norm before the column layer (whole: left alone, a sum would multiply it by tp), a weight per
channel of the split dim, one module used on both sides, and a weight read outside its module's
forward (refused, naming it). Loss and every gradient against one process, fp32, at tp 2 and 3.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distributed import distributed


class Scalar(nn.Module):
    """A learnable activation (xIELU's alpha): one parameter shared by every channel."""

    def __init__(self):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor([0.7]))

    def forward(self, x):
        return x * torch.sigmoid(F.softplus(self.alpha) * x)


class PerChannel(nn.Module):
    """A scale per feature of the column layer's output: would have to be split with it."""

    def __init__(self, n):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return x * self.scale


class Mixer(nn.Module):
    """Reads a child's weight in its own forward (as state-space mixers hand conv1d.weight to a kernel)."""

    def __init__(self, n):
        super().__init__()
        self.conv = nn.Conv1d(n, n, 3, padding=2, groups=n)

    def forward(self, x):
        return F.conv1d(x.transpose(1, 2), self.conv.weight, self.conv.bias, padding=2, groups=x.shape[-1])[
            ..., :x.shape[1]].transpose(1, 2)


class Block(nn.Module):
    def __init__(self, kind: str, hidden=12, ffn=24):
        super().__init__()
        self.kind = kind
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)
        self.act = {"scalar": Scalar(), "before": Scalar(), "both": Scalar(), "per_channel": PerChannel(ffn),
                    "mixer": Mixer(hidden)}[kind]

    def forward(self, x):
        if self.kind in ("before", "mixer"):
            x = self.act(x)  # on the whole input, before the column layer
        h = self.up(self.norm(x))
        if self.kind != "before":
            h = self.act(h) if self.kind != "mixer" else F.gelu(h)
        if self.kind == "both":
            x = self.act(x)
        return x + self.down(h)


PLAN_KEYS = ("up", "down")


def _case(kind: str) -> dict:
    import overlapkit
    from overlapkit.models import expected_local
    from overlapkit.tensor_parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.device_mesh import init_device_mesh

    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    ref = Block(kind, ffn=12 * tp)
    x = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(1))
    try:
        model = overlapkit.parallelize(copy.deepcopy(ref), mesh, plan={"up": ColwiseParallel(overlap="bulk"),
                                                                       "down": RowwiseParallel(overlap="bulk")})
        loss = model(x).pow(2).mean()
        loss.backward()
    except ValueError as e:
        return {"refused": str(e)}
    r = ref(x).pow(2).mean()
    r.backward()
    errs = {"loss": abs(loss.item() - r.item()) / abs(r.item())}
    for name, local, full in expected_local(model, ref, "grad"):
        errs[name] = ((local - full).norm() / full.norm()).item()
    errs["summed"] = getattr(model, "plan_edges_summed", None)
    return errs


@distributed(world_size=2, timeout_s=120)
def _tp2():
    return {kind: _case(kind) for kind in ("scalar", "before", "both", "per_channel", "mixer")}


@distributed(world_size=3, timeout_s=120)
def _tp3():
    return {kind: _case(kind) for kind in ("scalar", "before")}


@pytest.mark.parametrize("run", [_tp2, _tp3], ids=["tp2", "tp3"])
def test_parameters_between_column_and_row_are_summed_left_whole_or_refused(run):
    per_rank = run()
    got = per_rank[0]
    for other in per_rank[1:]:  # every rank refuses alike
        assert {k: v for k, v in other.items() if "refused" in v} == {k: v for k, v in got.items() if "refused" in v}
    for kind in ("scalar", "before"):  # exact: summed where it met the split activation, whole before it
        errs = dict(got[kind])
        assert errs.pop("summed") == (["act"] if kind == "scalar" else []), (kind, got[kind])
        assert "act.alpha" in errs and max(errs.values()) <= 1e-5, (kind, errs)
    if "both" in got:
        assert "act.alpha meet both this rank's part of a column layer's output and whole tensors" in \
            got["both"]["refused"]
        assert "act.scale meets this rank's part of a column layer's output in mul" in got["per_channel"]["refused"]
        assert "act.conv.weight is read outside its module's forward, as a replicated DTensor, by conv1d" in \
            got["mixer"]["refused"]
