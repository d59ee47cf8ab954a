"""Host cost of replicated DTensor parameters: a norm and an embedding, plain vs how parallelize leaves them.

After `parallelize` every parameter is a DTensor; a norm's module computes on local views of its
`Replicate()` parameters (tensor_parallel/replicated.py), so no DTensor dispatch sits on its path.
This probe times forward+backward of one RMSNorm (transformers' LlamaRMSNorm) and one embedding
at world size 1 (gloo, one CPU process: the collectives are no-ops, what is left is host work):
- norm plain: the nn.Module as transformers builds it;
- norm replicated: after `replicate_module` (local views, gradient returned as a DTensor);
- norm replicated + TP sum: the sequence-parallel form (`mark_sequence_parallel`), one more
  autograd node (its all-reduce is a no-op at world 1);
- norm DTensor dispatch: the same parameter and input as DTensors, every op through DTensor
  (what torch's own SequenceParallel style runs);
- embedding plain nn.Embedding vs VocabParallelEmbedding at tp=1.
The variants take turns in a balanced order; the median per variant and its ratio to plain.

    python benchmarks/probes/replicated_params_probe.py --tokens 16 --hidden 64 --out benchmarks/results
    python benchmarks/probes/replicated_params_probe.py --tokens 4096 --hidden 4096 --threads 16 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _lib
from _lib.common import (add_out_arg, add_smoke_arg, device_label, init_one_rank, out_dir, time_variants,  # noqa: E402
                         write_results)


def _norm(hidden: int):
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        return LlamaRMSNorm(hidden)
    except ImportError:
        return torch.nn.RMSNorm(hidden)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    add_out_arg(ap)
    add_smoke_arg(ap)
    args = ap.parse_args()
    if args.smoke:
        args.steps = 2
    torch.set_num_threads(args.threads)
    init_one_rank("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from _lib.unexported import replicate_module
    from overlapkit.tensor_parallel import VocabParallelEmbedding, mark_sequence_parallel

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    group = mesh.get_group()
    torch.manual_seed(0)
    norms = {k: _norm(args.hidden) for k in ("norm plain", "norm replicated", "norm replicated + TP sum",
                                              "norm DTensor dispatch")}
    replicate_module(norms["norm replicated"], mesh, group)
    # mark_sequence_parallel does nothing at tp=1; the sum's autograd node is what is timed.
    replicate_module(norms["norm replicated + TP sum"], mesh, group, sum_over=group)
    assert mark_sequence_parallel  # the public entry point of the same path
    dt = norms["norm DTensor dispatch"]
    dt.weight = torch.nn.Parameter(DTensor.from_local(dt.weight.data, mesh, [Replicate()]))
    x = torch.randn(1, args.tokens, args.hidden, requires_grad=True)
    x_dt = DTensor.from_local(x.detach(), mesh, [Replicate()]).requires_grad_(True)
    ids = torch.randint(0, args.vocab, (1, args.tokens))
    emb_plain = torch.nn.Embedding(args.vocab, args.hidden)
    emb_vp = VocabParallelEmbedding.from_full(emb_plain, mesh, name="embed")

    def step(name: str) -> None:
        if name.startswith("norm"):
            norm = norms[name]
            y = norm(x_dt if name == "norm DTensor dispatch" else x)
            y.sum().backward()
            norm.weight.grad = None
        else:
            emb = emb_plain if name == "embedding plain" else emb_vp
            emb(ids).sum().backward()
            emb.weight.grad = None

    variants = [*norms, "embedding plain", "embedding VocabParallelEmbedding"]
    times = time_variants(step, variants, args.steps, warmup=1 if args.smoke else 20, device=torch.device("cpu"))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}  # µs
    result = {"device": device_label("cpu"), "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
              "threads": args.threads, "steps": args.steps, "median_us": med,
              "ratio_to_plain": {k: med[k] / med["norm plain" if k.startswith("norm") else "embedding plain"]
                                 for k in med}}
    stem = os.path.join(out_dir(args), f"replicated_params_probe_t{args.tokens}_h{args.hidden}")
    write_results(result, stem, _markdown)
    dist.destroy_process_group()


def _markdown(r: dict) -> str:
    rows = [f"# Replicated DTensor parameters: forward+backward host cost ({r['device']}, {r['tokens']} tokens, "
            f"hidden {r['hidden']}, {r['threads']} thread(s), median of {r['steps']})", "",
            "| variant | µs | ratio to plain |", "|---|---|---|"]
    rows += [f"| {k} | {v:.1f} | {r['ratio_to_plain'][k]:.2f} |" for k, v in r["median_us"].items()]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
