"""user_step.py --moe: a transformers Qwen3-MoE trained with its experts over ep, overlapkit's routing beside torchtitan's.

Both variants are the same model with the same attention (overlapkit's `parallelize` over tp, SP where
the model allows it) and the same experts arithmetic (the experts module's own forward on a rank's
local experts, `run_local_experts`); they differ only in how tokens reach the experts:

- `torch_ep`: expert parallelism written the way torchtitan writes it (its `ExpertParallel` style):
  tokens sorted by expert, the per-expert counts exchanged, one `all_to_all_single_autograd` there and
  one back (torch's functional collectives), the received rows regrouped by local expert;
- `ok_ep`: `overlapkit.parallelize(model, groups.mesh)` with `init(ep=..)`: the experts `Shard(0)` over
  ep from the config's ep_plan, the tokens through overlapkit's chunked dispatch/combine (`chunks="auto"`).

transformers' own expert parallelism (`DistributedConfig(enable_expert_parallel=True)`) loads through
`from_pretrained` on a device mesh of CUDA ranks; it is not run here.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

MOE_PRESETS = {
    # Qwen3-MoE's shape (128 experts, top-8, expert width 1/4 of the dense one) cut down for a CPU host
    "tiny": dict(hidden_size=128, intermediate_size=512, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=4096,
                 batch=2, seq=256),
    # the 16-core host: a step of a few hundred ms at ep 4
    "cpu16": dict(hidden_size=512, intermediate_size=2048, moe_intermediate_size=512, num_experts=32,
                  num_experts_per_tok=8, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=64, vocab_size=16384, batch=4, seq=512),
}
MOE_VARIANTS = ("torch_ep", "ok_ep")


def build_moe(cfg_kw: dict, device, dtype):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    kw = {k: v for k, v in cfg_kw.items() if k not in ("batch", "seq")}
    cfg = Qwen3MoeConfig(**kw, max_position_embeddings=cfg_kw["seq"], attn_implementation="sdpa",
                         output_router_logits=True, router_aux_loss_coef=0.001)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # HF inits the stacked experts with empty(): draw them like the other weights
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.02)
    return model


def _torchtitan_forward(module: nn.Module, group, names: tuple[str, ...], num_local: int):
    """The experts module's forward as torchtitan's ExpertParallel routes it: counts, one all-to-all out, one back."""
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    from _lib.unexported import run_local_experts

    ep = dist.get_world_size(group)

    def forward(hidden, top_k_index, top_k_weights):
        tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_local * ep)
        recv = funcol.all_to_all_single(counts, None, None, group)
        recv = funcol.wait_tensor(recv) if hasattr(funcol, "wait_tensor") else recv
        in_splits = counts.view(ep, -1).sum(1).tolist()
        out_splits = recv.view(ep, -1).sum(1).tolist()
        routed = funcol.all_to_all_single_autograd(hidden[order // k], out_splits, in_splits, group)
        routed = funcol.wait_tensor(routed) if hasattr(funcol, "wait_tensor") else routed
        # rows arrive by (source rank, local expert): regroup them by local expert
        per = recv.view(ep, num_local)
        local_of_row = torch.repeat_interleave(torch.arange(num_local, device=per.device).repeat(ep), per.reshape(-1))
        perm = torch.argsort(local_of_row, stable=True)
        y = run_local_experts(module, routed[perm], local_of_row[perm],
                              {n: module._parameters[n].to_local() for n in names}, num_local)
        y = y.new_empty(y.shape).index_copy(0, perm, y)
        back = funcol.all_to_all_single_autograd(y, in_splits, out_splits, group)
        back = funcol.wait_tensor(back) if hasattr(funcol, "wait_tensor") else back
        slots = back.new_empty(back.shape).index_copy(0, order, back).view(tokens, k, -1)
        return (slots * top_k_weights.unsqueeze(-1).to(slots.dtype)).sum(1)

    return forward


def apply_torchtitan_ep(model: nn.Module, group) -> nn.Module:
    """Split every experts module of `model` over `group` (DTensors `Shard(0)` on an "ep" mesh, as torchtitan's
    ExpertParallel distributes them) and route as torchtitan does."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from _lib.unexported import expert_modules

    ep = torch.distributed.get_world_size(group)
    device = "cuda" if torch.distributed.get_backend(group) == "nccl" else "cpu"
    mesh = DeviceMesh.from_group(group, device, mesh_dim_names=("ep",))
    for module in expert_modules(model).values():
        n = module.num_experts // ep
        names = tuple(module._parameters)
        for name in names:
            p = module._parameters[name]
            local = nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
            local.expert_parallel = True  # overlapkit's TP leaves it alone; the dp average sums it over copies only
            module._parameters[name] = local
        module.forward = _torchtitan_forward(module, group, names, n)
    return model


def build_moe_variant(name: str, base: nn.Module, groups):
    import overlapkit

    model = copy.deepcopy(base)
    if name == "ok_ep":
        return overlapkit.parallelize(model, groups.mesh)
    if name == "torch_ep":
        apply_torchtitan_ep(model, groups.ep)
        return overlapkit.parallelize(model, groups.mesh["tp"])  # the same attention TP, no experts split by it
    raise ValueError(f"unknown MoE variant {name!r}; known {MOE_VARIANTS}")


def moe_markdown(result: dict) -> str:
    a, c = result["args"], result["config"]
    head = (f"HF Qwen3-MoE ({a['preset']}: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
            f"{c['num_experts']} experts of {c['moe_intermediate_size']}, top-{c['num_experts_per_tok']}, "
            f"{a['batch']} x {a['seq']} tokens a dp rank), {result['device']}, ep={a['ep']} tp={a['tp']} dp={a['dp']}, "
            f"{a['threads']} thread(s) a rank, torch {result['torch']}, transformers {result['transformers']}, "
            f"{a['rounds']} rounds after {a['warmup']}; ratio = median per-round ratio to `{result['reference']}` "
            "(middle half in brackets); step = slowest rank, median\n\n")
    rows = ["| variant | step ms | ratio | tokens/s | peak GiB/rank | expert MiB/rank | first step s | loss0 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for n, r in result["rows"].items():
        lo, hi = r["ratio_middle_half"]
        rows.append(f"| {n} | {r['step_ms']:.1f} | {r['ratio']:.3f} [{lo:.3f}, {hi:.3f}] | {r['tokens_per_s']:.0f} | "
                    f"{r['peak_gib']:.3f} | {result['expert_mib'][n]:.2f} | {r['first_step_s']:.2f} | {r['loss0']:.5f} |")
    notes = [f"\nfirst-step losses agree: {result['losses_agree']} (spread {result['loss_spread']:.2e}); "
             f"whole experts {result['expert_mib_whole']:.2f} MiB (each rank holds 1/ep)",
             f"chunks `auto` kept per experts module (ok_ep, rank 0): {result['ok_ep_chunks']}"]
    if result.get("all_to_all"):
        notes.append("token exchange time (all-to-alls, and the pairwise sends and receives of chunks=\"ranks\") "
                     "in one profiled step (the union of their ranges, slowest rank; profiled, so "
                     "slower than the timed step): " + "; ".join(
                         f"{n} {ms:.1f} of {step:.1f} ms ({100 * ms / step:.1f} %)"
                         for n, (step, ms) in result["all_to_all"].items())
                     + ". Hiding every one of the peer's all-to-alls saves at most its share: a ratio below "
                     "1 - that share needs faster compute, not more overlap.")
    return head + "\n".join(rows) + "\n" + "\n".join(notes) + "\n"


def expert_bytes(model: nn.Module) -> int:
    """This rank's bytes of expert parameters (its local shards)."""
    n = 0
    for p in model.parameters():
        if getattr(p, "expert_parallel", False):
            t = p.to_local() if hasattr(p, "to_local") else p
            n += t.numel() * t.element_size()
    return n
